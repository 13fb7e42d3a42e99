"""A tiny offline LLaVA-1.5 model directory for tests and ``ec-s3 demo``.

No model hub is reachable in CI, so the model is written from scratch:

* ``LlavaForConditionalGeneration`` with a llama text model (hidden 128, 4 heads of
  dim 32, 2 layers) and a CLIP vision tower (hidden 32, 2 layers, image 56x56,
  patch 14 -> 16 image tokens after dropping CLS);
* ``CLIPImageProcessor`` + ``LlavaProcessor`` + a byte-level BPE tokenizer trained
  with ``tokenizers`` on a few sentences (vocab < 512, specials
  ``<unk> <s> </s> <pad> <image>``) and a chat template that emits ``<image>\\n``;
* random weights (normal, std 0.02, fixed seed) in ``model.safetensors`` using the
  llava-hf checkpoint key layout (``language_model.model.*``,
  ``vision_tower.vision_model.*``,
  ``multi_modal_projector.*``, ``language_model.lm_head.weight``), so that outputs
  depend on the image (vLLM's ``load_format="dummy"`` weights make the image
  invisible).

:data:`HEAVY_VISION` is the default model with a heavier vision tower (more layers,
larger image and width): tens of ms per image on one core, yet still nearly free next to
prefill (in goodput runs a server that encoded no image took as long per request as one
that encoded every miss). Where encoding must cost what prefill costs, use the tiny
Qwen2.5-VL of :mod:`ec_s3.sandbox.tiny_qwen`. :class:`TinyShape` makes a bigger
model of the same layout (benchmarks: the encoder
output, one blob, is ``image tokens x text hidden`` bf16 values, 4 KiB by default):
``TinyShape(image_size=448, text_hidden=512)`` gives 1024 tokens x 512 = 1 MiB.

Only torch, safetensors, transformers, tokenizers and PIL are needed (all come with
vLLM). Building takes about a second.

Owns the model directory (built once per content version, atomically, with a
manifest), the test images and the vision-weight reseeding tests use. Does not own
serving it (:mod:`ec_s3.sandbox.vllm_server`) nor the server arguments it needs
(``TINY_MODEL_ARGS`` there).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
import zlib
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

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
MANIFEST = "ec_s3_tiny_model.json"

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
INIT_STD = 0.02
WEIGHT_DTYPE = "bfloat16"



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

_CORPUS = [
    "USER: What is in this picture? ASSISTANT: A small red square on a blue background.",
    "USER: Describe the image in one sentence. ASSISTANT: The image shows noise and colors.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "An encoder cache stores vision embeddings so a prefill instance can skip the encoder.",
    "Objects in the bucket are written once and read many times by the consumers.",
    "Hello world! This is a tiny tokenizer for tests: numbers 0 1 2 3 4 5 6 7 8 9.",
    "Green, yellow, purple and orange shapes float in a grey sky at noon.",
]


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


def read_manifest(model_dir: Path) -> dict[str, Any] | None:
    """The build manifest of a model dir made by :func:`build_tiny_llava`, or None."""
    try:
        return json.loads((Path(model_dir) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def _is_complete(dst: Path, want: dict[str, Any]) -> bool:
    have = read_manifest(dst)
    if have is None:
        return False
    for k, v in want.items():
        if have.get(k) != v:
            return False
    files = have.get("files", [])
    return bool(files) and all((dst / f).is_file() for f in files)


def train_tokenizer(specials: list[str] = SPECIAL_TOKENS, bos: str | None = "<s>"):
    """A byte-level BPE tokenizer trained on a few sentences (vocab < 512) whose first
    ids are ``specials``; ``bos`` (a special) is prepended to every sequence, as llama
    tokenizers do (None: nothing is)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=specials[0]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        min_frequency=1,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    steps: list[Any] = [processors.ByteLevel(trim_offsets=False)]
    if bos is not None:
        bos_id = tok.token_to_id(bos)
        steps.append(processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]))
    # ByteLevel post-processing keeps offsets sane.
    tok.post_processor = processors.Sequence(steps)
    for i, t in enumerate(specials):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    assert tok.get_vocab_size() < 512
    return tok


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


def random_state_dict(model_cls: Any, cfg: Any, seed: int, hf_key: Any) -> dict[str, Any]:
    """Random weights for ``model_cls(cfg)`` under checkpoint names ``hf_key(name)``:
    norms one (weights) and zero (biases), the rest normal with std :data:`INIT_STD`, each
    tensor from its own generator (values do not depend on iteration order)."""
    import torch

    with torch.device("meta"):
        model = model_cls(cfg)
    out: dict[str, torch.Tensor] = {}
    for name, p in sorted(model.named_parameters()):
        key = hf_key(name)
        is_norm = "norm" in key or "layrnorm" in key  # RMSNorm / LayerNorm params
        if is_norm and key.endswith(".weight"):
            t = torch.ones(p.shape, dtype=torch.float32)
        elif is_norm and key.endswith(".bias"):
            t = torch.zeros(p.shape, dtype=torch.float32)
        else:
            g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % 2**63)
            t = torch.randn(p.shape, generator=g, dtype=torch.float32) * INIT_STD
        out[key] = t.to(getattr(torch, WEIGHT_DTYPE)).contiguous()
    return out


def _random_state_dict(cfg, seed: int) -> dict[str, Any]:
    from transformers import LlavaForConditionalGeneration

    return random_state_dict(LlavaForConditionalGeneration, cfg, seed, _hf_key)


def _write_model(tmp: Path, seed: int, random_weights: bool, shape: TinyShape = DEFAULT_SHAPE) -> list[str]:
    from transformers import CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast

    tok = train_tokenizer()
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
    image_token_id = tok.token_to_id(IMAGE_TOKEN)
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

    cfg = _configs(tok.get_vocab_size(), image_token_id, shape)
    cfg.save_pretrained(str(tmp))
    (tmp / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}, indent=2)
    )

    if random_weights:
        from safetensors.torch import save_file

        sd = _random_state_dict(cfg, seed)
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})

    return sorted(p.name for p in tmp.iterdir() if p.is_file())


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


def atomic_model_dir(dst: Path, want: dict[str, Any], write: Callable[[Path], list[str]]) -> Path:
    """``dst`` holding a complete build described by ``want`` (its manifest): reused if it
    already does, else ``write(tmp)`` fills a sibling temp dir (returning its file names)
    that is renamed into place (a concurrent builder that wins the rename is accepted)."""
    if _is_complete(dst, want):
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        files = write(tmp)
        manifest = dict(want, files=files)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))

        if dst.exists():
            if _is_complete(dst, want):  # someone else finished meanwhile
                return dst
            old = dst.parent / f".{dst.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            try:
                dst.rename(old)
            except FileNotFoundError:
                old = None
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        try:
            tmp.rename(dst)
        except OSError:
            # Lost a race with another builder: accept its result if it is complete.
            if _is_complete(dst, want):
                return dst
            raise
        return dst
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


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
