"""``ec-s3``: the operator's command line for an ec-s3 bucket.

Subcommands: ``check`` (prove a config works), ``stats`` (what the cache holds),
``gc`` (delete old blobs or install a lifecycle rule), ``inspect`` (validate one
blob), ``bench`` (a quick transfer check), and ``proxy`` / ``demo`` (passed through to
:mod:`ec_s3.proxy.main` / :mod:`ec_s3.demo.run`). The work is done in :mod:`ec_s3.cli.ops`; this
module parses arguments and prints. It never imports vLLM, and torch only for
``inspect``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import math
import sys
import time
from typing import Any, TextIO

from ec_s3 import __version__
from ec_s3.config import ConfigError, ECS3Config, config_keys
from ec_s3.store.client import StoreError

__all__ = ["main"]

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
_PASSTHROUGH = {
    "proxy": ("ec_s3.proxy.main", "run the ec-s3 proxy (see `ec-s3 proxy --help`)"),
    "demo": ("ec_s3.demo.run", "run the ec-s3 demo (see `ec-s3 demo --help`)"),
}

_CONFIG_HELP = """\
configuration (the same keys as the connector's ec_connector_extra_config):
  --config takes JSON text, @FILE or a file path holding either the
  ec_connector_extra_config dict or the whole ec_transfer_config JSON passed to
  vLLM (its ec_connector_extra_config is used). Flags override it; bucket and
  endpoint_url fall back to $EC_S3_BUCKET and $EC_S3_ENDPOINT_URL. Credentials come
  from the standard AWS chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
  AWS_SESSION_TOKEN, AWS_PROFILE, instance roles) unless the config sets
  access_key_id / secret_access_key. Credentials are never printed.
"""


# ---------------------------------------------------------------------- output helpers
class ProgressBar:
    """A one-line text progress bar on stderr, ``progress(phase, done, total)``.

    On a terminal the line is redrawn (at most every 0.1 s); otherwise a line is printed
    when a phase starts, every 5 s and when it completes, so logs stay short.
    """

    def __init__(self, stream: TextIO | None = None, *, enabled: bool = True, width: int = 30,
                 interval_s: float | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval_s = interval_s if interval_s is not None else (0.1 if self.tty else 5.0)
        self._state: tuple[str, int, int | None] | None = None
        self._drawn: tuple[str, int, int | None] | None = None
        self._last = 0.0
        self._open = False

    def __call__(self, phase: str, done: int, total: int | None) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        previous, self._state = self._state, (phase, done, total)
        new_phase = previous is None or previous[0] != phase
        if new_phase and previous is not None:
            self._flush(previous)
        final = total is not None and done >= total
        if new_phase or final or now - self._last >= self.interval_s:
            self._draw(self._state)
            self._last = now

    def _text(self, state: tuple[str, int, int | None]) -> str:
        phase, done, total = state
        if total:
            frac = min(1.0, done / total)
            filled = int(round(frac * self.width))
            return f"{phase:<9}[{'#' * filled}{'.' * (self.width - filled)}] {frac * 100:5.1f}% {done}/{total}"
        return f"{phase:<9}{done} objects"

    def _draw(self, state: tuple[str, int, int | None]) -> None:
        if state == self._drawn:
            return
        self._drawn = state
        if self.tty:
            self.stream.write("\r" + self._text(state) + "\x1b[K")
            self._open = True
        else:
            self.stream.write(self._text(state) + "\n")
        self.stream.flush()

    def _flush(self, state: tuple[str, int, int | None]) -> None:
        """Show the phase's last state, then end its line."""
        self._draw(state)
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False

    def close(self) -> None:
        if self._state is not None:
            self._flush(self._state)
            self._state = None


def _out(text: str = "") -> None:
    print(text, file=sys.stdout)


def _err(text: str) -> None:
    print(text, file=sys.stderr)


def _json_out(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, default=str))


def _fail(message: str, fix: str | None = None) -> int:
    _err(f"ec-s3: error: {message}")
    if fix:
        _err(f"  fix: {fix}")
    return EXIT_FAIL


