"""Operator tasks behind the ``ec-s3`` command line: check, stats, gc, inspect, bench.

Every function here is typed and returns a report dataclass; the CLI (:mod:`ec_s3.cli.main`)
only parses arguments and prints. Nothing here imports vLLM, and torch is imported
only by :func:`inspect_blob` (through the codec).

Sync functions take an :class:`~ec_s3.store.S3Store` and block on its background loop;
the ``*_async`` variants are for code already on that loop. Progress callbacks are
``progress(phase, done, total)`` with ``total`` None while unknown (listing).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import math
import os
import re
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from botocore import exceptions as boto_exc

from ec_s3.blob.format import BLOB_NAME_RE
from ec_s3.blob.keys import PROBE_NAMESPACE
from ec_s3.config import ConfigError, ECS3Config
from ec_s3.store.diagnose import Diagnosis, credential_source, diagnose
from ec_s3.store.errors import to_store_error
from ec_s3.store.client import (
    DELETE_BATCH,
    AccessDenied,
    IntegrityError,
    ObjectInfo,
    ObjectNotFound,
    S3Store,
    StoreError,
    StoreRequestError,
)

__all__ = [
    "AGE_BUCKETS",
    "CheckReport",
    "CheckStep",
    "Diagnosis",
    "GcReport",
    "InspectReport",
    "LifecycleReport",
    "NamespaceStats",
    "PROBE_NAMESPACE",
    "Progress",
    "TransferReport",
    "bucket_stats",
    "build_config",
    "check_access",
    "credential_source",
    "diagnose",
    "extra_config_from_json",
    "find_blob_keys",
    "format_bytes",
    "format_duration",
    "inspect_blob",
    "install_lifecycle",
    "list_namespaces",
    "list_objects",
    "namespace_of",
    "parse_duration",
    "parse_size",
    "plan_gc",
    "run_gc",
    "transfer_check",
]

Progress = Callable[[str, int, "int | None"], None]

#: Age classes of ``stats``: (label, upper bound in seconds, exclusive).
AGE_BUCKETS: tuple[tuple[str, float], ...] = (
    ("<1h", 3600.0),
    ("<1d", 86400.0),
    ("<7d", 7 * 86400.0),
    (">=7d", math.inf),
)
_LIST_TIMEOUT_S = None  # listing a large prefix takes as long as it takes; requests time out singly


def _noop(phase: str, done: int, total: int | None) -> None:
    return None


# ---------------------------------------------------------------------- parsing helpers
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw]?)")


def parse_duration(text: str) -> float:
    """``"7d"``, ``"12h"``, ``"30m"``, ``"45s"``, ``"1d12h"``, ``"2w"`` or plain seconds."""
    s = str(text).strip().lower()
    if not s:
        raise ValueError("empty duration")
    pos, total = 0, 0.0
    while pos < len(s):
        m = _DURATION_PART.match(s, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"bad duration {text!r}: use e.g. 30m, 12h, 7d, 1d12h")
        total += float(m.group(1)) * _DURATION_UNITS[m.group(2) or "s"]
        pos = m.end()
        while pos < len(s) and s[pos] == " ":
            pos += 1
    return total


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"500MiB"``, ``"10GB"``, ``"2G"``, ``"1048576"``: SI units are powers of 1000, ``*iB`` of 1024.

    A bare letter (``"2G"``) means the binary unit, as ``ls -h`` and ``df -h`` print it.
    """
    m = _SIZE_RE.match(str(text))
    if m is None:
        raise ValueError(f"bad size {text!r}: use e.g. 500MiB, 10GB, 2G or a byte count")
    number, unit, binary, b = m.group(1), m.group(2).lower(), m.group(3), m.group(4)
    if not unit:
        if binary:
            raise ValueError(f"bad size {text!r}")
        return int(float(number))
    power = "kmgtp".index(unit) + 1
    base = 1024 if (binary or not b) else 1000
    return int(float(number) * base**power)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def format_duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


# ---------------------------------------------------------------------- configuration
def extra_config_from_json(value: str, *, read_file: Callable[[str], str] | None = None) -> dict[str, Any]:
    """The ``ec_connector_extra_config`` dict from ``--config``.

    ``value`` is JSON text, ``@path`` (``@-`` is stdin) or a path to a JSON file. The JSON
    may be the extra-config dict itself, the whole ``ec_transfer_config`` one passes to
    vLLM (its ``ec_connector_extra_config`` is taken), or an object holding
    ``ec_transfer_config`` (e.g. a saved vLLM config).
    """
    reader = read_file or _read_text
    text = value
    if value.startswith("@"):
        text = reader(value[1:])
    elif not value.lstrip().startswith("{") and os.path.isfile(value):
        text = reader(value)
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"--config is not valid JSON ({exc}); pass JSON text or @FILE") from None
    if not isinstance(data, dict):
        raise ConfigError("--config must be a JSON object")
    if isinstance(data.get("ec_transfer_config"), (dict, str)):
        data = data["ec_transfer_config"]
        if isinstance(data, str):
            data = json.loads(data)
    if "ec_connector_extra_config" in data or any(
        k in data for k in ("ec_connector", "ec_role", "ec_connector_module_path", "engine_id")
    ):
        extra = data.get("ec_connector_extra_config") or {}
        if isinstance(extra, str):
            try:
                extra = json.loads(extra)
            except ValueError:
                raise ConfigError("ec_connector_extra_config is a string but not JSON") from None
        if not isinstance(extra, dict):
            raise ConfigError("ec_connector_extra_config must be a JSON object")
        return dict(extra)
    return dict(data)


