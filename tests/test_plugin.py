"""The vLLM plugin: ``ECS3Connector`` is a shortcut, an explicit module path wins."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm.config import ECTransferConfig  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory  # noqa: E402

from ec_s3 import plugin  # noqa: E402
from ec_s3.connector.facade import ECS3Connector  # noqa: E402


def _cfg(**kw: object) -> ECTransferConfig:
    return ECTransferConfig(ec_connector="ECS3Connector", ec_role="ec_consumer", **kw)  # type: ignore[arg-type]


@pytest.fixture
def wrapper_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A user's module that wraps the connector under the same class name."""
    (tmp_path / "my_ec_wrapper.py").write_text(
        "from ec_s3.connector.facade import ECS3Connector as _Base\n"
        "class ECS3Connector(_Base):\n    wrapped = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_ec_wrapper"
    sys.modules.pop("my_ec_wrapper", None)


def test_name_alone_resolves_through_the_plugin() -> None:
    plugin.register()
    assert ECConnectorFactory.get_connector_class(_cfg()) is ECS3Connector
    assert ECConnectorFactory.get_connector_class(_cfg(ec_connector_module_path="ec_s3")) is ECS3Connector


def test_explicit_module_path_loads_exactly_that_class(wrapper_module: str) -> None:
    """Before: the registry answered first and the wrapper was silently ignored."""
    plugin.register()
    plugin.register()  # vLLM may load plugins more than once per process
    cls = ECConnectorFactory.get_connector_class(_cfg(ec_connector_module_path=wrapper_module))
    assert cls is not ECS3Connector and issubclass(cls, ECS3Connector) and cls.wrapped


def test_other_connectors_are_untouched() -> None:
    plugin.register()
    cfg = ECTransferConfig(ec_connector="ECExampleConnector", ec_role="ec_consumer",
                           ec_connector_module_path="ec_s3")
    assert ECConnectorFactory.get_connector_class(cfg).__name__ == "ECExampleConnector"
