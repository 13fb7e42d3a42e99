"""A local server process with its whole process group, and the reaper that takes the
group down when the owning Python process dies without cleaning up.

Owns starting a command as a session leader, stopping its group (SIGTERM, then SIGKILL,
then waiting), the reaper (this file is its program: stdlib-only module-level imports),
and SIGTERM/SIGHUP as KeyboardInterrupt in the owner. Does not own what the command is,
its readiness, log or files (:mod:`ec_s3.sandbox.vllm_server`, :mod:`.embedded_s3`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["ProcessGroup", "group_alive", "interrupt_on_signals", "log_tail"]

_KILL_WAIT_S = 10.0  # after SIGKILL: how long a member may take to go


def group_alive(pgid: int) -> bool:
    """Whether a process group has a member that is not a zombie (an orphaned zombie
    still answers ``killpg(pgid, 0)`` until its new parent reaps it, and in a container
    whose PID 1 does not reap, that is forever)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # fields: state ppid pgrp ...
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


def log_tail(path: Path, max_bytes: int = 3000) -> str:
    """The end of a group's log, for an error message (never raises)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read().decode("utf-8", "replace")
    except OSError as exc:
        return f"<no log: {exc}>"


class ProcessGroup:
    """``cmd`` running as the leader of a new process group, logging to ``log_path``.

    ``env`` is the child's whole environment. A reaper process holds the read end of a
    pipe whose write end only this process has: when this process exits for any reason
    the reaper reads EOF, terminates the group (``reaper_grace_s`` between SIGTERM and
    SIGKILL) and removes ``scratch`` if given. :meth:`stop` and :meth:`kill` retire the
    reaper only once the group is gone, so an interrupted stop still leaves it to
    finish the job, and never signal a group id again once it is gone (ids are reused).
    """

    def __init__(self, cmd: Sequence[str], *, log_path: Path, env: Mapping[str, str], label: str,
                 cwd: Path | None = None, reaper_grace_s: float = 15.0, scratch: Path | None = None) -> None:
        self._gone = False
        self._reaper: subprocess.Popen[bytes] | None = None
        with log_path.open("ab") as log:
            log.write(f"\n=== {label}: {' '.join(cmd)}\n".encode())
            log.flush()
            self.proc: subprocess.Popen[bytes] = subprocess.Popen(
                list(cmd), cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
        try:
            self._reaper = subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(__file__), str(self.proc.pid),
                 str(reaper_grace_s), str(scratch or "")],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C on the owner's terminal must not reach it
            )
        except BaseException:
            self.kill()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM the leader (it shuts its own children down), SIGKILL whatever is left of
        the group after ``timeout_s``. Idempotent; returns the leader's exit status."""
        if not self._gone and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)
        return self.kill()

    def kill(self) -> int | None:
        """SIGKILL the whole group at once and wait until no live member is left."""
        if not self._gone:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(_KILL_WAIT_S)
            deadline = time.monotonic() + _KILL_WAIT_S
            while group_alive(self.proc.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            self._gone = True
        self._retire_reaper()
        return self.proc.returncode

    def _retire_reaper(self) -> None:
        reaper, self._reaper = self._reaper, None
        if reaper is not None:
            reaper.kill()  # the group is gone: it must never signal a recycled group id
            reaper.wait()
            if reaper.stdin is not None:
                reaper.stdin.close()


@contextlib.contextmanager
def interrupt_on_signals() -> Iterator[None]:
    """SIGTERM / SIGHUP raise KeyboardInterrupt in the owner, like Ctrl-C, so that every
    ``finally`` that stops a group (and its servers, proxy, S3) runs; the previous
    handlers come back afterwards. A no-op outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(ValueError, OSError):
            old[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, h in old.items():
            with contextlib.suppress(ValueError, OSError):
                signal.signal(sig, h)


def _reap(argv: list[str]) -> None:
    """The reaper: wait for EOF on stdin (the owner is gone), then take the group down."""
    pgid, grace_s, scratch = int(argv[0]), float(argv[1]), argv[2] if len(argv) > 2 else ""
    try:
        sys.stdin.buffer.read()
    except BaseException:  # noqa: BLE001 - whatever woke it, the owner is gone
        pass
    if group_alive(pgid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if group_alive(pgid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
    if scratch:
        time.sleep(0.2)  # let the last writer close its files
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    _reap(sys.argv[1:])
