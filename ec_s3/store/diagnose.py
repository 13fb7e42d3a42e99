"""Diagnoses: a failed S3 call in an operator's words, a cause and a fix.

Owns the wording, the same for the connector's start-up checks (:mod:`ec_s3.connector.preflight`)
and ``ec-s3 check``, read off the error's class and its ``status``/``code`` fields (at most one
bounded probe more, never on the store's loop). Does not classify exceptions
(:func:`ec_s3.store.error_map.to_store_error` does), retry, log or decide whether a failure is
fatal.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import urllib.error
import urllib.request
from collections.abc import Mapping

from botocore.configloader import load_config

from ec_s3.config import ECS3Config
from ec_s3.store.connection import resolve_endpoint
from ec_s3.store.errors import (
    AccessDenied,
    BucketNotFound,
    CABundleError,
    CertificateNameMismatch,
    CircuitOpen,
    CredentialsTimeout,
    NoCredentials,
    ObjectNotFound,
    StoreConfigError,
    StoreRequestError,
    StoreTimeout,
    StoreUnavailable,
    StoreUnreachable,
    TLSError,
    UntrustedCertificate,
)
from ec_s3.store.error_map import to_store_error
from ec_s3.store.tls import certificate_names

__all__ = ["Diagnosis", "credential_source", "diagnose"]


# A profile's settings that name where its credentials come from, in the order botocore tries them.
_PROFILE_SOURCES = ("aws_access_key_id", "role_arn", "web_identity_token_file", "sso_session", "sso_start_url",
                    "credential_process")


def credential_source(config: ECS3Config, environ: Mapping[str, str] | None = None) -> str:
    """Where the credentials come from, in words (with what the profile runs, when its
    config file says: ``credential_process``, ``role_arn``, SSO); never the credentials."""
    env = os.environ if environ is None else environ
    if config.access_key_id is not None:
        return "explicit (access_key_id/secret_access_key in the config)"
    if env.get("AWS_ACCESS_KEY_ID"):
        return "environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)"
    if env.get("AWS_PROFILE"):
        setting, path = _profile_source(env, env["AWS_PROFILE"])
        return f"AWS profile {env['AWS_PROFILE']!r}" + (f": {setting} (in {path})" if setting else "")
    setting, path = _profile_source(env, "default")
    if setting:
        return f"AWS default chain: {setting} of profile 'default' (in {path})"
    return "AWS default chain (shared credentials file, SSO, container or instance role)"


def _profile_source(env: Mapping[str, str], profile: str) -> tuple[str | None, str]:
    """The setting of ``profile`` in the AWS config file that gives its credentials, and
    the file; None when the file or the profile cannot be read or names none."""
    path = os.path.expanduser(env.get("AWS_CONFIG_FILE") or "~/.aws/config")
    try:
        settings = load_config(path)["profiles"].get(profile) or {}
    except Exception:  # noqa: BLE001 - missing or unparsable: the client's to report
        return None, path
    return next((name for name in _PROFILE_SOURCES if settings.get(name)), None), path


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """Why an S3 call failed, in an operator's words, and what to do about it."""

    kind: str  # credentials | no_credentials | bucket | endpoint | tls | permission | region | clock | server | other
    cause: str
    fix: str


_BUCKET_PERMISSIONS = ("s3:ListBucket", "s3:CreateBucket")  # granted on the bucket's ARN, not its objects'
_PERMISSION_FOR_OP = {
    "LIST": "s3:ListBucket",
    "HEAD": "s3:GetObject",
    "GET": "s3:GetObject",
    "PUT": "s3:PutObject",
    "DELETE": "s3:DeleteObject",
    "DeleteObjects": "s3:DeleteObject",
    "CreateBucket": "s3:CreateBucket",
    "PutLifecycle": "s3:PutLifecycleConfiguration",
    "GetLifecycle": "s3:GetLifecycleConfiguration",
}


