"""What ec-s3 needs to know about the served model, read from vLLM's config.

Producer and consumers derive the same namespace, dtype and row widths from the same
model, exchanging nothing. Owns those facts and this host's identity. Does not own keys
or the blob format (:mod:`ec_s3.blob`) or ec-s3's own config (:mod:`ec_s3.config`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
from collections.abc import Collection
from typing import TYPE_CHECKING

import torch

from ec_s3.config import ECS3Config
from ec_s3.blob.keys import KeySpace, model_namespace
from ec_s3.log import logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.multimodal.inputs import MultiModalFeatureSpec

__all__ = ["ModelInfo", "carries_media", "describe_role", "host_id"]


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """Model facts the connector checks blobs against."""

    model: str
    dtype: torch.dtype
    # Width per modality when vLLM measured it; ``default_width`` otherwise.
    widths: dict[str, int]
    default_width: int | None
    keyspace: KeySpace
    engine_id: str
    bucket: str = ""

    @property
    def location(self) -> str:
        """Where this model's blobs live, as ``ec_transfer_params`` name it
        (``NAMESPACE_FIELD``): ``s3://<bucket>/<prefix>/<namespace>/``. The endpoint is
        left out: one store may have several names, and a URL may carry a user."""
        return f"s3://{self.bucket}/{self.keyspace.root}"

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig, config: ECS3Config) -> ModelInfo:
        model_config = vllm_config.model_config
        ec_config = vllm_config.ec_transfer_config
        dtype = model_config.dtype
        if not isinstance(dtype, torch.dtype):  # pragma: no cover - vLLM resolves it
            dtype = getattr(torch, str(dtype))
        widths = dict(getattr(ec_config, "mm_encoder_output_widths", None) or {})
        default_width = config.encoder_output_width
        if default_width is None:
            try:
                default_width = int(model_config.hf_text_config.hidden_size)
            except (AttributeError, TypeError, ValueError):
                default_width = None
        namespace = config.namespace or model_namespace(
            str(model_config.model),
            revision=model_config.revision,
            dtype=str(dtype).removeprefix("torch."),
            encoder_width=config.encoder_output_width or default_width,
        )
        return cls(
            model=str(model_config.model),
            dtype=dtype,
            widths=widths,
            default_width=default_width,
            keyspace=KeySpace(config.prefix, namespace),
            engine_id=str(getattr(ec_config, "engine_id", "") or ""),
            bucket=config.bucket,
        )

    def width_for(self, modality: str) -> int | None:
        """The row width an encoder output of ``modality`` must have, if known.

        An explicit ``encoder_output_width`` wins; vLLM's measured width is next
        (it knows DeepStack-style wide outputs); the text hidden size is the fallback.
        """
        return self.widths.get(modality, self.default_width)


def carries_media(feature: MultiModalFeatureSpec, metadata_fields: Collection[str]) -> bool:
    """Whether ``feature`` holds anything vLLM can encode (media, or embeddings) beyond
    ``metadata_fields``, the model's placeholder metadata (vLLM's
    ``placeholder_metadata_fields``: what a metadata-only item carries, e.g. Qwen-VL's
    ``image_grid_thw``). False for an item without data at all."""
    data = feature.data
    return data is not None and any(field not in metadata_fields for field in data)


_HOST_ID: str | None = None


def host_id() -> str:
    """Identifies this host (and boot), so a worker can tell whether the scheduler's
    staging directory is the one it can see."""
    global _HOST_ID
    if _HOST_ID is None:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
        except OSError:
            boot = ""
        raw = f"{socket.gethostname()}\0{boot}\0{os.environ.get('EC_S3_HOST_ID', '')}"
        _HOST_ID = hashlib.sha256(raw.encode()).hexdigest()[:16]
    return _HOST_ID


def describe_role(role: str, vllm_config: VllmConfig, config: ECS3Config, model: ModelInfo) -> None:
    """The one start-up line per connector part: which role, which bucket and namespace."""
    ec_config = vllm_config.ec_transfer_config
    logger.info(
        "ec-s3: %s connector (%s) for s3://%s/%s endpoint=%s",
        role, ec_config.ec_role if ec_config else "?", config.bucket, model.keyspace.root,
        config.endpoint_url or "aws",
    )
