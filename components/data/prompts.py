"""Synthetic prompts for self-distillation training of Medusa heads.

`training_prompts(n, seed)` returns n distinct chat prompts (explanations, stories, poems, emails,
lists, comparisons, how-to steps, Python coding tasks, arithmetic word problems, definitions,
advice, rewrite/summary tasks, trivia, ...). The pool is fixed: prompts.json.gz holds it as a list
of groups (one per instruction template), generated once from the former template code (~100
templates filled from a few hundred topics and objects, pool seed 1234). Prompts identical to the
held-out evaluation prompts in pipeline/prompts/*.jsonl were excluded when generating it. `seed`
only decides the order, which interleaves the groups so any prefix is varied.
"""

import functools
import gzip
import json
import random
from pathlib import Path

_POOL_FILE = Path(__file__).with_name("prompts.json.gz")


@functools.lru_cache(maxsize=1)
def _pool() -> tuple[tuple[str, ...], ...]:
    with gzip.open(_POOL_FILE, "rt", encoding="utf-8") as f:
        return tuple(tuple(group) for group in json.load(f))


def available_prompts() -> int:
    """How many distinct training prompts `training_prompts` can return."""
    return sum(len(g) for g in _pool())


def training_prompts(n: int, seed: int = 0) -> list[str]:
    """Return `n` distinct training prompts, deterministically ordered by `seed`: each group is
    shuffled with `random.Random(seed)`, then groups are interleaved (round-robin, random ties)."""
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    total = available_prompts()
    if n > total:
        raise ValueError(f"requested {n} training prompts but only {total} distinct prompts are available")
    rng = random.Random(seed)
    keyed = []
    for group in _pool():
        items = list(group)
        rng.shuffle(items)
        keyed.extend((i + rng.random(), p) for i, p in enumerate(items))
    keyed.sort(key=lambda kp: kp[0])
    return [p for _, p in keyed[:n]]
