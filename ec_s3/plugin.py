"""vLLM general plugin: makes ``"ec_connector": "ECS3Connector"`` a shortcut.

vLLM loads every ``vllm.general_plugins`` entry point in each of its processes, so
the name works without ``ec_connector_module_path``. vLLM's factory looks a name up in
its registry *before* it reads ``ec_connector_module_path``; registering the name alone
would therefore make an explicit module path silently ignored (someone who wraps or
subclasses the connector under the same class name would get ours). So the plugin
also gives the module path precedence, for this one name only: with
``ec_connector_module_path`` set, exactly ``<module>.ECS3Connector`` is loaded, as
vLLM does for every unregistered name. Owns the registration only; nothing of the
connector is imported until vLLM asks for the class.
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
