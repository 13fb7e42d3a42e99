"""What the endpoint of ``ec-s3 check`` can do, and what ec-s3 does where it cannot.

Owns the capability probes (ranged GET, conditional PUT and Complete, multipart, checksum
refusal, TLS and CA, region, clock skew), their rows and the table; the probes write under
``<prefix>/_ec_s3_probe/`` and remove what they wrote. Correctness never depends on them:
each row says what a missing capability costs. Does not own the access check around it
(:mod:`ec_s3.cli.check`) nor how the client resolves region and CA
(:func:`ec_s3.store.connection.resolve_endpoint`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import email.utils
import os
import secrets
import time
from collections.abc import Awaitable
from typing import Any
from urllib.parse import urlsplit

from botocore import exceptions as boto_exc

from ec_s3.blob.keys import PROBE_NAMESPACE
from ec_s3.cli.console import out
from ec_s3.config import ECS3Config
from ec_s3.store.client import S3Store
from ec_s3.store.connection import EndpointSettings
from ec_s3.store.error_map import to_store_error

__all__ = ["Capability", "print_table", "probe_capabilities", "static_rows"]

OK, MISSING, UNKNOWN, SKIPPED, INFO, FAILED = "ok", "missing", "unknown", "skipped", "info", "failed"
_SKEW_WARN_S = 300.0  # SigV4 refuses requests beyond 15 min: warn well before
_WRONG_CRC32 = "AAAAAA=="  # the CRC32 of no body the probe sends


@dataclasses.dataclass
class Capability:
    name: str
    status: str  # ok | missing | unknown | skipped | info | failed
    detail: str  # what the endpoint did
    action: str = ""  # what ec-s3 does about it (where not ok)


# ---------------------------------------------------------------------- answers
@dataclasses.dataclass
class _Answer:
    status: int
    code: str
    headers: dict[str, str]
    body: dict[str, Any]


async def _answer(call: Awaitable[dict[str, Any]], timeout: float) -> _Answer:
    """The status, error code and headers of one request, errors included; a transport
    failure (no answer) raises."""
    try:
        resp = await asyncio.wait_for(call, timeout)
    except boto_exc.ClientError as exc:
        resp = exc.response or {}
    meta = resp.get("ResponseMetadata") or {}
    return _Answer(int(meta.get("HTTPStatusCode") or 0), str((resp.get("Error") or {}).get("Code") or ""),
                   {k.lower(): str(v) for k, v in (meta.get("HTTPHeaders") or {}).items()}, resp)


def _skew_row(answer: _Answer | None, received: float) -> Capability:
    date = answer.headers.get("date") if answer is not None else None
    if not date:
        return Capability("clock skew", UNKNOWN, "no Date header in the server's answer")
    try:
        skew = email.utils.parsedate_to_datetime(date).timestamp() - received
    except (TypeError, ValueError):
        return Capability("clock skew", UNKNOWN, f"unreadable Date header {date!r}")
    detail = f"{skew:+.1f} s (server Date, whole seconds, vs this host)"
    if abs(skew) <= _SKEW_WARN_S:
        return Capability("clock skew", OK, detail)
    return Capability("clock skew", MISSING, detail, "SigV4 requests fail with RequestTimeTooSkewed beyond "
                      "15 min; sync this host's clock (NTP) before the connector starts")


def static_rows(config: ECS3Config, settings: EndpointSettings, *, handshake_failed: bool = False) -> list[Capability]:
    """TLS and region, as the store resolves them (:func:`ec_s3.store.connection.resolve_endpoint`);
    with ``handshake_failed`` the TLS row says so rather than ok."""
    region = Capability("region", INFO, f"{settings.region} (from {settings.region_source})")
    if (config.endpoint_url or "https://").lower().startswith("http://"):
        return [Capability("TLS", MISSING, f"plain http ({config.endpoint_url})",
                           "requests and blobs travel in clear (signatures do not reveal the keys); "
                           "use https off loopback or a private network"), region]
    if not settings.trust.verify:
        return [Capability("TLS", MISSING, "https, certificate and host name not verified (verify_tls: false)",
                           "anyone on the path can impersonate the server; trust its CA instead "
                           "(ca_bundle or AWS_CA_BUNDLE)"), region]
    if handshake_failed:
        return [Capability("TLS", FAILED, f"https, the handshake failed (see FAIL below); the certificate was "
                           f"checked against {settings.ca_file} (from {settings.ca_source})"), region]
    return [Capability("TLS", OK, f"https, verified with {settings.ca_file} (from {settings.ca_source})"), region]


# ---------------------------------------------------------------------- the probes
class _Probes:
    """One run of the probes: what they created, so that it is removed again."""

    def __init__(self, store: S3Store, client: Any) -> None:
        self.store, self.client, self.config = store, client, store.config
        self.timeout = self.config.connect_timeout_s + self.config.read_timeout_s
        stem = f"{self.config.prefix.strip('/')}/{PROBE_NAMESPACE}/cap-{int(time.time())}-{secrets.token_hex(4)}"
        self.keys = {name: f"{stem}-{name}" for name in ("put", "mpu", "crc")}
        self.written: set[str] = set()
        self.uploads: list[tuple[str, str]] = []
        self.body: bytes | None = None  # the probe object's bytes, once written

    def call(self, op: str, **kwargs: Any) -> Awaitable[_Answer]:
        return _answer(getattr(self.client, op)(Bucket=self.store.bucket, **kwargs), self.timeout)

    async def cleanup(self) -> None:
        for key, upload_id in self.uploads:
            await _quietly(self.call("abort_multipart_upload", Key=key, UploadId=upload_id))
        for key in self.written:
            await _quietly(self.call("delete_object", Key=key))


async def _quietly(call: Awaitable[Any]) -> None:
    try:
        await call
    except Exception:  # noqa: BLE001 - cleanup is best effort; the probe key is reported
        pass


async def _probe_put(p: _Probes) -> tuple[Capability, bool]:
    """Conditional create on PUT; True when a probe object exists afterwards."""
    key, body = p.keys["put"], os.urandom(64)
    first = await p.call("put_object", Key=key, Body=body, IfNoneMatch="*")
    if first.status != 200:
        return Capability("conditional PUT", UNKNOWN, f"first PUT answered {first.status} {first.code}",
                          _IGNORED_PUT), False
    p.written.add(key)
    p.body = body
    second = await p.call("put_object", Key=key, Body=body, IfNoneMatch="*")
    if second.status == 412:
        return Capability("conditional PUT", OK, "If-None-Match: * on an existing key answers 412"), True
    what = "overwrote the object (200)" if second.status == 200 else f"answered {second.status} {second.code}"
    return Capability("conditional PUT", MISSING, f"If-None-Match: * ignored: {what}",
                      _IGNORED_PUT + _gcs_note(p.config)), True


async def _probe_range(p: _Probes, key: str, body: bytes | None) -> Capability:
    got = await p.call("get_object", Key=key, Range="bytes=1-4")
    data, stream = b"", got.body.get("Body")
    if stream is not None:
        try:  # a server that ignores Range sends the whole object: read no more than asked
            data = await asyncio.wait_for(stream.read(4), p.timeout) if got.status == 206 else b""
        finally:
            stream.close()
    content_range = got.headers.get("content-range", "")
    if got.status == 206 and content_range.startswith("bytes 1-4/") and (body is None or data == body[1:5]):
        return Capability("ranged GET", OK, f"206, Content-Range {content_range}")
    if got.status == 200:
        return Capability("ranged GET", MISSING, "Range ignored: 200 with the whole object",
                          "a 200 is taken as the whole object: a blob comes in one request instead of "
                          "parallel parts (slower for large blobs, still correct)")
    return Capability("ranged GET", MISSING, f"answered {got.status} {got.code} {content_range}".strip(),
                      "GETs of this endpoint fail; ec-s3 cannot read blobs here")


async def _complete_twice(p: _Probes) -> tuple[_Answer, _Answer | None]:
    """A one-part upload completed with If-None-Match: *, then a second one on the same key."""
    key, answers = p.keys["mpu"], []
    for _ in range(2):
        created = await p.call("create_multipart_upload", Key=key)
        if created.status != 200:
            answers.append(created)
            break
        upload_id = str(created.body["UploadId"])
        p.uploads.append((key, upload_id))
        part = await p.call("upload_part", Key=key, UploadId=upload_id, PartNumber=1, Body=b"ec-s3 probe")
        if part.status != 200:
            answers.append(part)
            break
        parts = {"Parts": [{"PartNumber": 1, "ETag": part.body["ETag"]}]}
        done = await p.call("complete_multipart_upload", Key=key, UploadId=upload_id,
                            MultipartUpload=parts, IfNoneMatch="*")
        answers.append(done)
        if done.status != 200:
            break
        # The upload stays on the cleanup list: a server that answered 200 without
        # completing (a gateway that hides a 412) still holds it; aborting a completed
        # one is a harmless 404.
        p.written.add(key)
    return answers[0], answers[1] if len(answers) > 1 else None


async def _probe_multipart(p: _Probes) -> list[Capability]:
    first, second = await _complete_twice(p)
    if first.status != 200:
        threshold = p.config.multipart_threshold_bytes >> 20
        return [Capability("multipart upload", MISSING, f"answered {first.status} {first.code}",
                           f"blobs of {threshold} MiB (multipart_threshold_bytes) or more cannot be stored; raise "
                           "multipart_threshold_bytes up to the server's largest single PUT"),
                Capability("conditional Complete", SKIPPED, "no multipart upload")]
    rows = [Capability("multipart upload", OK, "create, upload part, complete")]
    assert second is not None
    if second.status == 412:
        # One Complete after another: whether the check holds against a concurrent
        # Complete (moto's does not) cannot be seen from a sequential probe.
        rows.append(Capability("conditional Complete", OK, "If-None-Match: * on an existing key answers 412 "
                               "(in sequence; a race is not probed)"))
    else:
        rows.append(Capability("conditional Complete", MISSING,
                               f"If-None-Match: * ignored: answered {second.status} {second.code}".strip(),
                               _IGNORED_COMPLETE))
    return rows


async def _probe_checksum(p: _Probes) -> Capability:
    key = p.keys["crc"]
    got = await p.call("put_object", Key=key, Body=b"ec-s3 checksum probe", ChecksumCRC32=_WRONG_CRC32)
    if got.status == 400:
        return Capability("checksum headers", OK, f"a wrong x-amz-checksum-crc32 is refused ({got.code})")
    if got.status == 200:
        p.written.add(key)
        return Capability("checksum headers", MISSING, "a wrong x-amz-checksum-crc32 was accepted and stored",
                          _UNVERIFIED_CHECKSUM)
    return Capability("checksum headers", UNKNOWN, f"answered {got.status} {got.code}", _UNVERIFIED_CHECKSUM)


_IGNORED_PUT = ("two producers of the same blob may both upload it and the second overwrites the first with "
                "the same bytes (keys are content digests); readers stay correct, since later ranges of a "
                "multi-part GET carry If-Match with the first answer's ETag. Cost: duplicate uploads only")
_IGNORED_COMPLETE = ("ec-s3 HEADs the key before every multipart upload, so only two producers racing on the "
                     "same blob overwrite it, with the same bytes; readers as for PUT")
_UNVERIFIED_CHECKSUM = ("the server stores what it receives; ec-s3 verifies its own CRC32 (metadata "
                        "ec-s3-crc32, with checksum_algorithm set) after every GET, so a damaged blob is a miss, "
                        "never a tensor")


def _gcs_note(config: ECS3Config) -> str:
    host = urlsplit(config.endpoint_url or "").hostname or ""
    if host.endswith("googleapis.com"):
        return ("; GCS's XML API spells this condition x-goog-if-generation-match: 0, which ec-s3 does "
                "not send")
    return ""


_ORDER = ("ranged GET", "conditional PUT", "conditional Complete", "multipart upload", "checksum headers",
          "TLS", "region", "clock skew")
_WRITING = ("conditional PUT", "conditional Complete", "multipart upload", "checksum headers")


async def probe_capabilities(store: S3Store, *, read_only: bool, settings: EndpointSettings,
                             existing_key: str | None = None) -> list[Capability]:
    """Every capability row, probed where it takes a request; ``existing_key`` is an
    object a read-only run may read a range of."""
    p = _Probes(store, await store._get_client())
    rows: dict[str, Capability] = {}
    try:
        sent = time.time()
        miss = await p.call("head_object", Key=p.keys["put"])  # any answer carries the server's Date
        rows["clock skew"] = _skew_row(miss, (sent + time.time()) / 2)
        if read_only:
            rows["ranged GET"] = (await _probe_range(p, existing_key, None) if existing_key else
                                  Capability("ranged GET", SKIPPED, "no object under the prefix to read"))
            rows.update((name, Capability(name, SKIPPED, "--read-only: writing probes skipped")) for name in _WRITING)
        else:
            rows["conditional PUT"], have = await _probe_put(p)
            rows["ranged GET"] = (await _probe_range(p, p.keys["put"], p.body) if have else
                                  Capability("ranged GET", UNKNOWN, "no probe object to read"))
            rows.update((row.name, row) for row in await _probe_multipart(p))
            rows["checksum headers"] = await _probe_checksum(p)
    except Exception as exc:  # noqa: BLE001 - the rows probed so far stand; the rest say why not
        error = to_store_error("probe", "", exc)
        reason = error.reason if error is not None else f"{type(exc).__name__}: {exc}"
        for name in _ORDER[:5] + ("clock skew",):
            rows.setdefault(name, Capability(name, UNKNOWN, f"probe stopped: {reason}"))
    finally:
        await p.cleanup()
    rows.update((row.name, row) for row in static_rows(store.config, settings))
    return [rows[name] for name in _ORDER if name in rows]


def print_table(rows: list[Capability]) -> None:
    """The capability table, then what ec-s3 does about each row that is not ok."""
    out("endpoint capabilities:")
    width = max(len(r.name) for r in rows)
    for r in rows:
        out(f"  {r.name:<{width}}  {r.status:<7}  {r.detail}")
    for r in rows:
        if r.action and r.status in (MISSING, UNKNOWN):
            out(f"  ec-s3 without {r.name}: {r.action}")
