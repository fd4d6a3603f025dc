"""How many torch threads a job computes with: its share of the cores, so parallel sweep jobs never
oversubscribe them.

torch's OpenMP pool spin-waits: two jobs that each take every core of a 2-core machine measured a
plain SmolLM2 step at ~2,000 ms where one thread each gave 43 ms (26 ms for one job alone with two
threads). `threads: auto` takes the cores this process may run on divided by the jobs that run at
once: 1 for the basic launcher (jobs run one after another), the joblib launcher's `n_jobs`, or
the whole allocation of a Slurm task (submitit: `cpus_per_task`, which is what the task sees).
An OMP_NUM_THREADS set in the environment caps it. The entry points (`python -m pipeline`,
`python -m pipeline.bench`) apply it; code calling `decode()` itself keeps its own setting.
"""
from __future__ import annotations

import os

import torch
from hydra.types import RunMode

from pipeline.errors import UserError
from pipeline.io import hydra_config


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def parallel_jobs() -> int:
    """Jobs of this sweep that run at the same time on this machine (1 outside a joblib sweep)."""
    hc = hydra_config()
    if hc is None or hc.mode != RunMode.MULTIRUN or "joblib" not in str(hc.launcher.get("_target_", "")):
        return 1
    n = hc.launcher.get("n_jobs") or 1
    n = int(n)
    return max(1, cores() + 1 + n if n < 0 else n)  # joblib: -1 = every core, -2 = all but one, ...


def share(threads) -> int:
    """The thread count for `threads` = auto | a positive int."""
    if threads in (None, "auto"):
        n = max(1, cores() // parallel_jobs())
        env = os.environ.get("OMP_NUM_THREADS", "")
        return min(n, int(env)) if env.isdigit() and int(env) > 0 else n
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise UserError(f"threads must be auto or a positive int, got {threads!r}")
    return threads


def configure(cfg) -> int:
    """Set torch's intra-op threads for this job from `cfg.threads`; returns the count."""
    n = share(cfg.get("threads", "auto"))
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
