"""How many torch threads a CPU worker runs: the cores this process may use, less the cores left
to the processes beside it, shared among the workers on the host, unless --cpu-threads
(KVLEDGER_CPU_THREADS) says otherwise; and how they wait.

"May use": the CPU affinity mask (`taskset`, `docker --cpuset-cpus`), capped by a cgroup v2 CPU
quota (`docker --cpus`), which the affinity mask does not show. `kvledger up` tells each worker
how many workers it starts (KVLEDGER_WORKERS_ON_HOST: replicas x tensor-parallel ranks), so N
workers on one machine do not each claim every core.

"Less the cores left": Redis, the ledger and the gateway run beside the workers under `kvledger
up`, a little each step. A torch thread they preempt holds every other thread at the next
barrier, so their CPU can cost the worker its whole time, not a share; and a batch-1 decode step
reads every weight once (memory-bound), so a second thread buys it little. SmolLM2, one request
through `kvledger up` against transformers on a quiet 2-core machine (benchmarks/real_model.py):
1.02x with the reserved core (1 thread each), 1.04x with 2 threads each; 16 at once, 5.5x.
vLLM's CPU backend reserves cores for its API server the same way (VLLM_CPU_NUM_OF_RESERVED_CPU);
here --cpu-reserved-cores (KVLEDGER_CPU_RESERVED_CORES), 0 for a worker alone, 1 under `up`.

How they wait: torch's OpenMP threads spin between parallel regions by default. On a CPU shared
with other work (the ledger, the gateway, other processes) a spinning thread takes the core the
working one needs, and every barrier waits for a descheduled thread: SmolLM2 decoding on 2 threads
of a loaded 2-core machine ran at 0.2-0.36 tok/s spinning against 2.1-3.1 tok/s with
OMP_WAIT_POLICY=PASSIVE (1 thread: 2.4). So a worker sets PASSIVE unless the environment already
says otherwise, before torch is imported (OpenMP reads it once, when it loads).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from observability import get_logger

if TYPE_CHECKING:  # torch loads OpenMP: not before prefer_passive_openmp_wait()
    import torch

log = get_logger("kvledger.worker")

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


@dataclass(frozen=True, slots=True)
class ThreadPlan:
    threads: int
    usable_cores: int
    workers_on_host: int
    source: str  # "flag": --cpu-threads / KVLEDGER_CPU_THREADS; "cores": the cores' share
    reserved_cores: int = 0


def usable_cores(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """Cores this process may run on: its affinity mask, capped by a cgroup v2 quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform (macOS)
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cpu_max)
    return max(1, min(cores, quota) if quota is not None else cores)


def cgroup_cpu_quota(cpu_max: Path = CGROUP_CPU_MAX) -> int | None:
    """Whole cores a cgroup v2 `cpu.max` allows ("200000 100000" -> 2, rounded up); None
    without a quota or a readable file."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return max(1, math.ceil(int(quota) / int(period)))
    except (ValueError, ZeroDivisionError):
        return None


def plan_threads(
    requested: int | None, workers_on_host: int = 1, reserved_cores: int = 0
) -> ThreadPlan:
    cores = usable_cores()
    workers = max(1, workers_on_host)
    reserved = max(0, reserved_cores)
    if requested is not None:
        return ThreadPlan(requested, cores, workers, "flag", reserved)
    return ThreadPlan(max(1, (cores - reserved) // workers), cores, workers, "cores", reserved)


def prefer_passive_openmp_wait() -> str:
    """OMP_WAIT_POLICY=PASSIVE unless set already; call before torch is imported. Returns the
    policy in force."""
    return os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def configure_cpu_threads(
    device: torch.device,
    requested: int | None = None,
    workers_on_host: int = 1,
    reserved_cores: int = 0,
) -> ThreadPlan | None:
    """Set torch's intra-op threads for a CPU worker and log the figure; None on a GPU (the
    CPU then only feeds the device, and torch's default stands)."""
    import torch

    if device.type != "cpu":
        return None
    plan = plan_threads(requested, workers_on_host, reserved_cores)
    torch.set_num_threads(plan.threads)
    log.info(
        "cpu_threads",
        threads=plan.threads,
        usable_cores=plan.usable_cores,
        workers_on_host=plan.workers_on_host,
        reserved_cores=plan.reserved_cores,
        source=plan.source,
        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "unset"),
    )
    return plan
