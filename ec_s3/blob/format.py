"""The blob format's constants and key shape, without torch.

One home for what the codec (which needs torch), the keys, the store's ranged GET
and the CLI's gc must agree on: the format tag, the tensor name, the header bound,
the blob suffix and the pattern of a blob's name under a namespace. Owns no I/O and
no tensor code.
"""

from __future__ import annotations

import hashlib
import re

__all__ = [
    "BLOB_NAME_RE",
    "BLOB_SUFFIX",
    "FORMAT_TAG",
    "FORMAT_VERSION",
    "MAX_HEADER_BYTES",
    "MISSING_REPORT",
    "NAMESPACE_FIELD",
    "PENDING_MARK",
    "PLACEHOLDER_METADATA_KEY",
    "PRESENT_MARK",
    "PROBE_FIELD",
    "TENSOR_NAME",
    "identifier_digest",
]

FORMAT_VERSION = "1"
FORMAT_TAG = f"ec-s3/{FORMAT_VERSION}"
TENSOR_NAME = "ec_cache"
#: Upper bound of a blob's safetensors header (8-byte length + JSON); the store's
#: first ranged GET reads this much so most blobs need one request.
MAX_HEADER_BYTES = 64 * 1024
BLOB_SUFFIX = ".safetensors"
#: A blob's path below ``<prefix>/<namespace>/``: an optional tenant tag (for requests
#: with a ``cache_salt``), then the identifier's SHA-256.
BLOB_NAME_RE = re.compile(r"(?:t-[0-9a-f]{32}/)?[0-9a-f]{64}\.safetensors")
#: The field of an ``ec_transfer_params`` entry that marks an item as *pending*: an
#: encoder is encoding it while prefill/decode already has the request (the proxy's
#: parallel dispatch). Written by ``ec_s3.proxy``, read by ``ec_s3.connector``; here
#: because both may import this module and neither may import the other.
PENDING_MARK = "ec_s3_pending"
#: The field that marks an entry as *present*: the proxy knows the blob is in the bucket
#: already (an encoder answered for it a while ago, or the proxy's HEAD found it), and
#: sent no encoder request. Unlike a pending item, a present one that the bucket does not
#: have is gone (gc, a lifecycle rule), not late: the consumer encodes it at once.
PRESENT_MARK = "ec_s3_present"
#: The field of a consumer's answer (its ``ec_transfer_params``) that lists the keys of
#: items marked present that the bucket did not have, so the proxy forgets them.
MISSING_REPORT = "ec_s3_missing"
#: The field of an ``ec_transfer_params`` entry (a producer's, or a proxy's mark) that
#: names where its blob is published: ``s3://<bucket>/<prefix>/<namespace>/``. A consumer
#: whose own location differs refuses the entry at once (the blob will never appear at its
#: key) instead of waiting ``promised_wait_s`` for it. Entries without it are checked by key.
NAMESPACE_FIELD = "ec_s3_namespace"
#: A request whose ``ec_transfer_params`` hold this field (``ec-s3 proxy``'s start-up
#: check) is answered, by a producer and a consumer alike, with ``{PROBE_FIELD: {"role":
#: <ec_role>, "namespace": <location>}}`` in its own ``ec_transfer_params``.
PROBE_FIELD = "ec_s3_probe"
#: The S3 object metadata (``x-amz-meta-…``) in which a producer stores an item's
#: placeholder metadata, ``{"modality": "image", "metadata": {"image_grid_thw": [1, 70,
#: 70]}}`` as compact JSON, for models that declare vLLM's ``embedding_fields``: a proxy
#: whose HEAD finds the blob can then send prefill/decode a metadata-only part.
PLACEHOLDER_METADATA_KEY = "ec-s3-placeholder"
#: S3 allows 2 KB of user metadata per object; placeholder metadata above this is not stored.
MAX_PLACEHOLDER_METADATA_BYTES = 1024


def identifier_digest(identifier: str) -> str:
    """SHA-256 hex of an identifier; lone surrogates are encoded, never rejected."""
    return hashlib.sha256(identifier.encode("utf-8", "surrogatepass")).hexdigest()