_REGION_CODES = frozenset({"PermanentRedirect", "AuthorizationHeaderMalformed", "IllegalLocationConstraintException"})
_TOKEN_CODES = frozenset({"InvalidToken", "ExpiredToken", "TokenRefreshRequired"})


def diagnose(exc: BaseException, config: ECS3Config, *, op: str = "") -> Diagnosis:
    """Map a failed S3 call to a cause and a fix.

    Takes a :class:`StoreError` or a raw transport exception (from code that used the
    client directly), which goes through the store's one mapping first; it reads the
    error's class and its ``status``/``code`` fields, never its text.
    """
    error = to_store_error(op, "", exc)
    if error is None:
        if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
            return Diagnosis("endpoint", f"no answer from {_endpoint(config)} in time", "check the endpoint and the network")
        return Diagnosis("other", f"{type(exc).__name__}: {exc}", "check the config and the S3 server")
    if isinstance(error, CredentialsTimeout):
        return Diagnosis("no_credentials", f"the credential source did not answer in time ({error.message})",
                         f"make {credential_source(config)} answer within request_timeout_s="
                         f"{config.request_timeout_s:g}s, raise request_timeout_s, or set "
                         "access_key_id/secret_access_key in ec_connector_extra_config")
    if isinstance(error, NoCredentials):
        return Diagnosis(
            "no_credentials",
            f"no S3 credentials found ({error.message})",
            "export AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or set "
            "access_key_id/secret_access_key in ec_connector_extra_config",
        )
    if isinstance(error, StoreUnavailable):
        return _unavailable(error, config)
    if isinstance(error, AccessDenied):
        return _denied(error, config, op or error.op)
    if isinstance(error, CABundleError):
        source = resolve_endpoint(config).ca_source
        return Diagnosis("tls", error.message, f"make {source} name a readable PEM file of the CA(s) that "
                         f"signed {_endpoint(config)}'s certificate")
    if isinstance(error, (StoreRequestError, ObjectNotFound)):
        return _request(error, config)
    return Diagnosis("other", str(error), "check the config and the S3 server")


def _endpoint(config: ECS3Config) -> str:
    return config.endpoint_url or f"AWS S3 ({resolve_endpoint(config).region})"


def _tls(error: TLSError, config: ECS3Config) -> Diagnosis:
    """A failed handshake, with the CA it was checked against (the one the store
    resolved: :func:`~ec_s3.store.connection.resolve_endpoint`) and what to change."""
    endpoint, trust = _endpoint(config), resolve_endpoint(config).trust
    failed = f"TLS handshake with {endpoint} failed ({error.message})"
    port = "check that endpoint_url is https on the server's TLS port and names a host its certificate covers"
    if not isinstance(error, UntrustedCertificate):
        return Diagnosis(
            "tls", f"{failed}, not at the certificate check: the server there does not speak TLS (a plain-HTTP "
                   "port?) or shares no TLS version with this client",
            "use http:// for a plain-HTTP port, or the server's TLS port for https:// (endpoint_url)",
        )
    if isinstance(error, CertificateNameMismatch):
        return _name_mismatch(error, config, failed)
    if trust.is_default:
        return Diagnosis(
            "tls",
            f"{failed}; its certificate was checked against {trust.ca_file} ({trust.source}): a private CA is not among them",
            "trust the CA that signed the endpoint's certificate: set ca_bundle to its PEM file (or AWS_CA_BUNDLE, "
            f"or ca_bundle in the AWS profile); {port}; --set verify_tls=false for a test endpoint only",
        )
    return Diagnosis(
        "tls",
        f"{failed}; its certificate was checked against {trust.ca_file} (from {trust.source})",
        f"{trust.ca_file} does not hold the CA that signed {endpoint}'s certificate: put that CA's PEM in it, or "
        f"change where it came from ({trust.source}) to the right file; {port}",
    )


