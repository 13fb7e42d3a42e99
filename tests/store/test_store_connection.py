"""Building a store's S3 client (store/connection.py): what a process pays before its
first request.

A fresh process's first PUT was mostly client construction: botocore re-read and
re-parsed its S3 model, endpoint rules and partitions for every store of the process,
and the first request through aiobotocore loaded the CA bundle even for ``http://``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ssl
import time
from collections.abc import Callable
from typing import Any

import aioboto3
import pytest

from ec_s3.config import ECS3Config
from ec_s3.store.client import S3Store
from ec_s3.store.connection import open_client
from ec_s3.store.settings import StoreConfig


def test_the_stores_of_a_process_share_botocore_data(make_store: Callable[..., S3Store]) -> None:
    first, second = make_store(), make_store()
    clients = [s.run(s._get_client(), timeout=30) for s in (first, second)]
    assert clients[0] is not clients[1]  # credentials and config stay per client
    assert clients[0]._loader is clients[1]._loader


def test_a_client_builds_in_a_fraction_of_a_fresh_sessions_time(make_config: Callable[..., ECS3Config]) -> None:
    """Time is the property, with a wide margin: what is left (~1/5 of a fresh
    session's build here) must stay under half of it. Interleaved, best of three."""
    config = make_config()
    store = S3Store(config)  # only for its loop

    async def build(fresh: bool) -> float:
        async with contextlib.AsyncExitStack() as stack:
            t0 = time.perf_counter()
            if fresh:  # how a client was built before: a session of its own
                assert config.access_key_id is not None and config.secret_access_key is not None
                session = aioboto3.Session(aws_access_key_id=config.access_key_id.reveal(),
                                           aws_secret_access_key=config.secret_access_key.reveal(),
                                           region_name=config.region)
                await stack.enter_async_context(session.client("s3", endpoint_url=config.endpoint_url))
            else:
                await open_client(config, stack)
            return time.perf_counter() - t0

    try:
        store.run(build(False), timeout=60)  # imports and the process's first load
        fresh, shared = [], []
        for _ in range(3):
            fresh.append(store.run(build(True), timeout=60))
            shared.append(store.run(build(False), timeout=60))
    finally:
        store.close()
    print(f"client build, s: shared loader {min(shared):.3f}, fresh session {min(fresh):.3f}")
    assert min(shared) < 0.5 * min(fresh), (shared, fresh)


def test_a_plain_http_endpoint_loads_no_ca_bundle(make_store: Callable[..., S3Store],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    loads: list[Any] = []
    real = ssl.SSLContext.load_verify_locations

    def counted(self: ssl.SSLContext, *args: Any, **kwargs: Any) -> None:
        loads.append(args or kwargs)
        real(self, *args, **kwargs)

    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", counted)
    store = make_store()  # HEAD on the blob pool, DeleteObjects on aiobotocore's
    assert store.config.verify_tls and store.config.endpoint_url.startswith("http://")
    assert store.run(store.head_async("missing"), timeout=30) is None
    store.run(store.delete_many_async(["missing"]), timeout=30)
    assert loads == []


def test_configs_differing_only_outside_the_store_share_one_store(make_config: Callable[..., ECS3Config]) -> None:
    """Two engines of one process that differ in a connector key the store never reads
    share one pool and one breaker; a store key (the credentials) still separates them."""
    first = make_config(lookup_wait_s=0.5)
    stores = [S3Store.shared(first), S3Store.shared(dataclasses.replace(first, lookup_wait_s=2.0))]
    other = S3Store.shared(dataclasses.replace(first, max_attempts=first.max_attempts + 1))
    try:
        assert stores[0] is stores[1]
        assert other is not stores[0]
        assert stores[0].config == StoreConfig.of(first)
    finally:
        for store in (*stores, other):
            store.close(timeout=2)
