"""The demo's chat client: the request schedule, OpenAI chat bodies with one image,
and comparing two answers token by token.

Owns what is sent (a greedy request whose answer carries token ids and logprobs) and
when two answers count as equal. Used by ``ec-s3 demo`` and by ``tests/e2e/test_e2e.py``.
Does not own any server (:mod:`ec_s3.sandbox.vllm_server`) nor the summary
(:mod:`ec_s3.demo.report`).
"""

from __future__ import annotations

import base64
import functools
import io
import json
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "AGAIN",
    "BATCHING_TOLERANCE",
    "DEFAULT_MAX_TOKENS",
    "FLEET",
    "FRESH",
    "QUESTIONS",
    "ChatResult",
    "DemoRequest",
    "chat_body",
    "compare_results",
    "default_schedule",
    "image_data_url",
    "logprob_distance",
    "post_chat",
    "run_schedule",
]

QUESTIONS = ("What is in this picture?", "Describe the image in one sentence.")
DEFAULT_MAX_TOKENS = 8
#: The largest |logprob difference| that two answers with equal token ids may show and
#: still count as equal. A CPU engine's bf16 logprobs move in their last bits with the
#: batch a request is prefilled or decoded in (two requests prefilled together vs one
#: after the other), and under parallel dispatch each request is scheduled when its own
#: blob lands, so the consumer's batches need not be the plain server's. Measured: up to
#: 4.1e-3 on the tiny model (tests/e2e/test_e2e.py, CI run of 2026-12-02); an image encoded
#: with other weights moves the answer far beyond it (the e2e control asserts the margin).
BATCHING_TOLERANCE = 2e-2

#: What a request's image is to the prefill/decode server that gets it.
FRESH = "fresh"  # no encoder of the fleet has seen it
AGAIN = "again"  # this prefill/decode server had it in an earlier step
FLEET = "fleet"  # an encoder published it earlier (for another front); new to this server


@dataclass(frozen=True)
class DemoRequest:
    """One chat request of the schedule: an image (by seed) and a question."""

    index: int  # 1-based, stable across phases
    step: int  # requests of one step are sent concurrently, steps one after another
    image_seed: int
    question: str
    kind: str = FRESH  # FRESH, AGAIN or FLEET

    @property
    def image_label(self) -> str:
        return f"img-{self.image_seed}"


def default_schedule(seeds: Sequence[int] = (1, 2, 3, 4),
                     fleet_seeds: Sequence[int] = ()) -> list[list[DemoRequest]]:
    """6 requests over 4 images: two alone, two at once, then the first two images again
    with the other question (the consumer already holds those encoder outputs); then
    one request alone per image of ``fleet_seeds`` (images the caller has had an encoder
    publish beforehand, so they are in the bucket but new to prefill/decode)."""
    a, b, c, d = seeds
    plan = [[(a, 0)], [(b, 1)], [(c, 0), (d, 1)], [(a, 1)], [(b, 0)], *([(s, n % 2)] for n, s in enumerate(fleet_seeds))]
    schedule: list[list[DemoRequest]] = []
    seen: set[int] = set()
    n = 0
    for step, reqs in enumerate(plan, 1):
        row = []
        for seed, q in reqs:
            n += 1
            kind = FLEET if seed in fleet_seeds else AGAIN if seed in seen else FRESH
            row.append(DemoRequest(n, step, seed, QUESTIONS[q], kind))
        seen.update(seed for seed, _ in reqs)
        schedule.append(row)
    return schedule


