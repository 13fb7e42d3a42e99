"""The upstreams' roles, checked: an encoder URL must be an EC producer, a prefill/decode
URL must generate tokens and must not be a producer, and all of them should publish to and
read from one location (bucket, prefix, model namespace).

Owns the probe (one tiny text-only request per upstream; nothing encoded or published),
its judgement (a wrong role stops the start, or later takes the upstream out) and the
watch of upstreams that do not answer yet. Does not own the pools (:mod:`.upstreams`) or
``/health`` (:mod:`.status`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

import aiohttp

from ec_s3.blob.format import PROBE_FIELD
from ec_s3.log import logger

__all__ = ["Check", "FleetMisconfigured", "judge", "probe"]

PRODUCERS = ("ec_producer", "ec_both")
CONSUMERS = ("ec_consumer", "ec_both")
RETRY_S = 2.0


class FleetMisconfigured(RuntimeError):
    """An upstream is not what its flag says (encoder and prefill/decode swapped, or a
    wrong URL)."""


@dataclasses.dataclass
class Check:
    """What is known of one upstream's role."""

    kind: str  # "encoder" or "pd": which flag named it
    url: str
    state: str = "unchecked"  # unchecked | unreachable | ok | wrong
    role: str | None = None  # the ec_role it reported, if it is an ec-s3 server
    namespace: str | None = None  # where it publishes or reads blobs (ec-s3 only)
    detail: str = ""

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.state}
        if self.role:
            out["role"] = self.role
        if self.namespace:
            out["namespace"] = self.namespace
        if self.detail:
            out["detail"] = self.detail
        return out


def judge(kind: str, role: str | None, completion_tokens: int | None) -> str:
    """Why an upstream named by ``kind``'s flag is in the wrong role ("" when it is not)."""
    flag = "--encoder-url" if kind == "encoder" else "--pd-url"
    if kind == "encoder":
        if role is not None:
            return "" if role in PRODUCERS else f"is an {role} (prefill/decode), not an encoder: {flag} and --pd-url swapped?"
        if completion_tokens:
            return f"generates tokens and reports no EC producer role: not an encoder (wrong {flag}?)"
        return ""
    if role is not None:
        return "" if role in CONSUMERS else f"is an {role} (an encoder), not prefill/decode: --encoder-url and {flag} swapped?"
    if completion_tokens == 0:
        return f"answers with no tokens, as an encoder does: not prefill/decode (--encoder-url and {flag} swapped?)"
    return ""


async def probe(session: aiohttp.ClientSession, check: Check, headers: dict[str, str], timeout_s: float) -> None:
    """Ask ``check.url`` what it is and record the answer in ``check``; never raises."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.get(f"{check.url}/v1/models", headers=headers, timeout=timeout) as resp:
            if resp.status != 200:
                check.state, check.detail = "unchecked", f"GET /v1/models answered HTTP {resp.status}"
                return
            models = await resp.json(content_type=None)
        model = models["data"][0]["id"]
        body = {"model": model, "prompt": "ec-s3 probe", "max_tokens": 1, "ec_transfer_params": {PROBE_FIELD: True}}
        async with session.post(f"{check.url}/v1/completions", json=body, headers=headers, timeout=timeout) as resp:
            if resp.status != 200:
                check.state, check.detail = "unchecked", f"the probe answered HTTP {resp.status}"
                return
            answer = await resp.json(content_type=None)
    except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError, asyncio.TimeoutError) as exc:
        check.state, check.detail = "unreachable", exc.__class__.__name__
        return
    except (aiohttp.ClientError, ValueError, KeyError, IndexError, TypeError) as exc:
        check.state, check.detail = "unchecked", f"not a vLLM answer ({exc.__class__.__name__})"
        return
    params = answer.get("ec_transfer_params") if isinstance(answer, dict) else None
    found = params.get(PROBE_FIELD) if isinstance(params, dict) else None
    if isinstance(found, dict):
        check.role = found.get("role") if isinstance(found.get("role"), str) else None
        check.namespace = found.get("namespace") if isinstance(found.get("namespace"), str) else None
    usage = answer.get("usage") if isinstance(answer, dict) else None
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    problem = judge(check.kind, check.role, tokens if type(tokens) is int else None)
    check.state, check.detail = ("wrong", problem) if problem else ("ok", "")


class Fleet:
    """Every upstream's :class:`Check`, the start-up check and the background watch."""

    def __init__(self, encoder_urls: list[str], pd_urls: list[str]) -> None:
        self.checks = [Check("encoder", u) for u in encoder_urls] + [Check("pd", u) for u in pd_urls]
        self._watch: asyncio.Task[None] | None = None

    def of(self, url: str, kind: str) -> Check | None:
        return next((c for c in self.checks if c.url == url and c.kind == kind), None)

    @property
    def encoders_namespace(self) -> str | None:
        """Where the encoders publish, when every encoder checked so far agrees."""
        found = {c.namespace for c in self.checks if c.kind == "encoder" and c.namespace}
        return next(iter(found)) if len(found) == 1 else None

    async def check(self, session: aiohttp.ClientSession, headers: dict[str, str], timeout_s: float,
                    pending: list[Check] | None = None) -> None:
        await asyncio.gather(*(probe(session, c, headers, timeout_s) for c in (pending or self.checks)))

    def wrong(self) -> list[Check]:
        return [c for c in self.checks if c.state == "wrong"]

    def describe_wrong(self) -> str:
        return "; ".join(f"{'--encoder-url' if c.kind == 'encoder' else '--pd-url'} {c.url} {c.detail}"
                         for c in self.wrong())

    def mismatch(self) -> str:
        """The locations the servers named, when they are not one ("" when they are)."""
        found: dict[str, list[str]] = {}
        for c in self.checks:
            if c.namespace and c.state == "ok":
                found.setdefault(c.namespace, []).append(c.url)
        if len(found) < 2:
            return ""
        return "; ".join(f"{ns} ({', '.join(urls)})" for ns, urls in found.items())

    def watch(self, session: aiohttp.ClientSession, headers: dict[str, str], timeout_s: float,
              on_wrong: Callable[[Check], None]) -> None:
        """Check the upstreams not checked yet again every ``RETRY_S`` until each answered."""
        async def run() -> None:
            while True:
                pending = [c for c in self.checks if c.state == "unreachable"]
                if not pending:
                    return
                await asyncio.sleep(RETRY_S)
                await self.check(session, headers, timeout_s, pending)
                for c in pending:
                    if c.state == "wrong":
                        on_wrong(c)
                    elif c.state == "ok":
                        logger.info("ec-s3 proxy: %s %s checked: %s", c.kind, c.url, c.role or "no EC role reported")
                self.warn_mismatch()

        if self._watch is None and any(c.state == "unreachable" for c in self.checks):
            self._watch = asyncio.ensure_future(run())

    def warn_mismatch(self) -> None:
        mismatch = self.mismatch()
        if mismatch:
            logger.error(
                "ec-s3 proxy: the upstreams name different blob locations: %s. A consumer refuses every promise "
                "for another location (and encodes the item itself): give every server the same bucket, prefix "
                "and model path", mismatch)

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
