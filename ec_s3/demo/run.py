"""``ec-s3 demo``: encode / prefill-decode disaggregation through S3, end to end, checked.

Owns the entry point and the order of the phases: S3 (:mod:`ec_s3.demo.s3`), the model
(:mod:`ec_s3.demo.model`), the baseline (:mod:`ec_s3.demo.baseline`), the EPD stack or the
aggregated fleet with its summary (:mod:`ec_s3.demo.epd`, :mod:`ec_s3.demo.aggregated`);
the exit status, the failure messages, ``--keep-running``, and that everything it starts
is stopped on every exit. Does not own the flags (:mod:`ec_s3.demo.options`), the
requests (:mod:`ec_s3.demo.chat`) nor the servers (:mod:`ec_s3.sandbox`).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ec_s3.demo.aggregated import run_aggregated
from ec_s3.demo.baseline import run_baseline
from ec_s3.demo.context import FLEET_SEEDS, DemoContext, Setup
from ec_s3.demo.epd import CPU_ENCODE_TIMEOUT_S, encode_timeout_s, run_epd
from ec_s3.demo.model import prepare_model
from ec_s3.demo.options import AGGREGATED, build_parser
from ec_s3.demo.report import Out
from ec_s3.demo.s3 import delete_blobs, start_s3
from ec_s3.sandbox.procgroup import interrupt_on_signals
from ec_s3.sandbox.vllm_server import ServerError, VllmServer

# The two constants are re-exported: the tests read them from here.
__all__ = ["CPU_ENCODE_TIMEOUT_S", "FLEET_SEEDS", "build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    """``ec-s3 demo``; returns 0 only if every disaggregated answer equals the baseline's."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    extra: dict[str, Any] = {}
    if args.extra_config:
        try:
            extra = json.loads(args.extra_config)
            if not isinstance(extra, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            parser.print_usage(sys.stderr)
            print(f"ec-s3 demo: error: --extra-config: {exc}", file=sys.stderr)
            return 2
    out = Out(sys.stdout)
    try:
        with interrupt_on_signals():
            return _Demo(args, extra, out).run()
    except KeyboardInterrupt:
        out("\nec-s3 demo: interrupted; every server it started has been stopped")
        return 130


class _Demo(DemoContext):
    """One run of ``ec-s3 demo``: the phases in order, the failure messages, the exit status."""

    def run(self) -> int:
        out, args = self.out, self.args
        if args.topology == AGGREGATED:
            out("ec-s3 demo: two aggregated servers (ec_both) sharing S3, checked against a plain vLLM server")
        else:
            out("ec-s3 demo: encoder -> S3 -> prefill/decode, checked against a plain vLLM server")
        with contextlib.ExitStack() as stack:
            log_dir = self._log_dir()
            try:
                ok = self._phases(stack, log_dir)
            except ServerError as exc:
                out(f"\nec-s3 demo: FAILED: {exc}")
                return self._fail(log_dir)
            except Exception as exc:  # noqa: BLE001 - S3 setup errors get a message, not a traceback
                hint = _setup_hint(exc)
                if hint is None:
                    raise
                out(f"\nec-s3 demo: FAILED: {type(exc).__name__}: {exc}\n  fix: {hint}")
                return self._fail(log_dir)
            if ok is None:  # the baseline failed: nothing to compare with
                return self._fail(log_dir)
            if ok and args.log_dir is None:
                shutil.rmtree(log_dir, ignore_errors=True)
            elif not ok:
                out(f"  server logs: {log_dir}")
            return 0 if ok else 1

    def _phases(self, stack: contextlib.ExitStack, log_dir: Path) -> bool | None:
        """Phases 1 to 5 and the cleanup after them: whether every answer equals the
        baseline's; None if the baseline failed (phase 4 never ran)."""
        store, extra_config, env = start_s3(self, stack)
        model, server_args, server_env = prepare_model(self)
        setup = Setup(store, extra_config, model, server_args, {**server_env, **env}, log_dir)
        baseline = run_baseline(self, setup)
        if baseline is None:
            return None
        phase4 = run_aggregated if self.args.topology == AGGREGATED else run_epd
        ok, servers, proxy = phase4(self, stack, setup, baseline)
        if self.args.keep_running and all(s.is_running() for s in servers):
            self._keep_running(servers, proxy, model)
        if not self.args.keep_blobs:
            delete_blobs(self, store, setup.prefix)
        return ok

    def _encode_timeout_s(self) -> float:
        """The proxy's encoder limit for these flags (:func:`ec_s3.demo.epd.encode_timeout_s`);
        the tests read it through here."""
        return encode_timeout_s(self.args)

    def _fail(self, log_dir: Path) -> int:
        if any(log_dir.iterdir()):
            self.out(f"  server logs: {log_dir}")
        elif self.args.log_dir is None:
            with contextlib.suppress(OSError):
                log_dir.rmdir()
        return 1

    def _log_dir(self) -> Path:
        if self.args.log_dir is not None:
            self.args.log_dir.mkdir(parents=True, exist_ok=True)
            return self.args.log_dir
        return Path(tempfile.mkdtemp(prefix="ec-s3-demo-logs-"))

    # ------------------------------------------------------------------ keep running
    def _keep_running(self, servers: list[VllmServer], proxy: Any, model: str) -> None:
        out = self.out
        roles = ("server A", "server B") if self.args.topology == AGGREGATED else ("encoder", "prefill/decode")
        out("")
        out(f"--keep-running: proxy {proxy.url} ({roles[0]} {servers[0].url}, {roles[1]} {servers[1].url})")
        out(f"  try: curl -s {proxy.url}/v1/chat/completions -H 'Content-Type: application/json' \\")
        out(f"         -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": [{{\"type\": "
            f"\"image_url\", \"image_url\": {{\"url\": \"<data: or http URL>\"}}}}]}}]}}'")
        out("  Ctrl-C stops everything.")
        while all(s.is_running() for s in servers):
            time.sleep(1.0)
        out("a server exited; stopping the rest")


def _setup_hint(exc: Exception) -> str | None:
    """The fix printed for an S3 or config error (a message, not a traceback); None for
    any other error, which is raised."""
    from ec_s3.config import ConfigError
    from ec_s3.sandbox.embedded_s3 import EmbeddedS3Error
    from ec_s3.store.client import StoreError

    if isinstance(exc, EmbeddedS3Error):
        return "pass --endpoint-url (and AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) for your own S3"
    if isinstance(exc, (ConfigError, StoreError)):
        return "check the endpoint, bucket and credentials with `ec-s3 check`"
    return None


if __name__ == "__main__":
    raise SystemExit(main())
