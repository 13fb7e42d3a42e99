"""vLLM general plugin: makes ``"ec_connector": "ECS3Connector"`` a shortcut.

Registers the name in vLLM's connector registry in each vLLM process, and gives
``ec_connector_module_path`` precedence for this one name (vLLM's factory would otherwise
ignore an explicit module path). Owns the registration only; nothing of the connector is
imported until vLLM asks for the class.
"""

from __future__ import annotations

import importlib
from typing import Any

CONNECTOR_NAME = "ECS3Connector"
_PATCHED_FLAG = "_ec_s3_module_path_first"


def register() -> None:
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    if CONNECTOR_NAME not in ECConnectorFactory._registry:
        ECConnectorFactory.register_connector(CONNECTOR_NAME, "ec_s3.connector.facade", CONNECTOR_NAME)
    if getattr(ECConnectorFactory, _PATCHED_FLAG, False):
        return  # plugins may be loaded more than once per process
    registry_first = ECConnectorFactory.get_connector_class.__func__  # type: ignore[attr-defined]

    def get_connector_class(cls: type, ec_transfer_config: Any) -> Any:
        module_path = getattr(ec_transfer_config, "ec_connector_module_path", None)
        if ec_transfer_config.ec_connector == CONNECTOR_NAME and module_path:
            return getattr(importlib.import_module(module_path), CONNECTOR_NAME)
        return registry_first(cls, ec_transfer_config)

    ECConnectorFactory.get_connector_class = classmethod(get_connector_class)  # type: ignore[method-assign]
    setattr(ECConnectorFactory, _PATCHED_FLAG, True)
