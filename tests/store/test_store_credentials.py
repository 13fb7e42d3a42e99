"""The credential chain under a deadline: a slow or failing credential source ends as a
typed error within ``request_timeout_s``, once for every request waiting on it, and is
remembered for ``breaker_cooldown_s`` instead of being run again by each request.

Against the session's S3 server, with a real AWS config file whose profile names a
``credential_process`` script (the chain botocore itself runs); the environment holds
nothing else of the AWS chain (``clean_aws_env``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ec_s3.config import ECS3Config
from ec_s3.store.client import S3Store
from ec_s3.store.diagnose import credential_source, diagnose
from ec_s3.store.errors import NoCredentials


def _slow_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3_endpoint: Any, seconds: float) -> Path:
    """Profile ``slow``: a credential_process that logs its pid, sleeps, then prints the
    server's keys. Returns the file of pids (one line per run)."""
    runs = tmp_path / "runs"
    creds = s3_endpoint.credentials
    answer = json.dumps({"Version": 1, "AccessKeyId": creds.access_key_id, "SecretAccessKey": creds.secret_access_key})
    script = tmp_path / "slow-creds.py"
    script.write_text(
        f"#!{sys.executable}\nimport os, time\n"
        f"with open({str(runs)!r}, 'a') as f:\n    f.write(f'{{os.getpid()}}\\n')\n"
        f"time.sleep({seconds})\nprint({answer!r})\n"
    )
    script.chmod(0o700)
    config = tmp_path / "aws-config"
    config.write_text(f"[profile slow]\ncredential_process = {script}\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_PROFILE", "slow")
    return runs


def _store(s3_endpoint: Any, bucket: str, **overrides: Any) -> S3Store:
    return S3Store(ECS3Config.from_extra_config(
        {"bucket": bucket, "endpoint_url": s3_endpoint.url, **overrides}, environ={}))


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_slow_credential_process_ends_typed_within_the_deadline(
    s3_endpoint: Any, bucket: str, clean_aws_env: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """Failed before: each of 4 HEADs ran the 6 s process in turn under the client
    lock, with no deadline (24 s; here the first .result(5) timed out)."""
    runs = _slow_profile(tmp_path, clean_aws_env, s3_endpoint, seconds=6)
    store = _store(s3_endpoint, bucket, request_timeout_s=1.0, breaker_cooldown_s=30.0)
    try:
        started = time.monotonic()
        futures = [store.submit(store.head_async(f"k{i}")) for i in range(4)]
        assert time.monotonic() - started < 0.5  # the submitting thread (the scheduler's) never waits
        errors = []
        for future in futures:
            with pytest.raises(NoCredentials) as caught:
                future.result(5)
            errors.append(caught.value)
        assert time.monotonic() - started < 3.0  # one deadline for all four, not four 6 s runs
        for error in errors:
            assert "AWS profile 'slow': credential_process" in str(error) and "request_timeout_s=1" in str(error)
        # Remembered: the next request fails at once and runs no process.
        started = time.monotonic()
        with pytest.raises(NoCredentials):
            store.run(store.head_async("k"), timeout=5)
        assert time.monotonic() - started < 0.5
        pids = runs.read_text().split()
        assert len(pids) == 1
        assert _gone(int(pids[0]), 3.0)  # the process given up on was ended, not left running
        d = diagnose(errors[0], store.config, op="HEAD")
        assert d.kind == "no_credentials" and "credential_process" in d.cause and "request_timeout_s" in d.fix
    finally:
        store.close(timeout=2)


def test_a_remembered_failure_is_tried_again_after_the_cooldown(
    s3_endpoint: Any, bucket: str, clean_aws_env: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """After ``breaker_cooldown_s`` the chain is run again, and a source that is fast by
    then gives a working store."""
    runs = _slow_profile(tmp_path, clean_aws_env, s3_endpoint, seconds=3)
    store = _store(s3_endpoint, bucket, request_timeout_s=1.0, breaker_cooldown_s=1.0)
    try:
        with pytest.raises(NoCredentials):
            store.run(store.head_async("k"), timeout=5)
        script = tmp_path / "slow-creds.py"
        script.write_text(script.read_text().replace("time.sleep(3)", "time.sleep(0)"))
        time.sleep(1.2)
        assert store.run(store.head_async("k"), timeout=5) is None  # connected: a 404, not an error
        assert len(runs.read_text().split()) == 2
    finally:
        store.close(timeout=2)


def test_credential_source_names_what_the_profile_runs(clean_aws_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = tmp_path / "aws-config"
    config.write_text("[profile p]\ncredential_process = /bin/true\n[default]\nrole_arn = arn:aws:iam::1:role/r\n"
                      "source_profile = p\n")
    clean_aws_env.setenv("AWS_CONFIG_FILE", str(config))
    cfg = ECS3Config.from_extra_config({"bucket": "bucket"}, environ={})
    assert credential_source(cfg) == f"AWS default chain: role_arn of profile 'default' (in {config})"
    clean_aws_env.setenv("AWS_PROFILE", "p")
    assert credential_source(cfg) == f"AWS profile 'p': credential_process (in {config})"