def _ms(value: float | None) -> str:
    return f"{value:8.1f} ms" if value is not None else "       - ms"


# ---------------------------------------------------------------------- config from flags
def _add_config_args(p: argparse.ArgumentParser, *, namespace_help: str) -> None:
    g = p.add_argument_group("configuration")
    g.add_argument("--config", metavar="JSON|@FILE",
                   help="ec_connector_extra_config dict or whole ec_transfer_config JSON (text, @FILE or path)")
    g.add_argument("--bucket", help="S3 bucket (default: config, then $EC_S3_BUCKET)")
    g.add_argument("--endpoint-url", help="S3 endpoint, e.g. http://minio:9000 (default: config, then $EC_S3_ENDPOINT_URL, then AWS)")
    g.add_argument("--prefix", help="key prefix (default: config, then 'ec-cache')")
    g.add_argument("--region", help="signing region (default: config, then 'us-east-1')")
    g.add_argument("--namespace", help=namespace_help)
    g.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="set any config key (repeatable); `ec-s3 check --list-keys` lists them")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print a JSON report on stdout instead of text")
    o.add_argument("-q", "--quiet", action="store_true", help="no progress bar on stderr")
    o.add_argument("-v", "--verbose", action="store_true", help="debug logging of S3 requests and retries")


def _config_from_args(args: argparse.Namespace) -> ECS3Config:
    from ec_s3.cli.ops import build_config, extra_config_from_json

    base = extra_config_from_json(args.config) if args.config else {}
    overrides: dict[str, Any] = {}
    for item in args.sets:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r} must be KEY=VALUE")
        overrides[key.strip()] = value
    for name in ("bucket", "endpoint_url", "prefix", "region", "namespace"):
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = value
    return build_config(base, overrides)


def _open_store(args: argparse.Namespace) -> Any:
    from ec_s3.store.client import S3Store

    return S3Store(_config_from_args(args))


def _progress(args: argparse.Namespace) -> ProgressBar:
    return ProgressBar(enabled=not args.quiet)


def _where(config: ECS3Config) -> str:
    return (f"s3://{config.bucket}/{config.prefix}/ at {config.endpoint_url or 'AWS S3'} "
            f"(region {config.region}, {config.addressing_style} addressing)")


def _print_diagnosis(diagnosis: Any, *, label: str = "FAIL") -> None:
    _out(f"{label}: {diagnosis.cause}")
    _out(f"  fix: {diagnosis.fix}")


# ---------------------------------------------------------------------- check
def _cmd_check(args: argparse.Namespace) -> int:
    from ec_s3.cli import ops

    if args.list_keys:
        for key, default, doc in config_keys():
            _out(f"{key:<28} {default:<14} {doc}")
        return EXIT_OK
    try:
        config = _config_from_args(args)
    except ConfigError as exc:
        if args.json:
            _json_out({"ok": False, "diagnosis": {"kind": "config", "cause": str(exc),
                                                  "fix": "fix the named key (see `ec-s3 check --list-keys`)"}})
        else:
            _out(f"FAIL: bad configuration: {exc}")
            _out("  fix: correct the named key in --config / --set / the flags (`ec-s3 check --list-keys` lists them)")
        return EXIT_FAIL
    if not args.json:
        mode = "read-only (consumer)" if args.read_only else "read/write"
        _out(f"ec-s3 check, {mode}: {_where(config)}")
        _out(f"credentials: {ops.credential_source(config)}")
    report = ops.check_access(config, read_only=args.read_only, timeout=args.timeout)
    if args.json:
        _json_out(report.to_dict())
        return EXIT_OK if report.ok else EXIT_FAIL
    for step in report.steps:
        status = "ok  " if step.ok and not step.warning else ("WARN" if step.ok else "FAIL")
        _out(f"  {status}  {step.name:<11} {_ms(step.latency_ms)}  {step.detail}")
    for note in report.warnings:
        _out(f"warning: {note}")
    if report.ok:
        what = "read access (HEAD/GET, misses answer 404)" if args.read_only else "read/write access"
        _out(f"PASS: {what} to s3://{config.bucket}/{config.prefix}/ works")
        return EXIT_OK
    assert report.diagnosis is not None
    _print_diagnosis(report.diagnosis)
    return EXIT_FAIL


