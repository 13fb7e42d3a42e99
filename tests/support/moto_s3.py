"""moto's S3 server on loopback: the second, pure-Python S3 implementation in the tests.

Owns starting ``moto_server`` (from ``moto[server]``, the test extra) on a free port in
its own process group, and its readiness. moto keeps everything in memory and does not
check credentials: tests that need a refused signature assert that instead. Does not own
buckets (callers create them) nor the life cycle (:mod:`support.loopback_server`).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from ec_s3.sandbox.net import LOOPBACK, free_port, wait_answering
from ec_s3.sandbox.procgroup import ProcessGroup, log_tail

from .loopback_server import LoopbackServer, ServerError

__all__ = ["MotoServer"]


class MotoServer(LoopbackServer):
    """``moto_server`` on 127.0.0.1; the credentials are random but moto accepts any."""

    _dir_prefix = "ec-s3-moto-"

    @staticmethod
    def unavailable_reason() -> str | None:
        if importlib.util.find_spec("moto") is None or importlib.util.find_spec("werkzeug") is None:
            return "moto's server is not installed: pip install 'moto[server]' (the test extra)"
        return None

    def _launch(self, scratch: Path) -> None:
        self._port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MOTO_"))}
        # The console script may not be on PATH in an unactivated venv: run its module.
        cmd = [sys.executable, "-m", "moto.server", "-H", LOOPBACK, "-p", str(self._port)]
        self._group = ProcessGroup(cmd, log_path=scratch / "moto.log", env=env, label="moto",
                                   cwd=scratch, reaper_grace_s=2.0, scratch=scratch)
        error = wait_answering(self._port, self._group.poll, self._startup_timeout_s, "moto")
        if error is not None:
            raise ServerError(f"moto failed to start ({error}): {log_tail(scratch / 'moto.log')}")