def _read_text(path: str) -> str:
    if path == "-":
        import sys

        return sys.stdin.read()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read --config file {path!r}: {exc.strerror}") from None


def build_config(
    base: Mapping[str, Any] | None,
    overrides: Mapping[str, Any] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> ECS3Config:
    """``base`` (from ``--config``) updated by ``overrides`` (flags), then validated.

    ``bucket`` / ``endpoint_url`` fall back to ``EC_S3_BUCKET`` / ``EC_S3_ENDPOINT_URL``
    exactly as the connector does, so ``check`` proves what the connector will use.
    """
    extra = dict(base or {})
    extra.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return ECS3Config.from_extra_config(extra, environ=os.environ if environ is None else environ)


# ---------------------------------------------------------------------- check
@dataclasses.dataclass
class CheckStep:
    name: str
    ok: bool
    latency_ms: float | None
    detail: str = ""
    warning: bool = False  # passed, but something needs the operator's attention


@dataclasses.dataclass
class CheckReport:
    ok: bool
    read_only: bool
    bucket: str
    prefix: str
    endpoint_url: str | None
    region: str
    credentials: str  # where they come from, never what they are
    steps: list[CheckStep] = dataclasses.field(default_factory=list)
    diagnosis: Diagnosis | None = None
    warnings: list[str] = dataclasses.field(default_factory=list)
    probe_key: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


async def _timed(coro: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    result = await coro
    return result, (time.perf_counter() - t0) * 1000.0


async def _list_page(store: S3Store, prefix: str, *, max_keys: int = 1000, delimiter: str | None = None,
                     token: str | None = None) -> dict[str, Any]:
    async def _list(client: Any) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"Bucket": store.bucket, "Prefix": prefix, "MaxKeys": max_keys}
        if delimiter:
            kwargs["Delimiter"] = delimiter
        if token:
            kwargs["ContinuationToken"] = token
        return await client.list_objects_v2(**kwargs)

    return await store._call("LIST", prefix, _list)


async def check_access_async(store: S3Store, *, read_only: bool = False, probe_bytes: int = 4096,
                             environ: Mapping[str, str] | None = None) -> CheckReport:
    config = store.config
    root = f"{config.prefix}/"
    probe = f"{root}{PROBE_NAMESPACE}/check-{int(time.time())}-{secrets.token_hex(6)}.bin"
    report = CheckReport(
        ok=False, read_only=read_only, bucket=config.bucket, prefix=config.prefix,
        endpoint_url=config.endpoint_url, region=config.region,
        credentials=credential_source(config, environ), probe_key=probe,
    )

    def fail(step: str, exc: BaseException, op: str = "") -> CheckReport:
        d = diagnose(exc, config, op=op)
        raw = exc.reason if isinstance(exc, StoreError) else f"{type(exc).__name__}: {exc}"
        report.steps.append(CheckStep(step, False, None, raw))
        report.diagnosis = d
        return report

    # 1. LIST on the prefix: the answer carries an error code, so it tells wrong
    #    credentials, a missing bucket and an unreachable endpoint apart.
    first: dict[str, Any] | None = None
    try:
        page, ms = await _timed(_list_page(store, root, max_keys=1))
        contents = page.get("Contents") or []
        first = contents[0] if contents else None
        report.steps.append(CheckStep("list", True, ms, f"ListObjectsV2 s3://{config.bucket}/{root} answers"
                                      + (" (prefix has objects)" if first else " (prefix is empty)")))
    except AccessDenied as exc:
        d = diagnose(exc, config, op="LIST")
        if d.kind != "permission":
            return fail("list", exc, "LIST")
        note = ("no s3:ListBucket: `ec-s3 stats` and `gc` will not work, and on AWS a missing key "
                "answers 403 instead of 404")
        report.steps.append(CheckStep("list", True, None, "refused (403 AccessDenied): " + note, warning=True))
        report.warnings.append(note)
    except Exception as exc:  # noqa: BLE001 - every failure becomes a diagnosis
        return fail("list", exc, "LIST")

    # 2. HEAD of a missing key must be a 404: that is how the connector sees a miss.
    try:
        info, ms = await _timed(store.head_async(probe))
        if info is not None:
            raise StoreRequestError("HEAD", probe, "probe key unexpectedly exists")
        report.steps.append(CheckStep("head-miss", True, ms, "HEAD of a missing key answers 404 (a miss)"))
    except Exception as exc:  # noqa: BLE001
        return fail("head-miss", exc, "HEAD")

    if read_only:
        # 3. GET of a missing key: 404 NoSuchKey proves s3:GetObject (403 would not).
        try:
            t0 = time.perf_counter()
            try:
                await store.get_async(probe)
            except ObjectNotFound:
                ms = (time.perf_counter() - t0) * 1000.0
            else:
                raise StoreRequestError("GET", probe, "probe key unexpectedly exists")
            report.steps.append(CheckStep("get-miss", True, ms, "GET of a missing key answers 404 NoSuchKey"))
        except Exception as exc:  # noqa: BLE001
            return fail("get-miss", exc, "GET")
        if first is not None:
            key = str(first["Key"])
            try:
                info, ms = await _timed(store.head_async(key))
                report.steps.append(CheckStep("head-object", True, ms,
                                              f"HEAD of an existing object ({info.size if info else '?'} bytes)"))
            except Exception as exc:  # noqa: BLE001
                return fail("head-object", exc, "HEAD")
        report.ok = True
        return report

    # 3-6. A real round trip of a probe object.
    body = os.urandom(probe_bytes)
    try:
        _, ms = await _timed(store.put_async(probe, body, metadata={"ec-s3-probe": "1"}))
        report.steps.append(CheckStep("put", True, ms, f"PUT {probe_bytes}-byte probe object"))
    except Exception as exc:  # noqa: BLE001
        return fail("put", exc, "PUT")
    try:
        try:
            info, ms = await _timed(store.head_async(probe))
            if info is None or info.size != probe_bytes:
                raise StoreRequestError("HEAD", probe, f"probe reads back as {info and info.size} bytes, not {probe_bytes}")
            report.steps.append(CheckStep("head", True, ms, "HEAD sees the probe"))
        except Exception as exc:  # noqa: BLE001
            return fail("head", exc, "HEAD")
        try:
            got, ms = await _timed(store.get_async(probe))
            if bytes(got) != body:
                raise StoreRequestError("GET", probe, "probe came back with different bytes")
            report.steps.append(CheckStep("get", True, ms, "GET returns the same bytes"))
        except Exception as exc:  # noqa: BLE001
            return fail("get", exc, "GET")
    finally:
        try:
            _, ms = await _timed(store.delete_async(probe))
            report.steps.append(CheckStep("delete", True, ms, "DELETE removed the probe"))
        except Exception as exc:  # noqa: BLE001
            # The connector never deletes: a missing s3:DeleteObject only matters to gc.
            d = diagnose(exc, config, op="DELETE")
            note = f"could not delete the probe object {probe}: {d.cause}; `ec-s3 gc` needs s3:DeleteObject"
            report.steps.append(CheckStep("delete", True, None, d.cause, warning=True))
            report.warnings.append(note)
    report.ok = report.diagnosis is None
    return report


def check_access(config: ECS3Config, *, read_only: bool = False, probe_bytes: int = 4096,
                 timeout: float | None = 300.0, environ: Mapping[str, str] | None = None) -> CheckReport:
    """Prove that ``config`` works: list, HEAD-miss, then PUT/HEAD/GET/DELETE a probe.

    ``read_only`` checks only what a consumer needs (LIST, HEAD and GET of a missing key
    answer 404, HEAD of an existing object), so read-only credentials pass.
    """
    store = S3Store(config)
    try:
        return store.run(check_access_async(store, read_only=read_only, probe_bytes=probe_bytes,
                                            environ=environ), timeout)
    except (concurrent.futures.TimeoutError, TimeoutError):
        return CheckReport(
            ok=False, read_only=read_only, bucket=config.bucket, prefix=config.prefix,
            endpoint_url=config.endpoint_url, region=config.region,
            credentials=credential_source(config, environ),
            diagnosis=Diagnosis("endpoint", f"the check did not finish within {timeout:.0f} s",
                                "check that the endpoint answers S3 requests promptly, or raise --timeout"),
        )
    finally:
        store.close(timeout=5.0)


# ---------------------------------------------------------------------- listing
def _root(prefix: str) -> str:
    return prefix.strip("/") + "/"


def namespace_of(prefix: str, key: str) -> str:
    """The namespace segment of ``key`` under ``prefix`` (``""`` for objects right under it)."""
    rest = key[len(_root(prefix)):] if key.startswith(_root(prefix)) else key
    return rest.split("/", 1)[0] if "/" in rest else ""


async def list_objects_async(store: S3Store, prefix: str, progress: Progress | None = None) -> list[ObjectInfo]:
    progress = progress or _noop
    out: list[ObjectInfo] = []
    async for info in store.list_async(prefix):
        out.append(info)
        if len(out) % 1000 == 0:
            progress("listing", len(out), None)
    progress("listing", len(out), None)
    return out


def list_objects(store: S3Store, prefix: str, progress: Progress | None = None) -> list[ObjectInfo]:
    """Every object under ``prefix`` (a key prefix, usually ``<prefix>/`` or ``<prefix>/<ns>/``)."""
    return store.run(list_objects_async(store, prefix, progress), _LIST_TIMEOUT_S)


async def list_namespaces_async(store: S3Store, prefix: str) -> list[str]:
    root, token, out = _root(prefix), None, []
    while True:
        page = await _list_page(store, root, delimiter="/", token=token)
        for cp in page.get("CommonPrefixes") or []:
            ns = str(cp["Prefix"])[len(root):].strip("/")
            if ns:
                out.append(ns)
        token = page.get("NextContinuationToken")
        if not page.get("IsTruncated") or not token:
            return out


def list_namespaces(store: S3Store, prefix: str) -> list[str]:
    """The namespaces (first key segments) under ``<prefix>/``, probe area included."""
    return store.run(list_namespaces_async(store, prefix), _LIST_TIMEOUT_S)


# ---------------------------------------------------------------------- stats
@dataclasses.dataclass
class NamespaceStats:
    namespace: str
    objects: int = 0
    bytes: int = 0
    blobs: int = 0  # objects whose key has the blob form (<digest>.safetensors)
    ages: dict[str, int] = dataclasses.field(default_factory=lambda: {label: 0 for label, _ in AGE_BUCKETS})
    age_bytes: dict[str, int] = dataclasses.field(default_factory=lambda: {label: 0 for label, _ in AGE_BUCKETS})
    oldest_s: float | None = None  # age of the oldest object
    newest_s: float | None = None  # age of the newest object

    def add(self, info: ObjectInfo, age: float, *, blob: bool) -> None:
        self.objects += 1
        self.bytes += info.size
        self.blobs += blob
        label = next(label for label, bound in AGE_BUCKETS if age < bound)
        self.ages[label] += 1
        self.age_bytes[label] += info.size
        self.oldest_s = age if self.oldest_s is None else max(self.oldest_s, age)
        self.newest_s = age if self.newest_s is None else min(self.newest_s, age)

    def merge(self, other: NamespaceStats) -> None:
        self.objects += other.objects
        self.bytes += other.bytes
        self.blobs += other.blobs
        for label in self.ages:
            self.ages[label] += other.ages[label]
            self.age_bytes[label] += other.age_bytes[label]
        for attr, pick in (("oldest_s", max), ("newest_s", min)):
            mine, theirs = getattr(self, attr), getattr(other, attr)
            setattr(self, attr, theirs if mine is None else mine if theirs is None else pick(mine, theirs))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def summarize(objects: Iterable[ObjectInfo], prefix: str, *, now: float | None = None) -> dict[str, NamespaceStats]:
    """Per-namespace counts, bytes and age classes of ``objects`` (pure; sorted by namespace)."""
    now = time.time() if now is None else now
    root = _root(prefix)
    stats: dict[str, NamespaceStats] = {}
    for info in objects:
        ns = namespace_of(prefix, info.key)
        rest = info.key[len(root) + len(ns) + 1:] if ns else ""
        entry = stats.setdefault(ns, NamespaceStats(ns))
        entry.add(info, max(0.0, now - info.last_modified), blob=BLOB_NAME_RE.fullmatch(rest) is not None)
    return dict(sorted(stats.items()))


def total_stats(stats: Mapping[str, NamespaceStats]) -> NamespaceStats:
    total = NamespaceStats("TOTAL")
    for entry in stats.values():
        total.merge(entry)
    return total


def bucket_stats(store: S3Store, prefix: str | None = None, *, namespace: str | None = None,
                 now: float | None = None, progress: Progress | None = None) -> dict[str, NamespaceStats]:
    """Objects, bytes and age distribution per namespace under ``<prefix>/``.

    Ages are since the object was written (S3 keeps no access time).
    """
    prefix = prefix or store.config.prefix
    where = _root(prefix) + (f"{namespace}/" if namespace else "")
    objects = list_objects(store, where, progress)
    return summarize(objects, prefix, now=now)


# ---------------------------------------------------------------------- gc
def plan_gc(objects: Iterable[ObjectInfo], older_than_s: float | None, max_bytes: int | None,
            now: float | None = None) -> list[ObjectInfo]:
    """The objects to delete, oldest first.

    Every object at least ``older_than_s`` old goes (``0`` means all of them); then, if
    the rest still weighs more than ``max_bytes``, the oldest of the rest go until it
    fits. With neither bound nothing is selected.
    """
    now = time.time() if now is None else now
    ordered = sorted(objects, key=lambda o: (o.last_modified, o.key))
    selected: list[ObjectInfo] = []
    kept: list[ObjectInfo] = []
    for info in ordered:
        if older_than_s is not None and (older_than_s <= 0 or now - info.last_modified >= older_than_s):
            selected.append(info)
        else:
            kept.append(info)
    if max_bytes is not None:
        remaining = sum(o.size for o in kept)
        i = 0
        while remaining > max_bytes and i < len(kept):
            selected.append(kept[i])
            remaining -= kept[i].size
            i += 1
        selected.sort(key=lambda o: (o.last_modified, o.key))
    return selected


@dataclasses.dataclass
class GcReport:
    bucket: str
    prefix: str  # the key prefix scanned (<prefix>/ or <prefix>/<namespace>/)
    dry_run: bool
    older_than_s: float | None
    max_bytes: int | None
    scanned: int = 0
    scanned_bytes: int = 0
    selected: int = 0
    selected_bytes: int = 0
    deleted: int = 0
    deleted_bytes: int = 0
    oldest_selected_age_s: float | None = None
    newest_selected_age_s: float | None = None
    sample: list[str] = dataclasses.field(default_factory=list)  # the oldest few selected keys
    error: str | None = None
    diagnosis: Diagnosis | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def remaining(self) -> int:
        return self.scanned - (self.selected if self.dry_run else self.deleted)

    @property
    def remaining_bytes(self) -> int:
        return self.scanned_bytes - (self.selected_bytes if self.dry_run else self.deleted_bytes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(ok=self.ok, remaining=self.remaining, remaining_bytes=self.remaining_bytes)
        return d


async def run_gc_async(store: S3Store, *, prefix: str | None = None, namespace: str | None = None,
                       older_than_s: float | None = None, max_bytes: int | None = None,
                       dry_run: bool = False, now: float | None = None, progress: Progress | None = None,
                       batch_size: int = DELETE_BATCH, sample_size: int = 10) -> GcReport:
    if older_than_s is None and max_bytes is None:
        raise ValueError("gc needs older_than_s and/or max_bytes")
    if not 1 <= batch_size <= DELETE_BATCH:
        raise ValueError(f"batch_size must be 1..{DELETE_BATCH}")
    progress = progress or _noop
    where = _root(prefix or store.config.prefix) + (f"{namespace}/" if namespace else "")
    report = GcReport(bucket=store.bucket, prefix=where, dry_run=dry_run,
                      older_than_s=older_than_s, max_bytes=max_bytes)
    try:
        objects = await list_objects_async(store, where, progress)
    except Exception as exc:  # noqa: BLE001
        report.diagnosis = diagnose(exc, store.config, op="LIST")
        report.error = report.diagnosis.cause
        return report
    now = time.time() if now is None else now
    report.scanned = len(objects)
    report.scanned_bytes = sum(o.size for o in objects)
    victims = plan_gc(objects, older_than_s, max_bytes, now)
    report.selected = len(victims)
    report.selected_bytes = sum(o.size for o in victims)
    report.sample = [o.key for o in victims[:sample_size]]
    if victims:
        report.oldest_selected_age_s = max(0.0, now - victims[0].last_modified)
        report.newest_selected_age_s = max(0.0, now - victims[-1].last_modified)
    if dry_run or not victims:
        return report
    progress("deleting", 0, len(victims))
    for i in range(0, len(victims), batch_size):
        batch = victims[i : i + batch_size]
        try:
            await store.delete_many_async(o.key for o in batch)
        except Exception as exc:  # noqa: BLE001 - stop, report what was done and why
            report.diagnosis = diagnose(exc, store.config, op="DeleteObjects")
            report.error = report.diagnosis.cause
            break
        report.deleted += len(batch)
        report.deleted_bytes += sum(o.size for o in batch)
        progress("deleting", report.deleted, len(victims))
    return report


def run_gc(store: S3Store, *, prefix: str | None = None, namespace: str | None = None,
           older_than_s: float | None = None, max_bytes: int | None = None, dry_run: bool = False,
           now: float | None = None, progress: Progress | None = None,
           batch_size: int = DELETE_BATCH) -> GcReport:
    """List ``<prefix>/[<namespace>/]``, :func:`plan_gc`, and delete in batches of 1000.

    ``dry_run`` reports what would go and deletes nothing.
    """
    return store.run(run_gc_async(store, prefix=prefix, namespace=namespace, older_than_s=older_than_s,
                                  max_bytes=max_bytes, dry_run=dry_run, now=now, progress=progress,
                                  batch_size=batch_size), None)


# ---------------------------------------------------------------------- lifecycle
@dataclasses.dataclass
class LifecycleReport:
    ok: bool
    supported: bool | None  # None: unknown (the call failed for another reason)
    bucket: str
    rule: dict[str, Any]
    dry_run: bool = False
    installed: bool = False
    verified: bool = False  # read back and found as written
    other_rules_kept: int = 0
    diagnosis: Diagnosis | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_UNSUPPORTED_CODES = frozenset({"NotImplemented", "MethodNotAllowed", "UnsupportedOperation",
                                "XNotImplemented", "NotSupported"})


def lifecycle_rule(prefix: str, days: int, *, namespace: str | None = None) -> dict[str, Any]:
    where = _root(prefix) + (f"{namespace}/" if namespace else "")
    return {
        "ID": f"ec-s3-expire:{where}"[:255],
        "Filter": {"Prefix": where},
        "Status": "Enabled",
        "Expiration": {"Days": int(days)},
    }


def _client_error_parts(exc: boto_exc.ClientError) -> tuple[int, str, str]:
    err = exc.response.get("Error", {}) or {}
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return status, str(err.get("Code", "")), str(err.get("Message", ""))


def _lifecycle_unsupported(status: int, code: str, config: ECS3Config) -> Diagnosis:
    return Diagnosis(
        "unsupported",
        f"the S3 server at {config.endpoint_url or 'AWS'} does not support bucket lifecycle rules "
        f"({status} {code})",
        "expire blobs with a periodic `ec-s3 gc --older-than ...` instead (e.g. an hourly cron job "
        "or Kubernetes CronJob)",
    )


async def install_lifecycle_async(store: S3Store, days: int, *, prefix: str | None = None,
                                  namespace: str | None = None, dry_run: bool = False) -> LifecycleReport:
    config = store.config
    if days < 1:
        raise ValueError("lifecycle expiration needs at least 1 day")
    rule = lifecycle_rule(prefix or config.prefix, days, namespace=namespace)
    report = LifecycleReport(ok=False, supported=None, bucket=store.bucket, rule=rule, dry_run=dry_run)
    timeout = config.read_timeout_s + config.connect_timeout_s + 5.0

    def failed(exc: BaseException, op: str) -> LifecycleReport:
        if isinstance(exc, boto_exc.ClientError):
            status, code, message = _client_error_parts(exc)
            if status in (501, 405) or code in _UNSUPPORTED_CODES:
                report.supported = False
                report.diagnosis = _lifecycle_unsupported(status, code, config)
                return report
            if status in (401, 403) or (status == 404 and code == "NoSuchBucket"):
                exc = to_store_error(op, store.bucket, exc) or exc
            else:
                report.diagnosis = Diagnosis("other", f"{op} failed: {status} {code} {message}".strip(),
                                             "check the rule and the server's lifecycle support")
                return report
        elif isinstance(exc, (asyncio.TimeoutError, TimeoutError)) or isinstance(exc, (boto_exc.BotoCoreError, OSError)):
            exc = to_store_error(op, store.bucket, exc) or exc
        report.diagnosis = diagnose(exc, config, op=op)
        return report

    try:
        client = await store._get_client()
        try:
            resp = await asyncio.wait_for(
                client.get_bucket_lifecycle_configuration(Bucket=store.bucket), timeout)
            existing = list(resp.get("Rules") or [])
        except boto_exc.ClientError as exc:
            status, code, _ = _client_error_parts(exc)
            if code in ("NoSuchLifecycleConfiguration", "NoSuchLifecycle") or (status == 404 and code != "NoSuchBucket"):
                existing = []
            else:
                raise
    except Exception as exc:  # noqa: BLE001
        return failed(exc, "GetLifecycle")
    others = [r for r in existing if r.get("ID") != rule["ID"]]
    report.other_rules_kept = len(others)
    if dry_run:
        report.ok = True
        return report
    try:
        await asyncio.wait_for(
            client.put_bucket_lifecycle_configuration(
                Bucket=store.bucket, LifecycleConfiguration={"Rules": [*others, rule]}),
            timeout,
        )
    except Exception as exc:  # noqa: BLE001
        return failed(exc, "PutLifecycle")
    report.installed = True
    report.supported = True
    try:
        resp = await asyncio.wait_for(client.get_bucket_lifecycle_configuration(Bucket=store.bucket), timeout)
        mine = [r for r in resp.get("Rules") or [] if r.get("ID") == rule["ID"]]
        report.verified = bool(mine) and (mine[0].get("Expiration") or {}).get("Days") == days
    except Exception:  # noqa: BLE001 - installed; the read-back is a bonus
        report.verified = False
    report.ok = True
    return report


def install_lifecycle(store: S3Store, days: int, *, prefix: str | None = None, namespace: str | None = None,
                      dry_run: bool = False) -> LifecycleReport:
    """Install (or replace) an expiration rule of ``days`` on ``<prefix>/``; other rules are kept."""
    return store.run(install_lifecycle_async(store, days, prefix=prefix, namespace=namespace,
                                             dry_run=dry_run), 120.0)


# ---------------------------------------------------------------------- inspect
@dataclasses.dataclass
class InspectReport:
    key: str
    exists: bool
    valid: bool = False
    size: int | None = None
    last_modified: float | None = None
    namespace: str = ""  # from the key
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)  # the blob header's metadata
    dtype: str | None = None
    shape: list[int] | None = None
    data_offset: int | None = None
    s3_metadata: dict[str, str] = dataclasses.field(default_factory=dict)
    problems: list[str] = dataclasses.field(default_factory=list)
    error_reason: str | None = None  # BlobError.reason of the header check
    diagnosis: Diagnosis | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


async def inspect_blob_async(store: S3Store, key: str, *, identifier: str | None = None,
                             prefix: str | None = None) -> InspectReport:
    from ec_s3.blob.codec import BlobError, identifier_digest, read_header  # imports torch

    prefix = prefix or store.config.prefix
    report = InspectReport(key=key, exists=False, namespace=namespace_of(prefix, key))
    try:
        info = await store.head_async(key)
    except Exception as exc:  # noqa: BLE001
        report.diagnosis = diagnose(exc, store.config, op="HEAD")
        report.problems.append(report.diagnosis.cause)
        return report
    if info is None:
        report.problems.append("no such key")
        return report
    report.exists = True
    report.size, report.last_modified, report.s3_metadata = info.size, info.last_modified, dict(info.metadata)
    if info.size > store.config.max_blob_bytes:
        report.error_reason = "too_large"
        report.problems.append(f"{info.size} bytes exceeds max_blob_bytes={store.config.max_blob_bytes}")
        return report
    try:
        buf = await store.get_async(key)
    except StoreError as exc:
        if isinstance(exc, IntegrityError):  # stored checksum does not match the bytes
            report.error_reason = "integrity"
            report.problems.append(f"checksum mismatch: {exc.reason}")
            return report
        report.diagnosis = diagnose(exc, store.config, op="GET")
        report.problems.append(report.diagnosis.cause)
        return report
    except Exception as exc:  # noqa: BLE001
        report.diagnosis = diagnose(exc, store.config, op="GET")
        report.problems.append(report.diagnosis.cause)
        return report
    report.size = len(buf)
    try:
        entry, metadata, offset = read_header(buf, max_bytes=store.config.max_blob_bytes)
    except BlobError as exc:
        report.error_reason = exc.reason
        report.problems.append(f"header check failed: {exc}")
        return report
    report.metadata = dict(metadata)
    report.dtype = str(entry["dtype"]).removeprefix("torch.")
    report.shape = list(entry["shape"])
    report.data_offset = offset
    # Consistency of the header with itself and with where the blob lives.
    if metadata.get("dtype") not in (None, report.dtype):
        report.problems.append(f"metadata dtype {metadata.get('dtype')!r} != tensor dtype {report.dtype!r}")
    if metadata.get("shape") not in (None, ",".join(map(str, report.shape))):
        report.problems.append(f"metadata shape {metadata.get('shape')!r} != tensor shape {report.shape}")
    digest = metadata.get("identifier_sha256", "")
    if "identifier" in metadata and identifier_digest(metadata["identifier"]) != digest:
        report.problems.append("identifier does not hash to identifier_sha256")
    base = key.rsplit("/", 1)[-1]
    if base.endswith(".safetensors") and base.removesuffix(".safetensors") != digest:
        report.problems.append("identifier_sha256 does not match the key's digest")
    if report.namespace and metadata.get("namespace") != report.namespace:
        report.problems.append(f"header namespace {metadata.get('namespace')!r} != key namespace {report.namespace!r}")
    if identifier is not None and identifier_digest(identifier) != digest:
        report.problems.append("blob belongs to another identifier")
    report.valid = not report.problems
    return report


def inspect_blob(store: S3Store, key: str, *, identifier: str | None = None,
                 prefix: str | None = None) -> InspectReport:
    """Fetch ``key`` and validate it as a blob: header structure, metadata, key consistency."""
    return store.run(inspect_blob_async(store, key, identifier=identifier, prefix=prefix), 600.0)


async def find_blob_keys_async(store: S3Store, identifier: str, *, prefix: str | None = None,
                               namespace: str | None = None, cache_salt: str | None = None) -> tuple[list[str], list[str]]:
    from ec_s3.blob.keys import KeySpace

    prefix = prefix or store.config.prefix
    namespaces = [namespace] if namespace else [
        ns for ns in await list_namespaces_async(store, prefix) if ns != PROBE_NAMESPACE
    ]
    candidates = [KeySpace(prefix, ns).key_for(identifier, cache_salt=cache_salt) for ns in namespaces]
    found = await asyncio.gather(*(store.head_async(k) for k in candidates))
    return [k for k, info in zip(candidates, found) if info is not None], candidates


def find_blob_keys(store: S3Store, identifier: str, *, prefix: str | None = None, namespace: str | None = None,
                   cache_salt: str | None = None) -> tuple[list[str], list[str]]:
    """(existing keys, keys looked at) of ``identifier`` in ``namespace`` or every namespace."""
    return store.run(find_blob_keys_async(store, identifier, prefix=prefix, namespace=namespace,
                                          cache_salt=cache_salt), 300.0)


# ---------------------------------------------------------------------- bench
@dataclasses.dataclass
class TransferReport:
    size_bytes: int
    count: int
    concurrency: int
    put_latencies_ms: list[float] = dataclasses.field(default_factory=list)
    get_latencies_ms: list[float] = dataclasses.field(default_factory=list)
    put_wall_s: float = 0.0
    get_wall_s: float = 0.0
    verified: bool = False  # every GET returned the bytes PUT
    cleaned_up: bool = False
    error: str | None = None
    diagnosis: Diagnosis | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def put_mib_s(self) -> float:
        return _rate(self.size_bytes * len(self.put_latencies_ms), self.put_wall_s)

    @property
    def get_mib_s(self) -> float:
        return _rate(self.size_bytes * len(self.get_latencies_ms), self.get_wall_s)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(ok=self.ok, put_mib_s=self.put_mib_s, get_mib_s=self.get_mib_s,
                 put=latency_summary(self.put_latencies_ms), get=latency_summary(self.get_latencies_ms))
        return d


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / (1 << 20) / seconds if seconds > 0 else 0.0


def latency_summary(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))]

    return {"min": ordered[0], "p50": pct(50), "p90": pct(90), "max": ordered[-1],
            "mean": sum(ordered) / len(ordered)}


