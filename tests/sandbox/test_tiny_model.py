"""The tiny LLaVA stand-in's heavier vision tower (``HEAVY_VISION``): built with the
sizes it promises, and exact (the same weights give bit-identical encoder outputs,
which the demo and e2e equality checks rely on)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ec_s3.sandbox.tiny_model import DEFAULT_SHAPE, HEAVY_VISION, TinyShape, build_tiny_llava, make_test_image


def test_heavy_vision_shape_builds_and_is_exact(tmp_path: Path) -> None:
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model_dir = build_tiny_llava(tmp_path / "heavy", shape=HEAVY_VISION)
    vision = LlavaForConditionalGeneration.from_pretrained(model_dir, torch_dtype=torch.bfloat16).config.vision_config
    assert (vision.hidden_size, vision.num_hidden_layers, vision.image_size) == (128, 4, 112)
    assert vision.num_attention_heads == 4 and vision.intermediate_size == 512
    assert HEAVY_VISION.num_image_tokens == 64 and HEAVY_VISION.text_hidden == DEFAULT_SHAPE.text_hidden

    pixels = AutoProcessor.from_pretrained(model_dir).image_processor(
        make_test_image(7, HEAVY_VISION.image_size), return_tensors="pt")["pixel_values"].to(torch.bfloat16)
    outputs = []
    for _ in range(2):  # two loads of the same directory: bit-identical features
        model = LlavaForConditionalGeneration.from_pretrained(model_dir, torch_dtype=torch.bfloat16).eval()
        with torch.no_grad():
            features = model.get_image_features(pixel_values=pixels)
        outputs.append(features[0] if isinstance(features, (list, tuple)) else features.pooler_output[0])
    assert outputs[0].shape == (64, DEFAULT_SHAPE.text_hidden)
    assert torch.equal(outputs[0], outputs[1])


def test_vision_sizes_are_validated() -> None:
    with pytest.raises(ValueError, match="vision_hidden"):
        TinyShape(vision_hidden=48)
    with pytest.raises(ValueError, match="vision_layers"):
        TinyShape(vision_layers=0)
