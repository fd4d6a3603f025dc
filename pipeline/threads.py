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


class StepThreads:
    """The torch threads of each engine step, measured: all of the job's threads, or one fewer, which
    leaves a core to whatever else runs (the server's HTTP side, a client on the same machine).

    torch's OpenMP pool spin-waits at each of a step's parallel regions, so a core that another
    process takes for a moment stalls the whole step. On 2 cores with the load generator beside the
    server, one stream took 17 ms a token on 2 threads and 13 ms on 1, while 16 streams were faster
    on 2. So steps are grouped by their live sequences (1, 2-3, 4-7, ...); a group runs each count
    for `probe` steps, then the one whose mean step time is lower, and tries the other again for
    `probe` steps every `every` steps, as the load around it changes. Only for products whose bits
    do not depend on the thread count (the native kernels split work by outputs, never a sum)."""

    def __init__(self, most: int, probe: int = 6, every: int = 150, decay: float = 0.85):
        self.options = [most, most - 1] if most >= 2 else [most]
        self.probe, self.every, self.decay = probe, every, decay
        self.groups: dict[int, dict] = {}

    def _group(self, live: int) -> dict:
        return self.groups.setdefault(max(1, live).bit_length(), {
            "ms": {n: None for n in self.options}, "runs": {n: 0 for n in self.options}, "steps": 0,
            "trial": None, "left": 0})

    def choose(self, live: int) -> int:
        """The thread count for a step over `live` sequences."""
        if len(self.options) == 1:
            return self.options[0]
        g = self._group(live)
        untried = [n for n in self.options if g["runs"][n] < self.probe]
        if untried:
            return untried[0]
        best = min(self.options, key=lambda n: g["ms"][n])
        if g["left"] == 0 and g["steps"] % self.every == self.every - 1:
            g["trial"], g["left"] = next(n for n in self.options if n != best), self.probe
        if g["left"] > 0:
            return g["trial"]
        return best

    def record(self, live: int, threads: int, seconds: float) -> None:
        """What a step over `live` sequences took on `threads` threads."""
        if len(self.options) == 1:
            return
        g = self._group(live)
        g["steps"] += 1
        g["runs"][threads] += 1
        if g["left"] > 0 and threads == g["trial"]:
            g["left"] -= 1
        ms, old = seconds * 1e3, g["ms"][threads]
        g["ms"][threads] = ms if old is None else self.decay * old + (1 - self.decay) * ms

    def describe(self) -> dict:
        """Per group (its live sequences from 2^(k-1)), each count's mean step time in ms."""
        return {f"{1 << (k - 1)}+": {str(n): None if v is None else round(v, 2) for n, v in g["ms"].items()}
                for k, g in sorted(self.groups.items())}
