"""``ec-s3 proxy`` / ``python -m ec_s3.proxy``: the command line and the serve loop.

Owns the flags (each maps to one :class:`~ec_s3.proxy.config.ProxyConfig` field), their
defaults in the help text, and serving until SIGINT/SIGTERM. It does not own validation
(the config does) nor anything the proxy does per request (:mod:`ec_s3.proxy.server`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
from typing import Any

from ec_s3.log import logger
from ec_s3.proxy.config import ProxyConfig
from ec_s3.proxy.fleet import FleetMisconfigured
from ec_s3.proxy.server import EPDProxy

__all__ = ["build_parser", "config_from_args", "main"]

_API_KEY_ENV = "EC_S3_PROXY_API_KEY"
_UPSTREAM_API_KEY_ENV = "EC_S3_PROXY_UPSTREAM_API_KEY"


class _Defaults:
    """ProxyConfig's field defaults by attribute, for the help texts."""

    def __getattr__(self, name: str) -> Any:
        return {f.name: f.default for f in dataclasses.fields(ProxyConfig)}[name]


def build_parser(prog: str = "ec-s3 proxy") -> argparse.ArgumentParser:
    d = _Defaults()
    p = argparse.ArgumentParser(
        prog=prog,
        description=(
            "OpenAI-compatible EPD proxy: sends each media item of a chat request to an encoder "
            "(ec_producer) and the request to a prefill/decode instance (ec_consumer), at once "
            "(--dispatch parallel) or after the encoders answered, with their ec_transfer_params "
            "(serial). Encoder failures never fail a request."
        ),
    )
    _add_upstream_args(p, d)
    _add_dispatch_args(p, d)
    _add_client_args(p, d)
    _add_known_args(p, d)
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def _add_upstream_args(p: argparse.ArgumentParser, d: Any) -> None:
    """Where the upstreams are, and the timeouts and pools of the requests to them."""
    p.add_argument("--encoder-url", "--encode-servers-urls", dest="encoder_urls", action="append", default=[],
                   metavar="URL", help="encoder instance base URL; repeat or comma-separate (none: all go to PD)")
    p.add_argument("--pd-url", "--prefill-decode-servers-urls", dest="pd_urls", action="append", default=[],
                   metavar="URL", required=True, help="prefill/decode instance base URL; repeat or comma-separate")
    p.add_argument("--host", default=d.host, help=f"address to bind (default {d.host})")
    p.add_argument("--port", type=int, default=d.port, help=f"port to bind, 0 for any (default {d.port})")
    p.add_argument("--connect-timeout", type=float, default=d.connect_timeout_s, metavar="S",
                   help=f"TCP connect timeout to upstreams (default {d.connect_timeout_s:g})")
    p.add_argument("--encode-timeout", type=float, default=d.encode_timeout_s, metavar="S",
                   help=f"whole encoder request; past it the item is encoded by PD (default {d.encode_timeout_s:g})")
    p.add_argument("--total-timeout", type=float, default=0.0, metavar="S",
                   help="whole PD exchange including a stream; 0 = no limit (default 0)")
    p.add_argument("--read-timeout", type=float, default=d.read_timeout_s, metavar="S",
                   help="longest silence from an upstream: before its answer starts and between the chunks of a "
                        "stream (then 504, or the stream ends with an error event); a non-streamed answer comes "
                        "when generation ends, so keep it above the longest; 0 = no limit "
                        f"(default {d.read_timeout_s:g})")
    p.add_argument("--health-timeout", type=float, default=d.health_timeout_s, metavar="S",
                   help=f"per-upstream /health probe (default {d.health_timeout_s:g})")
    p.add_argument("--health-cache", type=float, default=d.health_cache_s, metavar="S",
                   help="reuse /health's answer this long (and while the next probe runs, up to --health-timeout "
                        "more); concurrent calls share one probe either way; 0 = probe on every call "
                        f"(default {d.health_cache_s:g})")
    p.add_argument("--startup-check", type=float, default=d.startup_check_s, metavar="S",
                   help="at start, wait this long for each upstream's role check: an encoder URL that is no EC "
                        "producer, or a prefill/decode URL that is one (swapped flags), stops the start; one not "
                        "answering yet is checked in the background, and never used if wrong; 0 = no check "
                        f"(default {d.startup_check_s:g})")
    p.add_argument("--keepalive-timeout", type=float, default=d.keepalive_timeout_s, metavar="S",
                   help="drop idle upstream connections after this; keep below the upstreams' keep-alive "
                        f"(VLLM_HTTP_TIMEOUT_KEEP_ALIVE, default 5) (default {d.keepalive_timeout_s:g})")
    p.add_argument("--max-connections-per-upstream", type=int, default=d.max_connections_per_upstream, metavar="N",
                   help=f"connection pool bound per upstream instance (default {d.max_connections_per_upstream})")
    p.add_argument("--down-cooldown", type=float, default=d.down_cooldown_s, metavar="S",
                   help=f"skip an upstream this long after it refused a connection (default {d.down_cooldown_s:g})")
    p.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout_s, metavar="S",
                   help="on SIGTERM, stop listening and let requests in flight finish this long; keep it at least "
                        f"prefill/decode's own --shutdown-timeout (default {d.shutdown_timeout_s:g})")


