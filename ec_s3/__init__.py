"""ec-s3: an S3/MinIO-backed encoder-cache connector for vLLM's encode / prefill /
decode disaggregation.

``ECS3Connector`` is imported lazily so that the store, codec and CLI work without
importing vLLM (which takes seconds); vLLM itself resolves
``ec_connector_module_path="ec_s3"`` + ``ec_connector="ECS3Connector"`` through
``getattr`` on this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["ECS3Config", "ECS3Connector", "__version__"]

if TYPE_CHECKING:
    from ec_s3.config import ECS3Config
    from ec_s3.connector.facade import ECS3Connector


def __getattr__(name: str) -> Any:
    if name == "ECS3Connector":
        from ec_s3.connector.facade import ECS3Connector

        return ECS3Connector
    if name == "ECS3Config":
        from ec_s3.config import ECS3Config

        return ECS3Config
    raise AttributeError(f"module 'ec_s3' has no attribute {name!r}")