# ---------------------------------------------------------------------- stats
def _cmd_stats(args: argparse.Namespace) -> int:
    from ec_s3.cli import ops

    try:
        store = _open_store(args)
    except ConfigError as exc:
        return _fail(f"bad configuration: {exc}", "correct the named key")
    progress = _progress(args)
    try:
        t0 = time.monotonic()
        try:
            stats = ops.bucket_stats(store, namespace=store.config.namespace, progress=progress)
        except Exception as exc:  # noqa: BLE001
            progress.close()
            d = ops.diagnose(exc, store.config, op="LIST")
            return _fail(d.cause, d.fix)
        progress.close()
        elapsed = time.monotonic() - t0
        total = ops.total_stats(stats)
        if args.json:
            _json_out({
                "bucket": store.bucket, "prefix": store.config.prefix, "endpoint_url": store.config.endpoint_url,
                "age_buckets": [label for label, _ in ops.AGE_BUCKETS], "list_seconds": elapsed,
                "namespaces": {ns or "(none)": s.to_dict() for ns, s in stats.items()},
                "total": total.to_dict(),
            })
            return EXIT_OK
        _out(f"s3://{store.bucket}/{store.config.prefix}/  ({total.objects} objects listed in {elapsed:.1f}s; "
             "age = time since written)")
        if not stats:
            _out("  (empty)")
            return EXIT_OK
        labels = [label for label, _ in ops.AGE_BUCKETS]
        width = max(12, *(len(ns or "(none)") for ns in stats))
        head = f"{'namespace':<{width}} {'objects':>9} {'bytes':>11} " + " ".join(f"{lb:>8}" for lb in labels) + "  oldest"
        _out(head)
        rows = [*stats.values(), total] if len(stats) > 1 else list(stats.values())
        for s in rows:
            name = s.namespace or "(none)"
            ages = " ".join(f"{s.ages[lb]:>8}" for lb in labels)
            oldest = ops.format_duration(s.oldest_s) if s.oldest_s is not None else "-"
            _out(f"{name:<{width}} {s.objects:>9} {ops.format_bytes(s.bytes):>11} {ages}  {oldest}")
        return EXIT_OK
    finally:
        store.close(timeout=5.0)


# ---------------------------------------------------------------------- gc
def _cmd_gc(args: argparse.Namespace) -> int:
    from ec_s3.cli import ops

    try:
        older = ops.parse_duration(args.older_than) if args.older_than is not None else None
        max_bytes = ops.parse_size(args.max_bytes) if args.max_bytes is not None else None
    except ValueError as exc:
        return _fail(str(exc))
    if args.lifecycle:
        if older is None or max_bytes is not None:
            return _fail("--lifecycle needs --older-than (whole days) and no --max-bytes",
                         "e.g. `ec-s3 gc --lifecycle --older-than 7d`; size budgets need the listing gc")
    elif older is None and max_bytes is None:
        return _fail("gc needs --older-than and/or --max-bytes",
                     "e.g. `ec-s3 gc --older-than 7d --dry-run` or `ec-s3 gc --max-bytes 500GiB`")
    try:
        store = _open_store(args)
    except ConfigError as exc:
        return _fail(f"bad configuration: {exc}", "correct the named key")
    try:
        if args.lifecycle:
            return _gc_lifecycle(args, store, older)
        progress = _progress(args)
        report = ops.run_gc(store, namespace=store.config.namespace, older_than_s=older, max_bytes=max_bytes,
                            dry_run=args.dry_run, progress=progress)
        progress.close()
        if args.json:
            _json_out(report.to_dict())
            return EXIT_OK if report.ok else EXIT_FAIL
        rules = []
        if older is not None:
            rules.append(f"older than {args.older_than}")
        if max_bytes is not None:
            rules.append(f"beyond a budget of {ops.format_bytes(max_bytes)} (oldest first)")
        _out(f"gc s3://{store.bucket}/{report.prefix}: blobs {' and '.join(rules)}")
        _out(f"  scanned      {report.scanned} objects, {ops.format_bytes(report.scanned_bytes)}")
        verb = "would delete" if args.dry_run else "selected"
        _out(f"  {verb:<12} {report.selected} objects, {ops.format_bytes(report.selected_bytes)}"
             + (f" (ages {ops.format_duration(report.newest_selected_age_s or 0)}"
                f"..{ops.format_duration(report.oldest_selected_age_s or 0)})" if report.selected else ""))
        if args.dry_run:
            for key in report.sample[:5]:
                _out(f"    {key}")
            if report.selected > 5:
                _out(f"    ... and {report.selected - 5} more")
            _out(f"  kept         {report.remaining} objects, {ops.format_bytes(report.remaining_bytes)}")
            _out("dry run: nothing was deleted")
        else:
            _out(f"  deleted      {report.deleted} objects, {ops.format_bytes(report.deleted_bytes)}")
            _out(f"  kept         {report.remaining} objects, {ops.format_bytes(report.remaining_bytes)}")
        if not report.ok:
            assert report.diagnosis is not None
            _print_diagnosis(report.diagnosis)
            return EXIT_FAIL
        return EXIT_OK
    finally:
        store.close(timeout=5.0)


