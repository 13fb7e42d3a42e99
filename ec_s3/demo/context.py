"""What the phases of ``ec-s3 demo`` share, and what a phase does to a server it started.

Owns :class:`DemoContext` (the flags, the printer, the schedule, the timings; warming a
server up, giving it an engine step, sending it the schedule, waiting for its uploads,
stopping it) and :class:`Setup` (what phases 1 and 2 hand to the servers). Does not own
any phase (:mod:`ec_s3.demo.run` orders them), the requests' bodies
(:mod:`ec_s3.demo.chat`) nor the servers (:mod:`ec_s3.sandbox.vllm_server`).
"""

from __future__ import annotations

import argparse
import secrets
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ec_s3.demo.chat import QUESTIONS, ChatResult, DemoRequest, chat_body, default_schedule, post_chat, run_schedule
from ec_s3.demo.report import Out, run_blobs
from ec_s3.sandbox.vllm_server import ServerError, VllmServer, stop_all

__all__ = ["FLEET_SEEDS", "WARMUP_SEED", "DemoContext", "Setup"]

WARMUP_SEED = 0  # the image of each phase's warm-up request (not in the schedule)
FLEET_SEEDS = (5, 6)  # published by the encoder before the schedule, as if for another front


@dataclass(frozen=True)
class Setup:
    """What phases 1 (S3) and 2 (the model) hand to the servers of phases 3 and 4."""

    store: Any  # the S3Store of this process: listing and deleting the run's blobs
    extra_config: dict[str, Any]  # the servers' ec_connector_extra_config (no secrets in it)
    model: str
    server_args: list[str]
    env: dict[str, str]  # the servers' environment (the embedded S3 server's credentials)
    log_dir: Path

    @property
    def prefix(self) -> str:
        return self.extra_config["prefix"]


class DemoContext:
    """One run's flags, printer, schedule and timings, and what every phase does with them."""

    def __init__(self, args: argparse.Namespace, extra: dict[str, Any], out: Out) -> None:
        self.args = args
        self.extra = extra
        self.bucket_lookup: dict[str, Any] | None = None  # set by ec_s3.demo.s3.start_s3
        self.out = out
        self.schedule = default_schedule(fleet_seeds=FLEET_SEEDS)
        self.timings: dict[str, float] = {}
        self.vllm_args = [a for raw in args.vllm_arg for a in shlex.split(raw)]
        # Photos of a real size for Qwen-VL and real models; the tiny LLaVA takes 112 px.
        self.photo = args.model is not None or args.tiny_model == "qwen"

    def step(self, n: int, text: str) -> None:
        self.out(f"\n[{n}/5] {text}")

    def stop(self, servers: list[VllmServer], proxy: Any) -> None:
        t = time.monotonic()
        stop_all(servers)
        proxy.stop()
        self.timings["shutdown"] = time.monotonic() - t

    def warm_up(self, url: str, model: str) -> ChatResult:
        """One request with an image outside the schedule: the first image request of a
        fresh server is seconds slower (processor and encoder warm-up), which would
        otherwise land on whichever request comes first. Its counts are excluded."""
        result = post_chat(url, chat_body(model, WARMUP_SEED, QUESTIONS[0], max_tokens=self.args.max_tokens,
                                             photo=self.photo),
                           timeout=self.args.request_timeout, request_id=f"warm-up-{secrets.token_hex(3)}")
        if not result.ok:
            raise ServerError(f"the warm-up request to {url} failed: HTTP {result.status}: {result.error}")
        return result

    def nudge(self, url: str, model: str) -> None:
        """A text-only request, so that an engine runs one more step (and reports stats)."""
        post_chat(url, {"model": model, "messages": [{"role": "user", "content": "Hello"}],
                        "max_tokens": 1, "temperature": 0.0}, timeout=self.args.request_timeout)

    def run_phase_schedule(self, url: str, model: str, phase: str,
                           after_step: Callable[[int, list[DemoRequest]], None], started: float, warm_up: str,
                           id_prefix: str | None = None) -> dict[int, ChatResult]:
        """The schedule through ``url`` (the phase's proxy); records the phase's timings
        under ``phase`` and prints them after ``warm_up`` (what its warm-up took)."""
        t_req = time.monotonic()
        results = run_schedule(url, model, self.schedule, max_tokens=self.args.max_tokens,
                               timeout=self.args.request_timeout, id_prefix=id_prefix or phase,
                               after_step=after_step, photo=self.photo)
        self.timings[f"{phase}_requests"] = time.monotonic() - t_req
        self.timings[phase] = time.monotonic() - started
        self.out(f"      {warm_up}; {len(results)} requests in {self.timings[f'{phase}_requests']:.2f} s "
                 "(metric scrapes between steps included)")
        return results

    def wait_listed(self, urls: list[str], model: str, store: Any, prefix: str, count: int,
                    what: str, timeout_s: float = 60.0) -> None:
        """Until the run's prefix lists ``count`` blobs, giving the servers at ``urls``
        engine steps (uploads are reported and finished with them)."""
        deadline = time.monotonic() + timeout_s
        while len(run_blobs(store, prefix, self.out) or []) < count:
            if time.monotonic() > deadline:
                raise ServerError(f"{what} were not in the bucket after {timeout_s:.0f} s")
            for url in urls:
                self.nudge(url, model)
            time.sleep(0.2)
