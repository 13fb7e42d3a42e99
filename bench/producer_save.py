"""Producer step cost: ``save_caches`` time per call vs the time for the same blob to
become visible in the store (HEAD 200), through the real ECS3Connector (worker role).

Goal: median ``save_caches`` <= 1% of the upload time. Both are measured in one run,
so the ratio holds on a noisy machine. Starts its own SeaweedFS.

    .venv/bin/python bench/producer_save.py --calls 200 --size-mib 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

for _k, _v in {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}.items():
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402

from ec_s3.config import ECS3Config  # noqa: E402
from ec_s3.embedded_s3 import EmbeddedS3Server  # noqa: E402
from ec_s3.store import S3Store  # noqa: E402
from ec_s3.tiny_model import build_tiny_llava  # noqa: E402


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--size-mib", type=int, default=8)
    parser.add_argument("--visible-samples", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "producer_save.json")
    args = parser.parse_args()

    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    from ec_s3.connector import ECS3Connector
    from ec_s3.metadata import ECS3ConnectorMetadata

    work = Path(tempfile.mkdtemp(prefix="ec-s3-bench-"))
    server = EmbeddedS3Server(data_dir=work / "s3").start()
    try:
        model_dir = build_tiny_llava(work / "model")
        extra: dict[str, Any] = {
            "bucket": "bench", "endpoint_url": server.endpoint_url,
            "access_key_id": server.credentials.access_key_id,
            "secret_access_key": server.credentials.secret_access_key,
            "max_inflight_bytes": (args.calls + 2) * (args.size_mib + 1) << 20, "lookup": "promised",
        }
        store = S3Store(ECS3Config.from_extra_config(extra, environ={}))
        store.run(store.create_bucket_async())
        vllm_config = EngineArgs(
            model=str(model_dir), max_model_len=512, enforce_eager=True,
            ec_transfer_config={"ec_connector": "ECS3Connector", "ec_connector_module_path": "ec_s3",
                                "ec_role": "ec_producer", "ec_connector_extra_config": extra},
        ).create_engine_config()
        conn = ECS3Connector(vllm_config, ECConnectorRole.WORKER)
        conn.bind_connector_metadata(ECS3ConnectorMetadata())
        keyspace = conn.model.keyspace
        width = 2048
        rows = (args.size_mib << 20) // (width * 2)
        tensor = torch.randn(rows, width).to(torch.bfloat16)

        # 1. Upload time: save one item, poll HEAD until the blob is visible.
        visible: list[float] = []
        for i in range(args.visible_samples):
            ident = f"visible-{i}"
            cache = {ident: tensor}
            started = time.perf_counter()
            conn.save_caches(cache, ident)
            key = keyspace.key_for(ident)
            while store.run(store.head_async(key)) is None:
                time.sleep(0.001)
            visible.append(time.perf_counter() - started)
        print(f"upload-visible: median {statistics.median(visible) * 1e3:.1f} ms", file=sys.stderr)

        # 2. save_caches cost: a burst of calls, as a model step would make them.
        costs: list[float] = []
        for i in range(args.calls):
            ident = f"burst-{i}"
            cache = {ident: tensor}
            started = time.perf_counter()
            conn.save_caches(cache, ident)
            costs.append(time.perf_counter() - started)
        conn.shutdown()
        store.close()
    finally:
        server.stop()

    save_med, vis_med = statistics.median(costs), statistics.median(visible)
    result = {
        "size_mib": args.size_mib,
        "calls": args.calls,
        "save_caches_median_us": save_med * 1e6,
        "save_caches_p99_us": _pct(costs, 0.99) * 1e6,
        "save_caches_max_us": max(costs) * 1e6,
        "upload_visible_median_ms": vis_med * 1e3,
        "upload_visible_min_ms": min(visible) * 1e3,
        "ratio_save_to_upload": save_med / vis_med,
        "goal_ratio": 0.01,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"save_caches ({args.size_mib} MiB, {args.calls} calls): median {result['save_caches_median_us']:.0f} us, "
          f"p99 {result['save_caches_p99_us']:.0f} us")
    print(f"blob visible after: median {result['upload_visible_median_ms']:.1f} ms")
    print(f"ratio save/upload: {result['ratio_save_to_upload'] * 100:.3f}% (goal <= 1%)")
    return 0 if result["ratio_save_to_upload"] <= 0.01 else 1


if __name__ == "__main__":
    raise SystemExit(main())
