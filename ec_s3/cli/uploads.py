"""``ec-s3 gc --uploads``: report and abort stale incomplete multipart uploads under the prefix.

An upload neither completed nor aborted keeps its parts billed and invisible until
aborted. Owns which go (:func:`plan_uploads`, pure: older than ``--older-than``, default a
day), the aborts and their report. Does not own listing or aborting one upload
(:mod:`ec_s3.store.multipart`), the blob gc nor the lifecycle rule.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time
from collections.abc import Iterable
from typing import Any

from ec_s3.cli.common import Outcome, Progress, format_duration, no_progress
from ec_s3.cli.console import EXIT_FAIL, EXIT_OK, json_out, out, print_diagnosis
from ec_s3.cli.listing import key_root
from ec_s3.store.client import S3Store
from ec_s3.store.multipart import IncompleteUpload, abort_upload_async, list_uploads_async

__all__ = ["DEFAULT_UPLOAD_AGE_S", "UploadsGcReport", "plan_uploads", "run", "run_uploads_gc",
           "run_uploads_gc_async"]

DEFAULT_UPLOAD_AGE_S = 86400.0
_ABORTS_IN_FLIGHT = 8


def plan_uploads(uploads: Iterable[IncompleteUpload], older_than_s: float, now: float) -> list[IncompleteUpload]:
    """The uploads started at least ``older_than_s`` ago, oldest first."""
    return sorted((u for u in uploads if now - u.initiated >= older_than_s), key=lambda u: (u.initiated, u.key))


@dataclasses.dataclass
class UploadsGcReport(Outcome):
    bucket: str
    prefix: str
    dry_run: bool
    older_than_s: float
    scanned: int = 0  # incomplete uploads under the prefix
    selected: int = 0  # of those, old enough to abort
    aborted: int = 0
    oldest_age_s: float | None = None
    sample: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # key, upload_id, age_s

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "ok": self.ok}


async def run_uploads_gc_async(store: S3Store, *, prefix: str | None = None, namespace: str | None = None,
                               older_than_s: float = DEFAULT_UPLOAD_AGE_S, dry_run: bool = False,
                               now: float | None = None, progress: Progress | None = None,
                               sample_size: int = 10) -> UploadsGcReport:
    progress = progress or no_progress
    where = key_root(prefix or store.config.prefix) + (f"{namespace}/" if namespace else "")
    report = UploadsGcReport(bucket=store.bucket, prefix=where, dry_run=dry_run, older_than_s=older_than_s)
    found: list[IncompleteUpload] = []
    try:
        async for upload in list_uploads_async(store, where):
            found.append(upload)
            if len(found) % 1000 == 0:
                progress("listing uploads", len(found), None)
    except Exception as exc:  # noqa: BLE001 - reported with a diagnosis
        report.record_failure(exc, store.config, op="ListMultipartUploads")
        return report
    now = time.time() if now is None else now
    victims = plan_uploads(found, older_than_s, now)
    report.scanned, report.selected = len(found), len(victims)
    report.sample = [{"key": u.key, "upload_id": u.upload_id, "age_s": max(0.0, now - u.initiated)}
                     for u in victims[:sample_size]]
    if victims:
        report.oldest_age_s = max(0.0, now - victims[0].initiated)
    if dry_run or not victims:
        return report
    progress("aborting uploads", 0, len(victims))
    for i in range(0, len(victims), _ABORTS_IN_FLIGHT):
        batch = victims[i : i + _ABORTS_IN_FLIGHT]
        results = await asyncio.gather(*(abort_upload_async(store, u.key, u.upload_id) for u in batch),
                                       return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        report.aborted += len(batch) - len(failures)
        progress("aborting uploads", report.aborted, len(victims))
        if failures:  # stop, report what was done and why
            report.record_failure(failures[0], store.config, op="AbortMultipartUpload")
            break
    return report


def run_uploads_gc(store: S3Store, **kwargs: Any) -> UploadsGcReport:
    """:func:`run_uploads_gc_async` from a thread that is not the store's loop."""
    return store.run(run_uploads_gc_async(store, **kwargs), None)


def run(args: argparse.Namespace, store: S3Store, older_than_s: float | None, progress: Progress) -> int:
    """``ec-s3 gc --uploads [--older-than D] [--dry-run]`` once the arguments are checked."""
    older = DEFAULT_UPLOAD_AGE_S if older_than_s is None else older_than_s
    report = run_uploads_gc(store, namespace=store.config.namespace, older_than_s=older,
                            dry_run=args.dry_run, progress=progress)
    if args.json:
        json_out(report.to_dict())
        return EXIT_OK if report.ok else EXIT_FAIL
    out(f"gc s3://{store.bucket}/{report.prefix}: incomplete multipart uploads started "
        f"more than {format_duration(older)} ago")
    out(f"  found        {report.scanned} incomplete upload(s)")
    verb = "would abort" if args.dry_run else "selected"
    out(f"  {verb:<12} {report.selected}"
        + (f" (oldest started {format_duration(report.oldest_age_s or 0)} ago)" if report.selected else ""))
    if args.dry_run:
        for item in report.sample[:5]:
            out(f"    {item['key']}  (upload {item['upload_id'][:16]}…, {format_duration(item['age_s'])} old)")
        if report.selected > 5:
            out(f"    ... and {report.selected - 5} more")
        out("dry run: nothing was aborted")
    else:
        out(f"  aborted      {report.aborted}")
    if not report.ok:
        assert report.diagnosis is not None
        print_diagnosis(report.diagnosis)
        return EXIT_FAIL
    return EXIT_OK
