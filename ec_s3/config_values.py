"""How one value of ``ec_connector_extra_config`` becomes a typed value.

Owns :class:`ConfigError`, :class:`Secret`, the parsers of JSON / CLI values (integers,
sizes with units, numbers, booleans, strings, choices, refusing a field's ``removed`` values),
credential references (``env:NAME``, ``file:/path``) and vLLM's ``ec_role`` values. Every
``*_bytes`` key and size flag (``ec-s3 gc --max-bytes``) goes through :func:`parse_size`. Does not own which keys exist, their defaults or bounds
(:mod:`ec_s3.config` declares them) nor rules across keys.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
from collections.abc import Mapping
from typing import Any, Literal, Union, get_args, get_origin

__all__ = ["EC_ROLES", "ConfigError", "Secret", "coerce", "parse_size", "resolve_secret", "SECRET_KEYS"]

#: vLLM's ``ECTransferConfig.ec_role`` values (``ECRole`` in vllm/config/ec_transfer.py, 0.32-0.34).
EC_ROLES = ("ec_producer", "ec_consumer", "ec_both")


class ConfigError(ValueError):
    """A configuration key is missing, unknown or has a bad value."""


class Secret:
    """A credential that never shows itself in a repr, str or f-string."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('**********')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)



_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)
SIZE_EXAMPLES = "500MiB, 10GB, 2G or a byte count"


def parse_size(text: str) -> int:
    """``"500MiB"``, ``"10GB"``, ``"2G"``, ``"1048576"``: SI units are powers of 1000, ``*iB`` of 1024.

    A bare letter (``"2G"``) means the binary unit, as ``ls -h`` and ``df -h`` print it.
    """
    m = _SIZE_RE.match(str(text))
    if m is None:
        raise ValueError(f"bad size {text!r}: use e.g. {SIZE_EXAMPLES}")
    number, unit, binary, b = m.group(1), m.group(2).lower(), m.group(3), m.group(4)
    if not unit:
        if binary:
            raise ValueError(f"bad size {text!r}")
        return int(float(number))
    power = "kmgtp".index(unit) + 1
    base = 1024 if (binary or not b) else 1000
    return int(float(number) * base**power)


SECRET_KEYS = ("access_key_id", "secret_access_key", "session_token")
# Literal values of these are secrets worth a warning; an access key id alone is not.
_WARN_LITERAL = frozenset({"secret_access_key", "session_token"})
_warned_literal: set[str] = set()


def resolve_secret(name: str, value: str, environ: Mapping[str, str]) -> str:
    """Resolve an ``env:NAME`` / ``file:/path`` reference; warn once about a literal."""
    if value.startswith("env:"):
        var = value[4:]
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", var):
            raise ConfigError(f"{name}: 'env:{var}' is not an environment variable name")
        resolved = environ.get(var)
        if not resolved:
            raise ConfigError(f"{name}=env:{var} but ${var} is not set (or empty) in the engine's environment")
        return resolved
    if value.startswith("file:"):
        path = value[5:]
        try:
            with open(path, encoding="utf-8") as f:
                resolved = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"{name}=file:{path} cannot be read ({exc.strerror}); check the path and its permissions") from None
        if not resolved:
            raise ConfigError(f"{name}=file:{path} is empty")
        return resolved
    if name in _WARN_LITERAL and name not in _warned_literal:
        _warned_literal.add(name)
        from ec_s3.log import logger

        logger.warning(
            "ec-s3: %s was given literally in ec_connector_extra_config: it is visible in the engine's "
            "command line (/proc/<pid>/cmdline) and vLLM logs it with its non-default args; pass "
            "\"%s\": \"env:NAME\" or \"file:/path\" instead, or use the AWS credential chain "
            "(AWS_SECRET_ACCESS_KEY, a profile or an instance role)", name, name,
        )
    return value


def coerce(f: dataclasses.Field[Any], value: Any, hint: Any) -> Any:
    """Turn a JSON or CLI value into the field's type (``hint``, resolved), or fail
    naming the key."""
    name = f.name
    if value is None:
        if f.default is None:
            return None
        raise ConfigError(f"{name} may not be null")
    kind = _without_none(hint)
    if isinstance(value, str) and (why := f.metadata.get("removed", {}).get(value)):
        raise ConfigError(f"{name}={value!r} is no longer accepted: {why}")
    try:
        if f.metadata.get("secret"):
            if isinstance(value, Secret):
                return value
            if not isinstance(value, str) or not value:
                raise TypeError("a non-empty string")
            return Secret(value)
        parse = _parse_size_value if kind is int and name.endswith("_bytes") else _PARSERS.get(kind)
        if parse is not None:
            return parse(value)
        if get_origin(kind) is Literal:
            if value not in get_args(kind):
                raise TypeError("one of " + ", ".join(repr(c) for c in get_args(kind)))
            return value
    except (TypeError, ValueError) as exc:
        shown = "<hidden>" if f.metadata.get("secret") else repr(value)
        expected = exc.args[0] if isinstance(exc, TypeError) and exc.args else getattr(kind, "__name__", kind)
        raise ConfigError(f"{name}={shown} is invalid: expected {expected}") from None
    raise AssertionError(f"unhandled config type {hint} for {name}")  # pragma: no cover


def _without_none(hint: Any) -> Any:
    """``X`` for ``X | None`` (and ``Optional[X]``); any other hint as it is."""
    if get_origin(hint) in (Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _parse_int(value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError("an integer")
    if isinstance(value, float):
        if not value.is_integer():
            raise TypeError("an integer")
        return int(value)
    return int(str(value).strip().replace("_", ""))


def _parse_size_value(value: Any) -> int:
    """A ``*_bytes`` key: a byte count (JSON number or digits) or a size with a unit."""
    if isinstance(value, (bool, int, float)):
        return _parse_int(value)
    try:
        return _parse_int(value)
    except ValueError:
        pass
    try:
        return parse_size(value)
    except ValueError:
        raise TypeError(f"a size such as {SIZE_EXAMPLES}") from None


def _parse_float(value: Any) -> float:
    if isinstance(value, bool):
        raise TypeError("a number")
    number = float(value)
    if not math.isfinite(number):
        raise TypeError("a finite number")
    return number


def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise TypeError("a boolean (true/false)")


def _parse_str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError("a string")
    return value


_PARSERS: dict[Any, Any] = {int: _parse_int, float: _parse_float, bool: _parse_bool, str: _parse_str}

