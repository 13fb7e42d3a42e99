"""A test-only CPU platform for the rig on vLLM 0.34, whose ``CpuPlatform`` refuses an x86
CPU without Triton (triton-cpu, not on PyPI) before it builds any config.

``install()`` gives the resolved ``current_platform`` this subclass: its
``check_and_update_config`` runs vLLM's own with the Triton test passed, so every other
check and update it makes stays as vLLM wrote it. It does nothing on a vLLM without that
check (0.32, 0.33), where Triton is really there, or off the CPU platform.
"""

from __future__ import annotations

import inspect
from typing import Any


def _refuses_without_triton(cls: type) -> bool:
    try:
        return "requires Triton" in inspect.getsource(cls.check_and_update_config)
    except (OSError, TypeError):
        return False


def install() -> bool:
    """Give vLLM's current platform the rig's subclass; True if it now has it."""
    from vllm.platforms.cpu import CpuPlatform

    if not _refuses_without_triton(CpuPlatform):  # before current_platform is resolved
        return False
    import vllm.platforms
    import vllm.triton_utils

    platform = vllm.platforms.current_platform
    if isinstance(platform, RigCpuPlatform):
        return True
    if type(platform) is not CpuPlatform or vllm.triton_utils.HAS_TRITON:
        return False
    # The same object, so every module that already imported current_platform sees it too.
    platform.__class__ = RigCpuPlatform
    return True


def _rig_cpu_platform() -> type:
    from vllm.platforms.cpu import CpuPlatform

    class RigCpuPlatform(CpuPlatform):  # type: ignore[misc, valid-type]
        @classmethod
        def check_and_update_config(cls, vllm_config: Any) -> None:
            import vllm.triton_utils

            had = vllm.triton_utils.HAS_TRITON
            vllm.triton_utils.HAS_TRITON = True  # read at call time by CpuPlatform's check
            try:
                super().check_and_update_config(vllm_config)
            finally:
                vllm.triton_utils.HAS_TRITON = had

    return RigCpuPlatform


RigCpuPlatform = _rig_cpu_platform()
