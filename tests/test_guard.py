"""The speculation guard: drafting pauses while trees commit fewer tokens per ms than plain steps,
resumes after a doubling backoff, and never changes tokens."""
from __future__ import annotations

import pytest

from pipeline.core.guard import SpeculationGuard


def run(guard: SpeculationGuard, steps: int, tree_rate: float, plain_rate: float) -> list[bool]:
    """Drive the guard with fixed rates (tokens per ms of a tree / plain step); returns its decisions."""
    out = []
    for _ in range(steps):
        d = guard.speculate()
        out.append(d)
        guard.record(d, 2 if d else 1, 2 / tree_rate if d else 1 / plain_rate)
    return out


def test_warmup_then_drafting_while_it_pays():
    g = SpeculationGuard(warmup=2, probe=3)
    decisions = run(g, 40, tree_rate=1.5, plain_rate=1.0)
    assert decisions[:2] == [False, False] and all(decisions[2:])
    assert g.stats["pauses"] == 0 and g.stats["held_steps"] == 2


def test_losing_trees_pause_with_a_doubling_backoff():
    g = SpeculationGuard(warmup=1, probe=2, backoff=4, max_backoff=8)
    decisions = run(g, 40, tree_rate=0.5, plain_rate=1.0)
    # 1 warm-up plain step, 2 probing tree steps, 4 plain, 2 probing, 8 plain, 2 probing, 8 plain (capped) ...
    expected = [False] + [True] * 2 + [False] * 4 + [True] * 2 + [False] * 8 + [True] * 2 + [False] * 8
    assert decisions[:len(expected)] == expected
    assert g.stats["pauses"] >= 3 and sum(decisions) < len(decisions) / 3


def test_a_probe_that_wins_resets_the_backoff():
    g = SpeculationGuard(warmup=1, probe=2, backoff=4)
    run(g, 3, tree_rate=0.5, plain_rate=1.0)  # warm-up, probe, probe -> pause
    assert g.left == 4 and g.backoff == 8
    run(g, 4, tree_rate=0.5, plain_rate=1.0)  # the pause
    run(g, 3, tree_rate=2.0, plain_rate=1.0)  # a winning probe
    assert g.backoff == 4 and g.left == 0


def test_bad_settings_fail():
    with pytest.raises(ValueError, match="guard.probe"):
        SpeculationGuard(probe=0)


def test_engine_consults_the_guard_and_stays_lossless(tiny_backbone):
    """On the tiny model with an n-gram proposer: a guard that always pauses gives plain steps only, one
    that never pauses drafts; both give greedy's tokens, and every step is reported to it."""
    from conftest import compose_config

    class Scripted(SpeculationGuard):
        def __init__(self, allow: bool):
            super().__init__()
            self.allow, self.calls = allow, []

        def speculate(self):
            return self.allow

        def record(self, drafted, tokens, ms):
            self.calls.append((drafted, tokens))

    from pipeline.build import build_engine
    prompt = "one two three one two three one two three one two"
    base = ["model=tiny", "max_new_tokens=24", "stream=false", "chat=false"]
    ids = tiny_backbone.tokenizer.encode(prompt)
    plain, _ = build_engine(compose_config(["decode=greedy", *base]), tiny_backbone)
    ref = plain.generate(ids).token_ids
    for allow in (False, True):
        engine, _ = build_engine(compose_config(["decode=tree_ngram", *base, "speculation_guard=true"]), tiny_backbone)
        assert isinstance(engine.guard, SpeculationGuard)
        engine.guard = Scripted(allow)
        gen = engine.generate(ids)
        assert gen.token_ids == ref
        calls = engine.guard.calls
        assert len(calls) == gen.steps - 1  # every step after the prefill
        assert any(d for d, _ in calls) == allow and sum(t for _, t in calls) >= len(gen.token_ids) - 1
