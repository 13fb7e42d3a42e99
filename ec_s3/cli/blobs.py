"""``ec-s3 inspect``: find one blob (by key or by item identifier) and validate it.

Owns locating a blob (a key, ``s3://bucket/key``, or an identifier looked up in one or
every namespace), the checks of a fetched blob against itself and against its key, and
the printing. Does not own the blob format (:mod:`ec_s3.blob.codec`, imported only
when a blob is read, because it imports torch) nor the key scheme
(:mod:`ec_s3.blob.keys`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time
from typing import Any

from ec_s3.blob.keys import PROBE_NAMESPACE
from ec_s3.cli.common import add_command, format_bytes, format_duration, opened_store
from ec_s3.cli.console import EXIT_FAIL, EXIT_MISSING, EXIT_OK, fail, json_out, out
from ec_s3.cli.listing import list_namespaces_async, namespace_of
from ec_s3.store.client import IntegrityError, S3Store
from ec_s3.store.diagnose import Diagnosis, diagnose

__all__ = [
    "InspectReport",
    "find_blob_keys",
    "find_blob_keys_async",
    "inspect_blob",
    "inspect_blob_async",
    "register",
]

# Header metadata printed on lines of their own; the rest is printed as "meta k=v".
_SHOWN_METADATA = ("format", "identifier", "identifier_sha256", "dtype", "shape", "namespace", "producer")


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

    def unreadable(self, exc: BaseException, store: S3Store, op: str) -> InspectReport:
        self.diagnosis = diagnose(exc, store.config, op=op)
        self.problems.append(self.diagnosis.cause)
        return self


async def inspect_blob_async(store: S3Store, key: str, *, identifier: str | None = None,
                             prefix: str | None = None) -> InspectReport:
    from ec_s3.blob.codec import BlobError, read_header  # imports torch

    prefix = prefix or store.config.prefix
    report = InspectReport(key=key, exists=False, namespace=namespace_of(prefix, key))
    try:
        info = await store.head_async(key)
    except Exception as exc:  # noqa: BLE001
        return report.unreadable(exc, store, "HEAD")
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
    except IntegrityError as exc:  # the stored checksum does not match the bytes
        report.error_reason = "integrity"
        report.problems.append(f"checksum mismatch: {exc.reason}")
        return report
    except Exception as exc:  # noqa: BLE001
        return report.unreadable(exc, store, "GET")
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
    _check_consistency(report, key, identifier)
    report.valid = not report.problems
    return report


def _check_consistency(report: InspectReport, key: str, identifier: str | None) -> None:
    """The header against itself and against where the blob lives (its key, its namespace)."""
    from ec_s3.blob.codec import identifier_digest

    metadata = report.metadata
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


# ---------------------------------------------------------------------- the command
def run(args: argparse.Namespace) -> int:
    with opened_store(args) as store:
        config = store.config
        target = args.target
        s3_root = f"s3://{config.bucket}/"
        if target.startswith(s3_root):
            target = target[len(s3_root):]
        identifier: str | None = None
        if target.startswith(config.prefix.strip("/") + "/") and not args.identifier:
            keys = [target]
        else:
            identifier = args.target
            try:
                keys, looked = find_blob_keys(store, identifier, namespace=config.namespace,
                                              cache_salt=args.cache_salt)
            except Exception as exc:  # noqa: BLE001
                d = diagnose(exc, config, op="LIST")
                return fail(d.cause, d.fix)
            if not keys:
                return _no_blob(args, identifier, looked, config.namespace, config.prefix)
        reports = [inspect_blob(store, key, identifier=identifier) for key in keys]
        status = _status(reports)
        if args.json:
            data = [r.to_dict() for r in reports]
            ok = status == EXIT_OK
            json_out({"ok": ok, "blobs": data} if len(data) != 1 else {"ok": ok, **data[0]})
            return status
        for r in reports:
            _print_report(r)
        return status


def _status(reports: list[InspectReport]) -> int:
    """0 when every blob is valid; 3 when the only trouble is a blob that is not there
    (a miss, which the connector expects); 1 for an invalid or unreadable one."""
    if all(r.valid for r in reports):
        return EXIT_OK
    if all(r.valid or _missing(r) for r in reports):
        return EXIT_MISSING
    return EXIT_FAIL


def _missing(r: InspectReport) -> bool:
    return not r.exists and r.diagnosis is None


def _no_blob(args: argparse.Namespace, identifier: str, looked: list[str], namespace: str | None,
             prefix: str) -> int:
    where = f"namespace {namespace!r}" if namespace else f"any of the {len(looked)} namespace(s) under {prefix}/"
    msg = f"no blob for identifier {identifier!r} in {where}"
    if args.json:
        json_out({"ok": False, "exists": False, "identifier": identifier, "looked_at": looked, "error": msg})
    else:
        out(f"MISSING: {msg}")
        for key in looked[:10]:
            out(f"  looked at {key}")
        out("  fix: pass the full key, the right --namespace, or --cache-salt for a salted request")
    return EXIT_MISSING


def _print_report(r: InspectReport) -> None:
    out(f"key        {r.key}")
    if not r.exists and r.diagnosis is not None:  # not read: the store failed
        out(f"FAIL: {r.diagnosis.cause}")
        out(f"  fix: {r.diagnosis.fix}")
        return
    if not r.exists:
        out("MISSING: no object at this key (not found; a consumer takes it as a miss)")
        return
    age = time.time() - r.last_modified if r.last_modified else None
    out(f"size       {r.size} bytes ({format_bytes(r.size or 0)})"
        + (f", written {format_duration(age)} ago" if age is not None else ""))
    out(f"namespace  {r.namespace or '(none)'} (from the key)")
    if r.metadata:
        md = r.metadata
        out(f"format     {md.get('format', '-')}")
        out(f"identifier {md.get('identifier', '(not stored: too long or not printable)')}")
        out(f"id sha256  {md.get('identifier_sha256', '-')}")
        out(f"dtype      {r.dtype}")
        out(f"shape      {tuple(r.shape or ())}")
        out(f"header ns  {md.get('namespace', '-')}")
        out(f"producer   {md.get('producer') or '-'}")
        for k, v in sorted((k, v) for k, v in md.items() if k not in _SHOWN_METADATA):
            out(f"meta       {k}={v}")
        out(f"data       {r.data_offset}+{(r.size or 0) - (r.data_offset or 0)} bytes")
    for k, v in sorted(r.s3_metadata.items()):
        out(f"s3 meta    {k}={v}")
    if r.valid:
        out("VALID: header parses and passes the structural checks; metadata matches the key")
    else:
        out("INVALID: " + "; ".join(r.problems))
        if r.error_reason:
            out(f"  reason: {r.error_reason} (ec-s3 rejects a blob that fails this check)")
    out("")


def register(sub: Any) -> None:
    p = add_command(
        sub, "inspect", help="show and validate one blob", func=run,
        description="Fetch one blob and show its size, metadata (format, identifier, dtype, shape, "
                    "namespace, producer) and whether it is valid (header parse and structural checks, "
                    "metadata consistent with its key). TARGET is a full key under the prefix (or "
                    "s3://bucket/key), or an item identifier (mm_hash / multi_modal_uuid) whose key is "
                    "computed in --namespace, or looked up in every namespace under the prefix. "
                    "Exit status 0 if valid, 3 if missing (not found: MISSING), 1 if invalid (INVALID) "
                    "or unreadable (FAIL).",
        namespace_help="namespace for an identifier (default: look in every namespace)",
    )
    p.add_argument("target", metavar="KEY|IDENTIFIER")
    p.add_argument("--identifier", action="store_true", help="treat TARGET as an identifier even if it looks like a key")
    p.add_argument("--cache-salt", help="the request's cache_salt, for blobs of salted (per-tenant) requests")
