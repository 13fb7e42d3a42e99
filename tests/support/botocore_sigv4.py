"""botocore's S3 SigV4 signer with payload signing off, as ec-s3 used it
before :mod:`ec_s3.store.sigv4`: the reference that module is checked against
(tests/store/test_store_sigv4.py) and the baseline its cost is measured against
(bench/small_ops.py). Owns nothing else."""

from __future__ import annotations

from collections.abc import Mapping

from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import ReadOnlyCredentials

__all__ = ["botocore_signed_headers"]


class _UnsignedPayloadAuth(S3SigV4Auth):
    def _should_sha256_sign_payload(self, request: AWSRequest) -> bool:
        return False


def botocore_signed_headers(method: str, url: str, headers: Mapping[str, str], *, access_key: str, secret_key: str,
                            token: str | None, region: str) -> dict[str, str]:
    """What botocore signs for the request (its clock: ``botocore.auth.get_current_datetime``),
    called as :func:`ec_s3.store.sigv4.signed_headers` is."""
    request = AWSRequest(method=method, url=url, headers=dict(headers))
    _UnsignedPayloadAuth(ReadOnlyCredentials(access_key, secret_key, token), "s3", region).add_auth(request)
    return dict(request.headers.items())
