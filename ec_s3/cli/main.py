"""``ec-s3``: the operator's command line for an ec-s3 bucket.

Owns the top-level parser, the dispatch to ``check``, ``stats``, ``gc``, ``inspect``,
``bench`` and the ``proxy`` / ``demo`` pass-throughs, and the errors every command can
end with. Does not own any command: each lives in its own module with its parser, work
and printing. Imports neither vLLM nor torch.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import logging
import sys

from ec_s3 import __version__
from ec_s3.cli import bench, blobs, bucket, check
from ec_s3.cli.common import CONFIG_HELP
from ec_s3.cli.console import EXIT_OK, EXIT_USAGE, err, fail
from ec_s3.config import ConfigError
from ec_s3.store.client import StoreError

__all__ = ["build_parser", "main"]

_PASSTHROUGH = {
    "proxy": ("ec_s3.proxy.main", "run the ec-s3 proxy (see `ec-s3 proxy --help`)"),
    "demo": ("ec_s3.demo.run", "run the ec-s3 demo (see `ec-s3 demo --help`)"),
}


# ---------------------------------------------------------------------- passthrough
def _passthrough(name: str, argv: list[str]) -> int:
    module_name = _PASSTHROUGH[name][0]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        missing = getattr(exc, "name", None)
        if missing == module_name:
            return fail(f"`ec-s3 {name}` is not available: this ec-s3 installation has no {module_name} module",
                        "upgrade or reinstall ec-s3 (pip install -U ec-s3)")
        return fail(f"`ec-s3 {name}` cannot start: importing {module_name} failed ({exc})",
                    "install the missing package or reinstall ec-s3")
    except Exception as exc:  # noqa: BLE001 - a broken module must not produce a traceback
        return fail(f"`ec-s3 {name}` cannot start: importing {module_name} failed "
                    f"({type(exc).__name__}: {exc})", "reinstall ec-s3")
    entry = getattr(module, "main", None)
    if not callable(entry):
        return fail(f"{module_name} has no main(argv) entry point", "upgrade or reinstall ec-s3")
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
        epilog=CONFIG_HELP + """
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
    for command in (check, bucket, blobs, bench):
        command.register(sub)
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
        return fail(f"bad configuration: {exc}", "correct the named key")
    except StoreError as exc:
        return fail(str(exc), "check the endpoint, the credentials and the bucket with `ec-s3 check`")
    except (TimeoutError, concurrent.futures.TimeoutError):
        return fail("the operation timed out", "check the endpoint with `ec-s3 check`")
    except KeyboardInterrupt:
        err("ec-s3: interrupted")
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
