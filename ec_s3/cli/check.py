"""``ec-s3 check``: prove that a configuration works against the real bucket.

Owns the probe sequence (with ``--create-bucket``, the bucket first if missing; LIST the
prefix, HEAD a missing key, then PUT/HEAD/GET/DELETE a probe object; reads only with
``--read-only``), its report and its printing. Does not
own the wording of a failure (:mod:`ec_s3.store.diagnose`, shared with the connector's
start-up checks), retries (the store's), nor the endpoint's capability table that
follows a passing check (:mod:`ec_s3.cli.capabilities`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from ec_s3.blob.keys import PROBE_NAMESPACE
from ec_s3.cli.capabilities import Capability, print_table, probe_capabilities, static_rows
from ec_s3.cli.common import add_command, config_from_args
from ec_s3.cli.console import EXIT_FAIL, EXIT_OK, fmt_ms, json_out, out, print_diagnosis, where
from ec_s3.cli.listing import list_page
from ec_s3.config import ConfigError, ECS3Config, config_keys
from ec_s3.store.client import AccessDenied, BucketNotFound, ObjectNotFound, S3Store, StoreError, StoreRequestError
from ec_s3.store.connection import resolve_endpoint
from ec_s3.store.diagnose import Diagnosis, credential_source, diagnose

__all__ = ["CheckReport", "CheckStep", "check_access", "check_access_async", "register"]

T = TypeVar("T")
# fail(step, exc, op): records the failed step and its diagnosis; returns the report.
_Fail = Callable[[str, BaseException, str], "CheckReport"]


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
    region_source: str = ""  # connection.resolve_endpoint: key, env var, profile or default
    tls_ca: str | None = None  # the CA file TLS is verified with (None: not verified)
    tls_ca_source: str = ""
    steps: list[CheckStep] = dataclasses.field(default_factory=list)
    diagnosis: Diagnosis | None = None
    warnings: list[str] = dataclasses.field(default_factory=list)
    probe_key: str = ""
    capabilities: list[Capability] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _resolved(config: ECS3Config) -> dict[str, Any]:
    """The report's region and CA fields: what the store resolves (connection.resolve_endpoint)."""
    resolved = resolve_endpoint(config)
    return {"region": resolved.region, "region_source": resolved.region_source,
            "tls_ca": resolved.ca_file, "tls_ca_source": resolved.ca_source}


async def _timed(aw: Awaitable[T]) -> tuple[T, float]:
    t0 = time.perf_counter()
    result = await aw
    return result, (time.perf_counter() - t0) * 1000.0


async def check_access_async(store: S3Store, *, read_only: bool = False, probe_bytes: int = 4096,
                             environ: Mapping[str, str] | None = None, create_bucket: bool = False) -> CheckReport:
    """The access steps; once they pass, the endpoint's capabilities are probed (the
    TLS and region rows come either way)."""
    existing: list[str] = []
    report = await _check_steps(store, read_only, probe_bytes, environ, existing, create_bucket)
    settings = resolve_endpoint(store.config)  # as the report's region and CA fields
    if report.ok:
        report.capabilities = await probe_capabilities(store, read_only=read_only, settings=settings,
                                                       existing_key=existing[0] if existing else None)
    else:
        failed = report.diagnosis is not None and report.diagnosis.kind == "tls"
        report.capabilities = static_rows(store.config, settings, handshake_failed=failed)
    return report


async def _create_bucket(store: S3Store, report: CheckReport) -> None:
    """``--create-bucket`` after step 1's LIST answered NoSuchBucket: create it (on AWS S3,
    in the resolved region)."""
    bucket = store.config.bucket
    region = resolve_endpoint(store.config).region if store.config.endpoint_url is None else None
    _, ms = await _timed(store.create_bucket_async(region, taken_is_error=True))
    report.steps.append(CheckStep("create-bucket", True, ms,
                                  f"CreateBucket s3://{bucket}" + (f" in {region}" if region else "") + " (it was missing)"))


