"""The tiny Qwen2.5-VL serves video: its chat template renders a video part (before, the
part vanished from the prompt and vLLM served the text alone), and the test clips of
:func:`~ec_s3.sandbox.tiny_qwen.clip_mp4` have the time scales (Qwen2.5-VL's
``second_per_grid_ts``) they promise once vLLM's own loader has sampled them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ec_s3.sandbox.tiny_qwen import clip_mp4

VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.mark.parametrize("part", [{"type": "video"}, {"type": "video_url", "video_url": {"url": "x"}},
                                  {"type": "video_embeds"}])
def test_the_chat_template_renders_a_video_part(tiny_qwen_dir: Path, part: dict) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_qwen_dir))
    messages = [{"role": "user", "content": [{"type": "image"}, part, {"type": "text", "text": "What happens?"}]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == f"<|im_start|>user\n{IMAGE}{VIDEO}What happens?<|im_end|>\n<|im_start|>assistant\n"
    # The processor's template (what vLLM reads first) is the same: transformers 5 saves it
    # as chat_template.jinja, older releases as chat_template.json; at least one is there.
    jinja, legacy = tiny_qwen_dir / "chat_template.jinja", tiny_qwen_dir / "chat_template.json"
    saved = [jinja.read_text()] if jinja.exists() else []
    saved += [json.loads(legacy.read_text())["chat_template"]] if legacy.exists() else []
    assert saved and all(template == tok.chat_template for template in saved), saved


@pytest.mark.parametrize(("fps", "frames", "scale", "grid_t"),
                         [(8, 8, 0.5, 2), (2, 11, 1.1, 5), (1, 4, 2.0, 2), (2, 4, 1.0, 2)])
def test_clips_have_the_time_scale_they_promise(tiny_qwen_dir: Path, fps: float, frames: int, scale: float,
                                                grid_t: int) -> None:
    """vLLM's qwen2_vl loader, then the model's HF processor, as vLLM runs them."""
    from transformers import AutoProcessor
    from transformers.video_utils import VideoMetadata
    from vllm.multimodal.video import VIDEO_LOADER_REGISTRY

    loader = VIDEO_LOADER_REGISTRY.load("qwen2_vl")
    video, meta = loader.load_bytes(clip_mp4(7, fps=fps, frames=frames))
    meta = {k: v for k, v in meta.items() if k != "do_sample_frames"}
    processor = AutoProcessor.from_pretrained(str(tiny_qwen_dir))
    out = processor(text=[VIDEO], videos=[video], video_metadata=[VideoMetadata(**meta)], do_sample_frames=False,
                    return_tensors="pt")
    assert out["video_grid_thw"][0][0].item() == grid_t
    assert out["second_per_grid_ts"][0] == pytest.approx(scale, rel=1e-6)
