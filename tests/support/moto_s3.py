"""moto's S3 server on loopback: the second, pure-Python S3 implementation in the tests.

Owns starting ``moto_server`` (from ``moto[server]``, the test extra) on a free port in
its own process group, its readiness and its stop. moto keeps everything in memory and
does not check credentials: tests that need a refused signature skip it. Does not own
buckets (callers create them).
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from ec_s3.sandbox.embedded_s3 import S3Credentials
from ec_s3.sandbox.net import LOOPBACK, free_port, wait_answering
from ec_s3.sandbox.procgroup import ProcessGroup, log_tail

__all__ = ["MotoError", "MotoServer"]


class MotoError(RuntimeError):
    """moto is not installed, or its server did not come up."""


class MotoServer:
    """``moto_server`` on 127.0.0.1. Same interface as
    :class:`ec_s3.sandbox.embedded_s3.EmbeddedS3Server` (:meth:`start`,
    :attr:`endpoint_url`, :attr:`credentials`, :meth:`stop`); the credentials are
    random but moto accepts any."""

    def __init__(self, startup_timeout_s: float = 30.0) -> None:
        self._credentials = S3Credentials.generate()
        self._startup_timeout_s = startup_timeout_s
        self._lock = threading.RLock()
        self._group: ProcessGroup | None = None
        self._dir: Path | None = None
        self._port: int | None = None
        self.startup_seconds: float | None = None

    @staticmethod
    def unavailable_reason() -> str | None:
        if importlib.util.find_spec("moto") is None or importlib.util.find_spec("werkzeug") is None:
            return "moto's server is not installed: pip install 'moto[server]' (the test extra)"
        return None

    @property
    def endpoint_url(self) -> str:
        if self._port is None:
            raise MotoError("server not started")
        return f"http://{LOOPBACK}:{self._port}"

    @property
    def credentials(self) -> S3Credentials:
        return self._credentials

    def start(self) -> MotoServer:
        with self._lock:
            if self._group is not None:
                raise MotoError("server already started")
            reason = self.unavailable_reason()
            if reason is not None:
                raise MotoError(reason)
            t0 = time.monotonic()
            self._dir = Path(tempfile.mkdtemp(prefix="ec-s3-moto-"))
            self._port = free_port()
            atexit.register(self.stop)
            env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MOTO_"))}
            # The console script may not be on PATH in an unactivated venv: run its module.
            cmd = [sys.executable, "-m", "moto.server", "-H", LOOPBACK, "-p", str(self._port)]
            try:
                self._group = ProcessGroup(cmd, log_path=self._dir / "moto.log", env=env, label="moto",
                                           cwd=self._dir, reaper_grace_s=2.0, scratch=self._dir)
                error = self._wait_ready()
                if error is not None:
                    raise MotoError(f"moto failed to start ({error}): {log_tail(self._dir / 'moto.log')}")
                self.startup_seconds = time.monotonic() - t0
                return self
            except BaseException:
                self.stop()
                raise

    def stop(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            atexit.unregister(self.stop)
            group, self._group = self._group, None
            if group is not None:
                group.stop(timeout_s)
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None

    def __enter__(self) -> MotoServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_ready(self) -> str | None:
        assert self._group is not None and self._port is not None
        return wait_answering(self._port, self._group.poll, self._startup_timeout_s, "moto")
