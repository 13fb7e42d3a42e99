"""The store's own configuration: the keys of :class:`~ec_s3.config.ECS3Config` the store reads.

Owns :class:`StoreConfig` (a frozen copy of the store's keys, validated already by
``ECS3Config``) and :func:`shared_key`, the identity the cache of shared stores is keyed by,
each secret as a keyed digest. Does not own parsing or validating keys (:mod:`ec_s3.config`)
nor the cache itself (:mod:`.client`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets
from typing import Any

from ec_s3.config import ECS3Config, Secret

__all__ = ["SharedKey", "StoreConfig", "shared_key"]

SharedKey = tuple[tuple[str, Any], ...]
_KEY_SALT = secrets.token_bytes(16)  # per process: a shared key is no stable hash of a secret


@dataclasses.dataclass(frozen=True)
class StoreConfig:
    """The keys the store reads; their meaning and defaults are ECS3Config's."""

    bucket: str
    prefix: str
    namespace: str | None
    endpoint_url: str | None
    region: str | None
    access_key_id: Secret | None
    secret_access_key: Secret | None
    session_token: Secret | None
    addressing_style: str
    verify_tls: bool
    ca_bundle: str | None
    checksum_algorithm: str
    connect_timeout_s: float
    read_timeout_s: float
    request_timeout_s: float
    max_attempts: int
    retry_base_delay_s: float
    retry_max_delay_s: float
    max_concurrency: int
    max_pool_connections: int
    multipart_threshold_bytes: int
    multipart_part_bytes: int
    get_range_bytes: int
    hedge_after_factor: float
    max_hedges_in_flight: int
    max_blob_bytes: int
    breaker_threshold: int
    breaker_cooldown_s: float

    @classmethod
    def of(cls, config: ECS3Config | StoreConfig) -> StoreConfig:
        if isinstance(config, StoreConfig):
            return config
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


def shared_key(config: StoreConfig) -> SharedKey:
    """The identity of a store configuration: every field, each secret as a keyed digest.

    Two configs that differ only in credentials must get two clients (one client would
    sign both with the first one's keys), yet the key must not hold a secret in clear
    where a repr or a log could show it.
    """

    def comparable(value: Any) -> Any:
        if isinstance(value, Secret):
            return "hmac-sha256:" + hmac.new(_KEY_SALT, value.reveal().encode(), hashlib.sha256).hexdigest()
        try:
            hash(value)
        except TypeError:
            return repr(value)
        return value

    return tuple((f.name, comparable(getattr(config, f.name))) for f in dataclasses.fields(config))