async def transfer_check_async(store: S3Store, size_bytes: int, count: int, *, concurrency: int = 1,
                               progress: Progress | None = None, key_prefix: str | None = None) -> TransferReport:
    if size_bytes < 1 or count < 1 or concurrency < 1:
        raise ValueError("size_bytes, count and concurrency must be >= 1")
    progress = progress or _noop
    report = TransferReport(size_bytes=size_bytes, count=count, concurrency=concurrency)
    base = key_prefix or f"{_root(store.config.prefix)}{PROBE_NAMESPACE}/bench-{int(time.time())}-{secrets.token_hex(4)}"
    keys = [f"{base}/{i:04d}.bin" for i in range(count)]
    body = bytearray(os.urandom(size_bytes))
    sem = asyncio.Semaphore(concurrency)
    written: list[str] = []
    done = 0

    async def put(key: str) -> None:
        nonlocal done
        async with sem:
            t0 = time.perf_counter()
            await store.put_async(key, body)
            report.put_latencies_ms.append((time.perf_counter() - t0) * 1000.0)
            written.append(key)
            done += 1
            progress("put", done, count)

    async def get(key: str) -> bool:
        nonlocal done
        async with sem:
            t0 = time.perf_counter()
            got = await store.get_async(key)
            report.get_latencies_ms.append((time.perf_counter() - t0) * 1000.0)
            done += 1
            progress("get", done, count)
            return got == body

    op = "PUT"
    try:
        progress("put", 0, count)
        t0 = time.perf_counter()
        await asyncio.gather(*(put(k) for k in keys))
        report.put_wall_s = time.perf_counter() - t0
        op, done = "GET", 0
        progress("get", 0, count)
        t0 = time.perf_counter()
        same = await asyncio.gather(*(get(k) for k in keys))
        report.get_wall_s = time.perf_counter() - t0
        report.verified = all(same)
        if not report.verified:
            report.error = "a GET returned different bytes than were PUT"
    except Exception as exc:  # noqa: BLE001
        report.diagnosis = diagnose(exc, store.config, op=op)
        report.error = report.diagnosis.cause
    finally:
        if written:
            try:
                await store.delete_many_async(written)
                report.cleaned_up = True
            except Exception as exc:  # noqa: BLE001
                report.error = report.error or f"could not delete the bench objects under {base}/: {exc}"
        else:
            report.cleaned_up = True
    return report


def transfer_check(store: S3Store, size_bytes: int, count: int, *, concurrency: int = 1,
                   progress: Progress | None = None, key_prefix: str | None = None) -> TransferReport:
    """PUT then GET ``count`` random blobs of ``size_bytes`` through ``store`` (``concurrency``
    at a time), verify the bytes, delete them, and report latencies and MiB/s."""
    return store.run(transfer_check_async(store, size_bytes, count, concurrency=concurrency,
                                          progress=progress, key_prefix=key_prefix), None)
