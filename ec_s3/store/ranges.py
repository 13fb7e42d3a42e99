"""What a ranged GET answer must say: its status, Content-Length and Content-Range checked against the range asked.

Owns parsing ``Content-Length`` and ``Content-Range`` strictly, the rule that turns an answer's
status and those headers (and its ``Transfer-Encoding``, by :func:`.http1.coding_error`) into a
:class:`Span` or a typed :class:`~.errors.StoreUnavailable`. Does not own sending the requests
(:mod:`.wire`), retries and the order of a GET's ranges (:mod:`.client`, :mod:`.download`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from ec_s3.store.errors import StoreUnavailable
from ec_s3.store.http1 import coding_error

__all__ = ["Span", "check_answer", "parse_content_length", "parse_content_range"]

_LENGTH_RE = re.compile(r"[0-9]{1,19}")
_RANGE_RE = re.compile(r"bytes ([0-9]{1,19})-([0-9]{1,19})/([0-9]{1,19}|\*)")


def parse_content_length(value: str | None) -> int | None:
    """The length a ``Content-Length`` value says; None when absent or not a number.
    Identical repeated values (``5, 5``, allowed by RFC 9110) are one length."""
    if value is None:
        return None
    values = {v.strip() for v in value.split(",")}
    if len(values) != 1:
        return None
    (only,) = values
    return int(only) if _LENGTH_RE.fullmatch(only) else None


def parse_content_range(value: str | None) -> tuple[int, int, int | None] | None:
    """(first, last, total) of a ``bytes first-last/total`` value (total None for
    ``*``); None when absent or malformed."""
    match = _RANGE_RE.fullmatch((value or "").strip())
    if match is None:
        return None
    total = None if match.group(3) == "*" else int(match.group(3))
    return int(match.group(1)), int(match.group(2)), total


@dataclasses.dataclass(frozen=True)
class Span:
    """What an accepted answer carries: ``length`` body bytes (None: a 200 of unknown
    length, read to its end), of an object of ``total`` bytes (None when unknown)."""

    length: int | None
    total: int | None


def check_answer(status: int, headers: Mapping[str, str], first: int, last: int, key: str) -> Span:
    """The span of an answer to ``Range: bytes=first-last``, or a typed error when the
    answer is not that range: a 206 must name exactly ``first`` to ``min(last,
    total - 1)`` and carry as many bytes; a 200 (a server that ignores Range: the whole
    object) is only the asked bytes when the range starts at 0."""
    if (why := coding_error(headers)) is not None:
        raise StoreUnavailable("GET", key, why)
    raw_length = headers.get("Content-Length")
    length = parse_content_length(raw_length)
    if raw_length is not None and length is None:
        raise StoreUnavailable("GET", key, f"malformed Content-Length {raw_length[:40]!r}")
    if status == 200:
        if first != 0:
            raise StoreUnavailable("GET", key, f"asked bytes {first}-{last}, answered the whole object (200)")
        return Span(length, length)
    if status != 206:
        raise StoreUnavailable("GET", key, f"unexpected status {status} to a ranged GET")
    raw_range = headers.get("Content-Range")
    parsed = parse_content_range(raw_range)
    if parsed is None or parsed[2] is None:
        raise StoreUnavailable("GET", key, f"206 with a malformed Content-Range {(raw_range or '')[:60]!r}")
    start, end, total = parsed
    if start != first or end != min(last, total - 1) or end < start:
        raise StoreUnavailable("GET", key, f"asked bytes {first}-{last}, answered {raw_range!r}")
    if length is not None and length != end - start + 1:
        raise StoreUnavailable("GET", key, f"Content-Range {raw_range!r} with Content-Length {length}")
    return Span(end - start + 1, total)
