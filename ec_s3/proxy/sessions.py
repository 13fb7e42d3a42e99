"""The proxy's HTTP client sessions: one pool each for encoders, prefill/decode and probes.

Owns their connection pools' sizes (the probes' is small: ``/health`` and the roles'
checks) and their opening and closing (on the app's startup and cleanup, :mod:`.server`).
It does not own what is sent on them (:mod:`.encode`, :mod:`.pd`, :mod:`.status`,
:mod:`.fleet`) nor choosing an upstream (:mod:`.upstreams`).
"""

from __future__ import annotations

import aiohttp

from ec_s3.proxy.config import ProxyConfig

__all__ = ["UpstreamSessions"]


class UpstreamSessions:
    """Three sessions, so that encoder traffic can never take the PD's connections, and a
    small third one for /health's probes, so that they never queue behind either. Each is
    None until :meth:`open`."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.encoder: aiohttp.ClientSession | None = None
        self.pd: aiohttp.ClientSession | None = None
        self.health: aiohttp.ClientSession | None = None

    def open(self) -> None:
        """Open the three sessions (on the event loop that will use them)."""
        cfg = self.config

        def connector(n_upstreams: int) -> aiohttp.TCPConnector:
            return aiohttp.TCPConnector(
                limit=cfg.max_connections_per_upstream * max(n_upstreams, 1),
                limit_per_host=cfg.max_connections_per_upstream,
                keepalive_timeout=cfg.keepalive_timeout_s,
            )

        # auto_decompress=False: bodies are relayed byte for byte with their encoding.
        self.encoder = aiohttp.ClientSession(connector=connector(len(cfg.encoder_urls)))
        self.pd = aiohttp.ClientSession(connector=connector(len(cfg.pd_urls)), auto_decompress=False)
        n_upstreams = len(cfg.pd_urls) + len(cfg.encoder_urls)
        self.health = aiohttp.ClientSession(connector=aiohttp.TCPConnector(
            limit=2 * n_upstreams, limit_per_host=2, keepalive_timeout=cfg.keepalive_timeout_s))

    async def close(self) -> None:
        """Close what :meth:`open` opened."""
        assert self.encoder is not None and self.pd is not None and self.health is not None
        await self.encoder.close()
        await self.pd.close()
        await self.health.close()
