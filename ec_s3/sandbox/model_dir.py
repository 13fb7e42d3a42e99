"""What both tiny offline models' builders share (:mod:`ec_s3.sandbox.tiny_model`,
:mod:`ec_s3.sandbox.tiny_qwen`): a model directory built atomically under a manifest
(reused while the manifest matches), a byte-level BPE tokenizer trained on a few
sentences, and random weights under a checkpoint's key names. Does not own any model's
configuration, processor or chat template (each model's module does)."""

from __future__ import annotations

import json
import os
import shutil
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

MANIFEST = "ec_s3_tiny_model.json"
INIT_STD = 0.02
WEIGHT_DTYPE = "bfloat16"

_CORPUS = [
    "USER: What is in this picture? ASSISTANT: A small red square on a blue background.",
    "USER: Describe the image in one sentence. ASSISTANT: The image shows noise and colors.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "An encoder cache stores vision embeddings so a prefill instance can skip the encoder.",
    "Objects in the bucket are written once and read many times by the consumers.",
    "Hello world! This is a tiny tokenizer for tests: numbers 0 1 2 3 4 5 6 7 8 9.",
    "Green, yellow, purple and orange shapes float in a grey sky at noon.",
]


def read_manifest(model_dir: Path) -> dict[str, Any] | None:
    """The build manifest of a model dir made by :func:`atomic_model_dir`, or None."""
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


def train_tokenizer(specials: list[str], bos: str | None = "<s>") -> Any:
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