def _gc_lifecycle(args: argparse.Namespace, store: Any, older: float) -> int:
    from ec_s3.cli import ops

    days = max(1, math.ceil(older / 86400.0))
    if older % 86400.0:
        _err(f"note: S3 lifecycle rules count whole days: expiring after {days} day(s)")
    report = ops.install_lifecycle(store, days, namespace=store.config.namespace, dry_run=args.dry_run)
    if args.json:
        _json_out(report.to_dict())
        return EXIT_OK if report.ok else EXIT_FAIL
    rule = report.rule
    desc = f"expire objects under s3://{store.bucket}/{rule['Filter']['Prefix']} {days} day(s) after they are written"
    if not report.ok:
        assert report.diagnosis is not None
        _out(f"lifecycle rule NOT installed ({desc})")
        _print_diagnosis(report.diagnosis)
        return EXIT_FAIL
    if report.dry_run:
        _out(f"dry run: would install lifecycle rule {rule['ID']!r}: {desc}")
        _out(f"  {report.other_rules_kept} other rule(s) on the bucket would be kept")
        return EXIT_OK
    _out(f"installed lifecycle rule {rule['ID']!r}: {desc}")
    _out(f"  {report.other_rules_kept} other rule(s) kept; "
         + ("read back and verified" if report.verified else "could not read it back to verify"))
    _out("  note: the server applies the rule on its own schedule (usually once a day)")
    return EXIT_OK


# ---------------------------------------------------------------------- inspect
def _cmd_inspect(args: argparse.Namespace) -> int:
    from ec_s3.cli import ops

    try:
        store = _open_store(args)
    except ConfigError as exc:
        return _fail(f"bad configuration: {exc}", "correct the named key")
    try:
        target = args.target
        config = store.config
        s3_root = f"s3://{config.bucket}/"
        if target.startswith(s3_root):
            target = target[len(s3_root):]
        identifier: str | None = None
        if target.startswith(config.prefix.strip("/") + "/") and not args.identifier:
            keys = [target]
        else:
            identifier = args.target
            try:
                keys, looked = ops.find_blob_keys(store, identifier, namespace=config.namespace,
                                                  cache_salt=args.cache_salt)
            except Exception as exc:  # noqa: BLE001
                d = ops.diagnose(exc, config, op="LIST")
                return _fail(d.cause, d.fix)
            if not keys:
                where = (f"namespace {config.namespace!r}" if config.namespace
                         else f"any of the {len(looked)} namespace(s) under {config.prefix}/")
                msg = f"no blob for identifier {identifier!r} in {where}"
                if args.json:
                    _json_out({"ok": False, "identifier": identifier, "looked_at": looked, "error": msg})
                else:
                    _out(f"INVALID: {msg}")
                    for key in looked[:10]:
                        _out(f"  looked at {key}")
                    _out("  fix: pass the full key, the right --namespace, or --cache-salt for a salted request")
                return EXIT_FAIL
        reports = [ops.inspect_blob(store, key, identifier=identifier) for key in keys]
        ok = all(r.valid for r in reports)
        if args.json:
            data = [r.to_dict() for r in reports]
            _json_out({"ok": ok, "blobs": data} if len(data) != 1 else {"ok": ok, **data[0]})
            return EXIT_OK if ok else EXIT_FAIL
        for r in reports:
            _print_inspect(r)
        return EXIT_OK if ok else EXIT_FAIL
    finally:
        store.close(timeout=5.0)


