"""Promise pickup: how soon a consumer picks up a promised blob once it becomes
visible, and how many GETs it spends waiting, for the poll schedule in
``ec_s3.connector.admission``, the one it replaced (``legacy``: 5 ms doubling up to 1 s)
and a poll every 2 ms (``dense``), in the same run, interleaved.

A consumer (vLLM's real ``Scheduler`` with the scheduler-role ``ECS3Connector``,
tests/support/vllm_rig, stepped like EngineCore) gets a request whose only image is
promised; a thread PUTs that blob ``delay`` after the request arrived (4.5 KiB: the tiny
model's 16 x 128 bf16 image). Per trial, one request, a fresh image:

* ``pickup``: from the PUT's response (the blob is visible at the latest then) to the
  step that schedules the request (the GET that found it and its validation included);
* ``poll_gap``: from the PUT's response to the start of the GET that found the blob
  (negative when a GET that started during the PUT saw it): the schedule's own delay;
* ``gets``: lookups started for the item (each a GET; all but the last a 404), and
  ``gets_per_s`` = gets / time the request waited.

Goal (issue #13): pickup within 5 ms (p90) of visibility without hammering the store.

    .venv/bin/python -m bench.promise_pickup [--quick] [--delays-ms 5 20 100 300 1000 2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import threading
import time
import types
from pathlib import Path
from typing import Any

from bench import benchlib as bl

if __name__ == "__main__":  # a run, before vLLM is imported; imported for run_all's rows, os.environ stays
    bl.setup_env()

ROWS, WIDTH = 16, 128  # the tiny model's image: 16 tokens x hidden 128
GOAL_MS = 5.0  # issue #13: picked up within 5 ms (p90) of becoming visible
# "dense": the bound the current schedule gives up for fewer GETs: every poll 2 ms
# after the previous one started, one at a time, however long the wait.
SCHEDULES = ("current", "legacy", "dense")


def legacy_next_lookup_at(admission: Any, item: Any, promise: Any, waited: float) -> float:
    """The schedule before issue #13: the next poll of a missing promised blob
    ``min(1 s, 5 ms * 2 ** (attempts - 1))`` after the previous answer arrived."""
    from ec_s3.connector.items import ItemState

    if promise is not None and item.state is ItemState.MISSING:
        return item.checked_at + min(1.0, 0.005 * 2 ** max(0, item.attempts - 1))
    return type(admission).next_lookup_at(admission, item, promise, waited)


def dense_next_lookup_at(admission: Any, item: Any, promise: Any, waited: float) -> float:
    from ec_s3.connector.items import ItemState

    if promise is not None and item.state is ItemState.MISSING:
        return item.started_at + 0.002
    return type(admission).next_lookup_at(admission, item, promise, waited)


_PATCHES = {"legacy": legacy_next_lookup_at, "dense": dense_next_lookup_at}


def use_schedule(sched: Any, name: str) -> None:
    admission = sched._admission  # ec_s3.connector.admission: the poll schedule is its
    if name in _PATCHES:
        admission.next_lookup_at = types.MethodType(_PATCHES[name], admission)
    else:
        admission.__dict__.pop("next_lookup_at", None)


def one_trial(node: Any, store: Any, ident: str, delay_s: float, timeout_s: float) -> dict[str, float]:
    from tests.support.ec_harness import drive
    from tests.support.vllm_rig import fake_encoder_output

    from ec_s3.blob.codec import BlobMeta, encode_blob

    sched = node.scheduler_connector._scheduler
    keyspace = node.scheduler_connector.model.keyspace
    key = keyspace.key_for(ident)
    x = fake_encoder_output(ident, ROWS)
    blob = bytearray(encode_blob(x, BlobMeta(ident, x.dtype, tuple(x.shape), keyspace.namespace, "bench")))
    params = {ident: {"key": key, "shape": [ROWS, WIDTH], "dtype": "bfloat16", "modality": "image",
                      "item_indices": [0], "metadata": {}, "size_bytes": len(blob)}}
    counters = node.scheduler_connector.counters
    gets_before = counters.get("lookups_started")
    times: dict[str, float] = {}

    def publish() -> None:
        time.sleep(max(0.0, times["added"] + delay_s - time.monotonic()))
        times["put_start"] = time.monotonic()
        store.run(store.put_async(key, blob), timeout=30)
        times["visible"] = time.monotonic()

    req_id = f"r-{ident}"
    times["added"] = time.monotonic()
    node.driver.add(req_id, [ident], ec_transfer_params=params)
    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    deadline = times["added"] + timeout_s
    scheduled = None
    while time.monotonic() < deadline:
        so = node.driver.step()
        if so is not None and req_id in so.num_scheduled_tokens:
            scheduled = time.monotonic()
            break
        time.sleep(0.001)  # EngineCore's pause after a step that ran nothing
    thread.join()
    if scheduled is None:
        raise RuntimeError(f"{req_id} not scheduled within {timeout_s}s")
    item = sched._items.peek(key)
    found_at = item.started_at if item is not None else float("nan")
    gets = counters.get("lookups_started") - gets_before
    drive(node.driver, timeout_s=30)  # the request runs to its end (its item is staged: no more waiting)
    return {"delay_s": delay_s, "pickup_s": scheduled - times["visible"], "poll_gap_s": found_at - times["visible"],
            "put_s": times["visible"] - times["put_start"], "waited_s": scheduled - times["added"], "gets": gets,
            "gets_per_s": gets / (scheduled - times["added"])}


def run(ep: bl.Endpoint, bucket: str, model_dir: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    from tests.support.ec_harness import make_node

    from ec_s3.store.client import S3Store

    store = S3Store(ep.config(bucket))
    node = make_node(model_dir, "ec_consumer", ep.extra(bucket, promised_wait_s=60.0))
    sched = node.scheduler_connector._scheduler
    samples: list[dict[str, Any]] = []
    try:
        store.run(store.head_async("warm-up"))
        one_trial(node, store, "warm-up-item", 0.01, 30)  # the consumer's first GET opens its connections
        for n, (rep, delay_ms) in enumerate(itertools.product(range(args.repeats), args.delays_ms)):
            k = n % len(SCHEDULES)
            for name in SCHEDULES[k:] + SCHEDULES[:k]:  # rotated per trial
                use_schedule(sched, name)
                sample = one_trial(node, store, f"img-{name}-{rep}-{delay_ms}", delay_ms / 1000.0, 60)
                sample["schedule"] = name
                samples.append(sample)
                bl.log(f"{name:7s} delay {delay_ms:5d} ms: pickup {sample['pickup_s'] * 1e3:7.1f} ms, "
                       f"poll gap {sample['poll_gap_s'] * 1e3:7.1f} ms, {sample['gets']:4.0f} GETs")
        use_schedule(sched, "current")
    finally:
        node.close()
        store.close()
    return samples


def summarize(samples: list[dict[str, Any]], delays_ms: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in SCHEDULES:
        mine = [s for s in samples if s["schedule"] == name]
        per_delay = {}
        for d in delays_ms:
            ds = [s for s in mine if round(s["delay_s"] * 1000) == d]
            per_delay[str(d)] = {
                "pickup_ms": bl.summary([s["pickup_s"] * 1e3 for s in ds]),
                "poll_gap_ms": bl.summary([s["poll_gap_s"] * 1e3 for s in ds]),
                "gets": bl.summary([s["gets"] for s in ds]),
                "gets_per_s": bl.summary([s["gets_per_s"] for s in ds]),
                "put_ms": bl.summary([s["put_s"] * 1e3 for s in ds]),
            }
        out[name] = {
            "per_delay_ms": per_delay,
            "pickup_ms": bl.summary([s["pickup_s"] * 1e3 for s in mine]),
            "poll_gap_ms": bl.summary([s["poll_gap_s"] * 1e3 for s in mine]),
            "gets_per_s": bl.summary([s["gets_per_s"] for s in mine]),
        }
    cur, old, dense = out["current"], out["legacy"], out["dense"]
    out["ratios"] = {
        "pickup_p90_current_over_legacy": cur["pickup_ms"]["p90"] / old["pickup_ms"]["p90"],
        "poll_gap_p90_current_over_legacy": cur["poll_gap_ms"]["p90"] / old["poll_gap_ms"]["p90"],
        "pickup_p90_current_over_dense": cur["pickup_ms"]["p90"] / dense["pickup_ms"]["p90"],
        "gets_per_s_current_over_dense": cur["gets_per_s"]["median"] / dense["gets_per_s"]["median"],
    }
    return out


def print_tables(summ: dict[str, Any], delays_ms: list[int]) -> None:
    rows = []
    for d in delays_ms:
        row: list[Any] = [d]
        for name in SCHEDULES:
            s = summ[name]["per_delay_ms"][str(d)]
            row += [s["pickup_ms"]["median"], s["pickup_ms"]["p90"], s["poll_gap_ms"]["p90"], s["gets"]["median"],
                    s["gets_per_s"]["median"]]
        rows.append(row)
    headers = ["delay ms"]
    for name in SCHEDULES:
        headers += [f"{name} pickup p50 ms", "p90", "poll gap p90", "GETs", "GET/s"]
    print(bl.table(headers, rows, "promised blob pickup after it became visible (per delay)"))
    print(bl.table(["schedule", "pickup p50 ms", "pickup p90 ms", "poll gap p90 ms", "GET/s p50"],
                   [[n, summ[n]["pickup_ms"]["median"], summ[n]["pickup_ms"]["p90"], summ[n]["poll_gap_ms"]["p90"],
                     summ[n]["gets_per_s"]["median"]] for n in SCHEDULES], "all delays"))


def goal_rows(d: dict[str, Any] | None) -> list[dict[str, str]]:
    """bench/run_all.py's goal rows from ``promise_pickup.json``: pickup p90 for blobs
    visible within the dense-poll window (<= 100 ms), and over every delay."""
    current = ((d or {}).get("summary") or {}).get("current") or {}
    per = current.get("per_delay_ms") or {}
    fast = [v["pickup_ms"]["p90"] for k, v in per.items() if float(k) <= 100]
    if not fast:
        return []
    rate = current["gets_per_s"]["median"]
    gets_1s = (per.get("1000") or {}).get("gets", {}).get("median")
    cost = f"; {rate:.0f} GET/s per waiting item (median)" + (f", {gets_1s:.0f} GETs for a 1 s wait" if gets_1s else "")
    worst, overall = max(fast), current["pickup_ms"]["p90"]
    dense = d["summary"]["dense"]
    bound = (f"polling every 2 ms throughout (the bound, same run): p90 {dense['pickup_ms']['p90']:.1f} ms at "
             f"{dense['gets_per_s']['median']:.0f} GET/s per waiting item")

    def row(case: str, result: str, p90: float, why: str) -> dict[str, str]:
        ok = p90 <= GOAL_MS
        return {"goal": "1. critical path", "case": case, "result": result, "target": f"<= {GOAL_MS:g} ms p90",
                "status": "met" if ok else "MISSED", "why": "" if ok else why}

    return [row("promised blob picked up after it becomes visible (p90), visible <= 100 ms after the promise",
                f"p90 {worst:.1f} ms (worst delay){cost}", worst,
                f"a poll interval, one GET and a scheduler step; {bound}; close: a push from the producer "
                "(S3 has none)"),
            row("same, every delay measured", f"p90 {overall:.1f} ms", overall,
                f"after 100 ms the schedule (connector/admission.py) polls less often, trading pickup delay for "
                f"GETs; {bound}")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bl.add_common_args(parser)
    parser.add_argument("--delays-ms", type=int, nargs="+", default=None)
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    q = args.quick
    args.delays_ms = args.delays_ms or ([5, 20, 100, 300, 1000, 2000] if q else [5, 10, 20, 50, 100, 200, 300, 500, 1000, 2000])
    args.repeats = args.repeats or (4 if q else 10)

    from ec_s3.sandbox.tiny_model import build_tiny_llava

    model_dir = build_tiny_llava(Path(tempfile.gettempdir()) / "ec-s3-bench-tiny-llava")
    started = time.monotonic()
    with bl.s3_endpoint("pickup") as ep:
        bucket = bl.create_bucket(ep)
        samples = run(ep, bucket, model_dir, args)
    summ = summarize(samples, args.delays_ms)
    p90 = summ["current"]["pickup_ms"]["p90"]
    bl.write_json("promise_pickup", {
        "params": {"delays_ms": args.delays_ms, "repeats": args.repeats, "quick": q,
                   "blob_bytes": "tiny model image, ~4.5 KiB"},
        "elapsed_s": time.monotonic() - started,
        "goal": "promised blob picked up within 5 ms (p90) of becoming visible; state the GET rate per waiting item",
        "goal_met": p90 <= GOAL_MS, "summary": summ, "samples": samples,
    }, args.out_dir)
    print_tables(summ, args.delays_ms)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
