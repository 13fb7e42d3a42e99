"""What the matrix's launchers share: a server on 127.0.0.1 with its own temp dir and
process group, started once and stopped whatever happens.

Owns the life cycle (start once, an ``atexit`` stop, a stop that takes the whole group
down and removes the temp dir), the endpoint URL and the credentials. Does not own what
runs, how it becomes ready, nor the process group itself
(:class:`ec_s3.sandbox.procgroup.ProcessGroup`): subclasses launch in :meth:`_launch`.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import threading
import time
from pathlib import Path

from ec_s3.sandbox.embedded_s3 import S3Credentials
from ec_s3.sandbox.net import LOOPBACK
from ec_s3.sandbox.procgroup import ProcessGroup

__all__ = ["LoopbackServer", "ServerError"]


class ServerError(RuntimeError):
    """The server is not installed, or did not start."""


class LoopbackServer:
    """Same interface as :class:`ec_s3.sandbox.embedded_s3.EmbeddedS3Server`:
    :meth:`start`, :attr:`endpoint_url`, :attr:`credentials`, :meth:`stop`."""

    _dir_prefix = "ec-s3-server-"
    _stop_grace_s = 5.0  # SIGTERM to SIGKILL

    def __init__(self, credentials: S3Credentials | None = None, startup_timeout_s: float = 60.0) -> None:
        self._credentials = credentials or S3Credentials.generate()
        self._startup_timeout_s = startup_timeout_s
        self._lock = threading.RLock()
        self._group: ProcessGroup | None = None
        self._dir: Path | None = None
        self._port: int | None = None
        self.startup_seconds: float | None = None

    @staticmethod
    def unavailable_reason() -> str | None:
        """None when the server can run here, else what to install."""
        raise NotImplementedError

    @property
    def endpoint_url(self) -> str:
        if self._port is None:
            raise ServerError("server not started")
        return f"http://{LOOPBACK}:{self._port}"

    @property
    def credentials(self) -> S3Credentials:
        return self._credentials

    def start(self) -> LoopbackServer:
        with self._lock:
            if self._group is not None:
                raise ServerError("server already started")
            reason = self.unavailable_reason()
            if reason is not None:
                raise ServerError(reason)
            t0 = time.monotonic()
            # Short path: daemons put unix sockets in it (108-byte limit).
            self._dir = Path(tempfile.mkdtemp(prefix=self._dir_prefix))
            atexit.register(self.stop)
            try:
                self._launch(self._dir)
                self.startup_seconds = time.monotonic() - t0
                return self
            except BaseException:
                self.stop()
                raise

    def _launch(self, scratch: Path) -> None:
        """Start the server's process group under ``scratch`` and wait until it serves."""
        raise NotImplementedError

    def stop(self, timeout_s: float | None = None) -> None:
        """Take the whole process group down and remove the temp dir. Idempotent."""
        with self._lock:
            atexit.unregister(self.stop)
            group, self._group = self._group, None
            if group is not None:
                group.stop(self._stop_grace_s if timeout_s is None else timeout_s)
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None

    def __enter__(self) -> LoopbackServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self.endpoint_url if self._port is not None else "not started"
        return f"{type(self).__name__}({where}, {self._credentials!r})"
