"""One set of real vLLM servers on the tiny Qwen2.5-VL, shared by the test modules that
need them (``tests/e2e/test_e2e_qwen.py``, ``tests/e2e/test_e2e_corpus.py``): engine loads are
most of those modules' time, and CI's time is short.

The stack: SeaweedFS (the session's ``s3_endpoint``), a plain baseline server, an
``ec_producer`` behind a fault-injecting front (:class:`~support.faultproxy.FaultProxy`:
an encoder that fails mid-request on demand), an ``ec_consumer``, and ec-s3 proxies
in-process. The baseline and the producer load the original weights; every baseline
answer the modules need is taken then (:data:`BASELINES`), the baseline server stops,
and the vision tower is re-randomised on disk (same path: same identifiers and keys)
before the consumer starts: an answer equal to the baseline proves the consumer used the
producer's encoder output, not its own encoder.

:class:`StackHolder` starts the stack on first use and ``tests/conftest.py`` stops it
after the last test that uses it (``pytest_runtest_teardown``), so that three engines do
not stay loaded through the rest of the session.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ec_s3.blob.keys import KeySpace
from ec_s3.demo.chat import ChatResult, post_chat
from ec_s3.proxy.known import keyspace_of
from ec_s3.proxy.server import ProxyConfig, ProxyThread
from ec_s3.sandbox.env import CPU_OFFLINE_ENV
from ec_s3.sandbox.net import http_get
from ec_s3.sandbox.tiny_model import reseed_vision_weights
from ec_s3.sandbox.vllm_server import (
    QWEN_MODEL_ARGS,
    LoadProgress,
    VllmServer,
    ec_transfer_config,
    start_all,
    stop_all,
    wait_all_ready,
)
from support.faultproxy import FaultProxy
from support.s3_matrix import S3Endpoint, new_bucket

__all__ = ["BASELINES", "PREFIX", "QWEN_STACK_ARGS", "QwenStack", "StackHolder"]

LOAD_TIMEOUT_S = 900.0
PREFIX = "qwen"
# The tests' servers take up to 4 images and one video per request (the corpus sends
# 2-4 images, and an image with a video); otherwise QWEN_MODEL_ARGS.
QWEN_STACK_ARGS: tuple[str, ...] = (
    *QWEN_MODEL_ARGS[: QWEN_MODEL_ARGS.index("--limit-mm-per-prompt")],
    "--limit-mm-per-prompt", '{"image": 4, "video": 1}',
)

#: What each module needs of the plain server, taken before the vision tower changes:
#: ``name -> fn(baseline_url, model) -> any``; its result is ``QwenStack.baseline[name]``.
BASELINES: dict[str, Callable[[str, str], Any]] = {}


@dataclass
class QwenStack:
    model: str
    bucket: str
    endpoint: S3Endpoint
    producer: VllmServer
    consumer: VllmServer
    encoder_front: FaultProxy  # between the proxies and the producer: faults on demand
    store: Any
    baseline: dict[str, Any]
    proxies: dict[str, ProxyThread] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # the servers' ec_connector_extra_config

    def keyspace(self, key: str) -> KeySpace:
        space = keyspace_of(key, PREFIX)
        assert space is not None, key
        return space

    def proxy(self, name: str, *, direct: bool = False, **overrides: Any) -> ProxyThread:
        """The proxy ``name`` (started on first use): parallel dispatch unless ``overrides``
        say otherwise; its encoder is the producer itself with ``direct``, else the
        producer behind :attr:`encoder_front`."""
        if name not in self.proxies:
            encoder = self.producer.url if direct else self.encoder_front.endpoint_url
            config = {"encoder_urls": [encoder], "pd_urls": [self.consumer.url], "port": 0,
                      "encode_timeout_s": 60.0, "known_settle_s": 0.0, **overrides}
            self.proxies[name] = ProxyThread(ProxyConfig(**config)).start()
        return self.proxies[name]

    def bucket_lookup(self) -> dict[str, Any]:
        """The fleet's bucket, as ``ProxyConfig.bucket_lookup`` takes it."""
        creds = self.endpoint.credentials
        return {"bucket": self.bucket, "endpoint_url": self.endpoint.url, "prefix": PREFIX,
                "access_key_id": creds.access_key_id, "secret_access_key": creds.secret_access_key}

    def consumer_health(self) -> None:
        """The consumer's engine is alive: its process runs and /health is 200."""
        assert self.consumer.is_running(), self.consumer.log_tail()
        status, _ = http_get(f"{self.consumer.url}/health", timeout=10)
        assert status == 200, f"consumer /health {status}; {self.consumer.log_tail()}"

    def post(self, url: str, body: dict[str, Any]) -> ChatResult:
        return post_chat(url, body)

    def stop(self) -> None:
        for proxy in self.proxies.values():
            proxy.stop()
        self.proxies.clear()
        self.encoder_front.stop()
        stop_all([self.producer, self.consumer])
        self.store.close(timeout=5.0)