def _print_inspect(r: Any) -> None:
    from ec_s3.cli import ops

    _out(f"key        {r.key}")
    if not r.exists:
        _out(f"INVALID: {'; '.join(r.problems) or 'not found'}")
        if r.diagnosis is not None:
            _out(f"  fix: {r.diagnosis.fix}")
        return
    age = time.time() - r.last_modified if r.last_modified else None
    _out(f"size       {r.size} bytes ({ops.format_bytes(r.size or 0)})"
         + (f", written {ops.format_duration(age)} ago" if age is not None else ""))
    _out(f"namespace  {r.namespace or '(none)'} (from the key)")
    if r.metadata:
        md = r.metadata
        _out(f"format     {md.get('format', '-')}")
        _out(f"identifier {md.get('identifier', '(not stored: too long or not printable)')}")
        _out(f"id sha256  {md.get('identifier_sha256', '-')}")
        _out(f"dtype      {r.dtype}")
        _out(f"shape      {tuple(r.shape or ())}")
        _out(f"header ns  {md.get('namespace', '-')}")
        _out(f"producer   {md.get('producer') or '-'}")
        extra = {k: v for k, v in md.items()
                 if k not in ("format", "identifier", "identifier_sha256", "dtype", "shape", "namespace", "producer")}
        for k, v in sorted(extra.items()):
            _out(f"meta       {k}={v}")
        _out(f"data       {r.data_offset}+{(r.size or 0) - (r.data_offset or 0)} bytes")
    for k, v in sorted(r.s3_metadata.items()):
        _out(f"s3 meta    {k}={v}")
    if r.valid:
        _out("VALID: header parses and passes the structural checks; metadata matches the key")
    else:
        _out("INVALID: " + "; ".join(r.problems))
        if r.error_reason:
            _out(f"  reason: {r.error_reason} (ec-s3 rejects a blob that fails this check)")
    _out("")


# ---------------------------------------------------------------------- bench
def _cmd_bench(args: argparse.Namespace) -> int:
    from ec_s3.cli import ops

    if args.size_mb <= 0 or args.count < 1 or args.concurrency < 1:
        return _fail("--size-mb must be > 0, --count and --concurrency >= 1")
    try:
        store = _open_store(args)
    except ConfigError as exc:
        return _fail(f"bad configuration: {exc}", "correct the named key")
    try:
        size = max(1, int(args.size_mb * (1 << 20)))
        if not args.json:
            _out(f"bench {_where(store.config)}: {args.count} x {ops.format_bytes(size)}, "
                 f"concurrency {args.concurrency}")
        progress = _progress(args)
        report = ops.transfer_check(store, size, args.count, concurrency=args.concurrency, progress=progress)
        progress.close()
        if args.json:
            _json_out(report.to_dict())
            return EXIT_OK if report.ok else EXIT_FAIL
        for name, lat, rate in (("PUT", report.put_latencies_ms, report.put_mib_s),
                                ("GET", report.get_latencies_ms, report.get_mib_s)):
            if not lat:
                continue
            s = ops.latency_summary(lat)
            _out(f"  {name}  {rate:8.1f} MiB/s   latency ms: p50 {s['p50']:.1f}  p90 {s['p90']:.1f}  "
                 f"min {s['min']:.1f}  max {s['max']:.1f}")
        _out(f"  verified {report.verified}; bench objects deleted: {report.cleaned_up}")
        if not report.ok:
            if report.diagnosis is not None:
                _print_diagnosis(report.diagnosis)
            else:
                _out(f"FAIL: {report.error}")
            return EXIT_FAIL
        return EXIT_OK
    finally:
        store.close(timeout=5.0)


