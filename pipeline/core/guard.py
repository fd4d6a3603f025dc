"""Speculation that never loses for long: an online check of whether drafting pays, in this run.

A proposer's trees are worth their cost only while (tokens committed per tree step) / (tree step
time) beats (tokens per plain step) / (plain step time). Both are measured as the run goes, over the
whole batch of a step (tokens committed by every live sequence per millisecond), as exponential
moving averages. The guard starts with a couple of plain steps (their rate is the reference), then
lets the proposer draft; after `probe` tree steps, if the tree rate stays under the plain rate, it
runs plain steps for `backoff` steps (doubling each time drafting loses again, up to `max_backoff`,
back to the start when it wins), then probes again. Tokens never depend on it: a plain step and a
verified tree commit the same tokens (greedy) or the same distribution (exact sampling).
"""
from __future__ import annotations

from pipeline.errors import positive_int


class SpeculationGuard:
    def __init__(self, warmup: int = 2, probe: int = 6, backoff: int = 16, max_backoff: int = 512,
                 decay: float = 0.7, margin: float = 1.0):
        for name, v in (("warmup", warmup), ("probe", probe), ("backoff", backoff), ("max_backoff", max_backoff)):
            positive_int(v, f"guard.{name}")
        self.warmup, self.probe, self.base_backoff, self.max_backoff = warmup, probe, backoff, max_backoff
        self.decay, self.margin = decay, margin
        self.reset()

    def reset(self) -> None:
        self.plain_rate: float | None = None  # tokens per ms, plain steps
        self.tree_rate: float | None = None  # tokens per ms, tree steps
        self.left = self.warmup  # plain steps still to run before drafting
        self.backoff, self.tree_run = self.base_backoff, 0
        self.stats = {"tree_steps": 0, "plain_steps": 0, "held_steps": 0, "pauses": 0}

    def describe(self) -> dict:
        """Its counts in this run (results.json summary "guard"): tree, plain and held steps, pauses."""
        return dict(self.stats)

    def speculate(self) -> bool:
        """Whether this step may draft."""
        if self.left > 0:
            self.left -= 1
            self.stats["held_steps"] += 1
            return False
        return True

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def record(self, drafted: bool, tokens: int, ms: float) -> None:
        """After a step: whether any sequence verified a tree, the tokens all sequences committed, its time."""
        if ms <= 0:
            return
        rate = tokens / ms
        if not drafted:
            self.stats["plain_steps"] += 1
            self.plain_rate = self._ema(self.plain_rate, rate)
            return
        self.stats["tree_steps"] += 1
        self.tree_rate = self._ema(self.tree_rate if self.tree_run else None, rate)
        self.tree_run += 1
        if self.tree_run < self.probe or self.plain_rate is None:
            return
        if self.tree_rate < self.margin * self.plain_rate:  # drafting loses here: pause it
            self.left, self.tree_run = self.backoff, 0
            self.backoff = min(2 * self.backoff, self.max_backoff)
            self.stats["pauses"] += 1
        else:
            self.backoff = self.base_backoff
