"""``ec-s3 stats`` and ``ec-s3 gc``: what the cache holds, and deleting what is old.

Owns the per-namespace summary (counts, bytes, ages since written; the probe objects are
not a namespace), what gc deletes (:func:`plan_gc`, pure) and the batched deletes, with
their reports. Does not own gc by lifecycle rule (:mod:`ec_s3.cli.lifecycle`), of
incomplete uploads (:mod:`ec_s3.cli.uploads`), the listing (:mod:`ec_s3.cli.listing`) nor
retries (the store's).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from collections.abc import Iterable, Mapping
from typing import Any

from ec_s3.blob.format import BLOB_NAME_RE
from ec_s3.blob.keys import PROBE_NAMESPACE
from ec_s3.cli import lifecycle, uploads
from ec_s3.cli.common import (
    CONFIG_HELP,
    Outcome,
    Progress,
    add_command,
    format_bytes,
    format_duration,
    no_progress,
    opened_store,
    parse_duration,
    parse_size,
)
from ec_s3.cli.console import EXIT_FAIL, EXIT_OK, ProgressBar, fail, json_out, out, print_diagnosis
from ec_s3.cli.listing import key_root, list_objects, list_objects_async, namespace_of
from ec_s3.store.client import DELETE_BATCH, ObjectInfo, S3Store
from ec_s3.store.diagnose import diagnose

__all__ = [
    "AGE_BUCKETS",
    "GcReport",
    "NamespaceStats",
    "bucket_stats",
    "plan_gc",
    "register",
    "run_gc",
    "run_gc_async",
    "summarize",
    "total_stats",
]

#: Age classes of ``stats``: (label, upper bound in seconds, exclusive).
AGE_BUCKETS: tuple[tuple[str, float], ...] = (
    ("<1h", 3600.0),
    ("<1d", 86400.0),
    ("<7d", 7 * 86400.0),
    (">=7d", math.inf),
)


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
    """Per-namespace counts, bytes and age classes of ``objects`` (pure; sorted by
    namespace), without the probe objects."""
    now = time.time() if now is None else now
    root = key_root(prefix)
    stats: dict[str, NamespaceStats] = {}
    for info in objects:
        ns = namespace_of(prefix, info.key)
        if ns == PROBE_NAMESPACE:
            continue
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
    """Objects, bytes and age distribution per namespace under ``<prefix>/``."""
    prefix = prefix or store.config.prefix
    where = key_root(prefix) + (f"{namespace}/" if namespace else "")
    return summarize(list_objects(store, where, progress), prefix, now=now)


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
class GcReport(Outcome):
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
    progress = progress or no_progress
    where = key_root(prefix or store.config.prefix) + (f"{namespace}/" if namespace else "")
    report = GcReport(bucket=store.bucket, prefix=where, dry_run=dry_run,
                      older_than_s=older_than_s, max_bytes=max_bytes)
    try:
        objects = await list_objects_async(store, where, progress)
    except Exception as exc:  # noqa: BLE001
        report.record_failure(exc, store.config, op="LIST")
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
            report.record_failure(exc, store.config, op="DeleteObjects")
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


# ---------------------------------------------------------------------- the commands
def run_stats(args: argparse.Namespace) -> int:
    with opened_store(args) as store:
        t0 = time.monotonic()
        try:
            with ProgressBar.for_args(args) as progress:
                stats = bucket_stats(store, namespace=store.config.namespace, progress=progress)
        except Exception as exc:  # noqa: BLE001
            d = diagnose(exc, store.config, op="LIST")
            return fail(d.cause, d.fix)
        elapsed = time.monotonic() - t0
        total = total_stats(stats)
        if args.json:
            json_out({
                "bucket": store.bucket, "prefix": store.config.prefix, "endpoint_url": store.config.endpoint_url,
                "age_buckets": [label for label, _ in AGE_BUCKETS], "list_seconds": elapsed,
                "namespaces": {ns or "(none)": s.to_dict() for ns, s in stats.items()},
                "total": total.to_dict(),
            })
            return EXIT_OK
        out(f"s3://{store.bucket}/{store.config.prefix}/  ({total.objects} objects listed in {elapsed:.1f}s; "
            "age = time since written)")
        if not stats:
            out("  (empty)")
            return EXIT_OK
        labels = [label for label, _ in AGE_BUCKETS]
        width = max(12, *(len(ns or "(none)") for ns in stats))
        out(f"{'namespace':<{width}} {'objects':>9} {'bytes':>11} " + " ".join(f"{lb:>8}" for lb in labels)
            + "  oldest")
        rows = [*stats.values(), total] if len(stats) > 1 else list(stats.values())
        for s in rows:
            ages = " ".join(f"{s.ages[lb]:>8}" for lb in labels)
            oldest = format_duration(s.oldest_s) if s.oldest_s is not None else "-"
            out(f"{s.namespace or '(none)':<{width}} {s.objects:>9} {format_bytes(s.bytes):>11} {ages}  {oldest}")
        return EXIT_OK


def run_gc_command(args: argparse.Namespace) -> int:
    try:
        older = parse_duration(args.older_than) if args.older_than is not None else None
        max_bytes = parse_size(args.max_bytes) if args.max_bytes is not None else None
    except ValueError as exc:
        return fail(str(exc))
    if args.uploads:
        if args.lifecycle or max_bytes is not None:
            return fail("--uploads takes only --older-than (default 1d) and --dry-run",
                        "e.g. `ec-s3 gc --uploads --dry-run`; blobs and uploads are two gc runs")
    elif args.lifecycle:
        if older is None or max_bytes is not None:
            return fail("--lifecycle needs --older-than (whole days) and no --max-bytes",
                        "e.g. `ec-s3 gc --lifecycle --older-than 7d`; size limits need the listing gc")
    elif older is None and max_bytes is None:
        return fail("gc needs --older-than and/or --max-bytes",
                    "e.g. `ec-s3 gc --older-than 7d --dry-run` or `ec-s3 gc --max-bytes 500GiB`")
    with opened_store(args) as store:
        if args.uploads:
            with ProgressBar.for_args(args) as progress:
                return uploads.run(args, store, older, progress)
        if args.lifecycle:
            assert older is not None
            return lifecycle.run(args, store, older)
        with ProgressBar.for_args(args) as progress:
            report = run_gc(store, namespace=store.config.namespace, older_than_s=older, max_bytes=max_bytes,
                            dry_run=args.dry_run, progress=progress)
        if args.json:
            json_out(report.to_dict())
            return EXIT_OK if report.ok else EXIT_FAIL
        _print_gc(args, store, report)
        if not report.ok:
            assert report.diagnosis is not None
            print_diagnosis(report.diagnosis)
            return EXIT_FAIL
        return EXIT_OK


def _print_gc(args: argparse.Namespace, store: S3Store, report: GcReport) -> None:
    rules = []
    if report.older_than_s is not None:
        rules.append(f"older than {args.older_than}")
    if report.max_bytes is not None:
        rules.append(f"beyond a size limit of {format_bytes(report.max_bytes)} (oldest first)")
    out(f"gc s3://{store.bucket}/{report.prefix}: blobs {' and '.join(rules)}")
    out(f"  scanned      {report.scanned} objects, {format_bytes(report.scanned_bytes)}")
    verb = "would delete" if args.dry_run else "selected"
    out(f"  {verb:<12} {report.selected} objects, {format_bytes(report.selected_bytes)}"
        + (f" (ages {format_duration(report.newest_selected_age_s or 0)}"
           f"..{format_duration(report.oldest_selected_age_s or 0)})" if report.selected else ""))
    if args.dry_run:
        for key in report.sample[:5]:
            out(f"    {key}")
        if report.selected > 5:
            out(f"    ... and {report.selected - 5} more")
    else:
        out(f"  deleted      {report.deleted} objects, {format_bytes(report.deleted_bytes)}")
    out(f"  kept         {report.remaining} objects, {format_bytes(report.remaining_bytes)}")
    if args.dry_run:
        out("dry run: nothing was deleted")


def register(sub: Any) -> None:
    add_command(
        sub, "stats", help="objects, bytes and ages per namespace", func=run_stats,
        description="List every object under <prefix>/ and print, per namespace (one per model), the "
                    "object count, bytes and age distribution (<1h, <1d, <7d, >=7d; age is the time since "
                    "the blob was written: S3 keeps no access time). Needs s3:ListBucket.",
        namespace_help="only this namespace",
    )
    p = add_command(
        sub, "gc", help="delete old blobs, or install a lifecycle rule", func=run_gc_command,
        description="Delete blobs under <prefix>/ written longer ago than --older-than, and/or the oldest "
                    "blobs until the rest fits in --max-bytes. Deletes go in batches of 1000 "
                    "(DeleteObjects); --dry-run only reports. A blob deleted while a consumer fetches it "
                    "is just a miss (the item is encoded again). With --lifecycle, install an S3 "
                    "lifecycle rule instead (expire objects under the prefix --older-than whole days "
                    "after they are written, and abort incomplete multipart uploads a day after they "
                    "start), so the server does the gc; servers without lifecycle support are reported. "
                    "With --uploads, report and abort incomplete multipart uploads under the prefix "
                    "started longer ago than --older-than (default 1d) instead; --dry-run only reports.",
        epilog=CONFIG_HELP + "\nsizes: 500MiB, 10GB (1000^3), 2G (=2GiB), or bytes; "
                             "durations: 30m, 12h, 7d, 1d12h, 2w, or seconds\n",
        namespace_help="only this namespace",
    )
    p.add_argument("--older-than", metavar="DURATION",
                   help="delete blobs (with --uploads: abort uploads) at least this old (e.g. 7d, 12h, 30m; 0s = all)")
    p.add_argument("--max-bytes", metavar="SIZE", help="then delete the oldest until the rest fits this size (e.g. 500GiB)")
    p.add_argument("--dry-run", action="store_true", help="report what would be deleted; delete nothing")
    p.add_argument("--uploads", action="store_true",
                   help="abort incomplete multipart uploads started longer ago than --older-than (default 1d)")
    p.add_argument("--lifecycle", action="store_true",
                   help="install an S3 lifecycle expiration rule (--older-than, whole days) instead of deleting")
