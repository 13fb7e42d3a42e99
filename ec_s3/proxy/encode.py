"""One media item sent to one encoder, and what its answer or failure means.

Owns the encoder request: the least busy encoder's pick, its deadline, the outcome
(``ok``, ``http_error``, ``no_params``, ``unreachable``, ``timeout``, ``error``,
``cancelled``), its metrics and warnings, and a failure never raised: the item goes to
prefill/decode without params. It does not own which items are sent, or what a failure
changes for p/d (:mod:`.dispatch`), the payload (:mod:`.media`) or the pool (:mod:`.upstreams`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from ec_s3.proxy.client_embeds import EmbedsRules
from ec_s3.proxy.config import ProxyConfig
from ec_s3.proxy.metrics import ProxyMetrics
from ec_s3.proxy.sessions import UpstreamSessions
from ec_s3.proxy.upstreams import Pool, Upstream, Warner

__all__ = ["EncoderSender"]


class EncoderSender:
    """Sends one item to an encoder of ``pool`` on ``sessions.encoder``; what encoders
    publish per modality is taught to ``embeds_rules``."""

    def __init__(self, config: ProxyConfig, pool: Pool, sessions: UpstreamSessions, metrics: ProxyMetrics,
                 warner: Warner, embeds_rules: EmbedsRules) -> None:
        self.config = config
        self.pool = pool
        self.sessions = sessions
        self.metrics = metrics
        self.warner = warner
        self.embeds_rules = embeds_rules

    async def encode_one(self, payload: bytes, headers: dict[str, str], request_id: str) -> dict[str, Any] | None:
        """Send one item to the least busy encoder; its ``ec_transfer_params``, or None
        when it failed (logged and counted, never raised)."""
        session = self.sessions.encoder
        assert session is not None
        cfg = self.config
        upstream = self.pool.acquire()
        if upstream is None:
            self.metrics.inc("ec_s3_proxy_encoder_requests_total", upstream="none", outcome="skipped")
            return None
        timeout = aiohttp.ClientTimeout(total=cfg.encode_timeout_s, sock_connect=cfg.connect_timeout_s,
                                        sock_read=cfg.read_timeout_s)
        started = time.monotonic()
        outcome, detail = "error", ""
        try:
            async with session.post(
                f"{upstream.url}/v1/chat/completions", data=payload, headers=headers, timeout=timeout
            ) as resp:
                if resp.status != 200:
                    text = (await resp.text(errors="replace"))[:200]
                    outcome, detail = "http_error", f"HTTP {resp.status}: {text}"
                    return None
                payload = await resp.json(content_type=None)
            self.pool.mark_up(upstream)
            params = payload.get("ec_transfer_params") if isinstance(payload, dict) else None
            if not isinstance(params, dict) or not params:
                outcome, detail = "no_params", "answer carried no ec_transfer_params (is it an ec_producer?)"
                return None
            outcome = "ok"
            self.embeds_rules.learn(params)
            return params
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            self.pool.mark_down(upstream)
            outcome, detail = "unreachable", f"{exc.__class__.__name__}: {exc}"
        except asyncio.TimeoutError:
            outcome, detail = "timeout", f"no answer within encode_timeout_s={cfg.encode_timeout_s:g}"
        except (aiohttp.ClientError, ValueError, RecursionError) as exc:  # RecursionError: a too-deep answer
            outcome, detail = "error", f"{exc.__class__.__name__}: {str(exc)[:200]}"
        except asyncio.CancelledError:
            outcome = "cancelled"  # the client left: not the encoder's failure
            raise
        finally:
            self._done(upstream, outcome, detail, started, request_id)
        return None

    def _done(self, upstream: Upstream, outcome: str, detail: str, started: float, request_id: str) -> None:
        """An encoder request ended: its upstream released, counted, and a failure logged."""
        self.pool.release(upstream)
        self.metrics.inc("ec_s3_proxy_encoder_requests_total", upstream=upstream.url, outcome=outcome)
        self.metrics.inc("ec_s3_proxy_encoder_seconds_total", time.monotonic() - started, upstream=upstream.url)
        if outcome not in ("ok", "cancelled"):
            self.warner.warn(
                (upstream.url, outcome),
                "ec-s3 proxy: request %s: encoder %s failed (%s); the item goes to prefill/decode "
                "without params and is encoded there",
                request_id, upstream.url, detail,
            )
