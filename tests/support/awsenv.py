"""A process environment in which only what a test sets speaks for the AWS chain.

botocore reads credentials, region and CA bundle from ``AWS_*`` variables and from the
machine's ``~/.aws`` files; a test that relies on (or checks) that chain must start from
none of them. Owns that clean slate; the variables a test then sets are its own.
"""

from __future__ import annotations

import os

import pytest

__all__ = ["clean_aws_environment"]


def clean_aws_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drop every ``AWS_*``/``EC_S3_*`` variable (and ``REQUESTS_CA_BUNDLE``, which
    botocore also reads) and point the AWS files nowhere; ``monkeypatch`` restores all."""
    for name in list(os.environ):
        if name.startswith(("AWS_", "EC_S3_")) and name != "EC_S3_WEED_BIN":
            monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/ec-s3-test-credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/ec-s3-test-config")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
