"""The matrix's launchers (``tests/support/rgw.py``, ``tests/support/moto_s3.py``): each
serves S3, keeps everything under one temp dir, and its stop leaves no process of its
group and no files behind; RGW's gateway can die and come back with the data intact."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import boto3
import botocore.config
import pytest

from ec_s3.sandbox.procgroup import group_alive
from support.loopback_server import LoopbackServer
from support.moto_s3 import MotoServer
from support.rgw import RgwServer


@contextlib.contextmanager
def _serving(server: LoopbackServer) -> Iterator[Any]:
    """Start ``server``, yield a boto3 client on it with a bucket ``keep``; after the
    block, its process group and temp dir must be gone."""
    if (reason := server.unavailable_reason()) is not None:
        pytest.skip(reason)
    server.start()
    try:
        pgid = server._group.pid  # type: ignore[union-attr]  # noqa: SLF001 - what stop() must end
        scratch = server._dir  # noqa: SLF001
        assert scratch is not None and scratch.is_dir()
        creds = server.credentials
        s3 = boto3.client("s3", endpoint_url=server.endpoint_url, region_name="us-east-1",
                          aws_access_key_id=creds.access_key_id, aws_secret_access_key=creds.secret_access_key)
        s3.create_bucket(Bucket="keep")
        yield s3
    finally:
        server.stop()
    assert not group_alive(pgid)
    assert not scratch.exists()


def test_rgw_serves_survives_a_gateway_restart_and_stops_clean() -> None:
    server = RgwServer()
    with _serving(server) as s3:
        s3.put_object(Bucket="keep", Key="k", Body=b"v" * 10)
        server.kill_gateway()
        nobody = boto3.client("s3", endpoint_url=server.endpoint_url, region_name="us-east-1",
                              aws_access_key_id="x", aws_secret_access_key="y",
                              config=botocore.config.Config(retries={"max_attempts": 1}, connect_timeout=1))
        with pytest.raises(Exception):  # noqa: B017 - nothing listens: any connection error
            nobody.list_buckets()
        server.start_gateway()
        assert s3.get_object(Bucket="keep", Key="k")["Body"].read() == b"v" * 10


def test_moto_serves_and_stops_clean() -> None:
    with _serving(MotoServer()) as s3:
        s3.put_object(Bucket="keep", Key="k", Body=b"v")
        assert s3.get_object(Bucket="keep", Key="k")["Body"].read() == b"v"
