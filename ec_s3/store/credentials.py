"""A credential process the store gave up on is ended, not left running.

Owns the ``popen`` that the process providers of one botocore session use: it starts
the process as aiobotocore would and kills it (and reaps it) when the wait for its
answer ends any way but with the answer. Does not own the deadline or the memory of a
failure (:mod:`.client`), the credential chain itself (aiobotocore) nor building the
client (:mod:`.connection`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiobotocore.credentials import AioProcessProvider

__all__ = ["end_abandoned_credential_processes"]


def end_abandoned_credential_processes(session: Any) -> None:
    """Make every ``credential_process`` provider of ``session`` (an ``AioSession``
    whose credentials the chain will resolve) end its process when the wait is given up."""
    resolver = session.get_component("credential_provider")
    for provider in getattr(resolver, "providers", []):
        if isinstance(provider, AioProcessProvider):
            # No public hook: the chain builds this provider itself, and takes popen= only there.
            provider._popen = _popen


async def _popen(*args: Any, **kwargs: Any) -> _EndedOnCancel:
    return _EndedOnCancel(await asyncio.create_subprocess_exec(*args, **kwargs))


class _EndedOnCancel:
    """An ``asyncio.subprocess.Process`` whose :meth:`communicate` kills it when left
    early (cancelled by a deadline, or failing)."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self._process = process

    @property
    def returncode(self) -> int | None:
        return self._process.returncode

    async def communicate(self, input: bytes | None = None) -> tuple[bytes, bytes]:  # noqa: A002 - asyncio's name
        try:
            return await self._process.communicate(input)
        except BaseException:
            if self._process.returncode is None:
                self._process.kill()
                # Reaped in the background: this task is being cancelled, it must not wait.
                asyncio.ensure_future(self._process.wait())
            raise
