"""A tiny offline LLaVA-1.5 model directory for tests and ``ec-s3 demo``: a llama text
model and a CLIP vision tower with random weights in the llava-hf key layout, so that
outputs depend on the image. :data:`HEAVY_VISION` and :class:`TinyShape` make bigger ones.

Owns the model's configuration, processor and chat template, its test images and the
vision-weight reseeding tests use. Does not own building a directory atomically
(:mod:`.model_dir`), serving it (:mod:`ec_s3.sandbox.vllm_server`) nor Qwen (:mod:`.tiny_qwen`)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ec_s3.sandbox.model_dir import (INIT_STD, WEIGHT_DTYPE, atomic_model_dir, random_state_dict,
                                     read_manifest, train_tokenizer)

if TYPE_CHECKING:  # pragma: no cover
    from PIL import Image

__all__ = [
    "HEAVY_VISION",
    "IMAGE_SIZE",
    "IMAGE_TOKEN",
    "NUM_IMAGE_TOKENS",
    "PATCH_SIZE",
    "SPECIAL_TOKENS",
    "TinyShape",
    "build_tiny_llava",
    "default_model_dir",
    "make_test_image",
    "reseed_vision_weights",
    "read_manifest",
    "time_vision_tower",
]

# Bump when the produced directory changes, so stale builds are rebuilt.
FORMAT_VERSION = 3

IMAGE_SIZE = 56
PATCH_SIZE = 14
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2  # 16 (CLS dropped: "default" strategy)
IMAGE_TOKEN = "<image>"
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", IMAGE_TOKEN]  # ids 0..4
TEXT_HIDDEN = 128
TEXT_HEADS = 4  # head_dim 32: CPU attention rejects 16
TEXT_LAYERS = 2
VISION_HIDDEN = 32
VISION_LAYERS = 2
MAX_POSITIONS = 2048



@dataclasses.dataclass(frozen=True)
class TinyShape:
    """The sizes of a tiny model; the default is the tests' model (4 KiB encoder outputs).

    One encoder output (one blob) is ``num_image_tokens x text_hidden`` bf16 values.
    ``text_hidden`` must be a multiple of 32 (heads of 32 below 512, of 64 from 512 on:
    CPU attention accepts head sizes 32, 64, 80, ...); ``image_size`` a multiple of the
    patch (14). A server of a bigger shape needs ``--max-model-len`` and
    ``--max-num-batched-tokens`` above :attr:`num_image_tokens` (:meth:`server_args`).
    """

    image_size: int = IMAGE_SIZE
    text_hidden: int = TEXT_HIDDEN
    text_layers: int = TEXT_LAYERS
    text_intermediate: int = 2 * TEXT_HIDDEN
    # The CLIP vision tower (attention heads of 32): :data:`HEAVY_VISION` makes it
    # heavier, though still cheap next to prefill (see the module docstring).
    vision_hidden: int = VISION_HIDDEN
    vision_layers: int = VISION_LAYERS

    def __post_init__(self) -> None:
        if self.image_size <= 0 or self.image_size % PATCH_SIZE:
            raise ValueError(f"image_size: {self.image_size} is not a positive multiple of {PATCH_SIZE}")
        if self.text_hidden <= 0 or self.text_hidden % 32:
            raise ValueError(f"text_hidden: {self.text_hidden} is not a positive multiple of 32")
        if self.text_layers <= 0 or self.text_intermediate <= 0:
            raise ValueError("text_layers and text_intermediate must be positive")
        if self.vision_hidden <= 0 or self.vision_hidden % 32 or self.vision_layers <= 0:
            raise ValueError("vision_hidden must be a positive multiple of 32 and vision_layers positive")

    @property
    def num_image_tokens(self) -> int:
        return (self.image_size // PATCH_SIZE) ** 2

    @property
    def text_heads(self) -> int:
        return self.text_hidden // (64 if self.text_hidden >= 512 else 32)

    @property
    def blob_bytes(self) -> int:
        """The size of one image's encoder output (bf16), before the blob's header."""
        return self.num_image_tokens * self.text_hidden * 2

    @property
    def max_model_len(self) -> int:
        """Room for the image tokens and a short prompt and answer (512 by default)."""
        return max(512, 256 * -(-(self.num_image_tokens + 128) // 256))

    @property
    def max_positions(self) -> int:
        return max(MAX_POSITIONS, self.max_model_len)

    def server_args(self) -> tuple[str, ...]:
        """vLLM server arguments for this shape (the default shape: ``TINY_MODEL_ARGS``'s)."""
        max_len = self.max_model_len
        return ("--max-model-len", str(max_len), "--max-num-batched-tokens", str(max_len),
                "--enforce-eager", "--limit-mm-per-prompt", '{"image": 1}')


DEFAULT_SHAPE = TinyShape()
#: A stand-in whose encoder costs what a real one costs relative to its language model:
#: a 112x112 image (64 image tokens) through 4 CLIP layers of width 128 (MLP 512), sized
#: for tens of milliseconds per image in a vLLM server whose worker has one core, while
#: the text model stays as small as the default's (measured in vLLM by a TTFT bench since
#: retired); ``python -m ec_s3.sandbox.tiny_model --time`` times the tower alone in
#: transformers.
HEAVY_VISION = TinyShape(image_size=112, vision_hidden=128, vision_layers=4)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + ' ' }}"
    "{% else %}"
    "{% if message['role'] == 'user' %}USER: {% else %}ASSISTANT: {% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] in ['image', 'image_url', 'image_pil', 'image_embeds'] %}<image>\n"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}</s>{% endif %}{{ ' ' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)

def _manifest(seed: int, random_weights: bool, shape: TinyShape = DEFAULT_SHAPE) -> dict[str, Any]:
    out: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "seed": seed,
        "random_weights": random_weights,
        "image_size": shape.image_size,
        "patch_size": PATCH_SIZE,
        "num_image_tokens": shape.num_image_tokens,
    }
    if shape != DEFAULT_SHAPE:  # the default model's manifest is unchanged (no rebuilds)
        out["shape"] = dataclasses.asdict(shape)
    return out


