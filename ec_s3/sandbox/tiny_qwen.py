"""A tiny offline Qwen2.5-VL model directory, the model family EPD serves, for tests,
``ec-s3 demo`` and the benches: dynamic resolution, ``image_grid_thw`` placeholder metadata,
M-RoPE, an encoder that costs about what its prefill costs (:data:`QWEN_SHAPE`), and video.

Owns the model's configuration, processor and chat template, its photo-like test images and
clips (:func:`clip_mp4`). Does not own building a directory atomically (:mod:`.model_dir`),
serving it (:data:`ec_s3.sandbox.vllm_server.QWEN_MODEL_ARGS`) nor the LLaVA (:mod:`.tiny_model`)."""

from __future__ import annotations

import dataclasses
import io
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from ec_s3.sandbox.model_dir import INIT_STD, WEIGHT_DTYPE, atomic_model_dir, random_state_dict, train_tokenizer

if TYPE_CHECKING:  # pragma: no cover
    from PIL import Image

__all__ = [
    "QWEN_SHAPE",
    "QwenShape",
    "build_tiny_qwen",
    "clip_mp4",
    "default_qwen_dir",
    "grid_for",
    "make_photo",
    "photo_jpeg",
]

FORMAT_VERSION = 2  # 2: the chat template renders video parts
PATCH = 14
MERGE = 2  # spatial merge: 2x2 patches -> one image token
# Qwen2-VL's image processor defaults: what a real deployment resizes to.
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 1280
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|image_pad|>", "<|video_pad|>",
]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] in ['image', 'image_url', 'image_pil', 'image_embeds'] %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] in ['video', 'video_url', 'video_embeds'] %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclasses.dataclass(frozen=True)
class QwenShape:
    """Sizes of the tiny Qwen2.5-VL. The blob of one item is ``tokens x text_hidden`` bf16.

    ``text_hidden`` / ``text_heads`` must give a head size CPU attention accepts (32, 64,
    80, ...); the M-RoPE section is derived from it (half the head size, split 1:1.5:1.5).
    """

    text_hidden: int = 256
    text_layers: int = 10
    text_heads: int = 4
    text_intermediate: int = 1024
    vision_hidden: int = 128
    vision_heads: int = 4
    vision_layers: int = 2
    vision_intermediate: int = 512
    max_positions: int = 8192

    def __post_init__(self) -> None:
        for name in ("text_hidden", "text_layers", "text_heads", "text_intermediate", "vision_hidden",
                     "vision_heads", "vision_layers", "vision_intermediate", "max_positions"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive")
        if self.text_hidden % self.text_heads or (self.text_hidden // self.text_heads) % 16:
            raise ValueError(f"text_hidden/text_heads: head size {self.text_hidden / self.text_heads} is not a multiple of 16")
        if self.vision_hidden % self.vision_heads:
            raise ValueError("vision_hidden: not a multiple of vision_heads")

    @property
    def mrope_section(self) -> list[int]:
        half = self.text_hidden // self.text_heads // 2
        t = half // 4
        h = (half - t) // 2
        return [t, h, half - t - h]


#: The tests', demo's and benches' model: encode : prefill 0.94 on one core here
#: (``python -m ec_s3.sandbox.calibrate``: encode 135 ms, prefill 143 ms for a 1024² photo).
QWEN_SHAPE = QwenShape()


def grid_for(width: int, height: int) -> tuple[int, int, int]:
    """The ``image_grid_thw`` Qwen2-VL's image processor gives an image of this size
    (``smart_resize`` at the default pixel limits): 1024x1024 -> (1, 70, 70)."""
    factor = PATCH * MERGE
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > MAX_PIXELS:
        beta = math.sqrt((height * width) / MAX_PIXELS)
        h = math.floor(height / beta / factor) * factor
        w = math.floor(width / beta / factor) * factor
    elif h * w < MIN_PIXELS:
        beta = math.sqrt(MIN_PIXELS / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return 1, h // PATCH, w // PATCH


def _configs(vocab_size: int, ids: dict[str, int], shape: QwenShape):
    from transformers import Qwen2_5_VLConfig

    text = {
        "vocab_size": vocab_size,
        "hidden_size": shape.text_hidden,
        "intermediate_size": shape.text_intermediate,
        "num_hidden_layers": shape.text_layers,
        "num_attention_heads": shape.text_heads,
        "num_key_value_heads": shape.text_heads,
        "max_position_embeddings": shape.max_positions,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": shape.mrope_section},
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "max_window_layers": shape.text_layers,
    }
    vision = {
        "depth": shape.vision_layers,
        "hidden_size": shape.vision_hidden,
        "intermediate_size": shape.vision_intermediate,
        "num_heads": shape.vision_heads,
        "out_hidden_size": shape.text_hidden,
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": 2,
        "window_size": 112,
        # Qwen2.5-VL: windowed attention, full attention every 8th block; ours: the last.
        "fullatt_block_indexes": [shape.vision_layers - 1],
        "hidden_act": "silu",
    }
    cfg = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    cfg.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    for c in (cfg, cfg.text_config, cfg.vision_config):
        c.dtype = WEIGHT_DTYPE
    return cfg


# transformers 5 module names -> the Qwen2.5-VL checkpoint names vLLM loads.
_TO_HF_LAYOUT = [
    ("model.language_model.", "model."),
    ("model.visual.", "visual."),
    ("lm_head.", "lm_head."),
]


def _hf_key(name: str) -> str:
    for old, new in _TO_HF_LAYOUT:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _write_model(tmp: Path, seed: int, shape: QwenShape) -> list[str]:
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    tok = train_tokenizer(SPECIAL_TOKENS, bos=None)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token=None, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                              "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"},
        model_max_length=shape.max_positions, clean_up_tokenization_spaces=False, chat_template=CHAT_TEMPLATE,
    )
    image_processor = Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    processor = Qwen2_5_VLProcessor(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor(),
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(str(tmp))
    image_processor.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    tc_path = tmp / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"  # transformers 5 writes "TokenizersBackend"
    tc.setdefault("chat_template", CHAT_TEMPLATE)
    tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True))

    cfg = _configs(tok.get_vocab_size(), ids, shape)
    cfg.save_pretrained(str(tmp))
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]},
        indent=2))

    from safetensors.torch import save_file

    weights = random_state_dict(Qwen2_5_VLForConditionalGeneration, cfg, seed, _hf_key)
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return sorted(p.name for p in tmp.iterdir() if p.is_file())


