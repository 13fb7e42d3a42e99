"""The aiobotocore S3 client of one store: credentials, timeouts, signing, pool.

Owns how a client is built from an :class:`~ec_s3.config.ECS3Config` (botocore's payload
signing, checksums and retries off: docs/architecture.md says why) and :func:`resolve_endpoint`:
the region and the CA the AWS chain gives this store, each with where it came from, resolved
once and passed to the client and the direct data path alike. Does not own requests, retries
or errors (:mod:`ec_s3.store.client`, :mod:`ec_s3.store.errors`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import ssl
import threading
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiobotocore.config import AioConfig
from aiobotocore.credentials import AioCredentials, AioRefreshableCredentials
from aiobotocore.httpsession import AIOHTTPSession
from aiobotocore.session import AioSession
from botocore.exceptions import NoCredentialsError
from botocore.httpsession import get_cert_path
from botocore.session import Session as BotocoreSession
from botocore.utils import get_environ_proxies

from ec_s3.config import ECS3Config
from ec_s3.store.credentials import end_abandoned_credential_processes
from ec_s3.store.http1 import parse_timestamp_or_none
from ec_s3.store.tls import DEFAULT_CA_SOURCE, Trust, botocore_verify, check_ca_file

__all__ = ["Credentials", "EndpointSettings", "open_client", "resolve_endpoint"]

#: What a session's chain resolves to (each with an awaitable ``get_frozen_credentials``).
Credentials = AioCredentials | AioRefreshableCredentials

# What botocore itself falls back to for S3 when no region is found anywhere.
DEFAULT_REGION = "us-east-1"

_LOADER_LOCK = threading.Lock()
_loader: Any = None  # botocore's data loader, shared by every client of the process


@dataclasses.dataclass(frozen=True)
class EndpointSettings:
    """What a store resolved from its config and the AWS chain; sources in words."""

    region: str
    region_source: str  # "`region` key", "AWS_REGION", "AWS_DEFAULT_REGION", "profile 'x' (...)", "default (...)"
    trust: Trust

    @property
    def ca_file(self) -> str | None:
        return self.trust.ca_file

    @property
    def ca_source(self) -> str:
        return self.trust.source

    def tls_words(self, endpoint_url: str | None) -> str:
        """What TLS does toward ``endpoint_url`` (None: AWS, https), in one phrase."""
        if endpoint_url is not None and endpoint_url.startswith("http://"):
            return "not used (http endpoint)"
        if not self.trust.verify:
            return "encrypted, certificate and host name not verified (verify_tls: false)"
        # Said before any request: what the certificate will be checked against, not that it passed.
        return f"certificate checked against {self.trust.ca_file} (from {self.trust.source})"


def resolve_endpoint(config: ECS3Config) -> EndpointSettings:
    """The region and the CA this store uses, and where each came from. Reads the
    process environment and the AWS config file as botocore does; does no network I/O
    and never raises (a missing profile is the client's to report).

    Region: the ``region`` key, ``AWS_REGION`` (as the AWS CLI v2 and the other SDKs;
    botocore itself skips it), ``AWS_DEFAULT_REGION``, the profile's ``region``, else
    ``us-east-1``. CA: ``verify_tls: false`` (none), the ``ca_bundle`` key,
    ``AWS_CA_BUNDLE``, the profile's ``ca_bundle``, ``REQUESTS_CA_BUNDLE`` (botocore's
    fallback), else certifi's. Empty variables count as unset (botocore would take an
    empty ``AWS_CA_BUNDLE`` for "do not verify").
    """
    # Only the profile is read: without its ~40 ms of built-in event handlers.
    env, session = os.environ, BotocoreSession(include_builtin_handlers=False)
    region, region_source = config.region, "`region` key"
    for var in ("AWS_REGION", "AWS_DEFAULT_REGION"):
        if not region and env.get(var):
            region, region_source = env[var], var
    if not region and (profile_region := _profile_setting(session, "region")):
        region, region_source = profile_region, _profile_words(session, "region")
    if not region:
        region = DEFAULT_REGION
        region_source = "default (no `region` key, AWS_REGION, AWS_DEFAULT_REGION or profile region)"
    return EndpointSettings(region, region_source, _resolve_trust(config, session))


def _resolve_trust(config: ECS3Config, session: BotocoreSession) -> Trust:
    env = os.environ
    if not config.verify_tls:
        return Trust(False, None, "verify_tls: false")
    if config.ca_bundle:
        return Trust(True, config.ca_bundle, "`ca_bundle` key")
    if env.get("AWS_CA_BUNDLE"):
        return Trust(True, env["AWS_CA_BUNDLE"], "AWS_CA_BUNDLE")
    if profile_ca := _profile_setting(session, "ca_bundle"):
        return Trust(True, profile_ca, _profile_words(session, "ca_bundle"))
    if env.get("REQUESTS_CA_BUNDLE"):
        return Trust(True, env["REQUESTS_CA_BUNDLE"], "REQUESTS_CA_BUNDLE")
    return Trust(True, str(get_cert_path(True)), DEFAULT_CA_SOURCE)


def _profile_setting(session: BotocoreSession, name: str) -> str | None:
    """A setting of the session's profile; None when unset, or when the profile does
    not exist or its file cannot be parsed (creating the client reports that)."""
    try:
        value = session.get_scoped_config().get(name)
    except Exception:  # noqa: BLE001 - ProfileNotFound, ConfigParseError: the client's to report
        return None
    return str(value) if value else None


def _profile_words(session: BotocoreSession, name: str) -> str:
    """``profile 'x' (<name> in <file>)``."""
    profile = session.get_config_variable("profile") or "default"
    path = os.path.expanduser(str(session.get_config_variable("config_file")))
    return f"profile {profile!r} ({name} in {path})"


class BoundedPoolSession(AIOHTTPSession):
    """aiobotocore's aiohttp session with a deadline on getting a connection, and TLS
    that checks the host name.

    aiobotocore hands aiohttp only ``sock_connect`` and ``sock_read`` timeouts. aiohttp
    bounds its wait for a free pooled connection (and DNS) by ``ClientTimeout.connect``
    alone, which stays unset: once every pooled connection is held, the next request
    waits forever, and so does every request after it. Here that wait is bounded by
    connect + read timeout; running out raises aiohttp's ``ConnectionTimeoutError``,
    which the store reports as :class:`~ec_s3.store.errors.StoreUnreachable`.
    """

    def __init__(self, *args: Any, timeout: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, timeout=timeout, **kwargs)
        connect, read = timeout if isinstance(timeout, (list, tuple)) else (timeout, timeout)
        if connect is not None and read is not None:
            # No public hook: _timeout is what aiobotocore passes to its aiohttp.ClientSession.
            self._timeout = aiohttp.ClientTimeout(sock_connect=connect, sock_read=read, connect=connect + read)

    def _get_ssl_context(self) -> ssl.SSLContext:  # no public hook for the context's settings
        # aiobotocore's is urllib3's, with check_hostname off (urllib3 matches the name
        # itself; aiohttp does not): any certificate its CA signed was accepted.
        context = super()._get_ssl_context()
        context.check_hostname = True
        return context

    def _setup_proxy_ssl_context(self, proxy_url: str) -> ssl.SSLContext | None:  # nor for the proxy's
        # Without proxy CA settings aiobotocore gives its connector no context, and
        # aiohttp then verifies nothing of the endpoint reached through the proxy.
        return super()._setup_proxy_ssl_context(proxy_url) or self._get_ssl_context()


def _botocore_session() -> AioSession:
    """A fresh botocore session (credentials and config stay per client) reading
    botocore's data through the process's one loader.

    A session of its own re-reads and re-parses the S3 service model, its endpoint
    rules and the partitions: JSON that is most of the time a client takes to build,
    paid again by each store of a process (the start-up check's, the connector's, a
    CLI's). The loader caches that read-only data; botocore itself shares one loader
    between the clients of a session, and it holds no event-loop state.
    """
    global _loader
    session = AioSession()
    # A Last-Modified that is no date must not fail the whole answer (store/http1.py).
    session.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=parse_timestamp_or_none)
    with _LOADER_LOCK:
        if _loader is None:
            _loader = session.get_component("data_loader")
        else:
            session.register_component("data_loader", _loader)
    return session


def _speaks_tls(config: ECS3Config) -> bool:
    """Whether the client may speak TLS: not to an ``http://`` endpoint without a proxy
    (which may be HTTPS). Where it cannot, no CA file is loaded: each load costs tens of
    ms of the first request, and aiobotocore would do it even for ``http://``."""
    url = config.endpoint_url
    return not (url is not None and urlsplit(url).scheme == "http" and not get_environ_proxies(url))


async def open_client(
    config: ECS3Config, stack: contextlib.AsyncExitStack, settings: EndpointSettings | None = None
) -> tuple[Any, Credentials]:
    """A new S3 client for ``config``, closed when ``stack`` closes, with the region and
    CA of ``settings`` (default: :func:`resolve_endpoint`), and the credentials it signs
    with: the config's keys, else the AWS chain's, resolved here once (a refreshable
    set rotates under the same object). No network I/O but the chain's; a CA file that
    cannot be loaded raises :class:`~ec_s3.store.errors.CABundleError`, no credentials
    anywhere botocore's ``NoCredentialsError`` (mapped to ``NoCredentials``)."""
    settings = settings or resolve_endpoint(config)
    tls = _speaks_tls(config)
    if tls:
        check_ca_file(settings.trust)
    botocore_session = _botocore_session()
    if config.access_key_id is not None and config.secret_access_key is not None:
        botocore_session.set_credentials(config.access_key_id.reveal(), config.secret_access_key.reveal(),
                                         config.session_token.reveal() if config.session_token else None)
    else:  # the chain resolves them: a credential_process may run
        end_abandoned_credential_processes(botocore_session)
    # The session keeps what it resolved: create_client signs with this same object.
    credentials = await botocore_session.get_credentials()
    if credentials is None:
        raise NoCredentialsError()  # at connect, not as every request's failure
    # aiobotocore's own call (aioboto3's Session.client is this plus boto3's resource layer).
    client = await stack.enter_async_context(botocore_session.create_client(
        "s3",
        region_name=settings.region,
        endpoint_url=config.endpoint_url,
        verify=botocore_verify(settings.trust) if tls else False,
        config=_client_config(config, settings),
    ))
    return client, credentials


def _client_config(config: ECS3Config, settings: EndpointSettings) -> AioConfig:
    return AioConfig(
        region_name=settings.region,
        signature_version="s3v4",
        s3={"addressing_style": config.addressing_style, "payload_signing_enabled": False},
        retries={"total_max_attempts": 1, "mode": "standard"},
        connect_timeout=config.connect_timeout_s,
        read_timeout=config.read_timeout_s,
        max_pool_connections=config.max_pool_connections,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        tcp_keepalive=True,
        http_session_cls=BoundedPoolSession,
    )
