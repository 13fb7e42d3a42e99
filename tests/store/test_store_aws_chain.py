"""The store follows the AWS conventions for TLS trust and region, for the client and the blob pools.

Over real TLS: the session's S3 server behind a TLS front whose certificate a private
CA made for the test signs (``https_endpoint``). The CA is trusted the AWS ways
(``AWS_CA_BUNDLE``, a profile's ``ca_bundle``) or by the ``ca_bundle`` key; without
any, every request fails with a typed :class:`TLSError` and a diagnosis that names the
CA file that was used and what to set. The region comes from the ``region`` key, then
``AWS_REGION``, ``AWS_DEFAULT_REGION``, the profile, else ``us-east-1``, and ``ec-s3
check`` says which.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import certifi
import pytest

from ec_s3.config import ConfigError, ECS3Config
from ec_s3.store.client import S3Store
from ec_s3.store.diagnose import diagnose
from ec_s3.store.errors import StoreError, TLSError, UntrustedCertificate
from support.tls import HTTPSEndpoint, make_private_ca



def _profile_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, profile: str, **settings: str) -> Path:
    """An AWS config file with one profile, selected through AWS_CONFIG_FILE/AWS_PROFILE."""
    path = tmp_path / "aws-config"
    section = "default" if profile == "default" else f"profile {profile}"
    path.write_text(f"[{section}]\n" + "".join(f"{k} = {v}\n" for k, v in settings.items()))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(path))
    if profile != "default":
        monkeypatch.setenv("AWS_PROFILE", profile)
    return path


def _round_trip(store: S3Store) -> None:
    body = b"over a private CA " * 1000
    store.run(store.put_async("tls/k", body), timeout=30)
    info = store.run(store.head_async("tls/k"), timeout=30)
    assert info is not None and info.size == len(body)
    assert bytes(store.run(store.get_async("tls/k"), timeout=30)) == body


# ---------------------------------------------------------------------------- TLS trust
@pytest.mark.parametrize("how", ["AWS_CA_BUNDLE", "profile", "ca_bundle key"])
def test_private_ca_is_trusted_the_aws_ways(
    make_store: Callable[..., S3Store], https_endpoint: HTTPSEndpoint, clean_aws_env: pytest.MonkeyPatch,
    tmp_path: Path, how: str,
) -> None:
    """Failed before the AWS chain was honoured: verify=True made botocore ignore
    AWS_CA_BUNDLE and the profile, the direct path loaded certifi only, and the
    ``ca_bundle`` key did not exist."""
    overrides: dict[str, Any] = {}
    if how == "AWS_CA_BUNDLE":
        clean_aws_env.setenv("AWS_CA_BUNDLE", str(https_endpoint.ca_path))
    elif how == "profile":
        _profile_file(tmp_path, clean_aws_env, "onprem", ca_bundle=str(https_endpoint.ca_path))
    else:
        overrides["ca_bundle"] = str(https_endpoint.ca_path)
    store = make_store(https_endpoint.url, max_attempts=1, **overrides)
    _round_trip(store)
    recv = getattr(store._transport, "wire", None).recv_pool if getattr(store._transport, "wire", None) else None
    assert recv is not None and recv.opened >= 1  # the GET went through recv.py's TLS

    from ec_s3.store.connection import resolve_endpoint

    resolved = resolve_endpoint(store.config)
    assert resolved.ca_file == str(https_endpoint.ca_path)
    assert {"AWS_CA_BUNDLE": "AWS_CA_BUNDLE", "profile": "profile 'onprem'",
            "ca_bundle key": "`ca_bundle` key"}[how] in resolved.ca_source


def test_start_up_check_passes_with_aws_ca_bundle_and_says_what_to_set_without(
    make_config: Callable[..., ECS3Config], https_endpoint: HTTPSEndpoint, clean_aws_env: pytest.MonkeyPatch,
) -> None:
    """The issue's report: with AWS_CA_BUNDLE set, the start-up check stopped the engine
    with CERTIFICATE_VERIFY_FAILED on both data paths (failed before this change);
    without it, it stops the engine naming the CA it checked against."""
    from ec_s3.connector.preflight import StartupCheckError, run_startup_checks

    config = make_config(https_endpoint.url, startup_check="fatal")
    clean_aws_env.delenv("AWS_CA_BUNDLE", raising=False)
    with pytest.raises(StartupCheckError, match="checked against .*public CAs.*set ca_bundle"):
        run_startup_checks(config, producer=True, consumer=False)
    clean_aws_env.setenv("AWS_CA_BUNDLE", str(https_endpoint.ca_path))
    assert run_startup_checks(config, producer=True, consumer=False) == []


def test_untrusted_ca_is_a_tls_error_with_a_true_diagnosis(
    make_store: Callable[..., S3Store], https_endpoint: HTTPSEndpoint, clean_aws_env: pytest.MonkeyPatch,
) -> None:
    """Without a CA, the diagnosis says certifi's public CAs were used and names every
    way to trust a private one (before: "set AWS_CA_BUNDLE", with no word on which CA
    failed, and the advice did not work)."""
    store = make_store(https_endpoint.url, max_attempts=1)
    for op, call in (("GET", lambda: store.get_async("k")), ("PUT", lambda: store.put_async("k", b"x"))):
        with pytest.raises(UntrustedCertificate) as caught:
            store.run(call(), timeout=30)
        d = diagnose(caught.value, store.config, op=op)
        assert d.kind == "tls"
        assert certifi.where() in d.cause and "public CAs" in d.cause
        for way in ("ca_bundle", "AWS_CA_BUNDLE", "profile"):
            assert way in d.fix


def test_https_on_a_plain_port_is_not_called_a_ca_problem(
    make_store: Callable[..., S3Store], s3_endpoint: Any, clean_aws_env: pytest.MonkeyPatch,
) -> None:
    """A handshake that never reached the certificate check (https:// on the server's
    plain-HTTP port) is a TLSError but not an UntrustedCertificate, and its diagnosis
    points at the URL, not at a CA."""
    store = make_store(s3_endpoint.url.replace("http://", "https://"), max_attempts=1)
    with pytest.raises(TLSError) as caught:
        store.run(store.get_async("k"), timeout=30)
    assert not isinstance(caught.value, UntrustedCertificate)
    d = diagnose(caught.value, store.config, op="GET")
    assert d.kind == "tls" and "not at the certificate check" in d.cause and "http://" in d.fix
    assert "CA" not in d.cause + d.fix


def test_wrong_ca_diagnosis_names_the_file_and_its_source(
    make_store: Callable[..., S3Store], https_endpoint: HTTPSEndpoint, clean_aws_env: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """AWS_CA_BUNDLE names a CA that did not sign the endpoint's certificate: the
    diagnosis names that file and that variable, not "set AWS_CA_BUNDLE"."""
    other = make_private_ca(tmp_path / "other", name="another CA")
    clean_aws_env.setenv("AWS_CA_BUNDLE", str(other.ca_path))
    store = make_store(https_endpoint.url, max_attempts=1)
    with pytest.raises(UntrustedCertificate) as caught:
        store.run(store.get_async("k"), timeout=30)
    d = diagnose(caught.value, store.config, op="GET")
    assert d.kind == "tls" and str(other.ca_path) in d.cause and "AWS_CA_BUNDLE" in d.cause
    assert str(other.ca_path) in d.fix and "set AWS_CA_BUNDLE" not in d.fix


def test_aws_ca_bundle_wins_over_the_profile(
    make_store: Callable[..., S3Store], https_endpoint: HTTPSEndpoint, clean_aws_env: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """botocore's order (the variable, then the profile): the direct path takes what the
    client resolved, so a wrong CA in the profile is not used by either."""
    other = make_private_ca(tmp_path / "other", name="another CA")
    _profile_file(tmp_path, clean_aws_env, "default", ca_bundle=str(other.ca_path))
    clean_aws_env.setenv("AWS_CA_BUNDLE", str(https_endpoint.ca_path))
    _round_trip(make_store(https_endpoint.url, max_attempts=1))


def test_ca_bundle_key_wins_and_verify_tls_false_still_disables(
    make_store: Callable[..., S3Store], https_endpoint: HTTPSEndpoint, clean_aws_env: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    other = make_private_ca(tmp_path / "other", name="another CA")
    clean_aws_env.setenv("AWS_CA_BUNDLE", str(other.ca_path))
    _round_trip(make_store(https_endpoint.url, max_attempts=1,
                           ca_bundle=str(https_endpoint.ca_path)))
    _round_trip(make_store(https_endpoint.url, max_attempts=1,
                           ca_bundle=str(other.ca_path), verify_tls=False))


def test_ca_bundle_key_must_name_a_readable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="ca_bundle="):
        ECS3Config.from_extra_config({"bucket": "b-1", "ca_bundle": str(tmp_path / "missing.pem")}, environ={})
    with pytest.raises(ConfigError, match="ca_bundle="):
        ECS3Config.from_extra_config({"bucket": "b-1", "ca_bundle": ""}, environ={})


def test_unreadable_aws_ca_bundle_is_a_typed_config_error(
    make_store: Callable[..., S3Store], https_endpoint: HTTPSEndpoint, clean_aws_env: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """A missing or non-PEM file in AWS_CA_BUNDLE fails at once, not retried as an
    unreachable endpoint (botocore's FileNotFoundError is an OSError), and the
    diagnosis names the variable."""
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("not a certificate\n")
    for path in (tmp_path / "missing.pem", not_pem):
        clean_aws_env.setenv("AWS_CA_BUNDLE", str(path))
        store = make_store(https_endpoint.url)
        with pytest.raises(StoreError) as caught:
            store.run(store.get_async("k"), timeout=30)
        assert not caught.value.transient and store.stats.retries == 0
        d = diagnose(caught.value, store.config, op="GET")
        assert d.kind == "tls" and str(path) in d.cause and "AWS_CA_BUNDLE" in d.cause


# ---------------------------------------------------------------------------- region
@pytest.mark.parametrize(
    ("key", "env", "profile", "expected"),
    [
        ("eu-north-1", {"AWS_REGION": "eu-west-3"}, "ap-south-1", ("eu-north-1", "`region` key")),
        (None, {"AWS_REGION": "eu-west-3", "AWS_DEFAULT_REGION": "us-west-1"}, "ap-south-1", ("eu-west-3", "AWS_REGION")),
        (None, {"AWS_DEFAULT_REGION": "us-west-1"}, "ap-south-1", ("us-west-1", "AWS_DEFAULT_REGION")),
        (None, {}, "ap-south-1", ("ap-south-1", "profile 'team'")),
        (None, {}, None, ("us-east-1", "default")),
    ],
)
def test_region_follows_the_aws_chain(
    clean_aws_env: pytest.MonkeyPatch, tmp_path: Path, key: str | None, env: dict[str, str],
    profile: str | None, expected: tuple[str, str],
) -> None:
    from ec_s3.store.connection import resolve_endpoint

    for name, value in env.items():
        clean_aws_env.setenv(name, value)
    if profile:
        _profile_file(tmp_path, clean_aws_env, "team", region=profile)
    extra = {"bucket": "b-1", **({"region": key} if key else {})}
    resolved = resolve_endpoint(ECS3Config.from_extra_config(extra, environ={}))
    assert resolved.region == expected[0] and resolved.region_source.startswith(expected[1])


def test_client_and_wire_sign_for_the_region_of_the_environment(
    make_store: Callable[..., S3Store], clean_aws_env: pytest.MonkeyPatch,
) -> None:
    """Failed before: ``region`` defaulted to the literal us-east-1, passed explicitly."""
    clean_aws_env.setenv("AWS_REGION", "eu-west-3")
    store = make_store()
    assert store.config.region is None
    store.run(store.put_async("r/k", b"x"), timeout=30)
    assert store._transport.client.meta.region_name == "eu-west-3"
    assert getattr(store._transport, "wire", None) is not None and getattr(store._transport, "wire", None)._region == "eu-west-3"


def test_check_prints_region_and_ca_with_their_sources(
    s3_endpoint: Any, bucket: str, https_endpoint: HTTPSEndpoint, clean_aws_env: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from ec_s3.cli import main as cli

    for name, value in {"EC_S3_BUCKET": bucket, "EC_S3_ENDPOINT_URL": https_endpoint.url,
                        "AWS_ACCESS_KEY_ID": s3_endpoint.credentials.access_key_id,
                        "AWS_SECRET_ACCESS_KEY": s3_endpoint.credentials.secret_access_key,
                        "AWS_DEFAULT_REGION": "eu-central-1", "AWS_CA_BUNDLE": str(https_endpoint.ca_path)}.items():
        clean_aws_env.setenv(name, value)
    capsys.readouterr()
    assert cli.main(["check"]) == 0
    out = capsys.readouterr().out
    assert "region: eu-central-1 (from AWS_DEFAULT_REGION)" in out
    assert f"tls: certificate checked against {https_endpoint.ca_path} (from AWS_CA_BUNDLE)" in out
    assert cli.main(["check", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["region"] == "eu-central-1" and report["region_source"] == "AWS_DEFAULT_REGION"
    assert report["tls_ca"] == str(https_endpoint.ca_path) and report["tls_ca_source"] == "AWS_CA_BUNDLE"


# ---------------------------------------------------------------------------- TLS host names
def _front(s3_endpoint: Any, tmp_path: Path, *names: str) -> tuple[Any, Path]:
    """A TLS front on 127.0.0.1 whose certificate (signed by a CA made here) names ``names``."""
    from support.tls import TLSFront

    ca = make_private_ca(tmp_path / "names", server_names=names)
    return TLSFront(s3_endpoint.url, ca.server_context()).start(), ca.ca_path


def test_a_certificate_for_another_name_is_refused(
    make_store: Callable[..., S3Store], s3_endpoint: Any, clean_aws_env: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """Failed before (both paths, GET and HEAD): a certificate for wrong.example, signed by
    the trusted CA, was accepted for https://127.0.0.1 and the bytes came back: neither
    path checked the host name. Now a typed UntrustedCertificate, not retried, whose
    diagnosis names the host and the names the certificate carries."""
    from ec_s3.store.errors import CertificateNameMismatch

    front, ca_path = _front(s3_endpoint, tmp_path, "DNS:wrong.example")
    try:
        plain = make_store(s3_endpoint.url)
        plain.run(plain.put_async("names/k", b"secret bytes"), timeout=30)
        store = make_store(front.url, ca_bundle=str(ca_path))  # max_attempts: 4
        for op, call in (("GET", lambda: store.get_async("names/k")), ("HEAD", lambda: store.head_async("names/k"))):
            with pytest.raises(UntrustedCertificate) as caught:
                store.run(call(), timeout=30)
            assert isinstance(caught.value, CertificateNameMismatch) and not caught.value.transient
            assert store.stats.retries == 0
            d = diagnose(caught.value, store.config, op=op)
            assert d.kind == "tls" and "127.0.0.1" in d.cause and "wrong.example" in d.cause, d
            assert "verify_tls" in d.fix
        # verify_tls: false stays the one way out
        off = make_store(front.url, ca_bundle=str(ca_path), verify_tls=False)
        assert bytes(off.run(off.get_async("names/k"), timeout=30)) == b"secret bytes"
    finally:
        front.stop()


@pytest.mark.parametrize("names", [("IP:127.0.0.1",), ("DNS:localhost",)], ids=["IP SAN", "DNS name"])
def test_a_certificate_for_the_right_name_is_accepted(
    make_store: Callable[..., S3Store], s3_endpoint: Any, clean_aws_env: pytest.MonkeyPatch, tmp_path: Path,
    names: tuple[str, ...],
) -> None:
    """The right IP as an IP SAN, for https://127.0.0.1; a DNS name resolved to loopback,
    for https://localhost."""
    front, ca_path = _front(s3_endpoint, tmp_path, *names)
    try:
        url = front.url if names[0].startswith("IP:") else front.url.replace("127.0.0.1", "localhost")
        _round_trip(make_store(url, ca_bundle=str(ca_path), max_attempts=1))
    finally:
        front.stop()


def test_check_says_tls_is_off_with_verify_tls_false(make_config: Callable[..., ECS3Config],
                                                      https_endpoint: HTTPSEndpoint) -> None:
    from ec_s3.cli.capabilities import static_rows
    from ec_s3.store.connection import resolve_endpoint

    config = make_config(https_endpoint.url, verify_tls=False)
    row = static_rows(config, resolve_endpoint(config))[0]
    assert row.status != "ok" and "verify_tls: false" in row.detail and "host name" in row.detail
    assert "host name" in resolve_endpoint(config).tls_words(config.endpoint_url)