def default_qwen_dir() -> Path:
    """Where ``ec-s3 demo`` builds (and reuses) this model: ``~/.cache/ec-s3/tiny-qwen``."""
    from ec_s3.sandbox.tiny_model import default_model_dir

    return default_model_dir().parent / "tiny-qwen"


def build_tiny_qwen(dst: Path, *, seed: int = 0, shape: QwenShape = QWEN_SHAPE) -> Path:
    """Write (or reuse) the tiny Qwen2.5-VL model directory at ``dst``; returns ``dst``.

    A complete build of the same seed, shape and format version is reused as is;
    otherwise it is built beside ``dst`` and renamed into place."""
    want = {"model": "qwen2_5_vl", "format_version": FORMAT_VERSION, "seed": seed,
            "shape": dataclasses.asdict(shape), "init_std": INIT_STD}
    return atomic_model_dir(Path(dst), want, lambda tmp: _write_model(tmp, seed, shape))


def make_photo(seed: int, width: int = 1024, height: int | None = None) -> "Image.Image":
    """A deterministic photo-like RGB image (smooth gradients, shapes, fine noise) of a
    real photo's size; different seeds give clearly different images."""
    import numpy as np
    from PIL import Image

    height = width if height is None else height
    rng = np.random.default_rng(np.random.SeedSequence([0x0E5C, seed, width, height]))
    # Draw at a quarter of the size and upscale: photo-like smoothness, cheap to make.
    w, h = max(8, width // 4), max(8, height // 4)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    yy /= h
    xx /= w
    img = np.empty((h, w, 3), np.float32)
    for c in range(3):
        a, b, ph = rng.uniform(-2, 2), rng.uniform(-2, 2), rng.uniform(0, 2 * np.pi)
        img[..., c] = 0.5 + 0.35 * np.sin(2 * np.pi * (a * xx + b * yy) + ph)
    for _ in range(12):  # blobs of colour: "objects"
        cx, cy, r = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.03, 0.2)
        mask = ((xx - cx) ** 2 + (yy - cy) ** 2) < r * r
        img[mask] = rng.uniform(0, 1, size=3)
    small = Image.fromarray((np.clip(img, 0, 1) * 255).astype(np.uint8), mode="RGB")
    big = np.asarray(small.resize((width, height), Image.BILINEAR), dtype=np.int16)
    big = big + rng.integers(-6, 7, size=big.shape, dtype=np.int16)
    return Image.fromarray(np.clip(big, 0, 255).astype(np.uint8), mode="RGB")


def photo_jpeg(seed: int, width: int = 1024, height: int | None = None, quality: int = 85) -> bytes:
    """:func:`make_photo` as JPEG bytes (what clients send)."""
    out = io.BytesIO()
    make_photo(seed, width, height).save(out, format="JPEG", quality=quality)
    return out.getvalue()


def clip_mp4(seed: int, *, fps: float, frames: int, size: int = 64) -> bytes:
    """A small deterministic MP4 clip (``mp4v``, what opencv writes and vLLM's opencv
    loader reads): ``frames`` frames at ``fps``, ``size`` pixels square, a photo of
    ``seed`` drifting one step per frame. vLLM's ``qwen2_vl`` loader samples it at 2 fps
    (4 frames at least, an even number), and Qwen2.5-VL's ``second_per_grid_ts`` is
    2 / (sampled frames / frames * fps): 8 frames at 8 fps give 0.5, 11 at 2 fps 1.1,
    4 at 1 fps 2.0, 4 at 2 fps 1.0."""
    import os
    import tempfile

    import cv2
    import numpy as np

    base = np.asarray(make_photo(seed, 2 * size), dtype=np.uint8)
    fd, path = tempfile.mkstemp(suffix=".mp4")
    os.close(fd)
    try:
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), float(fps), (size, size))
        if not writer.isOpened():
            raise RuntimeError("opencv cannot write mp4v here")
        step = max(1, size // max(frames, 1))
        for n in range(frames):
            frame = base[n * step // 2: n * step // 2 + size, n * step: n * step + size]
            writer.write(np.ascontiguousarray(frame[..., ::-1]))  # RGB -> opencv's BGR
        writer.release()
        return Path(path).read_bytes()
    finally:
        os.unlink(path)


if __name__ == "__main__":  # python -m ec_s3.sandbox.tiny_qwen DIR
    import sys

    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m ec_s3.sandbox.tiny_qwen DIR  (timing: python -m ec_s3.sandbox.calibrate)")
    print(build_tiny_qwen(Path(sys.argv[1])))
