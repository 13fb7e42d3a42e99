"""Typed, validated configuration of ec-s3.

Every key of ``ec_connector_extra_config`` is declared once here (type, default, bounds,
one-line doc), so parsing, validation, errors and the table in docs/config.md cannot
drift apart. A bad or unknown key fails at start-up naming it; secrets never appear in a
repr, log line or error, and credential keys accept ``env:NAME`` / ``file:/path``
references. Does not own how one value is parsed (:mod:`ec_s3.config_values`).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import textwrap
from collections.abc import Iterable, Mapping
from typing import Any, Literal, get_type_hints

from ec_s3.config_values import SECRET_KEYS, ConfigError, Secret, coerce, resolve_secret

__all__ = ["ConfigError", "ECS3Config", "Secret", "config_keys"]

MiB = 1 << 20
GiB = 1 << 30

# S3 requires every multipart part but the last to be at least 5 MiB.
_MIN_PART_SIZE = 5 * MiB
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_PREFIX_SEGMENT_RE = re.compile(r"^[A-Za-z0-9._\-]{1,128}$")
_CPU_RANGE_RE = re.compile(r"(\d{1,4})(?:-(\d{1,4}))?")

Backpressure = Literal["block", "drop"]
LookupPolicy = Literal["always", "promised"]
AddressingStyle = Literal["auto", "path", "virtual"]
ChecksumAlgorithm = Literal["none", "CRC32", "CRC32C", "SHA256"]
StartupCheck = Literal["fatal", "warn", "off"]
DataPath = Literal["direct"]

#: Why ``data_path: botocore`` is gone, and what to write instead (coerce() names the key).
_BOTOCORE_PATH_REMOVED = (
    "it was removed: measured on an emulated network, the direct path did the same requests with less client "
    "CPU, and two data paths doubled every store test; delete the key (or write `direct`)"
)


def _doc(text: str, **extra: Any) -> dict[str, Any]:
    return {"doc": text, **extra}


@dataclasses.dataclass(frozen=True)
class ECS3Config:
    """Everything ec-s3 reads from ``ec_connector_extra_config``."""

    # --- where blobs live -------------------------------------------------------
    bucket: str = dataclasses.field(
        default="", metadata=_doc("S3 bucket holding the blobs (required).")
    )
    prefix: str = dataclasses.field(
        default="ec-cache",
        metadata=_doc("Key prefix; blobs go to `<prefix>/<namespace>/<digest>.safetensors`."),
    )
    namespace: str | None = dataclasses.field(
        default=None,
        metadata=_doc(
            "Override the model namespace (default: derived from model, revision, dtype, "
            "encoder width and blob format). Set the same value on every instance when "
            "hosts load the same model from different paths."
        ),
    )
    endpoint_url: str | None = dataclasses.field(
        default=None,
        metadata=_doc("S3 endpoint, e.g. `http://minio:9000` (default: AWS for the region)."),
    )
    region: str | None = dataclasses.field(
        default=None,
        metadata=_doc(
            "Region used for signing (default: the AWS chain: `AWS_REGION`, `AWS_DEFAULT_REGION`, the profile's "
            "`region`; else `us-east-1`). `ec-s3 check` prints the one used and where it came from."
        ),
    )
    addressing_style: AddressingStyle = dataclasses.field(
        default="path",
        metadata=_doc("`path` (MinIO, SeaweedFS), `virtual` or `auto` (AWS)."),
    )
    access_key_id: Secret | None = dataclasses.field(
        default=None,
        metadata=_doc(
            "Explicit access key, or a reference `env:NAME` / `file:/path` (default: the standard AWS "
            "credential chain).", secret=True,
        ),
    )
    secret_access_key: Secret | None = dataclasses.field(
        default=None,
        metadata=_doc(
            "Explicit secret key: prefer `env:NAME` or `file:/path`; a literal value is visible in the "
            "engine's command line and vLLM's args log line (ec-s3 warns).", secret=True,
        ),
    )
    session_token: Secret | None = dataclasses.field(
        default=None, metadata=_doc("Explicit session token; `env:NAME` / `file:/path` as above.", secret=True)
    )
    verify_tls: bool = dataclasses.field(
        default=True, metadata=_doc("Verify the endpoint's TLS certificate (`false` disables it, whatever `ca_bundle` says).")
    )
    ca_bundle: str | None = dataclasses.field(
        default=None,
        metadata=_doc(
            "PEM file of the CA(s) to trust for the endpoint's certificate, e.g. an on-prem MinIO's private CA "
            "(default: the AWS chain: `AWS_CA_BUNDLE`, the profile's `ca_bundle`, `REQUESTS_CA_BUNDLE`; else "
            "certifi's public CAs). Used by the S3 API client and the blob pools alike."
        ),
    )
    # --- client tuning ----------------------------------------------------------
    max_pool_connections: int = dataclasses.field(
        default=32,
        metadata=_doc(
            "HTTP connections kept to the endpoint, per pool: the S3 API client, the "
            "blob PUT/HEAD pool and the GET pool (idle ones close after 12 s).", min=1, max=1024,
        ),
    )
    data_path: DataPath = dataclasses.field(
        default="direct",
        metadata=_doc(
            "Kept so that older configs still load: `direct` is the only value (HEAD, PUT, UploadPart and GET "
            "signed by ec-s3, `store/sigv4.py`, on its own aiohttp pool; other requests through aiobotocore). "
            "`botocore` was removed.",
            removed={"botocore": _BOTOCORE_PATH_REMOVED},
        ),
    )
    max_concurrency: int = dataclasses.field(
        default=16,
        metadata=_doc("S3 requests in flight at once per process (parts count singly).", min=1, max=1024),
    )
    # vLLM's CPU backend pins every thread of a worker to its OMP cores (one core per
    # worker by default): the I/O thread, started there, would share that core with the
    # model step and its busy-wait after each step (bench/epd_stack.py measures
    # what that costs an upload). GPU workers are not pinned: `auto` changes nothing there.
    io_cpus: str = dataclasses.field(
        default="auto",
        metadata=_doc(
            "CPUs ec-s3's I/O thread runs on: `auto` any CPU this host (cgroup) allows, `inherit` those of "
            "the thread that starts it (vLLM's CPU backend pins workers to single cores), or a list such as `0-3,8`."
        ),
    )
    multipart_threshold_bytes: int = dataclasses.field(
        default=16 * MiB,
        metadata=_doc("Blobs at or above this size use multipart upload.", min=_MIN_PART_SIZE),
    )
    multipart_part_bytes: int = dataclasses.field(
        default=8 * MiB,
        metadata=_doc("Part size of multipart uploads (>= 5 MiB).", min=_MIN_PART_SIZE, max=5 * GiB),
    )
    get_range_bytes: int = dataclasses.field(
        default=2 * MiB,
        metadata=_doc(
            "Bytes per ranged GET: a blob of known size is asked as all its ranges at once (at most "
            "`max_concurrency`). Right at about one connection's bandwidth x the store's first-byte latency "
            "(S3 Standard: ~90 MB/s x 20 ms); smaller ranges cost more requests, larger ones wait on one connection.",
            min=64 * 1024, max=5 * GiB,
        ),
    )
    hedge_after_factor: float = dataclasses.field(
        default=3.0,
        metadata=_doc(
            "A ranged GET still running after this many times its expected time (learned from recent ranges, "
            "at least 0.1 s) is asked once more on another connection; the first complete answer is used. "
            "`0` turns hedging off; else above 1.", min=0.0, max=100.0,
        ),
    )
    max_hedges_in_flight: int = dataclasses.field(
        default=4,
        metadata=_doc("Hedged GET requests (see `hedge_after_factor`) in flight at once per store; `0` none.",
                      min=0, max=1024),
    )
    connect_timeout_s: float = dataclasses.field(
        default=2.0, metadata=_doc("TCP connect timeout per attempt.", min=0.01, max=600.0)
    )
    read_timeout_s: float = dataclasses.field(
        default=10.0,
        metadata=_doc("Timeout waiting for data on an open connection per attempt.", min=0.01, max=3600.0),
    )
    # read_timeout_s bounds each silence, not the whole: a server trickling a byte per
    # read_timeout_s would hold a request, and one of max_concurrency permits, forever.
    request_timeout_s: float = dataclasses.field(
        default=120.0,
        metadata=_doc(
            "Total time one attempt of one S3 request may take (connect, send, answer, body); also the "
            "longest wait for one of `max_concurrency` request permits, and for creating the client (the "
            "credential chain: a `credential_process`, SSO, an instance role).",
            min=0.1, max=3600.0,
        ),
    )
    max_attempts: int = dataclasses.field(
        default=4,
        metadata=_doc("Attempts per S3 request (throttling, 5xx and connection errors retry; 4xx never).", min=1, max=20),
    )
    retry_base_delay_s: float = dataclasses.field(
        default=0.05, metadata=_doc("First retry back-off; doubles per attempt, full jitter.", min=0.0, max=60.0)
    )
    retry_max_delay_s: float = dataclasses.field(
        default=2.0, metadata=_doc("Cap of one retry back-off.", min=0.0, max=600.0)
    )
    checksum_algorithm: ChecksumAlgorithm = dataclasses.field(
        default="none",
        metadata=_doc(
            "End-to-end integrity (`none`, `CRC32`, `CRC32C`, `SHA256`): every upload carries this checksum, "
            "which servers that verify it refuse on a mismatch (AWS S3, SeaweedFS; Ceph RGW 16.2 and moto store it "
            "unchecked: docs/compatibility.md), and ec-s3 stores a CRC32 of the blob in its metadata and verifies it "
            "after every GET (multipart and ranged too), on every server; a mismatch is a miss, never a tensor. "
            "`CRC32C` needs `awscrt`."
        ),
    )
    breaker_threshold: int = dataclasses.field(
        default=5,
        metadata=_doc("Consecutive failed requests (after retries) that open the circuit breaker.", min=1, max=10_000),
    )
    breaker_cooldown_s: float = dataclasses.field(
        default=5.0,
        metadata=_doc("How long the open breaker fails requests at once before one probe (doubles per failed probe, max 60 s); "
                      "also how long a failure to create the client (the credential chain) is remembered.", min=0.0, max=600.0),
    )
    max_blob_bytes: int = dataclasses.field(
        default=1 * GiB,
        metadata=_doc("Largest blob ec-s3 will write or accept; anything larger is rejected.", min=1024),
    )
    startup_check: StartupCheck = dataclasses.field(
        default="fatal",
        metadata=_doc(
            "At start-up, check bucket, credentials and permissions: `fatal` (misconfiguration stops the "
            "engine; an unreachable store only warns), `warn` or `off`."
        ),
    )
    # --- producer -----------------------------------------------------------------
    max_inflight_bytes: int = dataclasses.field(
        default=1 * GiB,
        metadata=_doc("Producer: bytes of encoder outputs waiting for upload (host copies included).", min=1 * MiB),
    )
    backpressure: Backpressure = dataclasses.field(
        default="block",
        metadata=_doc("Producer, when `max_inflight_bytes` is full: `block` the save until there is room, or `drop` the upload (counted)."),
    )
    shutdown_timeout_s: float = dataclasses.field(
        default=4.0,
        metadata=_doc(
            "How long `shutdown()` waits for pending uploads before spooling (or abandoning) the rest. "
            "vLLM's multiprocess executor kills workers after `VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS` (5 s).",
            min=0.0, max=3600.0,
        ),
    )
    spool_dir: str | None = dataclasses.field(
        default=None,
        metadata=_doc("Producer: directory where blobs whose upload failed wait for the store (one per producer instance); unset = drop and count."),
    )
    spool_max_bytes: int = dataclasses.field(
        default=10 * GiB, metadata=_doc("Producer: size bound of `spool_dir`; beyond it blobs are dropped and counted.", min=1 * MiB)
    )
    spool_retry_s: float = dataclasses.field(
        default=2.0, metadata=_doc("Producer: how often spooled blobs are retried while the store is down.", min=0.05, max=3600.0)
    )
    # --- consumer -----------------------------------------------------------------
    lookup: LookupPolicy = dataclasses.field(
        default="always",
        metadata=_doc("Consumer: `always` look up every item in the bucket, or only items `promised` in `ec_transfer_params`."),
    )
    # 5 s: about 3x the p99 time from save_caches to a visible 64 MiB blob
    # (measured by a producer-save bench since retired; docs/operations.md). A promise
    # later than that is a dead or overloaded producer; waiting longer (30 s was the old
    # default) only adds the wait to the request.
    promised_wait_s: float = dataclasses.field(
        default=5.0,
        metadata=_doc(
            "Consumer: how long to wait for an item promised in `ec_transfer_params` to appear before encoding it "
            "locally (default: ~3x the p99 upload time of a 64 MiB blob; raise it for slow links or larger blobs).",
            min=0.0, max=3600.0,
        ),
    )
    lookup_wait_s: float = dataclasses.field(
        default=2.0,
        metadata=_doc(
            "Consumer: how long a request waits for the lookup of an item nobody promised before it is encoded locally "
            "(an `ec_both` engine never waits for an item with media: it encodes first; also a producer's wait for an "
            "item sent without media, which only the bucket can provide).",
            min=0.0, max=600.0,
        ),
    )
    # The worker's own fetch (a staged file it cannot read, or workers on another host)
    # runs inside the model step: vLLM gathers the embedding right after. The step waits
    # at most this long; the store's attempts (max_attempts) are its only retries.
    remote_load_timeout_s: float = dataclasses.field(
        default=10.0,
        metadata=_doc(
            "Consumer: the longest a model step waits for a worker's own S3 fetch of a blob it cannot read from "
            "staging (its only retries are the store's `max_attempts`); then the item is encoded in the step if the "
            "request has media, else the load fails.",
            min=0.1, max=600.0,
        ),
    )
    # 0: a producer's HEAD costs a round trip (bench/results/summary.md) on
    # every fresh image's critical path, to save an encoder run only for images another
    # producer (or an earlier run) already uploaded; the HEAD still runs, in the background,
    # and its answer skips the encoder for every later request of that image.
    producer_lookup_wait_s: float = dataclasses.field(
        default=0.0,
        metadata=_doc(
            "Producer: how long a fresh item waits for its bucket HEAD before vLLM encodes it (0: never; the HEAD "
            "runs in the background and a blob it finds skips the encoder for later requests). Raise it only when "
            "encoding costs far more than a HEAD and images recur across producers or restarts.",
            min=0.0, max=600.0,
        ),
    )
    negative_cache_ttl_s: float = dataclasses.field(
        default=5.0,
        metadata=_doc(
            "A miss of an item nobody promised is remembered this long, so it costs at most one lookup per TTL "
            "(a consumer's GET, a producer's HEAD).",
            min=0.0, max=3600.0,
        ),
    )
    present_ttl_s: float = dataclasses.field(
        default=300.0,
        metadata=_doc(
            "Producer: a blob seen in the bucket (or uploaded) is trusted this long; after that the next request "
            "for it looks again, so a blob deleted by `ec-s3 gc` or a lifecycle rule is encoded and uploaded again.",
            min=0.0, max=7 * 86400.0,
        ),
    )
    staging_bytes: int = dataclasses.field(
        default=4 * GiB,
        metadata=_doc("Consumer: host shared memory for fetched blobs waiting for the workers.", min=1 * MiB),
    )
    staging_dir: str = dataclasses.field(
        default="/dev/shm",
        metadata=_doc("Consumer: directory (tmpfs) for the staging area shared with workers on this host."),
    )
    encoder_output_width: int | None = dataclasses.field(
        default=None,
        metadata=_doc("Expected width of an encoder output row (default: vLLM's measured width, else the text hidden size).", min=1),
    )

    # ---------------------------------------------------------------------------
    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any] | None, *, environ: Mapping[str, str] | None = None
    ) -> ECS3Config:
        """Parse and validate vLLM's ``ec_connector_extra_config``.

        Keys vLLM's own EC connectors read from the same dict are not ours and are
        ignored; anything else unknown is a typo and fails with the accepted keys.
        ``bucket`` and ``endpoint_url`` fall back to ``EC_S3_BUCKET`` /
        ``EC_S3_ENDPOINT_URL`` so one deployment can point every instance at one
        store through the environment.
        """
        environ = os.environ if environ is None else environ
        raw: dict[str, Any] = dict(extra or {})
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in raw if k not in fields and k not in _FOREIGN_KEYS)
        if unknown:
            raise ConfigError(_unknown_keys(unknown, fields))
        for env_key, name in (("EC_S3_BUCKET", "bucket"), ("EC_S3_ENDPOINT_URL", "endpoint_url")):
            if name not in raw and environ.get(env_key):
                raw[name] = environ[env_key]
        for name in SECRET_KEYS:
            if isinstance(raw.get(name), str):
                raw[name] = resolve_secret(name, raw[name], environ)
        # Resolved, not compared as strings: ``float | None`` is ``Optional[float]``.
        hints = get_type_hints(cls)
        values = {name: coerce(fields[name], value, hints[name]) for name, value in raw.items() if name in fields}
        config = cls(**values)
        config.validate()
        return config

    def __post_init__(self) -> None:
        # Most people write S3 prefixes with a trailing '/' ("ec-cache/"); keys are
        # built as f"{prefix}/{namespace}/...", so store it without the outer slashes.
        for name in ("prefix", "namespace"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, value.strip("/"))

    def validate(self) -> None:
        """Check cross-field rules and bounds; raise :class:`ConfigError` naming the key."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            lo, hi = f.metadata.get("min"), f.metadata.get("max")
            if value is None or isinstance(value, (str, Secret)):
                continue
            if lo is not None and value < lo:
                raise ConfigError(f"{f.name}={value!r} is below the minimum {lo!r}")
            if hi is not None and value > hi:
                raise ConfigError(f"{f.name}={value!r} is above the maximum {hi!r}")
        if not self.bucket:
            raise ConfigError("bucket is required: set ec_connector_extra_config.bucket (or EC_S3_BUCKET)")
        if not _BUCKET_RE.match(self.bucket) or ".." in self.bucket:
            raise ConfigError(f"bucket={self.bucket!r} is not a valid S3 bucket name (3-63 of a-z 0-9 . -)")
        _check_key_path("prefix", self.prefix)
        if self.namespace is not None:
            _check_key_path("namespace", self.namespace)
        if self.endpoint_url is not None and not re.match(r"^https?://[^/\s]+/?$", self.endpoint_url):
            raise ConfigError(
                f"endpoint_url={self.endpoint_url!r} must be http(s)://host[:port] without a path"
            )
        if self.region is not None and not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", self.region):
            raise ConfigError(f"region={self.region!r} is not a region name (e.g. 'eu-west-1'); leave it unset for the AWS chain")
        if self.ca_bundle is not None and not (os.path.isfile(self.ca_bundle) and os.access(self.ca_bundle, os.R_OK)):
            raise ConfigError(f"ca_bundle={self.ca_bundle!r} is not a readable file: name the PEM file of the CA(s) to trust")
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ConfigError("access_key_id and secret_access_key must be given together (or neither)")
        if self.checksum_algorithm == "CRC32C":
            try:
                import awscrt  # noqa: F401
            except ImportError:
                raise ConfigError(
                    "checksum_algorithm='CRC32C' needs the awscrt package (pip install 'botocore[crt]'); "
                    "or use CRC32 or SHA256"
                ) from None
        self.io_cpu_set()  # raises naming io_cpus
        if 0 < self.hedge_after_factor <= 1:
            raise ConfigError(f"hedge_after_factor={self.hedge_after_factor!r} must be 0 (off) or above 1")
        if self.retry_max_delay_s < self.retry_base_delay_s:
            raise ConfigError("retry_max_delay_s must be >= retry_base_delay_s")

    def io_cpu_set(self) -> frozenset[int] | None:
        """The CPUs of ``io_cpus``; None for ``inherit`` (leave the thread as it is)."""
        spec = self.io_cpus.strip()
        if spec == "inherit":
            return None
        if spec == "auto":
            # The kernel intersects this with the cgroup's cpuset: asking for every CPU
            # the machine has means "every CPU this process may use".
            return frozenset(range(os.cpu_count() or 1))
        cpus: set[int] = set()
        for part in spec.split(","):
            m = _CPU_RANGE_RE.fullmatch(part.strip())
            if m is None or (m[2] is not None and int(m[2]) < int(m[1])):
                raise ConfigError(
                    f"io_cpus={self.io_cpus!r} is invalid: expected 'auto', 'inherit' or a CPU list such as '0-3,8'"
                )
            cpus.update(range(int(m[1]), int(m[2] if m[2] is not None else m[1]) + 1))
        return frozenset(cpus)

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
        )
        return f"ECS3Config({shown})"


