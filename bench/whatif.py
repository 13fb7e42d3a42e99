"""What-if prototypes of proposed ec-s3 changes, measured against the code as it is,
in the same run. Nothing in ec_s3/ is edited: each variant monkeypatches one method
in this process only, to size the expected gain of a proposal before anyone
implements it. Not part of run_all.

    .venv/bin/python bench/whatif.py save      # publisher: wake the I/O loop at the end of the step, not in save_caches
    .venv/bin/python bench/whatif.py staging   # scheduler: StagingArea lock held by the I/O thread's file ops
    .venv/bin/python bench/whatif.py get       # store: first ranged GET covers the header (one request per blob)

Results go to ``bench/results/whatif_<name>.json``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

bl.setup_env()

import torch  # noqa: E402

# --------------------------------------------------------------------------- publisher patches


class DeferredWake:
    """BlobPublisher.publish without waking the I/O loop from inside the step: jobs
    queue up and ``kick()`` (what ``build_connector_worker_meta``/``get_finished`` at
    the end of the step would call) hands them over in one wake-up."""

    def __init__(self) -> None:
        from ec_s3.transfer.publisher import BlobPublisher

        self.cls = BlobPublisher
        self.queue: collections.deque[tuple[Any, Any]] = collections.deque()
        self.publishers: set[Any] = set()

    def __enter__(self) -> DeferredWake:
        queue, publishers = self.queue, self.publishers

        class _Deferring:
            def __init__(self, bg: Any, pub: Any) -> None:
                self._bg, self._pub = bg, pub

            def call_soon(self, fn: Any, *args: Any) -> None:
                queue.append((fn, args))
                publishers.add(self._bg)

            def __getattr__(self, name: str) -> Any:
                return getattr(self._bg, name)

        orig_publish = self.cls.publish

        def publish(pub: Any, *a: Any, **kw: Any) -> bool:
            store = pub._store  # noqa: SLF001
            real_bg = store.background
            store._bg = _Deferring(real_bg, pub)  # noqa: SLF001
            try:
                return orig_publish(pub, *a, **kw)
            finally:
                store._bg = real_bg  # noqa: SLF001

        self._orig = orig_publish
        self.cls.publish = publish
        return self

    def kick(self) -> None:
        if not self.queue:
            return
        items = list(self.queue)
        self.queue.clear()
        bg = next(iter(self.publishers))

        def run_all() -> None:
            for fn, args in items:
                fn(*args)

        bg.call_soon(run_all)

    def __exit__(self, *exc: Any) -> None:
        self.kick()
        self.cls.publish = self._orig


# --------------------------------------------------------------------------- save


def whatif_save(args: argparse.Namespace) -> dict[str, Any]:
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from ec_s3.connector.facade import ECS3Connector
    from ec_s3.connector.messages import ECS3ConnectorMetadata
    from ec_s3.sandbox.tiny_model import build_tiny_llava
    from ec_s3.sandbox.vllm_server import ec_transfer_config
    from support.vllm_rig import make_vllm_config

    model_dir = build_tiny_llava(Path(tempfile.gettempdir()) / "ec-s3-bench-tiny-llava")
    out: dict[str, Any] = {}
    with bl.s3_endpoint("whatif") as ep:
        bucket = bl.create_bucket(ep)
        extra = ep.extra(bucket, lookup="promised", max_inflight_bytes=1 << 30)
        conn = ECS3Connector(make_vllm_config(model_dir, ec_transfer_config("ec_producer", extra)),
                             ECConnectorRole.WORKER)
        conn.bind_connector_metadata(ECS3ConnectorMetadata())
        pub = conn._worker._publisher  # noqa: SLF001
        variants = ("as-is", "deferred-wake")
        for size in args.sizes_mib:
            rows = size * bl.MiB // 8192
            res: dict[str, list[float]] = {v: [] for v in variants}
            for i in range(args.samples):
                for v in (variants if i % 2 == 0 else variants[::-1]):  # alternate the order
                    tensor = torch.randn(rows, 4096).to(torch.bfloat16)
                    ident = f"{v}-{size}-{i}-{time.time_ns()}"
                    dw = DeferredWake() if v == "deferred-wake" else contextlib.nullcontext()
                    with dw:
                        t0 = time.perf_counter()
                        conn.save_caches({ident: tensor}, ident)
                        res[v].append(time.perf_counter() - t0)
                    assert pub.flush(120) == 0
                    time.sleep(0.02)
            out[str(size)] = {v: bl.summary([x * 1e6 for x in xs]) for v, xs in res.items()}
            base = statistics.median(res["as-is"])
            msg = ", ".join(f"{v} {statistics.median(xs) * 1e6:.0f} us ({statistics.median(xs) / base:.2f}x)" for v, xs in res.items())
            bl.log(f"save_caches {size} MiB: {msg}")
        conn.shutdown()
    return {"sizes": out, "unit": "us per save_caches call"}


# --------------------------------------------------------------------------- staging lock


class _NoLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None

    def acquire(self, *a: Any, **kw: Any) -> bool:
        return True

    def release(self) -> None:
        return None


def whatif_staging(args: argparse.Namespace) -> dict[str, Any]:
    """Scheduler call latency with StagingArea's lock as is vs a no-op lock (an
    upper bound of what not holding it across file syscalls would give), and how long
    the I/O thread holds it per allocate()."""
    import scheduler_cost as sc

    from ec_s3.transfer import staging as staging_mod
    from ec_s3.sandbox.tiny_model import build_tiny_llava

    model_dir = build_tiny_llava(Path(tempfile.gettempdir()) / "ec-s3-bench-tiny-llava")
    ns = argparse.Namespace(rounds=args.rounds, requests_per_round=12, seed=1)
    orig_init, orig_alloc = staging_mod.StagingArea.__init__, staging_mod.StagingArea.allocate
    holds: list[float] = []

    def timed_alloc(self: Any, *a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return orig_alloc(self, *a, **kw)
        finally:
            holds.append(time.perf_counter() - t0)

    out: dict[str, Any] = {}
    with bl.s3_endpoint("whatif-stg") as ep:
        bucket = bl.create_bucket(ep)
        for rep in range(args.repeats):
            for variant in (("as-is", "no-lock") if rep % 2 == 0 else ("no-lock", "as-is")):
                def init(self: Any, *a: Any, _v: str = variant, **kw: Any) -> None:
                    orig_init(self, *a, **kw)
                    if _v == "no-lock":
                        self._lock = _NoLock()

                staging_mod.StagingArea.__init__ = init
                staging_mod.StagingArea.allocate = timed_alloc
                try:
                    r = sc.bench_ec_s3(ep, bucket, model_dir, 0, ns)
                finally:
                    staging_mod.StagingArea.__init__ = orig_init
                    staging_mod.StagingArea.allocate = orig_alloc
                s = sc.summarize({variant: r})[variant]
                entry = out.setdefault(variant, {"all_p99_us": [], "per_method_p99_us": {}})
                entry["all_p99_us"].append(s["all_calls_us"]["p99"])
                for m, v in s["per_method_us"].items():
                    entry["per_method_p99_us"].setdefault(m, []).append(v.get("p99"))
                bl.log(f"staging {variant}: all calls p99 {s['all_calls_us']['p99']:.0f} us; "
                       f"update_state_after_free p99 {s['per_method_us']['update_state_after_free'].get('p99', 0):.0f} us; "
                       f"build_connector_meta p99 {s['per_method_us']['build_connector_meta'].get('p99', 0):.0f} us")
    out["allocate_duration_us"] = bl.summary([h * 1e6 for h in holds])
    return out


# --------------------------------------------------------------------------- GET requests


def whatif_get(args: argparse.Namespace) -> dict[str, Any]:
    """GET of an N MiB + header blob with 8 MiB parts (2 dependent requests) vs parts
    sized so the first request covers it (1 request) -- what a first Range of
    part + MAX_HEADER_BYTES would do."""
    from ec_s3.loop import shared_loop
    from ec_s3.blob.codec import BlobMeta, encode_blob
    from ec_s3.store.client import S3Store

    bg = shared_loop()
    out: dict[str, Any] = {}
    with bl.s3_endpoint("whatif-get") as ep:
        bucket = bl.create_bucket(ep)
        for size in args.sizes_mib:
            rows = size * bl.MiB // 8192
            blob = encode_blob(torch.randn(rows, 4096).to(torch.bfloat16), BlobMeta("b", torch.bfloat16, (rows, 4096), "ns", "p"))
            stores = {
                "as-is (8 MiB parts)": S3Store(ep.config(bucket)),
                "first range covers header": S3Store(ep.config(bucket, multipart_part_bytes=8 * bl.MiB + 64 * 1024,
                                                               multipart_threshold_bytes=16 * bl.MiB + 64 * 1024)),
            }
            keys = [f"g{size}/{i}" for i in range(args.objects)]
            st0 = next(iter(stores.values()))
            for k in keys:
                st0.run(st0.put_async(k, blob))
            res: dict[str, list[float]] = {n: [] for n in stores}
            reqs: dict[str, int] = {n: 0 for n in stores}
            for rep in range(args.repeats):
                for name, st in (list(stores.items()) if rep % 2 == 0 else list(stores.items())[::-1]):
                    r0 = st.stats.requests

                    async def go(st: Any = st) -> None:
                        for k in keys:
                            await st.get_async(k)

                    t0 = time.perf_counter()
                    bg.run(go())
                    res[name].append(len(keys) * len(blob) / bl.MiB / (time.perf_counter() - t0))
                    reqs[name] = (st.stats.requests - r0) // len(keys)
            out[str(size)] = {n: {"mib_per_s": bl.summary(v), "requests_per_get": reqs[n]} for n, v in res.items()}
            base = statistics.median(res["as-is (8 MiB parts)"])
            bl.log(f"GET {size} MiB x1: " + ", ".join(
                f"{n}: {statistics.median(v):.0f} MiB/s ({statistics.median(v) / base:.2f}x, {reqs[n]} requests)" for n, v in res.items()))
            for st in stores.values():
                st.close()
    return {"sizes": out}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["save", "staging", "get"])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--samples", type=int, default=9)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--objects", type=int, default=8)
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    fn = {"save": whatif_save, "staging": whatif_staging, "get": whatif_get}[args.what]
    bl.write_json(f"whatif_{args.what}", {"params": {k: str(v) for k, v in vars(args).items()}, **fn(args)}, args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
