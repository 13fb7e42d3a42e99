"""Config: typed, validated, errors name the key, secrets never leak."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from ec_s3.config import ConfigError, ECS3Config, config_keys

BASE = {"bucket": "ec-bucket"}


def test_defaults_and_string_coercion() -> None:
    cfg = ECS3Config.from_extra_config(
        {**BASE, "max_inflight_bytes": "64_000_000", "read_timeout_s": "2.5", "verify_tls": "false", "lookup": "promised"}
    )
    assert cfg.max_inflight_bytes == 64_000_000 and cfg.read_timeout_s == 2.5
    assert cfg.verify_tls is False and cfg.lookup == "promised" and cfg.prefix == "ec-cache"


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({}, "bucket"),
        ({**BASE, "bukcet": "x"}, "bukcet"),
        ({**BASE, "max_attempts": 0}, "max_attempts"),
        ({**BASE, "max_attempts": "many"}, "max_attempts"),
        ({**BASE, "max_attempts": True}, "max_attempts"),
        ({**BASE, "backpressure": "spin"}, "backpressure"),
        ({**BASE, "prefix": "../up"}, "prefix"),
        ({**BASE, "prefix": "a//b"}, "prefix"),
        ({**BASE, "prefix": "a/../b"}, "prefix"),
        ({**BASE, "prefix": "/"}, "prefix"),
        ({**BASE, "bucket": "Bad_Bucket"}, "bucket"),
        ({**BASE, "endpoint_url": "minio:9000"}, "endpoint_url"),
        ({**BASE, "multipart_part_bytes": 1024}, "multipart_part_bytes"),
        ({**BASE, "access_key_id": "AK"}, "access_key_id"),
        ({**BASE, "read_timeout_s": "nan"}, "read_timeout_s"),
    ],
)
def test_bad_values_name_the_key(extra: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)):
        ECS3Config.from_extra_config(extra, environ={})


def test_unknown_key_lists_accepted_keys() -> None:
    with pytest.raises(ConfigError, match=r"(?s)accepted keys:.*max_inflight_bytes"):
        ECS3Config.from_extra_config({**BASE, "typo": 1})


def test_secrets_never_in_repr_or_errors() -> None:
    cfg = ECS3Config.from_extra_config({**BASE, "access_key_id": "AKIASECRET1", "secret_access_key": "hunter2-very-secret"})
    assert "hunter2" not in repr(cfg) and "AKIASECRET1" not in repr(cfg) and "hunter2" not in str(cfg)
    assert cfg.secret_access_key is not None and cfg.secret_access_key.reveal() == "hunter2-very-secret"
    with pytest.raises(ConfigError) as err:
        ECS3Config.from_extra_config({**BASE, "secret_access_key": 12345, "access_key_id": "a"})
    assert "12345" not in str(err.value)


def test_bucket_and_endpoint_from_env() -> None:
    cfg = ECS3Config.from_extra_config({}, environ={"EC_S3_BUCKET": "env-bucket", "EC_S3_ENDPOINT_URL": "http://h:9000"})
    assert cfg.bucket == "env-bucket" and cfg.endpoint_url == "http://h:9000"


def test_every_key_is_documented_in_docs_config() -> None:
    """docs/config.md holds the table scripts/config_table.py renders from the keys'
    own declarations: every key, its default and its meaning as the code has them."""
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("config_table", root / "scripts" / "config_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    doc = (root / "docs" / "config.md").read_text()
    missing = [key for key, _, _ in config_keys() if f"| `{key}` |" not in doc]
    assert not missing, f"config keys missing from docs/config.md: {missing}"
    assert module.table() in doc, "docs/config.md's table is out of date: run scripts/config_table.py"


@pytest.mark.parametrize(("written", "stored"), [("ec-cache/", "ec-cache"), ("team-a/ec-cache/", "team-a/ec-cache"),
                                                   ("/ec-cache", "ec-cache"), ("ec-cache", "ec-cache")])
def test_prefix_as_people_write_it(written: str, stored: str) -> None:
    """``ec-cache/`` (how S3 prefixes are usually written) used to stop the engine."""
    cfg = ECS3Config.from_extra_config({**BASE, "prefix": written, "namespace": written}, environ={})
    assert cfg.prefix == stored and cfg.namespace == stored
    assert ECS3Config(bucket="ec-bucket", prefix=written).prefix == stored


def test_credentials_by_reference(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text("from-a-file\n")
    env = {"MY_KEY_ID": "AKIDFROMENV", "MY_SECRET": "from-the-env"}
    with caplog.at_level(logging.WARNING, logger="vllm.ec_s3"):
        cfg = ECS3Config.from_extra_config(
            {**BASE, "access_key_id": "env:MY_KEY_ID", "secret_access_key": f"file:{secret_file}",
             "session_token": "env:MY_SECRET"}, environ=env,
        )
    assert cfg.access_key_id is not None and cfg.access_key_id.reveal() == "AKIDFROMENV"
    assert cfg.secret_access_key is not None and cfg.secret_access_key.reveal() == "from-a-file"
    assert cfg.session_token is not None and cfg.session_token.reveal() == "from-the-env"
    assert not [r for r in caplog.records if "literally" in r.getMessage()]
    assert "from-a-file" not in repr(cfg) and "from-the-env" not in repr(cfg)


@pytest.mark.parametrize("ref", ["env:UNSET_VAR", "env:bad name", "file:/nonexistent/secret"])
def test_bad_credential_reference_names_the_key(ref: str) -> None:
    with pytest.raises(ConfigError, match="secret_access_key") as err:
        ECS3Config.from_extra_config({**BASE, "access_key_id": "AK", "secret_access_key": ref}, environ={})
    assert "Traceback" not in str(err.value)


def test_literal_secret_warns_without_showing_it(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    import ec_s3.config_values as config_values

    monkeypatch.setattr(config_values, "_warned_literal", set())
    with caplog.at_level(logging.WARNING, logger="vllm.ec_s3"):
        ECS3Config.from_extra_config({**BASE, "access_key_id": "AK", "secret_access_key": "hunter2-literal"}, environ={})
    warnings = [r.getMessage() for r in caplog.records if "literally" in r.getMessage()]
    assert len(warnings) == 1 and "secret_access_key" in warnings[0] and "env:NAME" in warnings[0]
    assert "hunter2" not in caplog.text


def test_a_key_typed_float_or_none_is_parsed_by_its_resolved_type() -> None:
    """``_coerce`` used to compare annotations as strings: a ``float | None`` key hit its
    "unhandled config type" AssertionError."""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Extended(ECS3Config):
        grace_s: float | None = dataclasses.field(default=None, metadata={"doc": "test key", "min": 0.0})
        tries: int | None = dataclasses.field(default=None, metadata={"doc": "test key", "min": 1})

    cfg = Extended.from_extra_config({**BASE, "grace_s": "1.5", "tries": 3.0}, environ={})
    assert cfg.grace_s == 1.5 and cfg.tries == 3 and isinstance(cfg.tries, int)
    assert Extended.from_extra_config({**BASE, "grace_s": None}, environ={}).grace_s is None
    with pytest.raises(ConfigError, match="grace_s"):
        Extended.from_extra_config({**BASE, "grace_s": "soon"}, environ={})
    with pytest.raises(ConfigError, match="grace_s"):
        Extended.from_extra_config({**BASE, "grace_s": -1}, environ={})


def test_misspelt_key_suggests_the_right_one_and_lists_keys_readably() -> None:
    with pytest.raises(ConfigError) as err:
        ECS3Config.from_extra_config({**BASE, "staging_byte": 1 << 20}, environ={})
    message = str(err.value)
    assert "'staging_byte'" in message and "did you mean 'staging_bytes'" in message
    assert max(len(line) for line in message.splitlines()) <= 100, message
    assert "max_inflight_bytes" in message


@pytest.mark.parametrize(("written", "value"), [("1MiB", 1 << 20), ("2G", 2 << 30), ("500MB", 500 * 1000**2),
                                                 ("4194304", 4 << 20), (8 << 20, 8 << 20)])
def test_size_keys_take_units(written: object, value: int) -> None:
    cfg = ECS3Config.from_extra_config({**BASE, "staging_bytes": written, "spool_max_bytes": written,
                                        "max_inflight_bytes": written}, environ={})
    assert cfg.staging_bytes == cfg.spool_max_bytes == cfg.max_inflight_bytes == value


def test_a_bad_size_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"staging_bytes='lots' is invalid: .*500MiB"):
        ECS3Config.from_extra_config({**BASE, "staging_bytes": "lots"}, environ={})


def test_data_path_direct_still_loads_and_botocore_is_refused_naming_the_key() -> None:
    """Failed before (``botocore`` was accepted): the botocore data path was removed,
    and a config that still names it must fail at start-up saying what to do."""
    assert ECS3Config.from_extra_config({"bucket": "b-1"}, environ={}).data_path == "direct"
    assert ECS3Config.from_extra_config({"bucket": "b-1", "data_path": "direct"}, environ={}).data_path == "direct"
    with pytest.raises(ConfigError, match=r"data_path='botocore' is no longer accepted: it was removed.*delete the key"):
        ECS3Config.from_extra_config({"bucket": "b-1", "data_path": "botocore"}, environ={})
    with pytest.raises(ConfigError, match="data_path='fast' is invalid: expected one of 'direct'"):
        ECS3Config.from_extra_config({"bucket": "b-1", "data_path": "fast"}, environ={})
