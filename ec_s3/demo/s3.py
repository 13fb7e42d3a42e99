"""Phase 1 of ``ec-s3 demo``: the bucket and this run's key prefix, and their cleanup.

Owns starting the embedded SeaweedFS (without ``--endpoint-url``), the bucket, the fresh
prefix, which credentials go where (the servers' environment, this process's config;
never a command line or a log) and deleting the run's blobs at the end. Does not own the
S3 server (:mod:`ec_s3.sandbox.embedded_s3`) nor the client (:mod:`ec_s3.store.client`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from typing import Any

from ec_s3.cli.listing import key_root, list_objects_async
from ec_s3.demo.context import DemoContext
from ec_s3.demo.options import DEFAULT_BUCKET

__all__ = ["delete_blobs", "start_s3"]


def start_s3(demo: DemoContext, stack: contextlib.ExitStack) -> tuple[Any, dict[str, Any], dict[str, str]]:
    """(store for listing, the servers' ec_connector_extra_config, their env); sets
    ``demo.bucket_lookup``."""
    from ec_s3.config import ECS3Config, Secret
    from ec_s3.store.client import S3Store

    args, out = demo.args, demo.out
    t = time.monotonic()
    bucket = args.bucket or os.environ.get("EC_S3_BUCKET") or DEFAULT_BUCKET
    prefix = args.prefix or f"ec-s3-demo/{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
    env: dict[str, str] = {}
    store_extra: dict[str, Any] = {}
    if args.endpoint_url:
        endpoint, where = args.endpoint_url, f"S3 endpoint {args.endpoint_url}"
    else:
        from ec_s3.sandbox.embedded_s3 import EmbeddedS3Server

        demo.step(1, "S3: starting an embedded SeaweedFS server on loopback")
        server = EmbeddedS3Server()
        stack.callback(server.stop)
        server.start()
        endpoint, where = server.endpoint_url, f"embedded SeaweedFS at {server.endpoint_url}"
        creds = server.credentials
        # Servers get them in their environment; this process in its own config.
        env = {"AWS_ACCESS_KEY_ID": creds.access_key_id, "AWS_SECRET_ACCESS_KEY": creds.secret_access_key}
        # Secret objects: these never leave this process (no command line, no log).
        store_extra = {"access_key_id": Secret(creds.access_key_id), "secret_access_key": Secret(creds.secret_access_key)}
    if args.endpoint_url:
        demo.step(1, f"S3: using {where}")
    extra_config = {**demo.extra, "bucket": bucket, "endpoint_url": endpoint, "prefix": prefix}
    # The proxy HEADs the bucket for images other fronts published (bucket_lookup).
    demo.bucket_lookup = {**extra_config, **store_extra}
    config = ECS3Config.from_extra_config({**extra_config, **store_extra})
    store = S3Store(config)
    stack.callback(store.close, 5.0)
    store.run(store.create_bucket_async(), timeout=60)
    demo.timings["s3"] = time.monotonic() - t
    out(f"      {where}; bucket {bucket}, prefix {prefix} ({demo.timings['s3']:.1f} s)")
    return store, extra_config, env


def delete_blobs(demo: DemoContext, store: Any, prefix: str) -> None:
    """Every blob under ``prefix``; on a failure, prints the ``ec-s3 gc`` that finishes it."""
    try:
        keys = [o.key for o in store.run(list_objects_async(store, key_root(prefix)), timeout=60)]
        if keys:
            store.run(store.delete_many_async(keys), timeout=60)
    except Exception as exc:  # noqa: BLE001 - the answers are in; leftovers are reported, not fatal
        endpoint = f" --endpoint-url {store.config.endpoint_url}" if store.config.endpoint_url else ""
        demo.out(f"  could not delete this run's blobs ({type(exc).__name__}: {exc}); delete them with "
                 f"`ec-s3 gc --bucket {store.bucket}{endpoint} --prefix {prefix} --older-than 0s`")
