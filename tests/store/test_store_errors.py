"""Every way S3 can fail comes out of every store operation as a typed StoreError.

Real conditions only: an environment with no credentials anywhere, an ``https://`` URL
pointing at the plain-http S3 port, a proxy (named by the environment, as botocore
honours it) on a closed port, a dead port. Before, the first three escaped as raw
botocore exceptions. A caller's own exception (an allocator's) must come out
unchanged and unretried.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest

from ec_s3.config import ECS3Config
from ec_s3.store.client import S3Store
from ec_s3.store.diagnose import diagnose
from ec_s3.store.errors import NoCredentials, StoreError, StoreUnreachable, TLSError


MiB = 1 << 20


def _ops(store: S3Store) -> dict[str, Callable[[], Coroutine[Any, Any, Any]]]:
    async def listing() -> list[Any]:
        return [o async for o in store.list_async("p/")]

    return {
        "head": lambda: store.head_async("k"),
        "get": lambda: store.get_async("k"),
        "put": lambda: store.put_async("k", b"x" * 100),
        "put-multipart": lambda: store.put_async("big", bytearray(16 * MiB)),
        "delete": lambda: store.delete_async("k"),
        "delete-many": lambda: store.delete_many_async(["a", "b"]),
        "list": listing,
        "create-bucket": lambda: store.create_bucket_async(),
    }


OPS = list(_ops(None).keys())  # type: ignore[arg-type]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def no_aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Iterator[None]:
    """No credentials anywhere botocore looks, and no proxy."""
    for name in list(os.environ):
        if name.startswith("AWS_") or name.lower() in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "nonexistent-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "nonexistent-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    yield


def _store(url: str, bucket: str, **extra: Any) -> S3Store:
    return S3Store(ECS3Config.from_extra_config(
        {"bucket": bucket, "endpoint_url": url, "connect_timeout_s": 1.0, "read_timeout_s": 5.0,
         "retry_base_delay_s": 0.01, "retry_max_delay_s": 0.05, "max_attempts": 2, **extra},
        environ={},
    ))


def _failure(store: S3Store, op: str) -> StoreError:
    try:
        store.run(_ops(store)[op](), timeout=60)
    except StoreError as exc:
        return exc
    except Exception as exc:  # noqa: BLE001 - the bug this file guards against
        pytest.fail(f"{op} raised {type(exc).__module__}.{type(exc).__name__}, not a StoreError: {exc}")
    pytest.fail(f"{op} succeeded")


@pytest.mark.parametrize("op", OPS)
def test_no_credentials(op: str, s3_endpoint: Any, bucket: str, no_aws_env: None) -> None:
    store = _store(s3_endpoint.url, bucket)
    try:
        exc = _failure(store, op)
        assert isinstance(exc, NoCredentials), repr(exc)
        assert not exc.transient and exc.status is None
        assert store.stats.retries == 0 and not store.breaker.is_open
        assert diagnose(exc, store.config).kind == "no_credentials"
    finally:
        store.close(timeout=2)


def test_missing_credentials_fail_at_connect(s3_endpoint: Any, bucket: str, no_aws_env: None) -> None:
    """Failed before: the client was built without credentials and connecting
    succeeded; only each request failed, later. Now connecting fails, typed, naming
    where credentials were looked for."""
    store = _store(s3_endpoint.url, bucket)
    try:
        with pytest.raises(NoCredentials, match=r"credentials from") as caught:
            store.run(store._get_transport(), timeout=30)
        assert not caught.value.transient
        assert diagnose(caught.value, store.config).kind == "no_credentials"
    finally:
        store.close(timeout=2)


@pytest.mark.parametrize("op", OPS)
def test_https_to_a_plain_http_port_is_a_tls_error(
    op: str, s3_endpoint: Any, bucket: str, no_aws_env: None
) -> None:
    url = s3_endpoint.url.replace("http://", "https://", 1)
    creds = s3_endpoint.credentials
    store = _store(url, bucket, access_key_id=creds.access_key_id, secret_access_key=creds.secret_access_key)
    try:
        exc = _failure(store, op)
        assert isinstance(exc, TLSError), repr(exc)
        assert exc.transient and exc.status is None
        assert diagnose(exc, store.config).kind == "tls"
    finally:
        store.close(timeout=2)


@pytest.mark.parametrize("op", ["head", "get", "put"])
def test_proxy_on_a_closed_port_is_unreachable(
    op: str, s3_endpoint: Any, bucket: str, no_aws_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTP_PROXY", f"http://proxyuser:proxy-secret-pw@127.0.0.1:{_closed_port()}")
    creds = s3_endpoint.credentials
    store = _store(
        s3_endpoint.url, bucket, access_key_id=creds.access_key_id, secret_access_key=creds.secret_access_key,
    )
    try:
        exc = _failure(store, op)
        assert isinstance(exc, StoreUnreachable), repr(exc)
        assert exc.transient
        assert "proxy-secret-pw" not in str(exc) and "proxy-secret-pw" not in repr(exc)
        assert creds.secret_access_key not in str(exc)
        assert diagnose(exc, store.config).kind == "endpoint"
    finally:
        store.close(timeout=2)


@pytest.mark.parametrize("op", OPS)
def test_dead_port_is_unreachable(op: str, bucket: str, no_aws_env: None) -> None:
    store = _store(f"http://127.0.0.1:{_closed_port()}", bucket, access_key_id="k", secret_access_key="s")
    try:
        exc = _failure(store, op)
        assert isinstance(exc, StoreUnreachable) and exc.transient, repr(exc)
        assert "cannot reach" in diagnose(exc, store.config).cause
    finally:
        store.close(timeout=2)


@pytest.mark.parametrize("error", [FileExistsError("slot exists"), OSError(28, "No space left on device"), MemoryError()])
def test_allocator_errors_come_out_unchanged_and_unretried(
    error: Exception, make_store: Callable[..., S3Store]
) -> None:
    store = make_store(max_attempts=4)
    store.run(store.put_async("k", b"x" * 1000), timeout=30)

    def allocate(nbytes: int) -> memoryview:
        raise error

    with pytest.raises(type(error)) as got:
        store.run(store.get_async("k", allocate=allocate), timeout=30)
    assert got.value is error
    assert store.stats.retries == 0