def _name_mismatch(error: CertificateNameMismatch, config: ECS3Config, failed: str) -> Diagnosis:
    """A trusted certificate for another name: which names it carries (read by one more
    handshake, names unchecked) against the host that was asked for."""
    trust, host = resolve_endpoint(config).trust, error.host or "the endpoint's host"
    names = certificate_names(error.host, error.port, trust, config.connect_timeout_s) if error.host else None
    carries = ", ".join(names) if names else "names that could not be read again"
    return Diagnosis(
        "tls",
        f"{failed}: the certificate of {host} (signed by a CA in {trust.ca_file}, from {trust.source}) is for "
        f"{carries}, not for {host}: another server answers there, or one in the middle",
        f"use an endpoint_url whose host the certificate names, or give {host} a certificate that names it "
        "(a DNS name or an IP address SAN); --set verify_tls=false for a test endpoint only",
    )


def _unavailable(error: StoreUnavailable, config: ECS3Config) -> Diagnosis:
    endpoint = _endpoint(config)
    if isinstance(error, CircuitOpen):
        return Diagnosis(
            "endpoint",
            f"{endpoint} failed repeatedly, so further requests were not tried (circuit breaker open)",
            "run `ec-s3 check` to see the first failure; check the endpoint and retry",
        )
    if isinstance(error, TLSError):
        return _tls(error, config)
    if isinstance(error, StoreUnreachable):
        return Diagnosis(
            "endpoint",
            f"cannot reach the S3 endpoint {endpoint} ({error.message})",
            "check endpoint_url (--endpoint-url or EC_S3_ENDPOINT_URL): host, port and "
            "http/https, that the S3 server is running, and that no firewall or proxy "
            "(HTTP_PROXY/HTTPS_PROXY) blocks this host",
        )
    if isinstance(error, StoreTimeout):
        return Diagnosis(
            "endpoint",
            f"the S3 endpoint {endpoint} did not answer in time ({error.message})",
            "check that endpoint_url points at an S3 server (not another service) and that it is "
            "healthy; raise read_timeout_s/connect_timeout_s for a slow link",
        )
    return Diagnosis(
        "server",
        f"the S3 server kept failing ({error.reason}) after {config.max_attempts} attempts",
        "check the S3 server's health and logs, then retry",
    )


def _denied(error: AccessDenied, config: ECS3Config, op: str) -> Diagnosis:
    code, bucket = error.code, config.bucket
    if code == "InvalidAccessKeyId":
        return Diagnosis(
            "credentials",
            "wrong credentials: the endpoint does not know this access key id (403 InvalidAccessKeyId)",
            "set the access key of an account on this endpoint (AWS_ACCESS_KEY_ID / "
            "access_key_id); check that the endpoint URL is the one the key belongs to",
        )
    if code == "SignatureDoesNotMatch":
        return Diagnosis(
            "credentials",
            "wrong credentials: the secret key does not match the access key (403 SignatureDoesNotMatch)",
            "set the matching secret key (AWS_SECRET_ACCESS_KEY / secret_access_key); also check "
            "the region and that no proxy rewrites the request",
        )
    if code == "RequestTimeTooSkewed":
        return Diagnosis("clock", "this host's clock is too far off the server's (403 RequestTimeTooSkewed)",
                         "sync the clock (NTP) and retry")
    if code in _TOKEN_CODES:
        return Diagnosis("credentials", f"the session token is invalid or expired ({error.status} {code})",
                         "refresh the temporary credentials (AWS_SESSION_TOKEN / session_token)")
    permission = _PERMISSION_FOR_OP.get(op, f"the permission for {error.op}")
    if code is None:  # a HEAD answer carries no body, hence no code
        return Diagnosis(
            "permission",
            f"{error.op} was refused with a bare {error.status or 403}: wrong credentials or missing {permission}"
            + (" / s3:ListBucket" if error.op == "HEAD" else ""),
            f"check the credentials, then grant {permission} on arn:aws:s3:::{bucket}/{config.prefix}/*"
            + (" and s3:ListBucket on the bucket (without it a missing key answers 403, not 404)"
               if error.op == "HEAD" else ""),
        )
    return Diagnosis(
        "permission",
        f"permission missing: {error.op} was refused ({error.status or 403} {code}); it needs {permission}",
        f"grant {permission} on "
        + (f"arn:aws:s3:::{bucket}" if permission in _BUCKET_PERMISSIONS else f"arn:aws:s3:::{bucket}/{config.prefix}/*")
        + " to these credentials"
        + (" (or run `ec-s3 check --read-only` if this host only consumes)" if permission == "s3:PutObject" else ""),
    )


