"""What this job may use: the cores and memory of its SLURM allocation, else of this machine."""

from __future__ import annotations

import os


def allocation_cores() -> int:
    """Cores this job may use: SLURM's allocation when under SLURM, else the process's CPU affinity."""
    for var in ("SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE"):
        if os.environ.get(var, "").isdigit():
            return max(1, int(os.environ[var]))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def allocation_memory() -> int | None:
    """Bytes of memory SLURM granted this job, if known (SLURM_MEM_PER_NODE / SLURM_MEM_PER_CPU in MB)."""
    if os.environ.get("SLURM_MEM_PER_NODE", "").isdigit():
        return int(os.environ["SLURM_MEM_PER_NODE"]) * 2**20
    if os.environ.get("SLURM_MEM_PER_CPU", "").isdigit():
        return int(os.environ["SLURM_MEM_PER_CPU"]) * 2**20 * allocation_cores()
    return None
