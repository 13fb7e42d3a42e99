"""A prefill/decode answer the proxy has begun and not yet relayed, and what its start says.

Owns :class:`PdAnswer` (upstream, response and the bytes read so far) and
:meth:`PdAnswer.read_start` / :meth:`PdAnswer.failed_generation`: whether p/d answered with
vLLM's retryable ``finish_reason: "error"`` (its causes: docs/architecture.md). It does
not own sending or retrying (:mod:`.pd`), relaying (:mod:`.relay`) nor the order of sends
(:mod:`.dispatch`).
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from ec_s3.proxy.upstreams import Pool, Upstream

__all__ = ["PdAnswer"]

# vLLM's error types for a failed generation (GenerationError; RetryableRequestError).
_FAILED_GENERATION_TYPES = frozenset({"InternalServerError", "ServiceUnavailableError"})
# GenerationError's message (vllm/exceptions.py, 0.32-0.34): finish_reason "error".
_GENERATION_ERROR_MESSAGE = "Internal server error"
# A stream's start is read up to its first event past a bare role chunk, at most this much.
_MAX_START_BYTES = 64 * 1024


class PdAnswer:
    """A prefill/decode answer begun by :meth:`~ec_s3.proxy.pd.PdSender.begin`: the
    upstream it holds in its pool, the open response and the bytes read so far. ``close``
    (idempotent) frees both; closing an unfinished response aborts the PD's work."""

    def __init__(self, pool: Pool, upstream: Upstream, stream: bool) -> None:
        self.pool = pool
        self.upstream = upstream
        self.stream = stream
        self.resp: aiohttp.ClientResponse | None = None
        self.first = b""
        self._held = True

    async def read_start(self) -> None:
        """Read the start of the answer into :attr:`first`: the whole body, or for a
        stream its first chunk and, while everything read is complete events that are
        bare role chunks, the next (vLLM sends the role chunk and the first token, or the
        error that ended the request, in one step, so this waits for nothing more)."""
        assert self.resp is not None
        if not self.stream:
            self.first = await self.resp.read()
            return
        self.first = await self.resp.content.readany()
        while self.first and len(self.first) < _MAX_START_BYTES and _only_role_chunks(self.first):
            more = await self.resp.content.readany()
            if not more:
                break
            self.first += more

    def failed_generation(self) -> bool:
        """Whether vLLM's engine refused the request before any token (module docstring)."""
        if self.resp is None:
            return False
        if not self.stream:
            return self.resp.status in (500, 503) and _is_failed_generation(_json(self.first))
        events = list(_events(self.first))
        return any(_is_failed_generation(e) for e in events) and not any(_has_output(e) for e in events)

    def close(self) -> None:
        if self.resp is not None:
            self.resp.close()  # no-op once released
        if self._held:
            self._held = False
            self.pool.release(self.upstream)


def _json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return None


def _events(data: bytes) -> list[Any]:
    """The complete SSE ``data:`` events in ``data`` (``[DONE]`` as the string)."""
    out: list[Any] = []
    *complete, _rest = data.replace(b"\r\n", b"\n").split(b"\n\n")
    for block in complete:
        for line in block.split(b"\n"):
            if line.startswith(b"data:"):
                payload = line[5:].strip()
                out.append("[DONE]" if payload == b"[DONE]" else _json(payload))
    return out


def _only_role_chunks(data: bytes) -> bool:
    """Whether ``data`` is nothing but complete events that carry no output and no error."""
    events = _events(data)
    if not data.replace(b"\r\n", b"\n").endswith(b"\n\n"):
        return False  # an event is cut: the relay may go on, it has begun
    return bool(events) and all(isinstance(e, dict) and "error" not in e and not _has_output(e) for e in events)


def _has_output(event: Any) -> bool:
    """Whether a chunk carries generated output (content, reasoning, tool calls) or a finish."""
    if not isinstance(event, dict):
        return False
    for choice in event.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        if choice.get("finish_reason") is not None:
            return True
        delta = choice.get("delta") or {}
        if isinstance(delta, dict) and any(delta.get(k) for k in ("content", "reasoning", "reasoning_content",
                                                                  "tool_calls")):
            return True
    return False


def _is_failed_generation(payload: Any) -> bool:
    """vLLM's retryable request-level failure only: a RetryableRequestError, or a
    GenerationError with its own message. Any other 500 (``EngineDeadError``: "EngineCore
    encountered an issue") is not: its engine is gone, and the same request, if it is what
    killed it, would kill the next instance too."""
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict) or error.get("type") not in _FAILED_GENERATION_TYPES:
        return False
    return error.get("type") == "ServiceUnavailableError" or error.get("message") == _GENERATION_ERROR_MESSAGE
