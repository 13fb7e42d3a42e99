"""How ``ec-s3`` talks to its operator: exit statuses, stdout/stderr lines, JSON reports
and the progress bar.

Owns the output conventions every command follows (results on stdout, progress and
errors on stderr, ``error:`` plus a ``fix:`` line, credentials never printed). Does not
own what a command reports: each command module prints its own report.
"""

from __future__ import annotations

import json
import sys
import time
from types import TracebackType
from typing import Any, TextIO

from ec_s3.config import ECS3Config
from ec_s3.store.connection import resolve_endpoint
from ec_s3.store.diagnose import Diagnosis

__all__ = [
    "EXIT_FAIL",
    "EXIT_MISSING",
    "EXIT_OK",
    "EXIT_USAGE",
    "ProgressBar",
    "err",
    "fail",
    "fmt_ms",
    "json_out",
    "out",
    "print_diagnosis",
    "where",
]

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
EXIT_MISSING = 3  # ec-s3 inspect: no such blob (not found is not invalid)


def out(text: str = "") -> None:
    print(text, file=sys.stdout)


def err(text: str) -> None:
    print(text, file=sys.stderr)


def json_out(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, default=str))


def fail(message: str, fix: str | None = None) -> int:
    """Print ``ec-s3: error: ...`` (and the fix) on stderr; returns :data:`EXIT_FAIL`."""
    err(f"ec-s3: error: {message}")
    if fix:
        err(f"  fix: {fix}")
    return EXIT_FAIL


def print_diagnosis(diagnosis: Diagnosis, *, label: str = "FAIL") -> None:
    out(f"{label}: {diagnosis.cause}")
    out(f"  fix: {diagnosis.fix}")


def fmt_ms(value: float | None) -> str:
    return f"{value:8.1f} ms" if value is not None else "       - ms"


def where(config: ECS3Config) -> str:
    """The bucket, prefix and endpoint a command works on, in one phrase."""
    return (f"s3://{config.bucket}/{config.prefix}/ at {config.endpoint_url or 'AWS S3'} "
            f"(region {resolve_endpoint(config).region}, {config.addressing_style} addressing)")


class ProgressBar:
    """A one-line text progress bar on stderr, ``progress(phase, done, total)``.

    On a terminal the line is redrawn (at most every 0.1 s); otherwise a line is printed
    when a phase starts, every 5 s and when it completes, so logs stay short.
    """

    def __init__(self, stream: TextIO | None = None, *, enabled: bool = True, width: int = 30,
                 interval_s: float | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval_s = interval_s if interval_s is not None else (0.1 if self.tty else 5.0)
        self._state: tuple[str, int, int | None] | None = None
        self._drawn: tuple[str, int, int | None] | None = None
        self._last = 0.0
        self._open = False

    def __call__(self, phase: str, done: int, total: int | None) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        previous, self._state = self._state, (phase, done, total)
        new_phase = previous is None or previous[0] != phase
        if new_phase and previous is not None:
            self._flush(previous)
        final = total is not None and done >= total
        if new_phase or final or now - self._last >= self.interval_s:
            self._draw(self._state)
            self._last = now

    def _text(self, state: tuple[str, int, int | None]) -> str:
        phase, done, total = state
        if total:
            frac = min(1.0, done / total)
            filled = int(round(frac * self.width))
            return f"{phase:<9}[{'#' * filled}{'.' * (self.width - filled)}] {frac * 100:5.1f}% {done}/{total}"
        return f"{phase:<9}{done} objects"

    def _draw(self, state: tuple[str, int, int | None]) -> None:
        if state == self._drawn:
            return
        self._drawn = state
        if self.tty:
            self.stream.write("\r" + self._text(state) + "\x1b[K")
            self._open = True
        else:
            self.stream.write(self._text(state) + "\n")
        self.stream.flush()

    def _flush(self, state: tuple[str, int, int | None]) -> None:
        """Show the phase's last state, then end its line."""
        self._draw(state)
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False

    def close(self) -> None:
        if self._state is not None:
            self._flush(self._state)
            self._state = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()  # an open line is ended even when the command failed

    @classmethod
    def for_args(cls, args: Any) -> ProgressBar:
        """The bar of a command run with ``-q/--quiet`` or not."""
        return cls(enabled=not args.quiet)
