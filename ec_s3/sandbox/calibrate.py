"""What one image costs a model in vLLM on this host: its encoder step against the
prefill of as many tokens, measured in one engine (one CPU thread, as a server's worker);
``python -m ec_s3.sandbox.calibrate [--shape JSON] [--out FILE]``.

Owns the measurement. Does not own the model (:mod:`.tiny_qwen`) nor serving it."""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from ec_s3.sandbox.env import apply_offline_env

__all__ = ["time_encode_prefill"]


def time_encode_prefill(model: str, *, size: int = 1024, repeats: int = 6) -> dict[str, Any]:
    """Median milliseconds of an image request, a text request of equal length, the
    encoder's share and the front end's preprocessing, for a ``size``-px square photo."""
    apply_offline_env({"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0")})
    from vllm import LLM, SamplingParams
    from transformers import AutoProcessor

    from ec_s3.sandbox.tiny_qwen import grid_for, make_photo

    llm = LLM(model=model, max_model_len=4096, max_num_batched_tokens=4096, enforce_eager=True,
              enable_prefix_caching=False, limit_mm_per_prompt={"image": 1}, mm_processor_cache_gb=0)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    processor = AutoProcessor.from_pretrained(model)
    _, h, w = grid_for(size, size)
    tokens = h * w // 4
    image_prompt = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>hi<|im_end|>\n<|im_start|>assistant\n"
    pad_id = processor.tokenizer.convert_tokens_to_ids("a")

    def run(prompt: Any) -> float:
        started = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        return time.perf_counter() - started

    image_s, text_s, pre_s = [], [], []
    for i in range(repeats + 1):  # the first of each is a warm-up
        photo = make_photo(10_000 + i, size)
        started = time.perf_counter()
        processor(text=[image_prompt], images=[photo], return_tensors="pt")
        pre = time.perf_counter() - started
        t_img = run({"prompt": image_prompt, "multi_modal_data": {"image": photo}})
        n_text = len(processor.tokenizer(image_prompt)["input_ids"]) - 1 + tokens
        t_txt = run({"prompt_token_ids": [pad_id + (i % 7)] * n_text})
        if i:
            image_s.append(t_img)
            text_s.append(t_txt)
            pre_s.append(pre)
    try:
        llm.llm_engine.engine_core.shutdown()  # else its EngineCore outlives the measurement
    except Exception:  # noqa: BLE001 - best effort: the numbers are taken
        pass
    img, txt, pre = (statistics.median(v) * 1e3 for v in (image_s, text_s, pre_s))
    encode = img - txt - pre
    return {
        "size": size, "image_tokens": tokens, "image_request_ms": round(img, 1), "text_request_ms": round(txt, 1),
        "preprocess_ms": round(pre, 1), "encode_ms": round(encode, 1), "prefill_ms": round(txt, 1),
        "encode_to_prefill": round(encode / txt, 2), "threads": 1,
    }


def _main(argv: list[str]) -> int:
    import argparse
    import dataclasses
    import json
    import tempfile
    from pathlib import Path

    from ec_s3.sandbox.tiny_qwen import QWEN_SHAPE, build_tiny_qwen

    parser = argparse.ArgumentParser(prog="python -m ec_s3.sandbox.calibrate",
                                     description="time encode : prefill of a photo on the tiny Qwen2.5-VL in vLLM")
    parser.add_argument("--shape", type=json.loads, default={},
                        help='QwenShape fields to override, as JSON, e.g. \'{"vision_layers": 2}\'')
    parser.add_argument("--size", type=int, default=1024, help="photo width and height in pixels (default 1024)")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--out", type=Path, help="also write the result (JSON) here")
    args = parser.parse_args(argv)
    shape = dataclasses.replace(QWEN_SHAPE, **args.shape)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_qwen(Path(tmp) / "model", shape=shape)
        result = {"shape": dataclasses.asdict(shape),
                  **time_encode_prefill(str(model), size=args.size, repeats=args.repeats)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(_main(sys.argv[1:]))