def _configs(vocab_size: int, image_token_id: int, shape: TinyShape = DEFAULT_SHAPE):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    heads = TEXT_HEADS if shape == DEFAULT_SHAPE else shape.text_heads
    text = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.text_hidden,
        intermediate_size=shape.text_intermediate,
        num_hidden_layers=shape.text_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=shape.text_hidden // heads,
        max_position_embeddings=shape.max_positions,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
    )
    vision = CLIPVisionConfig(
        hidden_size=shape.vision_hidden,
        intermediate_size=(2 if shape.vision_hidden == VISION_HIDDEN else 4) * shape.vision_hidden,
        projection_dim=shape.vision_hidden,
        num_hidden_layers=shape.vision_layers,
        num_attention_heads=2 if shape.vision_hidden == VISION_HIDDEN else shape.vision_hidden // 32,
        image_size=shape.image_size,
        patch_size=PATCH_SIZE,
        num_channels=3,
        hidden_act="quick_gelu",
    )
    cfg = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token_id,
        image_seq_length=shape.num_image_tokens,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        tie_word_embeddings=False,
    )
    cfg.architectures = ["LlavaForConditionalGeneration"]
    for c in (cfg, text, vision):
        # vLLM on CPU downcasts float32 to bfloat16 anyway; storing bfloat16 avoids
        # a dtype-mismatch warning per weight at load.
        c.dtype = WEIGHT_DTYPE
    return cfg


# transformers >= 4.52 module names -> llava-hf checkpoint names.
_TO_HF_LAYOUT = [
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
]


def _hf_key(name: str) -> str:
    for old, new in _TO_HF_LAYOUT:
        if name.startswith(old):
            name = new + name[len(old) :]
            break
    # transformers 5 drops CLIPVisionModel's `vision_model.` level in memory;
    # llava-hf checkpoints (and vLLM) keep it.
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        name = "vision_tower.vision_model." + name[len("vision_tower.") :]
    return name


def _random_state_dict(cfg, seed: int) -> dict[str, Any]:
    from transformers import LlavaForConditionalGeneration

    return random_state_dict(LlavaForConditionalGeneration, cfg, seed, _hf_key)


def _write_model(tmp: Path, seed: int, random_weights: bool, shape: TinyShape = DEFAULT_SHAPE) -> list[str]:
    tok = train_tokenizer(SPECIAL_TOKENS)
    _write_processor(tmp, tok, shape)
    cfg = _configs(tok.get_vocab_size(), tok.token_to_id(IMAGE_TOKEN), shape)
    cfg.save_pretrained(str(tmp))
    (tmp / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}, indent=2)
    )

    if random_weights:
        from safetensors.torch import save_file

        sd = _random_state_dict(cfg, seed)
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})

    return sorted(p.name for p in tmp.iterdir() if p.is_file())


def _write_processor(tmp: Path, tok: Any, shape: TinyShape) -> None:
    """The tokenizer, image processor and LlavaProcessor files, with the chat template."""
    from transformers import CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        extra_special_tokens={"image_token": IMAGE_TOKEN},
        model_max_length=shape.max_positions,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": shape.image_size},
        crop_size={"height": shape.image_size, "width": shape.image_size},
        do_resize=True,
        do_center_crop=True,
        do_convert_rgb=True,
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        chat_template=CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,  # CLIP's CLS token
    )
    processor.save_pretrained(str(tmp))
    # Also the standalone files older loaders look for (preprocessor_config.json,
    # tokenizer files with the chat template).
    image_processor.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    # transformers 5 writes "TokenizersBackend", unknown to transformers 4; the
    # PreTrainedTokenizerFast alias loads in both.
    tc_path = tmp / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc.setdefault("chat_template", CHAT_TEMPLATE)
    tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True))


VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")  # LLaVA's; Qwen-VL's is "visual."


def reseed_vision_weights(model_dir: Path, seed: int, prefixes: tuple[str, ...] = VISION_PREFIXES) -> None:
    """Re-randomise the vision tower and projector of a built model in place. Tests use
    it to prove a consumer used a producer's encoder output: at the same model path (so
    the same mm identifiers and blob keys), an engine that encodes locally now gives
    other logprobs than one that loads the published output."""
    import safetensors.torch
    import torch

    path = Path(model_dir) / "model.safetensors"
    weights = safetensors.torch.load_file(str(path))
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in weights.items():
        if name.startswith(prefixes) and tensor.dim() >= 2:
            weights[name] = (torch.randn(tensor.shape, generator=gen) * INIT_STD).to(tensor.dtype)
    safetensors.torch.save_file(weights, str(path))


def default_model_dir() -> Path:
    """Where ``ec-s3 demo`` builds (and reuses) the model unless told otherwise:
    ``$XDG_CACHE_HOME/ec-s3/tiny-llava``, ``~/.cache`` when that is unset."""
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "ec-s3" / "tiny-llava"


def build_tiny_llava(dst: Path, *, seed: int = 0, random_weights: bool = True,
                     shape: TinyShape = DEFAULT_SHAPE) -> Path:
    """Write (or reuse) a tiny offline LLaVA-1.5 model directory at ``dst``.

    Returns ``dst``. If ``dst`` already holds a complete build with the same seed,
    ``random_weights`` flag, :class:`TinyShape` and format version, it returns at once. Otherwise the
    model is built in a sibling temp dir and renamed into place (a concurrent
    builder that wins the rename is accepted). With ``random_weights=False`` no
    ``model.safetensors`` is written: load it with ``load_format="dummy"`` (the image
    then has no visible effect on outputs).
    """
    want = _manifest(seed, random_weights, shape)
    return atomic_model_dir(Path(dst), want, lambda tmp: _write_model(tmp, seed, random_weights, shape))


def make_test_image(seed: int, size: int = IMAGE_SIZE) -> "Image.Image":
    """A deterministic RGB test image; different seeds give clearly different images.

    Smooth per-seed color gradients plus a per-seed block pattern and noise, so the
    images differ both globally and per 14x14 patch.
    """
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(np.random.SeedSequence([0xEC53, seed]))
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / max(size - 1, 1)
    base = np.empty((size, size, 3), dtype=np.float32)
    for c in range(3):
        a, b, ph = rng.uniform(-1, 1), rng.uniform(-1, 1), rng.uniform(0, 2 * np.pi)
        base[..., c] = 0.5 + 0.5 * np.sin(2 * np.pi * (a * xx + b * yy) + ph)
    cells = max(size // PATCH_SIZE, 1)
    blocks = rng.uniform(0, 1, size=(cells, cells, 3)).astype(np.float32)
    blocks = np.kron(blocks, np.ones((size // cells + 1, size // cells + 1, 1), np.float32))
    blocks = blocks[:size, :size]
    noise = rng.normal(0, 0.08, size=(size, size, 3)).astype(np.float32)
    img = np.clip(0.5 * base + 0.5 * blocks + noise, 0, 1)
    return Image.fromarray((img * 255).round().astype(np.uint8), mode="RGB")


def time_vision_tower(model_dir: Path, repeats: int = 10, threads: int = 1) -> float:
    """Seconds one image takes through the vision tower and projector of the model at
    ``model_dir`` (eager transformers, bf16, ``threads`` CPU threads): what choosing a
    :class:`TinyShape` for an encoder's cost needs."""
    import time

    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    torch.set_num_threads(threads)
    model = LlavaForConditionalGeneration.from_pretrained(model_dir, torch_dtype=torch.bfloat16).eval()
    size = int((read_manifest(model_dir) or {}).get("image_size", IMAGE_SIZE))
    pixels = AutoProcessor.from_pretrained(model_dir).image_processor(
        make_test_image(1, size), return_tensors="pt")["pixel_values"].to(torch.bfloat16)
    with torch.no_grad():
        model.get_image_features(pixel_values=pixels)  # warm-up
        started = time.perf_counter()
        for _ in range(repeats):
            model.get_image_features(pixel_values=pixels)
    return (time.perf_counter() - started) / repeats


if __name__ == "__main__":  # python -m ec_s3.sandbox.tiny_model --time
    import sys
    import tempfile

    if sys.argv[1:] != ["--time"]:
        raise SystemExit("usage: python -m ec_s3.sandbox.tiny_model --time")
    with tempfile.TemporaryDirectory() as tmp:
        for label, shape in (("default", DEFAULT_SHAPE), ("HEAVY_VISION", HEAVY_VISION)):
            seconds = time_vision_tower(build_tiny_llava(Path(tmp) / label, shape=shape))
            print(f"{label}: {seconds * 1e3:.1f} ms per image through the vision tower (1 thread)")
