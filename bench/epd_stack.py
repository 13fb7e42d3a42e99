"""The proxies in front of the benches' EPD stacks (``bench/goodput.py``'s topologies):
``ec-s3 proxy`` in its own process, and vLLM's example EPD proxy (vendored unchanged in
``bench/third_party/``) as the baseline.

Owns starting and stopping a proxy process until its ``/health`` answers. Does not own
the servers behind it (:mod:`ec_s3.sandbox.vllm_server`) nor the proxy itself
(:mod:`ec_s3.proxy`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench import benchlib as bl

# vLLM's example EPD proxy, unchanged but for a provenance comment (bench/third_party/)
VLLM_PROXY = bl.BENCH_DIR / "third_party" / "disagg_epd_proxy.py"
VLLM_PROXY_COMMIT = "7e4cd77021afa2d7298f9e6836dc789517b01925"


@dataclass
class ProxyProc:
    """A proxy in its own process and loop, as a deployment runs it: ``python -m ec_s3.proxy``
    (:meth:`start`) or any other proxy command (:meth:`spawn`)."""

    proc: subprocess.Popen[bytes]
    url: str

    @classmethod
    def start(cls, args: list[str], log_path: Path, what: str = "ec-s3 proxy") -> ProxyProc:
        """``python -m ec_s3.proxy`` with ``args`` (its upstreams, dispatch, routing) on a free loopback port."""
        from ec_s3.sandbox.net import LOOPBACK, free_port

        port = free_port()
        return cls.spawn([sys.executable, "-m", "ec_s3.proxy", *args, "--host", LOOPBACK, "--port", str(port),
                          "--log-level", "WARNING"], port, log_path, what)

    @classmethod
    def vllm_example(cls, encoder_url: str, pd_url: str, log_path: Path) -> ProxyProc:
        """vLLM's example EPD proxy (:data:`VLLM_PROXY`) in front of one encoder and one
        prefill/decode server, with no separate prefill stage: the benches' baseline."""
        from ec_s3.sandbox.net import LOOPBACK, free_port

        port = free_port()
        return cls.spawn([sys.executable, str(VLLM_PROXY), "--host", LOOPBACK, "--port", str(port),
                          "--encode-servers-urls", encoder_url, "--prefill-servers-urls", "disable",
                          "--decode-servers-urls", pd_url], port, log_path, "vLLM's example EPD proxy")

    @classmethod
    def spawn(cls, argv: list[str], port: int, log_path: Path, what: str) -> ProxyProc:
        """Run ``argv`` (a proxy listening on loopback ``port``) until its ``/health`` answers 200."""
        from ec_s3.sandbox.net import LOOPBACK, http_get

        log = log_path.open("wb")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=bl.REPO,
                                env={**os.environ, "PYTHONPATH": str(bl.REPO)})
        log.close()
        url = f"http://{LOOPBACK}:{port}"
        deadline = time.monotonic() + 60
        while http_get(f"{url}/health", 2.0)[0] != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{what} did not start; see {log_path}")
            time.sleep(0.2)
        return cls(proc, url)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
