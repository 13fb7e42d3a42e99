"""The environment a vLLM process needs on a CPU host without internet: a small KV
cache, no model-hub look-ups, no usage reporting.

Owns the one copy of those variables, for the servers the demo and the tests start,
the in-process engines of the tests and the benches. Does not own anything a real
deployment sets (device, model, credentials) nor per-caller extras (log levels,
CPU binding), which callers add on top.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from types import MappingProxyType

__all__ = ["CPU_OFFLINE_ENV", "apply_offline_env"]

CPU_OFFLINE_ENV: Mapping[str, str] = MappingProxyType({
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; vLLM's CPU default would take a large share of RAM
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
})


def apply_offline_env(extra: Mapping[str, str] | None = None, environ: MutableMapping[str, str] | None = None) -> None:
    """``setdefault`` :data:`CPU_OFFLINE_ENV` (and ``extra``) into ``environ`` (default
    ``os.environ``): a value the caller's shell already set wins. Call it before vLLM is
    imported in-process: vLLM caches its environment once an engine starts."""
    target = os.environ if environ is None else environ
    for key, value in {**CPU_OFFLINE_ENV, **(extra or {})}.items():
        target.setdefault(key, value)
