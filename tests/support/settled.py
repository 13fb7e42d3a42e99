"""A vLLM server's counter once it has settled: worker counters reach ``/metrics`` only
when the scheduler side collects stats, which vLLM does on engine steps, and uploads
finish after the step that queued them. Owns no server (:mod:`ec_s3.sandbox.vllm_server`
starts them)."""

from __future__ import annotations

import time
from typing import Any

from ec_s3.demo.chat import post_chat

__all__ = ["settled_metric"]


def settled_metric(server: Any, model: str, name: str, want: float, timeout_s: float = 30.0) -> float | None:
    """``name`` on ``server``'s /metrics once it reaches ``want`` (or its value at the
    deadline). A text-only request each round makes the engine run a step."""
    deadline = time.monotonic() + timeout_s
    while True:
        post_chat(server.url, {"model": model, "messages": [{"role": "user", "content": "Hello"}],
                               "max_tokens": 1, "temperature": 0.0})
        value = server.metrics().get(name)
        if (value is not None and value >= want) or time.monotonic() > deadline:
            return value
        time.sleep(0.5)
