"""The proxy's settings: :class:`ProxyConfig`, validated on construction.

Owns every knob the proxy has, its default and its validation (URLs normalised, bounds
checked), so a bad value fails at start-up with the field's name. It does not own
parsing the command line or reading key files (:mod:`ec_s3.proxy.main`), nor anything
that runs (:mod:`ec_s3.proxy.server`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from ec_s3.config import ConfigError, ECS3Config
from ec_s3.proxy.limits import BODY_COST_FACTOR
from ec_s3.proxy.routing import AFFINITY, ROUTES

__all__ = ["ProxyConfig"]


@dataclasses.dataclass(frozen=True)
class ProxyConfig:
    """Everything the proxy needs; validated on construction, URLs normalised.

    ``encoder_urls`` may be empty (every request then goes straight to PD, which still
    finds what the fleet already published when its ``lookup`` is ``always``).
    Timeouts are seconds; ``total_timeout_s=None`` lets a PD answer (a long stream)
    take as long as it takes. Keys (``api_key``, ``upstream_api_key``) never show in a
    repr.
    """

    encoder_urls: Sequence[str]
    pd_urls: Sequence[str]
    host: str = "127.0.0.1"
    port: int = 8000
    # TCP connect to any upstream.
    connect_timeout_s: float = 5.0
    # Whole encoder request, connect included; past it the item is left to the consumer.
    # Keep it below the consumers' promised_wait_s (5 s by default): under parallel
    # dispatch a consumer waits for a pending item until the proxy gives up on it.
    encode_timeout_s: float = 4.0
    # Whole PD exchange including the streamed body; None: no limit.
    total_timeout_s: float | None = None
    # Longest silence from a prefill/decode or encoder: before its answer starts, and
    # between the chunks of a stream (past it: 504, or the stream ends with an error event).
    # A non-streamed answer comes only when its generation ends: keep this above the
    # longest one. None: no limit.
    read_timeout_s: float | None = 300.0
    # Each upstream's /health probe of GET /health.
    health_timeout_s: float = 2.0
    # /health's answer is reused this long (0: probe on every call), and given while the
    # next probe runs for up to health_timeout_s more; calls that arrive while a probe
    # runs share it either way.
    health_cache_s: float = 1.0
    # At start, how long to wait for each upstream's role check (ec_s3/proxy/fleet.py):
    # one found in the wrong role stops the start; one not answering yet is checked in
    # the background. 0: no check.
    startup_check_s: float = 5.0
    # Idle upstream connections are dropped after this; keep it below the upstream's own
    # keep-alive (uvicorn's default is 5 s, vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE) so a
    # request is never written onto a connection the server is closing.
    keepalive_timeout_s: float = 4.0
    # Connection pool bound per upstream instance (requests beyond it queue in the proxy).
    max_connections_per_upstream: int = 256
    # An upstream that refused a connection is skipped for this long.
    down_cooldown_s: float = 5.0
    # Which prefill/decode instance a request goes to. "affinity": a request with media
    # goes where its first item went before (rendezvous hashing of its identifier) unless
    # that instance is over the load bound below, so a fleet's staging areas and caches
    # hold each image once (ec_s3.proxy.routing; the default: fewer GETs for the same
    # encodes in bench/affinity.py). "least-loaded": fewest requests outstanding.
    # Encoders and media-less requests are always chosen least-loaded.
    route: str = AFFINITY
    # The load bound of route="affinity": an instance takes a request only while its
    # requests outstanding stay within ceil((1 + route_balance) * mean), counting it.
    route_balance: float = 0.25
    # "parallel": the request goes to prefill/decode at once, its items marked pending,
    # while encoders encode them (items are named by content, as their uuid); "serial":
    # encoders first, then prefill/decode with their ec_transfer_params (for servers
    # that cannot take a uuid per content part).
    dispatch: str = "parallel"
    # Keep the media in the forwarded request (so the consumer can encode locally). False
    # drops the media of items an encoder published *and* that carry a client ``uuid``
    # (the only parts vLLM accepts without data); the PD then needs them in its processor
    # cache, else it answers an error, which is passed through.
    forward_media: bool = True
    # Merge the encoders' ec_transfer_params into the forwarded request. False behaves
    # like vLLM's example proxy (encoders still run, PD gets the client's request only):
    # consumers then need `lookup: always` and never wait for an upload in flight.
    forward_params: bool = True
    # Send prefill/decode a metadata-only part (e.g. {"type": "image_embeds", "image_embeds":
    # {"image_grid_thw": [1, 70, 70]}, "uuid": ...}) instead of the media for items whose
    # encoder output is in the bucket and whose placeholder metadata an encoder reported
    # (Qwen-VL and other models that declare vLLM's embedding_fields): prefill/decode then
    # never decodes nor processes that image (ec_s3.proxy.embeds). False: always the media.
    metadata_only: bool = True
    # Trust clients to name items in the servers' caches: their metadata-only parts and
    # the uuids of their embeddings parts are forwarded as they are. Only for clients that
    # are part of the serving stack (another proxy, a batch driver); otherwise a
    # metadata-only part is refused (400) and such uuids are namespaced (ec_s3.proxy.naming).
    # A client's embeddings tensor is refused (400) unless this is set, and then forwarded only
    # when its rows fit its grid as the encoders publish it (ec_s3.proxy.client_embeds).
    trust_client_embeds: bool = False
    # Forward the client's Authorization header upstream, only when the proxy does not
    # check one itself (api_key unset) and upstream_api_key is unset. A key the proxy
    # checks is the proxy's, and never leaves it.
    pass_authorization: bool = True
    # Bearer token sent to every upstream (vLLM --api-key); it replaces the client's.
    upstream_api_key: str | None = dataclasses.field(default=None, repr=False)
    # Bearer token clients must present on /v1/* (None: no check).
    api_key: str | None = dataclasses.field(default=None, repr=False)
    # With api_key: /metrics needs the key too, and /health without it answers its status
    # alone (no upstream URLs or states); probes still read its status code.
    protect_status: bool = False
    # Largest request body accepted (base64 media is big); larger ones get 413.
    max_body_bytes: int = 64 * 1024 * 1024
    # Media parts one chat request may hold: each distinct one costs an encoder request,
    # so this bounds the fan-out of a single client request. More: 400.
    max_items_per_request: int = 64
    # Chat requests handled at once (from arrival to the end of the relayed answer);
    # beyond it a request is answered 503 with Retry-After before its body is read.
    max_in_flight: int = 1024
    # The client side (docs/proxy.md, "At the edge"). Client connections held at once;
    # one more is answered 503 and closed before anything of it is read.
    max_connections: int = 2048
    # A client connection must send a complete request head within this after it opened
    # or after its previous answer (an idle keep-alive connection is closed then too).
    header_timeout_s: float = 15.0
    # A request body must arrive whole within this after its head (else 408).
    body_timeout_s: float = 60.0
    # A client that accepts nothing of its streamed answer for this long is cut off: its
    # slot, its bytes and its prefill/decode request are freed.
    send_timeout_s: float = 60.0
    # Memory the request bodies in flight may take together: each request is charged
    # BODY_COST_FACTOR (8) times its body's size, from before its body is read to the end
    # of its answer; one that does not fit waits (up to body_timeout_s), then gets 503.
    # At least 8 * max_body_bytes.
    body_budget_bytes: int = 1024 * 1024 * 1024
    # Items known to be in the bucket (an encoder answered for them, or a HEAD found
    # them) go to prefill/decode marked present, with no encoder request (ec_s3.proxy.known).
    # At most this many entries (0: every item goes to an encoder) ...
    known_max_entries: int = 65536
    # ... and this many bytes of them in this process.
    known_max_bytes: int = 64 * 1024 * 1024
    # An entry is trusted this long after it was learned: keep it below the bucket's
    # retention (ec-s3 gc --older-than, a lifecycle rule) and the producers' present_ttl_s.
    known_ttl_s: float = 240.0
    # For this long after an encoder answered, its blob may still be uploading: repeats are
    # sent with the encoder's promise (the consumer polls); after it, marked present.
    known_settle_s: float = 5.0
    # Opt-in: the ec_connector_extra_config of the fleet's bucket (bucket, endpoint_url,
    # prefix, ...; credentials from the AWS chain). Items nobody answered for here are
    # looked up with a HEAD first (parallel dispatch, items without processor kwargs):
    # how the proxies of one fleet share what is in the bucket. None: no HEAD.
    bucket_lookup: Mapping[str, Any] | None = dataclasses.field(default=None, repr=False)
    # The longest a request waits for those HEADs; past it its items go to encoders.
    bucket_lookup_timeout_s: float = 0.25
    # On SIGTERM (or stop()): stop listening, then let requests in flight finish for this
    # long before cancelling them. Keep it at least the prefill/decode servers' own
    # --shutdown-timeout, and below the pod's terminationGracePeriodSeconds minus preStop.
    shutdown_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        self._check_upstreams_and_timeouts()
        self._check_limits_and_routing()
        self._check_known_items()
        self._check_keys()

    def _check_upstreams_and_timeouts(self) -> None:
        object.__setattr__(self, "encoder_urls", _normalise_urls(self.encoder_urls, "encoder_urls"))
        object.__setattr__(self, "pd_urls", _normalise_urls(self.pd_urls, "pd_urls"))
        if not self.pd_urls:
            raise ValueError("pd_urls: at least one prefill/decode URL is required")
        if not 0 <= int(self.port) <= 65535:
            raise ValueError(f"port: {self.port!r} is not a TCP port")
        for name in ("connect_timeout_s", "encode_timeout_s", "health_timeout_s", "keepalive_timeout_s",
                     "header_timeout_s", "body_timeout_s", "send_timeout_s"):
            if not float(getattr(self, name)) > 0:
                raise ValueError(f"{name}: must be > 0")
        for name in ("total_timeout_s", "read_timeout_s"):
            value = getattr(self, name)
            if value is not None and not float(value) > 0:
                raise ValueError(f"{name}: must be > 0 or None (no limit)")
        if not float(self.startup_check_s) >= 0:
            raise ValueError("startup_check_s: must be >= 0 (0: no role check)")
        if not float(self.health_cache_s) >= 0:
            raise ValueError("health_cache_s: must be >= 0 (0: probe on every call)")

    def _check_limits_and_routing(self) -> None:
        if self.max_connections < 1:
            raise ValueError("max_connections: must be >= 1")
        if self.body_budget_bytes < BODY_COST_FACTOR * self.max_body_bytes:
            raise ValueError(
                f"body_budget_bytes: must be at least {BODY_COST_FACTOR} * max_body_bytes "
                f"({BODY_COST_FACTOR * self.max_body_bytes}), else the largest body could never be read"
            )
        if self.dispatch not in ("parallel", "serial"):
            raise ValueError(f"dispatch: {self.dispatch!r} is not 'parallel' or 'serial'")
        if self.route not in ROUTES:
            raise ValueError(f"route: {self.route!r} is not one of {', '.join(ROUTES)}")
        if not 0 <= float(self.route_balance) <= 100:
            raise ValueError("route_balance: must be >= 0 and at most 100 (0: perfect balance)")
        if self.down_cooldown_s < 0:
            raise ValueError("down_cooldown_s: must be >= 0")
        if self.max_connections_per_upstream < 1:
            raise ValueError("max_connections_per_upstream: must be >= 1")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes: must be >= 1024")
        if self.max_items_per_request < 1:
            raise ValueError("max_items_per_request: must be >= 1")
        if self.max_in_flight < 1:
            raise ValueError("max_in_flight: must be >= 1")

    def _check_known_items(self) -> None:
        if self.known_max_entries < 0:
            raise ValueError("known_max_entries: must be >= 0 (0: off)")
        if self.known_max_bytes < 4096:
            raise ValueError("known_max_bytes: must be >= 4096")
        if not 0 < float(self.known_ttl_s) <= 7 * 86400:
            raise ValueError("known_ttl_s: must be > 0 and at most 7 days (keep it below the bucket's retention)")
        if not 0 <= float(self.known_settle_s) < float(self.known_ttl_s):
            raise ValueError("known_settle_s: must be >= 0 and below known_ttl_s")
        if not 0 <= float(self.shutdown_timeout_s) <= 3600:
            raise ValueError("shutdown_timeout_s: must be >= 0 and at most 3600 (0: cancel requests in flight at once)")
        if not float(self.bucket_lookup_timeout_s) > 0:
            raise ValueError("bucket_lookup_timeout_s: must be > 0")
        if self.bucket_lookup is not None:
            if not isinstance(self.bucket_lookup, Mapping):
                raise ValueError("bucket_lookup: must be a mapping of ec_connector_extra_config keys, or None")
            try:
                ECS3Config.from_extra_config(dict(self.bucket_lookup))
            except ConfigError as exc:
                raise ValueError(f"bucket_lookup: {exc}") from None

    def _check_keys(self) -> None:
        if self.protect_status and self.api_key is None:
            raise ValueError("protect_status: needs api_key (the key /metrics and /health's details then ask for)")
        for name in ("api_key", "upstream_api_key"):
            key = getattr(self, name)
            # An empty key would silently mean "no check"; a newline would split headers.
            if key is not None and (not key or any(c in key for c in "\r\n")):
                raise ValueError(f"{name}: must be a non-empty single line")

def _normalise_urls(urls: Iterable[str] | str, name: str) -> tuple[str, ...]:
    if isinstance(urls, str):
        urls = [urls]
    out: list[str] = []
    for raw in urls:
        for url in str(raw).split(","):
            url = url.strip().rstrip("/")
            if not url:
                continue
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"{name}: {url!r} is not an http(s)://host:port URL")
            if parts.username is not None or parts.password is not None:
                # URLs are logged and labelled in metrics; credentials must not ride in them.
                raise ValueError(
                    f"{name}: a URL must not carry credentials; pass the upstreams' key with "
                    "--upstream-api-key-file or $EC_S3_PROXY_UPSTREAM_API_KEY"
                )
            if url not in out:
                out.append(url)
    return tuple(out)