async def _check_steps(store: S3Store, read_only: bool, probe_bytes: int, environ: Mapping[str, str] | None,
                       existing: list[str], create_bucket: bool = False) -> CheckReport:
    config = store.config
    root = f"{config.prefix}/"
    probe = f"{root}{PROBE_NAMESPACE}/check-{int(time.time())}-{secrets.token_hex(6)}.bin"
    report = CheckReport(
        ok=False, read_only=read_only, bucket=config.bucket, prefix=config.prefix,
        endpoint_url=config.endpoint_url, **_resolved(config),
        credentials=credential_source(config, environ), probe_key=probe,
    )

    def fail(step: str, exc: BaseException, op: str) -> CheckReport:
        d = diagnose(exc, config, op=op)
        raw = exc.reason if isinstance(exc, StoreError) else f"{type(exc).__name__}: {exc}"
        report.steps.append(CheckStep(step, False, None, raw))
        report.diagnosis = d
        return report

    try:
        try:
            first = await _check_list(store, report, existing)
        except BucketNotFound:
            if not create_bucket:
                raise
            try:
                await _create_bucket(store, report)
            except Exception as exc:  # noqa: BLE001
                return fail("create-bucket", exc, "CreateBucket")
            first = await _check_list(store, report, existing)
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
        return await _check_reads(store, report, probe, first, fail)
    return await _check_round_trip(store, report, probe, probe_bytes, fail)


async def _check_list(store: S3Store, report: CheckReport, existing: list[str]) -> dict[str, Any] | None:
    """1. LIST on the prefix: the answer carries an error code, so it tells wrong
    credentials, a missing bucket and an unreachable endpoint apart. Returns the first
    object listed; raises what failed (a missing s3:ListBucket is only a warning)."""
    config = store.config
    root = f"{config.prefix}/"
    try:
        page, ms = await _timed(list_page(store, root, max_keys=1))
    except AccessDenied as exc:
        if diagnose(exc, config, op="LIST").kind != "permission":
            raise
        note = ("no s3:ListBucket: `ec-s3 stats` and `gc` will not work, and on AWS a missing key "
                "answers 403 instead of 404")
        report.steps.append(CheckStep("list", True, None, "refused (403 AccessDenied): " + note, warning=True))
        report.warnings.append(note)
        return None
    contents = page.get("Contents") or []
    first: dict[str, Any] | None = contents[0] if contents else None
    if first and int(first.get("Size") or 0) >= 5:  # the capability probe reads bytes 1-4
        existing.append(str(first["Key"]))
    report.steps.append(CheckStep("list", True, ms, f"ListObjectsV2 s3://{config.bucket}/{root} answers"
                                  + (" (prefix has objects)" if first else " (prefix is empty)")))
    return first


async def _check_reads(store: S3Store, report: CheckReport, probe: str, first: dict[str, Any] | None,
                       fail: _Fail) -> CheckReport:
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


async def _check_round_trip(store: S3Store, report: CheckReport, probe: str, probe_bytes: int,
                            fail: _Fail) -> CheckReport:
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
            d = diagnose(exc, store.config, op="DELETE")
            note = f"could not delete the probe object {probe}: {d.cause}; `ec-s3 gc` needs s3:DeleteObject"
            report.steps.append(CheckStep("delete", True, None, d.cause, warning=True))
            report.warnings.append(note)
    report.ok = report.diagnosis is None
    return report


def check_access(config: ECS3Config, *, read_only: bool = False, probe_bytes: int = 4096,
                 timeout: float | None = 300.0, environ: Mapping[str, str] | None = None,
                 create_bucket: bool = False) -> CheckReport:
    """Prove that ``config`` works: list, HEAD-miss, then PUT/HEAD/GET/DELETE a probe.

    ``read_only`` checks only what a consumer needs (LIST, HEAD and GET of a missing key
    answer 404, HEAD of an existing object), so read-only credentials pass.
    """
    store = S3Store(config)
    try:
        return store.run(check_access_async(store, read_only=read_only, probe_bytes=probe_bytes,
                                            environ=environ, create_bucket=create_bucket), timeout)
    except (concurrent.futures.TimeoutError, TimeoutError):
        return CheckReport(
            ok=False, read_only=read_only, bucket=config.bucket, prefix=config.prefix,
            endpoint_url=config.endpoint_url, **_resolved(config),
            credentials=credential_source(config, environ),
            diagnosis=Diagnosis("endpoint", f"the check did not finish within {timeout:.0f} s",
                                "check that the endpoint answers S3 requests promptly, or raise --timeout"),
        )
    finally:
        store.close(timeout=5.0)