def _add_dispatch_args(p: argparse.ArgumentParser, d: Any) -> None:
    """How a request travels: dispatch, routing, and what prefill/decode receives."""
    p.add_argument("--dispatch", choices=["parallel", "serial"], default=d.dispatch,
                   help="parallel: send the request to prefill/decode while encoders encode its media (items "
                        "named by content, marked pending); serial: encoders first, then prefill/decode with "
                        f"their ec_transfer_params (for servers that take no uuid) (default {d.dispatch})")
    p.add_argument("--route", choices=["least-loaded", "affinity"], default=d.route,
                   help="how a request picks its prefill/decode instance: least-loaded, or affinity (where its "
                        "first media item went before: rendezvous hashing, bounded by --route-balance; for "
                        f"aggregated ec_both servers) (default {d.route})")
    p.add_argument("--route-balance", type=float, default=d.route_balance, metavar="EPS",
                   help="--route affinity: an instance takes a request only while its outstanding requests stay "
                        f"within ceil((1 + EPS) * mean), else the next choice does (default {d.route_balance:g})")
    p.add_argument("--no-forward-media", dest="forward_media", action="store_false",
                   help="null the media of uuid-carrying items an encoder published (PD must have them cached)")
    p.add_argument("--no-forward-params", dest="forward_params", action="store_false",
                   help="still send media to encoders but forward no ec_transfer_params to prefill/decode, "
                        "like vLLM's example proxy (consumers then need lookup: always; see docs/proxy.md)")
    p.add_argument("--no-metadata-only", dest="metadata_only", action="store_false",
                   help="always forward an item's media to prefill/decode, never a metadata-only part for items "
                        "in the bucket (see docs/proxy.md)")
    p.add_argument("--trust-client-embeds", action="store_true",
                   help="forward clients' metadata-only parts and embeddings uuids as they are, and their embeddings "
                        "tensors when their rows fit their grid (only for clients that are part of the serving stack; "
                        "otherwise those parts are refused with 400)")


