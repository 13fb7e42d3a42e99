"""The I/O thread's CPUs (``io_cpus``): a worker that vLLM's CPU backend pinned to one
core must not take ec-s3's uploads and downloads onto that core with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable

import pytest

from ec_s3.config import ConfigError, ECS3Config

REPO = Path(__file__).resolve().parents[1]


def test_io_cpus_accepts_auto_inherit_and_lists() -> None:
    def cpus(spec: str) -> frozenset[int] | None:
        return ECS3Config.from_extra_config({"bucket": "ec-bucket", "io_cpus": spec}).io_cpu_set()

    assert cpus("inherit") is None
    assert cpus("auto") == frozenset(range(os.cpu_count() or 1))
    assert cpus("0-3, 8") == frozenset({0, 1, 2, 3, 8})
    assert cpus("1") == frozenset({1})


@pytest.mark.parametrize("spec", ["", "x", "3-1", "0-", "-1", "0,,1", "0-99999"])
def test_io_cpus_rejects_what_is_not_a_cpu_list(spec: str) -> None:
    with pytest.raises(ConfigError, match="io_cpus"):
        ECS3Config.from_extra_config({"bucket": "ec-bucket", "io_cpus": spec})


_CHILD = textwrap.dedent(
    """
    import json, os, sys
    sys.path[:0] = [{repo!r}, {tests!r}]
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from ec_s3.connector.facade import ECS3Connector
    from ec_s3.loop import shared_loop
    from ec_s3.sandbox.vllm_server import ec_transfer_config
    from support.vllm_rig import make_vllm_config

    os.sched_setaffinity(0, {{0}})  # what vLLM's CPU backend does to a worker thread
    config = make_vllm_config({model!r}, ec_transfer_config("ec_producer", {extra!r}))
    connector = ECS3Connector(config, ECConnectorRole.WORKER)

    async def where():
        return sorted(os.sched_getaffinity(0))

    print(json.dumps(shared_loop().run(where(), 10)))
    connector.shutdown()
    """
)


@pytest.mark.parametrize(("io_cpus", "expect_all"), [("auto", True), ("inherit", False)])
def test_io_thread_leaves_a_pinned_workers_core(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], io_cpus: str, expect_all: bool
) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two CPUs")
    code = _CHILD.format(
        repo=str(REPO), tests=str(REPO / "tests"), model=str(tiny_model_dir),
        extra=extra_config(io_cpus=io_cpus, startup_check="off"),
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == (allowed if expect_all else [0])
