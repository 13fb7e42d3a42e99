"""vLLM general plugin: registers ``ECS3Connector`` by name.

vLLM loads every ``vllm.general_plugins`` entry point in each of its processes, so
``"ec_connector": "ECS3Connector"`` works without ``ec_connector_module_path``.
"""

from __future__ import annotations


def register() -> None:
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    if "ECS3Connector" not in ECConnectorFactory._registry:
        ECConnectorFactory.register_connector("ECS3Connector", "ec_s3.connector.facade", "ECS3Connector")