# Keys of vLLM's built-in EC connectors that operators may leave in a shared extra config.
_FOREIGN_KEYS = frozenset({"shared_storage_path", "ec_enable_nixl", "consumer_ack_timeout_s"})


def _unknown_keys(unknown: list[str], accepted: Iterable[str]) -> str:
    """The error of misspelt keys: each named, with the closest accepted key, then every
    accepted key wrapped to lines an operator can read."""
    accepted = sorted(accepted)
    named = []
    for key in unknown:
        close = difflib.get_close_matches(key, accepted, n=1, cutoff=0.6)
        named.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    listing = textwrap.fill(", ".join(accepted), width=88, initial_indent="  ", subsequent_indent="  ",
                            break_on_hyphens=False)
    return f"unknown ec_connector_extra_config key {', '.join(named)}; accepted keys:\n{listing}"


def _check_key_path(name: str, value: str) -> None:
    """Outer slashes are already stripped; what is left must be plain segments, because
    an empty, '.' or '..' segment in the middle means a different key to each S3 server
    (some normalise paths) and could escape the prefix."""
    segments = value.split("/")
    if not value or not all(_PREFIX_SEGMENT_RE.match(s) and s not in (".", "..") for s in segments):
        raise ConfigError(
            f"{name}={value!r} must be '/'-separated segments of A-Z a-z 0-9 . _ - "
            "(no empty, '.' or '..' segments), e.g. 'ec-cache' or 'team-a/ec-cache/'"
        )


def config_keys() -> list[tuple[str, str, str]]:
    """(key, default, doc) for every config key: the source of the table in docs/config.md (scripts/config_table.py)."""
    rows = []
    for f in dataclasses.fields(ECS3Config):
        default = "required" if f.name == "bucket" else repr(f.default)
        rows.append((f.name, default, f.metadata["doc"]))
    return rows
