"""What every ``ec-s3`` command shares: its configuration and its units.

Owns the config a command runs with (``--config`` JSON, the flags, ``--set``, then the
environment, exactly as the connector resolves it, so ``ec-s3 check`` proves what the
connector will use), the parsing of durations and the formatting of sizes and durations
(sizes are parsed as config keys are: :func:`ec_s3.config_values.parse_size`), the
progress-callback type and the failure fields reports share. Does not own any S3
request (the command modules do), nor printing (:mod:`ec_s3.cli.console`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ec_s3.config import ConfigError, ECS3Config
from ec_s3.config_values import EC_ROLES, parse_size  # the size syntax of every *_bytes key
from ec_s3.store.client import S3Store
from ec_s3.store.diagnose import Diagnosis, diagnose

__all__ = [
    "CONFIG_HELP",
    "Outcome",
    "Progress",
    "add_command",
    "add_config_args",
    "build_config",
    "config_from_args",
    "extra_config_from_json",
    "format_bytes",
    "format_duration",
    "no_progress",
    "opened_store",
    "parse_duration",
    "parse_size",
]

#: ``progress(phase, done, total)``; ``total`` is None while unknown (listing).
Progress = Callable[[str, int, "int | None"], None]


def no_progress(phase: str, done: int, total: int | None) -> None:
    return None


@dataclasses.dataclass(kw_only=True)
class Outcome:
    """How a multi-step operation ended: ``error`` is None when it succeeded; when it
    failed, ``diagnosis`` says why in an operator's words."""

    error: str | None = None
    diagnosis: Diagnosis | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def record_failure(self, exc: BaseException, config: ECS3Config, *, op: str) -> None:
        self.diagnosis = diagnose(exc, config, op=op)
        self.error = self.diagnosis.cause


CONFIG_HELP = """\
configuration (the same keys as the connector's ec_connector_extra_config):
  --config takes JSON text, @FILE or a file path holding either the
  ec_connector_extra_config dict or the whole ec_transfer_config JSON passed to
  vLLM (its ec_connector_extra_config is used). Flags override it; bucket and
  endpoint_url fall back to $EC_S3_BUCKET and $EC_S3_ENDPOINT_URL. Credentials come
  from the standard AWS chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
  AWS_SESSION_TOKEN, AWS_PROFILE, instance roles) unless the config sets
  access_key_id / secret_access_key. Credentials are never printed.
"""


# ---------------------------------------------------------------------- sizes and durations
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
    _check_ec_role(data.get("ec_role"))
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


def _check_ec_role(role: Any) -> None:
    """vLLM refuses any other ``ec_role`` at start-up: say so here, with the closest role."""
    if role is None or role in EC_ROLES:
        return
    close = difflib.get_close_matches(str(role), EC_ROLES, n=1, cutoff=0.6)
    raise ConfigError(f"ec_role={role!r} is not one of vLLM's EC roles"
                      + (f" (did you mean {close[0]!r}?)" if close else "")
                      + f"; use {', '.join(EC_ROLES)}")


def _read_text(path: str) -> str:
    if path == "-":
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


def add_config_args(p: argparse.ArgumentParser, *, namespace_help: str) -> None:
    """The configuration and output flags every S3 command takes."""
    g = p.add_argument_group("configuration")
    g.add_argument("--config", metavar="JSON|@FILE",
                   help="ec_connector_extra_config dict or whole ec_transfer_config JSON (text, @FILE or path)")
    g.add_argument("--bucket", help="S3 bucket (default: config, then $EC_S3_BUCKET)")
    g.add_argument("--endpoint-url", help="S3 endpoint, e.g. http://minio:9000 (default: config, then $EC_S3_ENDPOINT_URL, then AWS)")
    g.add_argument("--prefix", help="key prefix (default: config, then 'ec-cache')")
    g.add_argument("--region", help="signing region (default: config, then $AWS_REGION, $AWS_DEFAULT_REGION, the profile's region, "
                   "else 'us-east-1')")
    g.add_argument("--namespace", help=namespace_help)
    g.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="set any config key (repeatable); `ec-s3 check --list-keys` lists them")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print a JSON report on stdout instead of text")
    o.add_argument("-q", "--quiet", action="store_true", help="no progress bar on stderr")
    o.add_argument("-v", "--verbose", action="store_true", help="debug logging of S3 requests and retries")


def add_command(sub: Any, name: str, *, help: str, description: str, namespace_help: str,
                func: Callable[[argparse.Namespace], int], epilog: str = CONFIG_HELP) -> argparse.ArgumentParser:
    """Add an S3 command to the ``ec-s3`` subparsers: its help, the configuration and
    output flags, and ``func(args) -> exit status``. The caller adds its own flags."""
    p = sub.add_parser(name, formatter_class=argparse.RawDescriptionHelpFormatter, help=help,
                       description=description, epilog=epilog)
    add_config_args(p, namespace_help=namespace_help)
    p.set_defaults(func=func)
    return p


def config_from_args(args: argparse.Namespace) -> ECS3Config:
    """``--config``, then ``--set``, then the named flags; raises :class:`ConfigError`."""
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


@contextlib.contextmanager
def opened_store(args: argparse.Namespace) -> Iterator[S3Store]:
    """A store for the command's config, closed on every exit. A bad config raises
    :class:`ConfigError`, which :func:`ec_s3.cli.main.main` reports."""
    store = S3Store(config_from_args(args))
    try:
        yield store
    finally:
        store.close(timeout=5.0)