@functools.lru_cache(maxsize=64)
def image_data_url(seed: int, size: int | None = None, *, photo: bool = False) -> str:
    """A ``data:`` URL of the PNG of :func:`ec_s3.tiny_model.make_test_image` (seed; at
    ``size`` pixels, the default model's when None), or with ``photo`` of a JPEG photo
    of a real photo's size (:func:`ec_s3.sandbox.tiny_qwen.photo_jpeg`, 1024² by default)."""
    if photo:
        from ec_s3.sandbox.tiny_qwen import photo_jpeg

        jpeg = photo_jpeg(seed, size or 1024)
        return "data:image/jpeg;base64," + base64.b64encode(jpeg).decode("ascii")
    from ec_s3.sandbox.tiny_model import make_test_image

    buf = io.BytesIO()
    (make_test_image(seed) if size is None else make_test_image(seed, size)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def chat_body(model: str, image_seed: int, question: str, *, max_tokens: int = DEFAULT_MAX_TOKENS,
              photo: bool = False) -> dict[str, Any]:
    """A greedy OpenAI chat request with one image (``photo``: a 1024² JPEG photo, see
    :func:`image_data_url`) whose answer carries token ids and their logprobs (vLLM's
    ``return_tokens_as_token_ids``)."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image_data_url(image_seed, photo=photo)}},
            {"type": "text", "text": question},
        ]}],
        "temperature": 0.0,
        "max_tokens": max_tokens,
        "logprobs": True,
        "top_logprobs": 1,
        "return_tokens_as_token_ids": True,
    }


@dataclass
class ChatResult:
    """What came back for one chat request."""

    status: int
    latency_s: float
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


def post_chat(base_url: str, body: Mapping[str, Any], *, timeout: float = 180.0,
              request_id: str | None = None) -> ChatResult:
    """POST ``/v1/chat/completions``; never raises for HTTP or connection errors."""
    headers = {"Content-Type": "application/json"}
    if request_id:
        headers["X-Request-Id"] = request_id
    req = urllib.request.Request(f"{base_url.rstrip('/')}/v1/chat/completions",
                                 data=json.dumps(body).encode(), headers=headers, method="POST")
    started = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - our servers
            status, raw = int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        raw = exc.read() if exc.fp is not None else b""
        return ChatResult(int(exc.code), time.monotonic() - started, error=raw.decode("utf-8", "replace")[:300])
    except (OSError, ValueError) as exc:
        return ChatResult(0, time.monotonic() - started, error=f"{type(exc).__name__}: {exc}")
    latency = time.monotonic() - started
    try:
        payload = json.loads(raw)
        choice = payload["choices"][0]
        content = (choice.get("logprobs") or {}).get("content") or []
        token_ids = [int(str(t["token"]).split(":", 1)[1]) for t in content]
        logprobs = [float(t["logprob"]) for t in content]
        text = (choice.get("message") or {}).get("content") or ""
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        return ChatResult(status, latency, error=f"unexpected answer ({type(exc).__name__}: {exc})")
    return ChatResult(status, latency, token_ids, logprobs, text)


def logprob_distance(got: ChatResult, want: ChatResult) -> float:
    """The largest |logprob difference| of two answers; infinite when their token ids
    differ (or either failed)."""
    if not got.ok or not want.ok or got.token_ids != want.token_ids or len(got.logprobs) != len(want.logprobs):
        return float("inf")
    return max((abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)), default=0.0)


def compare_results(got: ChatResult, want: ChatResult, tolerance: float = 0.0) -> tuple[bool, str]:
    """(equal, one-word verdict): equal token ids and logprobs within ``tolerance``."""
    if not got.ok or not want.ok:
        return False, "error"
    if got.token_ids != want.token_ids:
        return False, "DIFFERENT tokens"
    diff = logprob_distance(got, want)
    if diff == float("inf"):
        return False, "DIFFERENT logprobs"
    if diff == 0.0:
        return True, "identical"
    if diff <= tolerance:
        return True, f"equal (max |dlogprob| {diff:.1e})"
    return False, f"DIFFERENT logprobs (max |d| {diff:.1e})"


def run_schedule(
    base_url: str,
    model: str,
    schedule: Sequence[Sequence[DemoRequest]],
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    timeout: float = 180.0,
    id_prefix: str = "ec-s3-demo",
    after_step: Callable[[int, list[DemoRequest]], None] | None = None,
    photo: bool = False,
) -> dict[int, ChatResult]:
    """Send the schedule to ``base_url`` (steps in order, a step's requests at once);
    ``after_step(step, requests)`` runs when a step's answers are all in."""
    results: dict[int, ChatResult] = {}
    run_id = secrets.token_hex(3)
    with ThreadPoolExecutor(max_workers=max((len(s) for s in schedule), default=1)) as pool:
        for reqs in schedule:
            futures = {
                r.index: pool.submit(post_chat, base_url, chat_body(model, r.image_seed, r.question,
                                                                    max_tokens=max_tokens, photo=photo),
                                     timeout=timeout, request_id=f"{id_prefix}-{run_id}-{r.index}")
                for r in reqs
            }
            for index, fut in futures.items():
                results[index] = fut.result()
            if after_step is not None and reqs:
                after_step(reqs[0].step, list(reqs))
    return results
