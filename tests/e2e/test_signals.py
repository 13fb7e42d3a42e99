"""SIGTERM on a real producer server: vLLM shuts its engine down, ec-s3 flushes the
uploads still pending (bounded by shutdown_timeout_s) before the process exits.

vLLM's default ``--shutdown-timeout 0`` aborts: it SIGKILLs the engine processes at
once, and no process can flush after SIGKILL (ec-s3 warns about it at start-up). A
producer therefore runs with ``--shutdown-timeout``, as the README says."""

from __future__ import annotations

import base64
import io
import json
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from ec_s3.sandbox.env import CPU_OFFLINE_ENV
from ec_s3.sandbox.vllm_server import TINY_MODEL_ARGS, VllmServer, ec_transfer_config
from ec_s3.store.client import S3Store
from ec_s3.sandbox.tiny_model import make_test_image
from support.faultproxy import FaultProxy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _chat(url: str, seed: int) -> dict[str, Any]:
    buf = io.BytesIO()
    make_test_image(seed).save(buf, format="PNG")
    image = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    body = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "What?"}]}]}
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def test_sigterm_flushes_pending_uploads(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], fault_proxy: FaultProxy,
    make_store: Callable[..., S3Store], tmp_path: Path,
) -> None:
    extra = extra_config(fault_proxy.endpoint_url, lookup="promised", shutdown_timeout_s=8.0)
    creds = {"AWS_ACCESS_KEY_ID": extra.pop("access_key_id"), "AWS_SECRET_ACCESS_KEY": extra.pop("secret_access_key")}
    server = VllmServer(tiny_model_dir, name="producer", ec_transfer_config=ec_transfer_config("ec_producer", extra),
                        args=[*TINY_MODEL_ARGS, "--served-model-name", "tiny", "--shutdown-timeout", "10"],
                        # INFO: the test waits for the worker's INFO line, whatever the caller's env says.
                        env={**CPU_OFFLINE_ENV, **creds, "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "10",
                             "VLLM_LOGGING_LEVEL": "INFO"},
                        log_path=tmp_path / "producer.log")
    with server:
        server.wait_ready(300)
        # Every upload is held at the proxy until the worker says it is flushing: pending
        # when it closes however long vLLM's own shutdown takes first (a fixed PUT latency
        # raced it on a loaded CI host: the uploads finished first, nothing was pending).
        fault_proxy.set_stall(True, methods=["PUT"])
        with ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(lambda s: _chat(server.url, s), range(6)))
        keys = [entry["key"] for r in replies for entry in r["ec_transfer_params"].values()]
        assert len(set(keys)) == 6
        fault_proxy.wait_until(lambda c: c.held_now >= 1, timeout_s=10)
        store = make_store()
        assert not any(store.run(store.head_async(k)) for k in keys), "uploads must still be pending"
        log_path = tmp_path / "producer.log"
        started = time.monotonic()
        with ThreadPoolExecutor(1) as pool:
            stopping = pool.submit(server.stop, 60)
            while "pending uploads before exit" not in log_path.read_text() and not stopping.done():
                time.sleep(0.1)
            fault_proxy.set_stall(False)  # released inside shutdown_timeout_s (8 s)
            code = stopping.result()
        stopped_after = time.monotonic() - started
    present = [k for k in keys if store.run(store.head_async(k)) is not None]
    log = log_path.read_text()
    print(f"\nSIGTERM: exit {code} after {stopped_after:.1f}s, {len(present)}/6 blobs present")
    assert present == keys, log[-3000:]
    assert "flushing 6 pending uploads before exit" in log
    assert "6 uploads were pending at shutdown: 0 abandoned" in log