def _add_client_args(p: argparse.ArgumentParser, d: Any) -> None:
    """The client side: keys, and what one request and one client may hold."""
    keys = p.add_argument_group(
        "keys", "prefer the files or the environment: a key given as a flag shows in every process listing"
    )
    keys.add_argument("--api-key-file", metavar="PATH",
                      help=f"file holding the bearer token clients must send (else ${_API_KEY_ENV}; unset: none)")
    keys.add_argument("--upstream-api-key-file", metavar="PATH",
                      help="file holding the bearer token sent to every upstream (vLLM --api-key) "
                           f"(else ${_UPSTREAM_API_KEY_ENV}); without one, upstreams get no key when "
                           "the proxy checks its own")
    keys.add_argument("--api-key", help=argparse.SUPPRESS)  # kept working; main() warns
    keys.add_argument("--upstream-api-key", help=argparse.SUPPRESS)
    keys.add_argument("--protect-status", action="store_true",
                      help="with a client key: /metrics needs it too, and /health without it answers its status "
                           "alone, no upstream URLs (probes read the status code)")
    p.add_argument("--no-pass-authorization", dest="pass_authorization", action="store_false",
                   help="do not forward the client's Authorization header upstream (never forwarded when the "
                        "proxy checks a key of its own)")
    p.add_argument("--max-body-bytes", type=_size, default=d.max_body_bytes, metavar="SIZE",
                   help=f"largest request body accepted, e.g. 64MiB (default {d.max_body_bytes})")
    p.add_argument("--max-items-per-request", type=int, default=d.max_items_per_request, metavar="N",
                   help="media parts one request may hold, each an encoder request; more is a 400 "
                        f"(default {d.max_items_per_request})")
    p.add_argument("--max-in-flight", type=int, default=d.max_in_flight, metavar="N",
                   help=f"chat requests handled at once; more get 503 + Retry-After (default {d.max_in_flight})")
    edge = p.add_argument_group("client side", "what one client can hold, and for how long (docs/proxy.md)")
    edge.add_argument("--max-connections", type=int, default=d.max_connections, metavar="N",
                      help="client connections held at once; one more gets 503 and is closed "
                           f"(default {d.max_connections})")
    edge.add_argument("--header-timeout", type=float, default=d.header_timeout_s, metavar="S",
                      help="a connection must send a complete request head within this after it opened or after its "
                           f"previous answer (idle keep-alive connections close then) (default {d.header_timeout_s:g})")
    edge.add_argument("--body-timeout", type=float, default=d.body_timeout_s, metavar="S",
                      help=f"a request body must arrive whole within this after its head, else 408 "
                           f"(default {d.body_timeout_s:g})")
    edge.add_argument("--send-timeout", type=float, default=d.send_timeout_s, metavar="S",
                      help="a client that accepts nothing of its streamed answer for this long is cut off "
                           f"(default {d.send_timeout_s:g})")
    edge.add_argument("--body-budget", type=_size, default=d.body_budget_bytes, metavar="SIZE",
                      help="memory all request bodies in flight may take, each charged 8x its size; a request that "
                           "does not fit waits up to --body-timeout, then 503; at least 8x --max-body-bytes "
                           f"(default {d.body_budget_bytes // (1 << 20)}MiB)")


def _add_known_args(p: argparse.ArgumentParser, d: Any) -> None:
    """Items known to be in the bucket."""
    known = p.add_argument_group(
        "known items", "items known to be in the bucket go to prefill/decode marked present, with no encoder request")
    known.add_argument("--known-max-entries", type=int, default=d.known_max_entries, metavar="N",
                       help=f"entries remembered, 0 = off (default {d.known_max_entries})")
    known.add_argument("--known-max-bytes", type=int, default=d.known_max_bytes, metavar="N",
                       help=f"bytes of them in this process (default {d.known_max_bytes})")
    known.add_argument("--known-ttl", type=float, default=d.known_ttl_s, metavar="S",
                       help="trust an entry this long; keep it below the bucket's retention (gc --older-than, a "
                            f"lifecycle rule) (default {d.known_ttl_s:g})")
    known.add_argument("--known-settle", type=float, default=d.known_settle_s, metavar="S",
                       help="after an encoder answered, send repeats with its promise this long before marking "
                            f"them present (its upload may be in flight) (default {d.known_settle_s:g})")
    known.add_argument("--bucket-lookup", metavar="JSON",
                       help="opt-in: the fleet's ec_connector_extra_config as JSON (bucket, endpoint_url, prefix; "
                            "credentials from the AWS chain); items nobody answered for here are HEADed first, so "
                            "the proxies of a fleet share what is in the bucket (parallel dispatch)")
    known.add_argument("--bucket-lookup-timeout", type=float, default=d.bucket_lookup_timeout_s, metavar="S",
                       help=f"longest wait for those HEADs (default {d.bucket_lookup_timeout_s:g})")


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    return ProxyConfig(
        encoder_urls=args.encoder_urls,
        pd_urls=args.pd_urls,
        host=args.host,
        port=args.port,
        connect_timeout_s=args.connect_timeout,
        encode_timeout_s=args.encode_timeout,
        total_timeout_s=args.total_timeout or None,
        read_timeout_s=args.read_timeout or None,
        health_timeout_s=args.health_timeout,
        health_cache_s=args.health_cache,
        startup_check_s=args.startup_check,
        keepalive_timeout_s=args.keepalive_timeout,
        max_connections_per_upstream=args.max_connections_per_upstream,
        down_cooldown_s=args.down_cooldown,
        shutdown_timeout_s=args.shutdown_timeout,
        dispatch=args.dispatch,
        route=args.route,
        route_balance=args.route_balance,
        forward_media=args.forward_media,
        forward_params=args.forward_params,
        metadata_only=args.metadata_only,
        trust_client_embeds=args.trust_client_embeds,
        pass_authorization=args.pass_authorization,
        upstream_api_key=_key(args.upstream_api_key, args.upstream_api_key_file, _UPSTREAM_API_KEY_ENV,
                              "upstream_api_key"),
        api_key=_key(args.api_key, args.api_key_file, _API_KEY_ENV, "api_key"),
        protect_status=args.protect_status,
        max_body_bytes=args.max_body_bytes,
        max_items_per_request=args.max_items_per_request,
        max_in_flight=args.max_in_flight,
        max_connections=args.max_connections,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        send_timeout_s=args.send_timeout,
        body_budget_bytes=args.body_budget,
        known_max_entries=args.known_max_entries,
        known_max_bytes=args.known_max_bytes,
        known_ttl_s=args.known_ttl,
        known_settle_s=args.known_settle,
        bucket_lookup=_without_literal_secrets(_json_object(args.bucket_lookup, "bucket_lookup"), "bucket_lookup"),
        bucket_lookup_timeout_s=args.bucket_lookup_timeout,
    )


