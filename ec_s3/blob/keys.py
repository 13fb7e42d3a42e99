"""Object keys: where a blob lives in the bucket.

``<prefix>/<namespace>/<digest>.safetensors``. The namespace names the model the
encoder output belongs to, so two models never share blobs; the digest is SHA-256 of
the item identifier. A client can choose the identifier (vLLM uses a request's
``multi_modal_uuids`` verbatim), so no client-controlled string ever reaches a key:
``/``, ``..``, NUL, 4 KiB or unicode identifiers cannot escape the namespace or collide.
"""

from __future__ import annotations

import hashlib
import re

from ec_s3.blob.format import BLOB_NAME_RE, BLOB_SUFFIX, FORMAT_VERSION, identifier_digest

__all__ = ["BLOB_SUFFIX", "PROBE_NAMESPACE", "KeySpace", "identifier_digest", "model_namespace", "probe_key", "tenant_tag"]

#: Objects written by start-up checks, ``ec-s3 check`` and ``ec-s3 bench`` live under
#: ``<prefix>/_ec_s3_probe/``; no namespace can be named so (namespaces end in a hash).
PROBE_NAMESPACE = "_ec_s3_probe"

_SLUG_UNSAFE = re.compile(r"[^a-z0-9._-]+")


def tenant_tag(cache_salt: str) -> str:
    """A short, non-reversible tag for a vLLM ``cache_salt`` (never stored verbatim)."""
    return "t-" + hashlib.sha256(b"ec-s3 cache_salt\0" + cache_salt.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def model_namespace(
    model: str,
    *,
    revision: str | None,
    dtype: str,
    encoder_width: int | None,
    format_version: str = FORMAT_VERSION,
) -> str:
    """A readable, collision-resistant namespace for one model's encoder outputs.

    The readable slug helps operators; the hash over every field is what separates
    namespaces, so two paths that slug alike still differ.
    """
    fields = "\0".join(
        [model, revision or "", dtype, str(encoder_width or ""), format_version]
    )
    slug = _SLUG_UNSAFE.sub("-", model.rstrip("/").rsplit("/", 1)[-1].lower()).strip("-.")
    slug = slug[:48] or "model"
    return f"{slug}-{hashlib.sha256(fields.encode('utf-8', 'surrogatepass')).hexdigest()[:16]}"


def probe_key(prefix: str, name: str = "write-check") -> str:
    """The key of a probe object under ``prefix``."""
    return f"{prefix.strip('/')}/{PROBE_NAMESPACE}/{name}"


class KeySpace:
    """Maps identifiers to keys under one ``<prefix>/<namespace>/``.

    ``key_for`` and ``owns`` are the only ways the connector turns identifiers into
    keys or accepts a key from elsewhere (e.g. ``ec_transfer_params``): a key it does
    not own is never read.
    """

    def __init__(self, prefix: str, namespace: str) -> None:
        self.prefix = prefix.strip("/")
        self.namespace = namespace.strip("/")
        self.root = f"{self.prefix}/{self.namespace}/"

    def key_for(self, identifier: str, *, cache_salt: str | None = None) -> str:
        digest = identifier_digest(identifier)
        if cache_salt:
            return f"{self.root}{tenant_tag(cache_salt)}/{digest}{BLOB_SUFFIX}"
        return f"{self.root}{digest}{BLOB_SUFFIX}"

    def owns(self, key: object) -> bool:
        """True if ``key`` is a well-formed blob key under this namespace."""
        if not isinstance(key, str) or not key.startswith(self.root):
            return False
        return BLOB_NAME_RE.fullmatch(key[len(self.root):]) is not None

    def __repr__(self) -> str:
        return f"KeySpace(root={self.root!r})"
