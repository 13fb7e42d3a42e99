"""Hedged GET ranges (ec_s3/store/hedge.py): the policy's arithmetic on a clock the test
moves, then GETs against SeaweedFS through the network emulator (a seeded stall) or the
fault proxy (a delay per request): the hedge wins with exactly the blob's bytes, a hedge
that loses leaves no connection, permit or budget held, and an object replaced meanwhile
is never a blend of two answers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import boto3
import pytest

from ec_s3.config import ECS3Config
from ec_s3.sandbox.netem import LinkProfile, NetEm
from ec_s3.store.client import S3Store
from ec_s3.store.hedge import FLOOR_S, WARM_AFTER, Clock, Hedging
from support.faultproxy import FaultProxy

pytestmark = pytest.mark.timeout(120)
KiB, MiB = 1 << 10, 1 << 20


class FakeClock(Clock):
    def __init__(self) -> None:
        self.t = 100.0

    def now(self) -> float:
        return self.t


def _warm(policy: Hedging, n: int = WARM_AFTER, first_byte_s: float = 0.02, per_byte_s: float = 1e-8) -> None:
    for _ in range(n):
        policy.record(first_byte_s, per_byte_s * MiB, MiB)


# -- the policy ------------------------------------------------------------------------------

def test_a_cold_policy_never_hedges_and_a_warm_one_waits_factor_times_the_expected() -> None:
    policy = Hedging(3.0, 4, clock=FakeClock())
    _warm(policy, WARM_AFTER - 1)
    assert not policy.warm and policy.deadline(MiB) is None
    policy.record(0.02, 0.01, MiB)
    assert policy.warm
    # median first byte 20 ms + 2 MiB at the median 1e-8 s/byte (the one 0.01 s range is no median)
    assert policy.deadline(2 * MiB) == pytest.approx(3.0 * (0.02 + 2 * MiB * 1e-8))
    assert policy.deadline(0) == pytest.approx(max(FLOOR_S, 3.0 * 0.02))  # a head alone


def test_the_deadline_has_a_floor_and_stalls_do_not_move_it() -> None:
    policy = Hedging(3.0, 4, clock=FakeClock())
    _warm(policy, 20, first_byte_s=0.001, per_byte_s=1e-10)
    assert policy.deadline(MiB) == FLOOR_S
    for _ in range(5):  # a few stalled ranges: the medians stand
        policy.record(2.0, 2.0, MiB)
    assert policy.deadline(MiB) == FLOOR_S


def test_the_budget_bounds_hedges_in_flight_and_zero_turns_hedging_off() -> None:
    policy = Hedging(3.0, 2, clock=FakeClock())
    assert [policy.take(), policy.take(), policy.take()] == [True, True, False]  # exhausted: no hedge
    policy.give_back()
    assert policy.take() and policy.in_flight == 2
    for off in (Hedging(0.0, 4), Hedging(3.0, 0)):
        _warm(off)
        assert off.deadline(MiB) is None


def test_a_stopwatch_does_not_count_waits_on_others() -> None:
    clock = FakeClock()
    watch = Hedging(3.0, 4, clock=clock).stopwatch()
    clock.t += 5.0  # the permit queue: before start()
    assert watch.elapsed() == 0.0 and watch.waiting
    watch.start()
    clock.t += 0.03
    with watch.wait():  # the first answer's head, the caller's buffer
        clock.t += 1.0
        assert watch.waiting and watch.elapsed() == pytest.approx(0.03)
    clock.t += 0.02
    assert not watch.waiting and watch.elapsed() == pytest.approx(0.05)


def test_config_keys_are_validated() -> None:
    from ec_s3.config import ConfigError

    base = {"bucket": "b-hedge"}
    assert ECS3Config.from_extra_config(base, environ={}).hedge_after_factor == 3.0
    assert ECS3Config.from_extra_config({**base, "hedge_after_factor": 0}, environ={}).hedge_after_factor == 0
    with pytest.raises(ConfigError, match="hedge_after_factor"):
        ECS3Config.from_extra_config({**base, "hedge_after_factor": 1.0}, environ={})
    with pytest.raises(ConfigError, match="max_hedges_in_flight"):
        ECS3Config.from_extra_config({**base, "max_hedges_in_flight": -1}, environ={})


# -- GETs against a real server ---------------------------------------------------------------

def _blob(n: int) -> bytes:
    return os.urandom(n)


def _get(store: S3Store, key: str, expected: int | None = None) -> tuple[bytes, float]:
    started = time.monotonic()
    got = store.run(store.get_async(key, expected_size=expected), timeout=60)
    return bytes(got), time.monotonic() - started


def _nothing_held(store: S3Store) -> None:
    """Every permit free, no hedge counted in flight, no connection of the GET pool busy."""
    assert store._permits is not None and store._permits._sem._value == min(
        store.config.max_concurrency, store.config.max_pool_connections)
    assert store.hedging.in_flight == 0
    wire = getattr(store._transport, "wire", None)
    if wire is not None and wire.recv_pool is not None:
        assert wire.recv_pool.in_use == 0


def test_a_stalled_get_is_hedged_and_the_hedge_wins_with_the_blobs_bytes(
    make_store: Callable[..., S3Store], make_config: Callable[..., ECS3Config]
) -> None:
    """Through netem, seed 16 with 20% of answers stalled 2 s: the first 8 answers go at
    once (the warm-up), the 9th stalls, the 10th (its hedge) does not. Without the hedge
    the 9th GET takes 2 s; with it, the floor (0.1 s) plus one more answer."""
    data = _blob(256 * KiB)
    direct = make_store()  # PUTs beside the link: only GET answers draw netem's stalls
    direct.run(direct.put_async("k", data), timeout=60)
    profile = LinkProfile("t", first_byte_s=0.005).with_tail(0.2, 2.0)
    with NetEm(make_config().endpoint_url or "", profile, seed=16) as link:
        store = make_store(link.endpoint_url)
        for _ in range(WARM_AFTER):  # one range each: the blob is smaller than get_range_bytes
            assert _get(store, "k")[0] == data
        assert store.stats.hedges == 0  # cold until now
        got, took = _get(store, "k")
        assert got == data
        assert took < 1.5, f"the stalled GET took {took:.2f}s: not hedged"
        assert (store.stats.hedges, store.stats.hedges_won) == (1, 1)
        assert {"store_hedges": 1.0, "store_hedges_won": 1.0}.items() <= store.stats.take_delta().items()
        _nothing_held(store)


def test_a_hedge_that_loses_is_cancelled_and_holds_nothing(
    make_store: Callable[..., S3Store], fault_proxy: FaultProxy
) -> None:
    """The first range's primary is late (0.4 s: past the 0.1 s floor) but its hedge later
    still (3 s): the primary's answer is used and the hedge is cancelled: no connection,
    permit or budget left behind, not counted as won, no retry. (Size unknown: the first
    range goes alone, so the proxy sees the primary, then the hedge.)"""
    data = _blob(3 * MiB)
    store = make_store(fault_proxy.endpoint_url, get_range_bytes=1 * MiB)
    store.run(store.put_async("k", data), timeout=60)
    for _ in range(3):
        assert _get(store, "k", len(data))[0] == data  # 3 ranges each: warm
    retries = store.stats.retries
    fault_proxy.delay_next([0.4, 3.0], methods=["GET"])
    got, took = _get(store, "k")
    assert got == data and took < 2.0
    assert (store.stats.hedges, store.stats.hedges_won, store.stats.retries) == (1, 0, retries)
    _nothing_held(store)


def test_an_object_replaced_between_primary_and_hedge_is_never_a_blend(
    make_store: Callable[..., S3Store], make_config: Callable[..., ECS3Config], fault_proxy: FaultProxy
) -> None:
    """A 2-range blob (size unknown: the later range is asked once the first answer's head
    is in), replaced when the caller places its buffer. The later range's primary is held
    0.6 s at the proxy, so it is hedged; both are asked If-Match the first ETag and meet a
    412: the primary's error stands, the GET restarts once and returns the new blob whole
    (never the first range of one object and the second of another)."""
    old, new = _blob(2 * MiB), _blob(2 * MiB)
    store = make_store(fault_proxy.endpoint_url, get_range_bytes=1 * MiB)
    store.run(store.put_async("k", old), timeout=60)
    for _ in range(WARM_AFTER // 2):
        assert _get(store, "k")[0] == old  # two ranges each: warm
    config = make_config()
    raw = boto3.client("s3", endpoint_url=config.endpoint_url, region_name="us-east-1",
                       aws_access_key_id=config.access_key_id.reveal(),  # type: ignore[union-attr]
                       aws_secret_access_key=config.secret_access_key.reveal())  # type: ignore[union-attr]

    def replacing(nbytes: int) -> memoryview:
        raw.put_object(Bucket=config.bucket, Key="k", Body=new)
        return memoryview(bytearray(nbytes))

    fault_proxy.delay_next([0.0, 0.6], methods=["GET"])  # the first range at once, the later one late
    got = store.run(store.get_async("k", allocate=replacing), timeout=60)
    assert bytes(got) == new
    assert (store.stats.hedges, store.stats.hedges_won) == (1, 0)
    _nothing_held(store)
