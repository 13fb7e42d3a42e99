"""Worker counters reach ``/metrics`` on a server that went idle (issue 41 item 4).

A producer's upload finishes on its worker's I/O loop after the step that encoded the
item, and vLLM publishes connector stats only with an engine step: without a later
step, ``vllm:ec_s3_blobs_uploaded_total`` stayed 0 on an idle encoder. One real
encoder server on SeaweedFS with the tiny model; no request is sent after the one
that encodes, and the counter must be right within a wide bound. Slow (one engine load).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from ec_s3.demo.chat import chat_body, post_chat
from ec_s3.sandbox.env import CPU_OFFLINE_ENV
from ec_s3.sandbox.vllm_server import TINY_MODEL_ARGS, VllmServer, ec_transfer_config
from ec_s3.store.client import S3Store

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.timeout(900)]

UPLOADED = "vllm:ec_s3_blobs_uploaded_total"
SETTLE_STEPS = "vllm:ec_s3_settle_steps_total"
BOUND_S = 5.0  # a wide margin: the upload itself takes milliseconds here


def _blobs(store: S3Store, prefix: str) -> list[str]:
    async def collect() -> list[str]:
        return [o.key async for o in store.list_async(f"{prefix}/")]

    keys = store.run(collect(), timeout=60)
    return [k for k in keys if k.endswith(".safetensors") and "/_ec_s3_probe/" not in k]


def test_an_idle_encoders_upload_counter_is_true_without_another_request(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]],
    make_store: Callable[..., S3Store], s3: Any, tmp_path: Path,
) -> None:
    prefix = "idle"
    extra = extra_config(prefix=prefix)
    del extra["access_key_id"], extra["secret_access_key"]  # through the environment
    env = {**CPU_OFFLINE_ENV, "AWS_ACCESS_KEY_ID": s3.credentials.access_key_id,
           "AWS_SECRET_ACCESS_KEY": s3.credentials.secret_access_key}
    store = make_store(prefix=prefix)
    model = str(tiny_model_dir)
    producer = VllmServer(model, name="producer", args=TINY_MODEL_ARGS, env=env,
                          log_path=tmp_path / "producer.log", ec_transfer_config=ec_transfer_config("ec_producer", extra))
    with producer:
        producer.wait_ready(timeout=600)
        for seed, want in ((71, 1), (72, 2), (73, 3)):
            r = post_chat(producer.url, chat_body(model, seed, "What is in this picture?"))
            assert r.ok, (r, producer.log_tail())
            deadline = time.monotonic() + 60
            while len(_blobs(store, prefix)) < want:
                assert time.monotonic() < deadline, "the encoder never uploaded its blob"
                time.sleep(0.05)
            uploaded_at = time.monotonic()
            # The server is idle now: nothing but /metrics is asked of it from here.
            value = None
            while time.monotonic() - uploaded_at < BOUND_S:
                value = producer.metrics().get(UPLOADED)
                if value == want:
                    break
                time.sleep(0.1)
            waited = time.monotonic() - uploaded_at
            assert value == want, (
                f"{UPLOADED} = {value} {waited:.1f} s after blob {want} was in the bucket, with the server idle")
            print(f"\nblob {want}: {UPLOADED} = {value} {waited:.2f} s after the blob was in the bucket",
                  file=sys.stderr)
        # What keeping the engine stepping cost: steps ec-s3 asked for while idle.
        time.sleep(1.0)
        steps = producer.metrics().get(SETTLE_STEPS)
        print(f"settle steps for 3 uploads: {steps}", file=sys.stderr)
        assert steps is not None and steps < 3 * 500, steps
        time.sleep(1.0)
        assert producer.metrics().get(SETTLE_STEPS) == steps, "the idle engine kept stepping"