def _size(text: str) -> int:
    """A byte count as users write one: 1073741824, 1GiB, 512MB, 2G."""
    from ec_s3.config_values import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _json_object(text: str | None, name: str) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{name}: not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name}: must be a JSON object")
    return value


# Keys of ec_connector_extra_config that hold secrets (ECS3Config's secret fields).
_SECRET_KEYS = ("secret_access_key", "session_token")


def _without_literal_secrets(value: dict[str, Any] | None, name: str) -> dict[str, Any] | None:
    """Refuse a secret written literally on the command line, where every local user
    reads it (/proc/<pid>/cmdline, ps); a reference or the AWS chain is fine."""
    for key in _SECRET_KEYS:
        secret = (value or {}).get(key)
        if isinstance(secret, str) and not secret.startswith(("env:", "file:")):
            raise ValueError(
                f"{name}: {key} is given literally, so every local user can read it on the command line; "
                f'write "{key}": "env:NAME" or "file:/path", or leave it out and use the AWS credential chain '
                "(AWS_SECRET_ACCESS_KEY, a profile or an instance role)"
            )
    return value


def _key(flag: str | None, path: str | None, env: str, name: str) -> str | None:
    """A key from its file, else its flag, else its environment variable (empty: none).
    A file that is empty yields "" so that the config refuses it: asked for, not found."""
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read().strip()
        except OSError as exc:
            raise ValueError(f"{name}: cannot read {path}: {exc.strerror}") from None
    return flag or os.environ.get(env) or None


async def _serve(config: ProxyConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    proxy = EPDProxy(config)
    await proxy.start()
    try:
        await stop.wait()
    finally:
        logger.info("ec-s3 proxy: shutting down: no new connections; requests in flight get up to %g s "
                    "(--shutdown-timeout)", config.shutdown_timeout_s)
        await proxy.stop()


def main(argv: list[str] | None = None) -> int:
    """``ec-s3 proxy`` / ``python -m ec_s3.proxy``: serve until SIGINT or SIGTERM."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        config = config_from_args(args)
    except SystemExit as exc:  # --help (0) and usage errors (2)
        return exc.code if isinstance(exc.code, int) else 2
    except ValueError as exc:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.setLevel(args.log_level)
    for flag, value in (("--api-key", args.api_key), ("--upstream-api-key", args.upstream_api_key)):
        if value:
            logger.warning(
                "ec-s3 proxy: %s on the command line is visible to every user of this host (ps, /proc); "
                "use %s-file or $%s instead", flag, flag,
                _API_KEY_ENV if flag == "--api-key" else _UPSTREAM_API_KEY_ENV,
            )
    try:
        asyncio.run(_serve(config))
    except OSError as exc:  # e.g. the port is taken
        logger.error("ec-s3 proxy: cannot serve on %s:%s: %s", config.host, config.port, exc)
        return 1
    except FleetMisconfigured as exc:
        logger.error("ec-s3 proxy: not starting: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
