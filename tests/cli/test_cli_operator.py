"""An operator's first hour without guesswork (issue 43): what ``ec-s3`` says when the
operator gets something slightly wrong, against a real S3 server (SeaweedFS).

Each test pins a message: a misspelt ``ec_role``, a TLS row that must not say ok when
the handshake failed, a plain-http request to a TLS port, the permission a refused
delete needs, the start-up probe hidden from ``stats``, and a missing blob told apart
from an invalid one.
"""

from __future__ import annotations

import json
import socketserver
import threading
from collections.abc import Callable, Iterator

import pytest

from ec_s3.blob.keys import PROBE_NAMESPACE, probe_key
from ec_s3.cli import common
from ec_s3.config import ConfigError
from ec_s3.sandbox.net import free_port
from ec_s3.store.client import S3Store
from support.tls import HTTPSEndpoint
from test_cli import PREFIX, ReadOnlyS3, Run, _clean_env, _put_blobs, env, readonly_s3, run_cli  # noqa: F401

# What Go's net/http (MinIO, SeaweedFS) answers any plain-HTTP request on a TLS port,
# before closing the connection.
_GO_TLS_PORT_ANSWER = b"HTTP/1.0 400 Bad Request\r\n\r\nClient sent an HTTP request to an HTTPS server.\n"


@pytest.fixture
def tls_port() -> Iterator[str]:
    """``http://127.0.0.1:<port>`` of a port that answers like Go's TLS listener does to plain HTTP."""

    class Answer(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            self.rfile.readline()
            self.wfile.write(_GO_TLS_PORT_ANSWER)

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Answer)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------------- ec_role
def test_ec_roles_are_the_ones_the_installed_vllm_accepts() -> None:
    from typing import get_args

    from vllm.config.ec_transfer import ECRole

    from ec_s3.config_values import EC_ROLES

    assert set(get_args(ECRole)) == set(EC_ROLES)


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


# ---------------------------------------------------------------------- TLS
def test_tls_row_is_not_ok_when_the_handshake_failed(run_cli: Run, env: dict[str, str],
                                                     https_endpoint: HTTPSEndpoint) -> None:
    """A certificate no CA here trusts: the handshake fails, so neither the `tls:` line
    nor the capability table may say the connection was verified."""
    rc, out, _ = run_cli("check", "--endpoint-url", https_endpoint.url, "--set", "max_attempts=1")
    assert rc == 1 and "FAIL: TLS handshake" in out
    tls_lines = [line for line in out.splitlines() if line.strip().startswith(("tls:", "TLS "))]
    assert tls_lines, out
    for line in tls_lines:
        assert " ok " not in f"{line} " and "verified with" not in line, line
    assert any("handshake failed" in line for line in tls_lines), tls_lines


def test_plain_http_to_a_tls_port_shows_the_servers_words(run_cli: Run, env: dict[str, str], tls_port: str) -> None:
    rc, out, _ = run_cli("check", "--endpoint-url", tls_port, "--set", "max_attempts=1")
    assert rc == 1
    assert "Client sent an HTTP request to an HTTPS server" in out
    assert "see the S3 error code above" not in out
    assert "https://127.0.0.1:" in out.split("fix:", 1)[1]


# ---------------------------------------------------------------------- permissions
def test_gc_with_read_only_credentials_names_delete_object(run_cli: Run, readonly_s3: ReadOnlyS3,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """SeaweedFS answers DeleteObjects 200 with a per-key AccessDenied in its body."""
    _clean_env(monkeypatch)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", readonly_s3.reader.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", readonly_s3.reader.secret_access_key)
    rc, out, _ = run_cli("gc", "--older-than", "0s", "--bucket", readonly_s3.bucket, "--endpoint-url", readonly_s3.url)
    assert rc == 1
    assert "s3:DeleteObject" in out and "see the S3 error code above" not in out


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


# ---------------------------------------------------------------------- check --create-bucket
def test_check_create_bucket_creates_a_missing_bucket_once(run_cli: Run, env: dict[str, str]) -> None:
    """No command created the bucket (issue 43): ``check --create-bucket`` makes a missing
    one, then proves access to it; run again, it leaves the bucket as it is."""
    import secrets

    name = f"ec-s3-made-{secrets.token_hex(4)}"
    rc, out, _ = run_cli("check", "--bucket", name)
    assert rc == 1 and "missing bucket" in out and "--create-bucket" in out.split("fix:", 1)[1], out
    rc, out, _ = run_cli("check", "--bucket", name, "--create-bucket")
    assert rc == 0 and "create-bucket" in out and f"CreateBucket s3://{name}" in out and "PASS" in out, out
    rc, out, _ = run_cli("check", "--bucket", name, "--create-bucket")
    assert rc == 0 and "create-bucket" not in out and "PASS" in out, out


def test_check_create_bucket_without_the_permission_names_it(run_cli: Run, readonly_s3: ReadOnlyS3,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    _clean_env(monkeypatch)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", readonly_s3.reader.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", readonly_s3.reader.secret_access_key)
    rc, out, _ = run_cli("check", "--create-bucket", "--bucket", "ec-s3-not-made", "--endpoint-url", readonly_s3.url)
    assert rc == 1 and "create-bucket" in out and "s3:CreateBucket" in out, out
    assert "arn:aws:s3:::ec-s3-not-made to these credentials" in out, out


def test_check_create_bucket_is_not_read_only(run_cli: Run, env: dict[str, str]) -> None:
    rc, out, _ = run_cli("check", "--create-bucket", "--read-only")
    assert rc == 1 and "--create-bucket" in out and "--read-only" in out, out


def test_a_bucket_name_taken_by_another_account_says_so() -> None:
    """AWS answers CreateBucket of another account's bucket name 409 BucketAlreadyExists
    (SeaweedFS has no accounts to show it): the fix is another name, not a permission."""
    from ec_s3.config import ECS3Config
    from ec_s3.store.diagnose import diagnose
    from ec_s3.store.errors import StoreRequestError

    config = ECS3Config.from_extra_config({"bucket": "taken"})
    taken = StoreRequestError("CreateBucket", "taken", "not yours", status=409, code="BucketAlreadyExists")
    d = diagnose(taken, config, op="CreateBucket")
    assert d.kind == "bucket" and "taken by another account" in d.cause and "another name" in d.fix, d
