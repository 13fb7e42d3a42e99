"""The command line of ``ec-s3 demo``: its flags, their defaults and the help text.

Owns the parser and the names of its choices (``--topology``). Does not own what the
flags do: the phases (:mod:`ec_s3.demo.run`) and the requests (:mod:`ec_s3.demo.chat`),
whose defaults it shows.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ec_s3.demo.chat import BATCHING_TOLERANCE, DEFAULT_MAX_TOKENS

__all__ = ["AGGREGATED", "DEFAULT_BUCKET", "EPD", "build_parser"]

DEFAULT_BUCKET = "ec-s3-demo"
EPD, AGGREGATED = "epd", "aggregated"  # --topology


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``ec-s3 demo``; ``--help`` prints its description and epilog as written."""
    p = argparse.ArgumentParser(
        prog="ec-s3 demo",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Run encode / prefill-decode disaggregation through S3 end to end: an encoder vLLM\n"
            "server publishes image encoder outputs to a bucket, a prefill/decode server loads\n"
            "them instead of encoding, the ec-s3 proxy routes between them; every answer is\n"
            "compared with a plain (non-disaggregated) vLLM server. Exit 0 only if all match.\n"
            "\n"
            "--topology aggregated: instead of encoder + prefill/decode, two ec_both servers\n"
            "(each encodes, publishes what it encodes, loads what the other published) behind\n"
            "the proxy with affinity routing; the summary shows what each server encoded and\n"
            "loaded, and that each distinct image was encoded once across the fleet.\n"
            "\n"
            "Without options everything is local: an embedded SeaweedFS S3 server and a tiny\n"
            "offline Qwen2.5-VL with random weights (a few minutes on a 2-core CPU)."
        ),
        epilog=(
            "S3: with --endpoint-url the credentials come from the standard AWS chain\n"
            "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ...); they are passed to the\n"
            "servers through the environment, never on a command line. Each run writes under a\n"
            "fresh prefix and deletes its blobs at the end (--keep-blobs keeps them).\n"
            "\n"
            "--model: the encoder and prefill/decode servers (or the two aggregated servers) run at\n"
            "the same time, so on one GPU give each a share, e.g.\n"
            "--vllm-arg=--gpu-memory-utilization=0.4 (use the = form, or\n"
            "quote several: --vllm-arg='--max-model-len 4096 --enforce-eager')."
        ),
    )
    _add_groups(p)
    p.add_argument("--keep-running", action="store_true",
                   help="leave the phase-4 servers and the proxy running after the summary (Ctrl-C stops)")
    return p


def _add_groups(p: argparse.ArgumentParser) -> None:
    """The S3, model-and-servers and requests flags."""
    s3 = p.add_argument_group("S3")
    s3.add_argument("--endpoint-url", default=os.environ.get("EC_S3_ENDPOINT_URL"),
                    help="S3/MinIO endpoint (default $EC_S3_ENDPOINT_URL; unset: start an embedded SeaweedFS)")
    s3.add_argument("--bucket", default=None,
                    help=f"bucket, created if missing (default $EC_S3_BUCKET or {DEFAULT_BUCKET})")
    s3.add_argument("--prefix", default=None,
                    help="key prefix for the blobs (default ec-s3-demo/<run id>: a fresh one per run)")
    s3.add_argument("--extra-config", default=None, metavar="JSON",
                    help='more ec_connector_extra_config keys, e.g. \'{"region": "eu-west-1"}\'')
    s3.add_argument("--keep-blobs", action="store_true", help="do not delete this run's blobs at the end")
    m = p.add_argument_group("model and servers")
    m.add_argument("--model", default=None,
                   help="model dir or id to serve instead of the tiny model (uses your vLLM and GPU)")
    m.add_argument("--tiny-model", choices=["qwen", "llava"], default="qwen",
                   help="the offline stand-in when --model is not given: a tiny Qwen2.5-VL with 1024² photos "
                        "(the model family EPD serves; default), or a tiny LLaVA-1.5 with small fixed-size images")
    m.add_argument("--tiny-model-dir", type=Path, default=None,
                   help="where the tiny model is built/reused (default $XDG_CACHE_HOME/ec-s3/tiny-qwen, /tiny-llava with --tiny-model llava)")
    m.add_argument("--topology", choices=[EPD, AGGREGATED], default=EPD,
                   help="epd (default): an encoder (ec_producer), a prefill/decode server (ec_consumer) and the "
                        "proxy; aggregated: two ec_both servers on one bucket (each its own staging dir) behind the "
                        "proxy with affinity routing and no encoder")
    m.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="extra argument(s) for every vLLM server (repeatable, shell-split)")
    m.add_argument("--load-timeout", type=float, default=600.0, metavar="S",
                   help="how long the servers may take to load (default 600)")
    m.add_argument("--log-dir", type=Path, default=None,
                   help="server logs (default: a temp dir, removed after a successful run)")
    r = p.add_argument_group("requests")
    r.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help=f"per answer (default {DEFAULT_MAX_TOKENS})")
    r.add_argument("--logprob-tolerance", type=float, default=BATCHING_TOLERANCE, metavar="X",
                   help="largest |logprob difference| of equal token ids still counted as a match "
                        f"(default {BATCHING_TOLERANCE:g}: batching noise; 0: identical)")
    r.add_argument("--request-timeout", type=float, default=180.0, metavar="S", help="per request (default 180)")