def _request(error: StoreRequestError | ObjectNotFound, config: ECS3Config) -> Diagnosis:
    bucket = config.bucket
    if isinstance(error, BucketNotFound) or (error.op == "HeadBucket" and isinstance(error, ObjectNotFound)):
        return Diagnosis(
            "bucket",
            f"missing bucket: {bucket!r} does not exist at {_endpoint(config)} (404 NoSuchBucket)",
            f"create it (`ec-s3 check --create-bucket` with these settings, or `aws s3 mb s3://{bucket}"
            + (f" --endpoint-url {config.endpoint_url}`)" if config.endpoint_url else "`)")
            + " or fix the bucket name (--bucket / EC_S3_BUCKET / bucket in the config)",
        )
    if error.code == "BucketAlreadyExists":
        return Diagnosis("bucket", f"the bucket name {bucket!r} is taken by another account (409 BucketAlreadyExists)",
                         "bucket names are global on AWS S3: choose another name (--bucket / bucket in the config)")
    if error.code in _REGION_CODES or error.status == 301:
        return Diagnosis("region", f"the bucket lives in another region ({error.reason})",
                         "set the bucket's region (--region / region in the config)")
    if error.code == "InvalidBucketName":
        return Diagnosis("bucket", f"the server rejects the bucket name {bucket!r} ({error.reason})",
                         "use a valid bucket name")
    if isinstance(error, StoreConfigError):
        return Diagnosis("other", f"the S3 client cannot build the request ({error.message})",
                         "check endpoint_url, region and addressing_style in the config")
    if error.code is None and (error.status or 0) >= 400:
        return _not_s3(error, config)
    return Diagnosis("other", f"{error.op} failed: {error.reason}", "see the S3 error code above; check the config")


def _not_s3(error: StoreRequestError | ObjectNotFound, config: ECS3Config) -> Diagnosis:
    """An error answer without an S3 error code: another service, or a TLS port spoken to
    in plain http. What its body says (one more GET) is the evidence."""
    endpoint = _endpoint(config)
    words = _server_words(config.endpoint_url, config.connect_timeout_s + config.read_timeout_s)
    says = f"; the server says: {words!r}" if words else ""
    cause = f"{error.op} failed: {error.reason}, not an S3 error answer{says}"
    url = config.endpoint_url or ""
    if url.startswith("http://") and any(w in (words or "").lower() for w in ("https", "tls", "ssl")):
        return Diagnosis("endpoint", cause, f"the server at {endpoint} speaks TLS: use "
                         f"endpoint_url={'https://' + url[len('http://'):]!r} (--endpoint-url / EC_S3_ENDPOINT_URL)")
    return Diagnosis("endpoint", cause, f"check that endpoint_url ({endpoint}) is an S3 endpoint, with the right "
                     "port and http/https, not another service or a proxy in front of it")


def _server_words(endpoint_url: str | None, timeout: float) -> str | None:
    """The first line of what the endpoint answers a plain GET of ``/`` (at most 200
    characters); None when there is none or no answer."""
    if not endpoint_url:
        return None
    try:
        with urllib.request.urlopen(endpoint_url.rstrip("/") + "/", timeout=timeout) as answer:  # noqa: S310
            body = answer.read(2048)
    except urllib.error.HTTPError as exc:
        body = exc.read(2048)
    except Exception:  # noqa: BLE001 - no words: the diagnosis stands without them
        return None
    lines = body.decode("utf-8", "replace").strip().splitlines()
    return lines[0][:200] if lines else None
