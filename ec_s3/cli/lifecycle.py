"""``ec-s3 gc --lifecycle``: let the S3 server expire old blobs, and abort stale incomplete
multipart uploads, by a bucket lifecycle rule.

Owns the rule ec-s3 installs (one per prefix, found again by its ID so a re-run
replaces it and keeps every other rule), telling "this server has no lifecycle
support" apart from other failures, and the printing. Does not own the listing gc
(:mod:`ec_s3.cli.bucket`) nor the store's request path: lifecycle calls are not
object operations, so they go to the S3 client directly with a timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
from typing import Any

from botocore import exceptions as boto_exc

from ec_s3.cli.console import EXIT_FAIL, EXIT_OK, err, json_out, out, print_diagnosis
from ec_s3.cli.listing import key_root
from ec_s3.config import ECS3Config
from ec_s3.store.client import S3Store
from ec_s3.store.error_map import to_store_error
from ec_s3.store.diagnose import Diagnosis, diagnose

__all__ = ["ABORT_UPLOADS_AFTER_DAYS", "LifecycleReport", "install_lifecycle", "install_lifecycle_async", "lifecycle_rule", "run"]


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


#: ec-s3's own uploads finish in seconds: one a day old is abandoned.
ABORT_UPLOADS_AFTER_DAYS = 1

_UNSUPPORTED_CODES = frozenset({"NotImplemented", "MethodNotAllowed", "UnsupportedOperation",
                                "XNotImplemented", "NotSupported"})


def lifecycle_rule(prefix: str, days: int, *, namespace: str | None = None) -> dict[str, Any]:
    where = key_root(prefix) + (f"{namespace}/" if namespace else "")
    return {
        "ID": f"ec-s3-expire:{where}"[:255],
        "Filter": {"Prefix": where},
        "Status": "Enabled",
        "Expiration": {"Days": int(days)},
        # Parts of uploads never completed nor aborted (a killed producer, an abort that
        # kept failing) are invisible to listings and expirations: abort them too.
        "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": ABORT_UPLOADS_AFTER_DAYS},
    }


def _client_error_parts(exc: boto_exc.ClientError) -> tuple[int, str, str]:
    error = exc.response.get("Error", {}) or {}
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return status, str(error.get("Code", "")), str(error.get("Message", ""))


def _lifecycle_unsupported(status: int, code: str, config: ECS3Config) -> Diagnosis:
    return Diagnosis(
        "unsupported",
        f"the S3 server at {config.endpoint_url or 'AWS'} does not support bucket lifecycle rules "
        f"({status} {code})",
        "expire blobs with a periodic `ec-s3 gc --older-than ...` instead (e.g. an hourly cron job "
        "or Kubernetes CronJob)",
    )


def _failed(report: LifecycleReport, store: S3Store, exc: BaseException, op: str) -> LifecycleReport:
    """``report`` with the diagnosis of ``op``'s failure (an unsupported API is no error of the operator's)."""
    config = store.config
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
    elif isinstance(exc, (asyncio.TimeoutError, TimeoutError, boto_exc.BotoCoreError, OSError)):
        exc = to_store_error(op, store.bucket, exc) or exc
    report.diagnosis = diagnose(exc, config, op=op)
    return report


async def _rules(client: Any, bucket: str, timeout: float) -> list[dict[str, Any]]:
    """The bucket's lifecycle rules ([] when it has none)."""
    try:
        resp = await asyncio.wait_for(client.get_bucket_lifecycle_configuration(Bucket=bucket), timeout)
    except boto_exc.ClientError as exc:
        status, code, _ = _client_error_parts(exc)
        if code in ("NoSuchLifecycleConfiguration", "NoSuchLifecycle") or (status == 404 and code != "NoSuchBucket"):
            return []
        raise
    return list(resp.get("Rules") or [])


async def install_lifecycle_async(store: S3Store, days: int, *, prefix: str | None = None,
                                  namespace: str | None = None, dry_run: bool = False) -> LifecycleReport:
    config = store.config
    if days < 1:
        raise ValueError("lifecycle expiration needs at least 1 day")
    rule = lifecycle_rule(prefix or config.prefix, days, namespace=namespace)
    report = LifecycleReport(ok=False, supported=None, bucket=store.bucket, rule=rule, dry_run=dry_run)
    timeout = config.read_timeout_s + config.connect_timeout_s + 5.0
    try:
        client = await store._get_client()
        existing = await _rules(client, store.bucket, timeout)
    except Exception as exc:  # noqa: BLE001
        return _failed(report, store, exc, "GetLifecycle")
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
        return _failed(report, store, exc, "PutLifecycle")
    report.installed = report.supported = True
    try:
        mine = [r for r in await _rules(client, store.bucket, timeout) if r.get("ID") == rule["ID"]]
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


def run(args: argparse.Namespace, store: S3Store, older_s: float) -> int:
    """``ec-s3 gc --lifecycle --older-than ...`` once the arguments are checked."""
    days = max(1, math.ceil(older_s / 86400.0))
    if older_s % 86400.0:
        err(f"note: S3 lifecycle rules count whole days: expiring after {days} day(s)")
    report = install_lifecycle(store, days, namespace=store.config.namespace, dry_run=args.dry_run)
    if args.json:
        json_out(report.to_dict())
        return EXIT_OK if report.ok else EXIT_FAIL
    rule = report.rule
    desc = (f"expire objects under s3://{store.bucket}/{rule['Filter']['Prefix']} {days} day(s) after they are "
            f"written, abort incomplete uploads {ABORT_UPLOADS_AFTER_DAYS} day(s) after they start")
    if not report.ok:
        assert report.diagnosis is not None
        out(f"lifecycle rule NOT installed ({desc})")
        print_diagnosis(report.diagnosis)
        return EXIT_FAIL
    if report.dry_run:
        out(f"dry run: would install lifecycle rule {rule['ID']!r}: {desc}")
        out(f"  {report.other_rules_kept} other rule(s) on the bucket would be kept")
        return EXIT_OK
    out(f"installed lifecycle rule {rule['ID']!r}: {desc}")
    out(f"  {report.other_rules_kept} other rule(s) kept; "
        + ("read back and verified" if report.verified else "could not read it back to verify"))
    out("  note: the server applies the rule on its own schedule (usually once a day)")
    return EXIT_OK
