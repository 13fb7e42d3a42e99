"""The matrix's launchers (``tests/support/rgw.py``, ``tests/support/moto_s3.py``): each
serves S3, keeps everything under one temp dir, and its stop leaves no process of its
group and no files behind; RGW's gateway can die and come back with the data intact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import boto3
import botocore.config
import pytest

from ec_s3.sandbox.procgroup import group_alive
from support.moto_s3 import MotoServer
from support.rgw import RgwServer


def _client(server: RgwServer | MotoServer) -> Any:
    creds = server.credentials
    return boto3.client("s3", endpoint_url=server.endpoint_url, region_name="us-east-1",
                        aws_access_key_id=creds.access_key_id, aws_secret_access_key=creds.secret_access_key)


def _scratch(server: RgwServer | MotoServer) -> Path:
    d = server._dir  # noqa: SLF001 - the test checks what stop() removes
    assert d is not None and d.is_dir()
    return d


def test_rgw_serves_survives_a_gateway_restart_and_stops_clean() -> None:
    if (reason := RgwServer.unavailable_reason()) is not None:
        pytest.skip(reason)
    server = RgwServer().start()
    try:
        pgid = server._group.pid  # type: ignore[union-attr]  # noqa: SLF001
        scratch = _scratch(server)
        s3 = _client(server)
        s3.create_bucket(Bucket="keep")
        s3.put_object(Bucket="keep", Key="k", Body=b"v" * 10)
        server.kill_gateway()
        with pytest.raises(Exception):  # noqa: B017 - nothing listens: any connection error
            boto3.client("s3", endpoint_url=server.endpoint_url, region_name="us-east-1",
                         aws_access_key_id="x", aws_secret_access_key="y",
                         config=botocore.config.Config(retries={"max_attempts": 1}, connect_timeout=1)
                         ).list_buckets()
        server.start_gateway()
        assert s3.get_object(Bucket="keep", Key="k")["Body"].read() == b"v" * 10
    finally:
        server.stop()
    assert not group_alive(pgid)
    assert not scratch.exists()


def test_moto_serves_and_stops_clean() -> None:
    if (reason := MotoServer.unavailable_reason()) is not None:
        pytest.skip(reason)
    server = MotoServer().start()
    try:
        pgid = server._group.pid  # type: ignore[union-attr]  # noqa: SLF001
        scratch = _scratch(server)
        s3 = _client(server)
        s3.create_bucket(Bucket="keep")
        s3.put_object(Bucket="keep", Key="k", Body=b"v")
        assert s3.get_object(Bucket="keep", Key="k")["Body"].read() == b"v"
    finally:
        server.stop()
    assert not group_alive(pgid)
    assert not scratch.exists()
