"""Phase 2 of ``ec-s3 demo``: the model every server of the run serves.

Owns the choice between ``--model`` (your vLLM install and device, your ``--vllm-arg``)
and the tiny offline stand-in (``--tiny-model``: built once in a cache dir, then reused),
with the server arguments and environment each needs. Does not own building the tiny
models (:mod:`ec_s3.sandbox.tiny_qwen`, :mod:`ec_s3.sandbox.tiny_model`) nor the servers.
"""

from __future__ import annotations

import time
from pathlib import Path

from ec_s3.demo.context import DemoContext
from ec_s3.sandbox.env import CPU_OFFLINE_ENV

__all__ = ["prepare_model"]


def prepare_model(demo: DemoContext) -> tuple[str, list[str], dict[str, str]]:
    """(the model path or id, the servers' arguments, the servers' environment)."""
    args, out = demo.args, demo.out
    t = time.monotonic()
    if args.model:
        demo.step(2, f"model: {args.model} (your vLLM install and device)")
        demo.timings["model"] = 0.0
        return str(args.model), list(demo.vllm_args), {}
    from ec_s3.sandbox.tiny_model import HEAVY_VISION, build_tiny_llava, default_model_dir, read_manifest
    from ec_s3.sandbox.tiny_qwen import build_tiny_qwen, default_qwen_dir
    from ec_s3.sandbox.vllm_server import QWEN_MODEL_ARGS

    if args.tiny_model == "qwen":
        dst = args.tiny_model_dir or default_qwen_dir()
        demo.step(2, "model: tiny offline Qwen2.5-VL, 1024² photos of 1,225 image tokens (random weights; "
                     "outputs are gibberish, but exact)")
        had = read_manifest(dst) is not None
        path = build_tiny_qwen(Path(dst))
        server_args = [*QWEN_MODEL_ARGS, *demo.vllm_args]
    else:
        dst = args.tiny_model_dir or default_model_dir()
        demo.step(2, "model: tiny offline LLaVA-1.5 with a heavier vision tower (random weights; "
                     "outputs are gibberish, but exact)")
        had = read_manifest(dst) is not None
        path = build_tiny_llava(Path(dst), shape=HEAVY_VISION)  # rebuilt if dst holds another shape
        server_args = [*HEAVY_VISION.server_args(), *demo.vllm_args]
    demo.timings["model"] = time.monotonic() - t
    out(f"      {path} ({'reused' if had else 'built'} in {demo.timings['model']:.1f} s)")
    return str(path), server_args, dict(CPU_OFFLINE_ENV)
