"""Which CPU cores each local vLLM server's worker may run on, when several servers
share one CPU host (docs/architecture.md says why one worker per core).

Owns the plan (:func:`plan_cores`, a pure function), the two spellings of a core set
(:func:`format_cpus` is also ``VLLM_CPU_OMP_THREADS_BIND``'s) and :func:`vllm_is_cpu_build`.
Does not own applying a plan to a process (:mod:`ec_s3.sandbox.vllm_server`), nor
binding anything but a worker's threads."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["OMP_BIND_ENV", "CorePlan", "format_cpus", "plan_cores", "vllm_is_cpu_build"]

# vllm-cpu: one CPU list per local worker rank ("0-2,5"; ranks separated by "|"),
# or "auto" (its default: CPU 0 for every server on a 2-core host), or "nobind".
OMP_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


@dataclass(frozen=True)
class CorePlan:
    """Where the servers' workers run.

    ``cores`` maps each server that got cores of its own to them (sorted CPU ids);
    a server left out keeps vLLM's own binding. ``spare`` are the cores no worker is
    bound to, left to the servers' API servers and engine cores (which vLLM does not
    bind). ``warning`` says why the servers could not be separated, if they could not.
    """

    cores: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    spare: tuple[int, ...] = ()
    warning: str | None = None


def plan_cores(servers: Sequence[str], available: Iterable[int], taken: Iterable[int] = ()) -> CorePlan:
    """Disjoint core sets for ``servers`` (names, in order) out of ``available`` (e.g.
    ``os.sched_getaffinity(0)``) less the cores ``taken`` by servers already running.

    * as many free cores as servers or more: contiguous, even shares in the given
      order, the first servers getting one more where it does not divide;
    * at least two free cores per server: one core per server is kept out of the
      shares (``spare``) for the front ends, as vLLM's own binding keeps one per
      worker for its engine core; on a 2-core host two servers get one core each;
    * fewer free cores than servers: no plan (every server keeps vLLM's binding) and
      a ``warning`` saying the workers will share a core.
    """
    names = list(servers)
    if len(set(names)) != len(names):
        raise ValueError(f"server names must differ: {names}")
    allowed = set(available)
    busy = set(taken) & allowed  # a core outside ``available`` is no concern of this plan
    free = sorted(allowed - busy)
    if not names:
        return CorePlan(spare=tuple(free))
    if len(free) < len(names):
        what = f"{len(free)} free CPU core{'s' if len(free) != 1 else ''}"
        if busy:
            what += f" ({format_cpus(busy)} held by servers already running)"
        return CorePlan(spare=tuple(free), warning=(
            f"{what} for {len(names)} vLLM server{'s' if len(names) != 1 else ''} ({', '.join(names)}): "
            "their workers cannot each get a core of their own; a worker busy-waits ~1 s after each step, "
            f"so expect stalls of up to a second per request; set {OMP_BIND_ENV} per server or use a host "
            "with more cores"))
    reserve = len(names) if len(free) >= 2 * len(names) else 0
    usable, spare = free[: len(free) - reserve], free[len(free) - reserve:]
    share, extra = divmod(len(usable), len(names))
    cores: dict[str, tuple[int, ...]] = {}
    start = 0
    for i, name in enumerate(names):
        n = share + (1 if i < extra else 0)
        cores[name] = tuple(usable[start: start + n])
        start += n
    return CorePlan(cores=cores, spare=tuple(spare))


def format_cpus(cpus: Iterable[int]) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"``: how people read a core set, and the format
    vllm-cpu parses for one worker in ``VLLM_CPU_OMP_THREADS_BIND``."""
    ids = sorted(set(cpus))
    runs: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        runs.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(runs)


def vllm_is_cpu_build(environ: Mapping[str, str]) -> bool:
    """Whether vLLM in this interpreter's environment runs on the CPU: the test vLLM
    itself makes (``VLLM_TARGET_DEVICE=cpu``, or a version or distribution naming
    "cpu", as ``vllm-cpu`` has), done from package metadata without importing vLLM
    (seconds). A GPU build answers False: its servers are not placed on cores."""
    if environ.get("VLLM_TARGET_DEVICE") == "cpu":
        return True
    try:
        return "cpu" in importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