def start_stack(endpoint: S3Endpoint, tiny_qwen_dir: Path, work: Path) -> QwenStack:
    creds = endpoint.credentials
    bucket, store = new_bucket(endpoint, "qwen")
    model_dir = work / "model"
    shutil.copytree(tiny_qwen_dir, model_dir)
    model = str(model_dir)
    s3_env = {**CPU_OFFLINE_ENV, "AWS_ACCESS_KEY_ID": creds.access_key_id,
              "AWS_SECRET_ACCESS_KEY": creds.secret_access_key}
    extra = {"bucket": bucket, "endpoint_url": endpoint.url, "prefix": PREFIX,
             "retry_base_delay_s": 0.01, "retry_max_delay_s": 0.2, "promised_wait_s": 30, "lookup_wait_s": 5,
             # A producer trusts what it published this long (default 300 s): a test's
             # "ec-s3 gc" deletes blobs a second old, as gc --older-than deletes blobs
             # older than the fleet's TTLs.
             "present_ttl_s": 1.0,
             # A small staging area (default 4 GiB): a consumer that no longer holds a
             # blob it fetched is a few requests away (tests/e2e/test_e2e_corpus.py).
             "staging_bytes": 2 * 1024 * 1024}
    baseline_srv = VllmServer(model, name="qwen-baseline", args=QWEN_STACK_ARGS, log_path=work / "baseline.log",
                              env={**CPU_OFFLINE_ENV, "AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None})
    producer = VllmServer(model, name="qwen-producer", args=QWEN_STACK_ARGS, env=s3_env,
                          log_path=work / "producer.log", ec_transfer_config=ec_transfer_config("ec_producer", extra))
    consumer = VllmServer(model, name="qwen-consumer", args=QWEN_STACK_ARGS, env=s3_env,
                          log_path=work / "consumer.log", ec_transfer_config=ec_transfer_config("ec_consumer", extra))
    front: FaultProxy | None = None
    progress = LoadProgress(sys.stderr, prefix="  e2e-qwen ")
    try:
        start_all([baseline_srv, producer])
        wait_all_ready([baseline_srv, producer], LOAD_TIMEOUT_S, progress=progress)
        baseline = {}
        for name, take in BASELINES.items():
            started = time.monotonic()
            baseline[name] = take(baseline_srv.url, model)
            print(f"  e2e-qwen: plain answers for {name} in {time.monotonic() - started:.1f} s", file=sys.stderr)
        baseline_srv.stop()

        reseed_vision_weights(model_dir, seed=99, prefixes=("visual.",))
        consumer.start()
        wait_all_ready([consumer], LOAD_TIMEOUT_S, progress=progress)
        front = FaultProxy(producer.url).start()
        return QwenStack(model, bucket, endpoint, producer, consumer, front, store, baseline, extra=extra)
    except BaseException:
        if front is not None:
            front.stop()
        stop_all([baseline_srv, producer, consumer])
        store.close(timeout=5.0)
        raise


class StackHolder:
    """The stack, started on first :meth:`get` and stopped by :meth:`stop` (then started
    again by a later :meth:`get`)."""

    def __init__(self, endpoint: S3Endpoint, tiny_qwen_dir: Path, workdir: Callable[[], Path]) -> None:
        self._endpoint, self._model, self._workdir = endpoint, tiny_qwen_dir, workdir
        self._stack: QwenStack | None = None

    def get(self) -> QwenStack:
        if self._stack is None:
            self._stack = start_stack(self._endpoint, self._model, self._workdir())
        return self._stack

    def stop(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.stop()