# ---------------------------------------------------------------------- the command
def run(args: argparse.Namespace) -> int:
    if args.list_keys:
        for key, default, doc in config_keys():
            out(f"{key:<28} {default:<14} {doc}")
        return EXIT_OK
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        if args.json:
            json_out({"ok": False, "diagnosis": {"kind": "config", "cause": str(exc),
                                                 "fix": "fix the named key (see `ec-s3 check --list-keys`)"}})
        else:
            out(f"FAIL: bad configuration: {exc}")
            out("  fix: correct the named key in --config / --set / the flags (`ec-s3 check --list-keys` lists them)")
        return EXIT_FAIL
    if args.create_bucket and args.read_only:
        out("FAIL: --create-bucket writes (CreateBucket) and --read-only checks read access only: drop one of them")
        return EXIT_FAIL
    if not args.json:
        mode = "read-only (consumer)" if args.read_only else "read/write"
        out(f"ec-s3 check, {mode}: {where(config)}")
        out(f"credentials: {credential_source(config)}")
        resolved = resolve_endpoint(config)
        out(f"region: {resolved.region} (from {resolved.region_source})")
        out(f"tls: {resolved.tls_words(config.endpoint_url)}")
    report = check_access(config, read_only=args.read_only, timeout=args.timeout, create_bucket=args.create_bucket)
    if args.json:
        json_out(report.to_dict())
        return EXIT_OK if report.ok else EXIT_FAIL
    for step in report.steps:
        status = "ok  " if step.ok and not step.warning else ("WARN" if step.ok else "FAIL")
        out(f"  {status}  {step.name:<13} {fmt_ms(step.latency_ms)}  {step.detail}")
    for note in report.warnings:
        out(f"warning: {note}")
    if report.capabilities:
        print_table(report.capabilities)
    if report.ok:
        what = "read access (HEAD/GET, misses answer 404)" if args.read_only else "read/write access"
        out(f"PASS: {what} to s3://{config.bucket}/{config.prefix}/ works")
        return EXIT_OK
    assert report.diagnosis is not None
    print_diagnosis(report.diagnosis)
    return EXIT_FAIL


def register(sub: Any) -> None:
    p = add_command(
        sub, "check", help="validate a config and prove access to the bucket", func=run,
        description="Validate the configuration, then prove access with real requests, reporting each "
                    "step's latency: LIST the prefix, HEAD a missing key (must answer 404: that is a miss), "
                    "then PUT, HEAD, GET and DELETE a probe object under <prefix>/_ec_s3_probe/. "
                    "With --read-only only reads are tried (LIST, HEAD and GET of a missing key), so a "
                    "consumer's read-only credentials pass; --create-bucket first creates the bucket if it is "
                    "missing. Then a table of the endpoint's capabilities "
                    "(ranged GET, If-None-Match: * on PUT and on CompleteMultipartUpload, multipart, "
                    "checksum headers verified, TLS and its CA, region, clock skew) and what ec-s3 does "
                    "about each one that is missing; its probes delete their objects and abort their "
                    "uploads, and --read-only skips the writing ones. Exit status 0 on PASS, 1 on FAIL "
                    "with the cause (wrong credentials, missing bucket, unreachable endpoint, missing "
                    "permission) and the fix; a missing capability alone does not fail the check.",
        namespace_help="namespace override (checked like any config key)",
    )
    p.add_argument("--read-only", action="store_true",
                   help="check only read access (consumers): no PUT/DELETE")
    p.add_argument("--create-bucket", action="store_true",
                   help="create the bucket first if it does not exist (needs s3:CreateBucket; on AWS S3 in the "
                        "configured region); an existing bucket is left as it is")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="give up after S seconds (default 300; each request also has its own timeouts)")
    p.add_argument("--list-keys", action="store_true", help="list every config key with default and meaning, then exit")