# ---------------------------------------------------------------------- passthrough
def _passthrough(name: str, argv: list[str]) -> int:
    module_name = _PASSTHROUGH[name][0]
    import importlib

    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        missing = getattr(exc, "name", None)
        if missing == module_name:
            return _fail(f"`ec-s3 {name}` is not available: this ec-s3 installation has no {module_name} module",
                         "upgrade or reinstall ec-s3 (pip install -U ec-s3)")
        return _fail(f"`ec-s3 {name}` cannot start: importing {module_name} failed ({exc})",
                     "install the missing package or reinstall ec-s3")
    except Exception as exc:  # noqa: BLE001 - a broken module must not produce a traceback
        return _fail(f"`ec-s3 {name}` cannot start: importing {module_name} failed "
                     f"({type(exc).__name__}: {exc})", "reinstall ec-s3")
    entry = getattr(module, "main", None)
    if not callable(entry):
        return _fail(f"{module_name} has no main(argv) entry point", "upgrade or reinstall ec-s3")
    result = entry(argv)
    return int(result) if isinstance(result, int) else EXIT_OK


# ---------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="ec-s3",
        formatter_class=fmt,
        description="Operate an ec-s3 encoder-cache bucket: prove access, look at what it holds, "
                    "expire old blobs, validate one blob, measure transfers.",
        epilog=_CONFIG_HELP + """
examples:
  ec-s3 check --bucket ec-cache --endpoint-url http://minio:9000
  ec-s3 check --read-only --config @ec_transfer_config.json
  ec-s3 stats --json
  ec-s3 gc --older-than 7d --dry-run
  ec-s3 gc --max-bytes 500GiB
  ec-s3 gc --lifecycle --older-than 7d
  ec-s3 inspect ec-cache/<namespace>/<digest>.safetensors
  ec-s3 bench --size-mb 32 --count 8
""",
    )
    parser.add_argument("--version", action="version", version=f"ec-s3 {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "check", formatter_class=fmt, help="validate a config and prove access to the bucket",
        description="Validate the configuration, then prove access with real requests, reporting each "
                    "step's latency: LIST the prefix, HEAD a missing key (must answer 404: that is a miss), "
                    "then PUT, HEAD, GET and DELETE a probe object under <prefix>/_ec_s3_probe/. "
                    "With --read-only only reads are tried (LIST, HEAD and GET of a missing key), so a "
                    "consumer's read-only credentials pass. Exit status 0 on PASS, 1 on FAIL with the "
                    "cause (wrong credentials, missing bucket, unreachable endpoint, missing permission) "
                    "and the fix.",
        epilog=_CONFIG_HELP,
    )
    _add_config_args(p, namespace_help="namespace override (checked like any config key)")
    p.add_argument("--read-only", action="store_true",
                   help="check only read access (consumers): no PUT/DELETE")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="give up after S seconds (default 300; each request also has its own timeouts)")
    p.add_argument("--list-keys", action="store_true", help="list every config key with default and meaning, then exit")
    p.set_defaults(func=_cmd_check)

    p = sub.add_parser(
        "stats", formatter_class=fmt, help="objects, bytes and ages per namespace",
        description="List every object under <prefix>/ and print, per namespace (one per model), the "
                    "object count, bytes and age distribution (<1h, <1d, <7d, >=7d; age is the time since "
                    "the blob was written: S3 keeps no access time). Needs s3:ListBucket.",
        epilog=_CONFIG_HELP,
    )
    _add_config_args(p, namespace_help="only this namespace")
    p.set_defaults(func=_cmd_stats)

    p = sub.add_parser(
        "gc", formatter_class=fmt, help="delete old blobs, or install a lifecycle rule",
        description="Delete blobs under <prefix>/ written longer ago than --older-than, and/or the oldest "
                    "blobs until the rest fits in --max-bytes. Deletes go in batches of 1000 "
                    "(DeleteObjects); --dry-run only reports. A blob deleted while a consumer fetches it "
                    "is just a miss (the item is encoded again). With --lifecycle, install an S3 "
                    "lifecycle rule instead (expire objects under the prefix --older-than whole days "
                    "after they are written), so the server does the gc; servers without lifecycle "
                    "support are reported.",
        epilog=_CONFIG_HELP + "\nsizes: 500MiB, 10GB (1000^3), 2G (=2GiB), or bytes; "
                              "durations: 30m, 12h, 7d, 1d12h, 2w, or seconds\n",
    )
    _add_config_args(p, namespace_help="only this namespace")
    p.add_argument("--older-than", metavar="DURATION", help="delete blobs at least this old (e.g. 7d, 12h, 30m; 0s = all)")
    p.add_argument("--max-bytes", metavar="SIZE", help="then delete the oldest until the rest fits this budget (e.g. 500GiB)")
    p.add_argument("--dry-run", action="store_true", help="report what would be deleted; delete nothing")
    p.add_argument("--lifecycle", action="store_true",
                   help="install an S3 lifecycle expiration rule (--older-than, whole days) instead of deleting")
    p.set_defaults(func=_cmd_gc)

    p = sub.add_parser(
        "inspect", formatter_class=fmt, help="show and validate one blob",
        description="Fetch one blob and show its size, metadata (format, identifier, dtype, shape, "
                    "namespace, producer) and whether it is valid (header parse and structural checks, "
                    "metadata consistent with its key). TARGET is a full key under the prefix (or "
                    "s3://bucket/key), or an item identifier (mm_hash / multi_modal_uuid) whose key is "
                    "computed in --namespace, or looked up in every namespace under the prefix. "
                    "Exit status 1 if the blob is missing or invalid.",
        epilog=_CONFIG_HELP,
    )
    p.add_argument("target", metavar="KEY|IDENTIFIER")
    _add_config_args(p, namespace_help="namespace for an identifier (default: look in every namespace)")
    p.add_argument("--identifier", action="store_true", help="treat TARGET as an identifier even if it looks like a key")
    p.add_argument("--cache-salt", help="the request's cache_salt, for blobs of salted (per-tenant) requests")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser(
        "bench", formatter_class=fmt, help="quick PUT/GET throughput and latency check",
        description="PUT then GET --count random blobs of --size-mb MiB under <prefix>/_ec_s3_probe/, "
                    "verify the bytes, print MiB/s and latencies, and delete them.",
        epilog=_CONFIG_HELP,
    )
    _add_config_args(p, namespace_help="(unused by bench)")
    p.add_argument("--size-mb", type=float, default=8.0, help="MiB per blob (default 8)")
    p.add_argument("--count", type=int, default=5, help="number of blobs (default 5)")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight (default 1: per-request latency)")
    p.set_defaults(func=_cmd_bench)

    for name, (_module, text) in _PASSTHROUGH.items():
        sub.add_parser(name, help=text, add_help=False,
                       description=f"{text}; every argument after `{name}` is passed to it")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ec-s3`` console script; returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    # proxy/demo own their arguments (including --help): hand them over untouched.
    if args_list and args_list[0] in _PASSTHROUGH:
        return _passthrough(args_list[0], args_list[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:  # --help, --version and usage errors
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if getattr(args, "verbose", False):
        # ec-s3's own debug lines only: botocore's would print request headers.
        from ec_s3.log import logger

        if not logger.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        return _fail(f"bad configuration: {exc}", "correct the named key")
    except StoreError as exc:
        return _fail(str(exc), "check the endpoint, the credentials and the bucket with `ec-s3 check`")
    except (TimeoutError, concurrent.futures.TimeoutError):
        return _fail("the operation timed out", "check the endpoint with `ec-s3 check`")
    except KeyboardInterrupt:
        _err("ec-s3: interrupted")
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
