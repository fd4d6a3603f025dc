"""The speculation guard: drafting pauses while trees commit fewer tokens per ms than plain steps,
resumes after a doubling backoff, and never changes tokens."""
from __future__ import annotations

import pytest

from pipeline.core.guard import SpeculationGuard

from helpers import compose_config, rebuild


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
        engine, _ = build_engine(compose_config(["decode=tree_ngram", *base, "guard=default"]), tiny_backbone)
        assert isinstance(engine.guard, SpeculationGuard)
        engine = rebuild(engine, guard=Scripted(allow))
        gen = engine.generate(ids)
        assert gen.token_ids == ref
        calls = engine.guard.calls
        assert len(calls) == gen.steps - 1  # every step after the prefill
        assert any(d for d, _ in calls) == allow and sum(t for _, t in calls) >= len(gen.token_ids) - 1


class SlowSteps:
    """The tiny model with a given cost curve: each forward takes at least base + per_row x rows ms
    (slept, so the curve, not this machine's load, sets the timings: the test checks the prediction
    machinery, not a speed)."""

    def __init__(self, model, base_ms: float = 60.0, per_row_ms: float = 6.0):
        self.model, self.base, self.per_row = model, base_ms, per_row_ms

    def __getattr__(self, name):
        return getattr(self.model, name)

    def step(self, batch, kv, layers=None):
        import time
        until = time.perf_counter() + (self.base + self.per_row * batch.tokens.shape[0]) / 1e3
        h = self.model.step(batch, kv, layers)
        time.sleep(max(0.0, until - time.perf_counter()))
        return h


def test_policy_prediction_is_within_15_percent_of_the_measured_speedup(tiny_backbone):
    """The sizing policy's prediction (components/proposer/policy.py: measured whole-step costs at each
    draft count, and the paths' acceptance) against decoding with that tree, on the tiny model given a
    CPU-like step cost. The proposer drafts a 3-deep chain whose first two drafts are the target's own
    next tokens and the third is wrong: P(path) = 1, 1, 0, so 3 tokens per step are predicted. The
    prediction counts the whole step (forward, LM head, verification, commit, proposal); a model of
    the forward alone would miss what the engine adds around it."""
    from components.proposer.policy import choose, step_costs
    from components.kv.contiguous import ContiguousKV
    from components.sampler.logits import Sampler
    from components.verifier.greedy import GreedyVerifier
    from pipeline.core import Engine, Tree
    from toy import PerSequence

    bb = tiny_backbone
    slow = SlowSteps(bb.model)
    ids = bb.tokenizer.encode("the quick brown fox jumps over the lazy dog")
    n = 48

    def engine(proposer=None):
        return Engine(slow, ContiguousKV(bb), Sampler(do_sample=False), [], n, proposer=proposer,
                      verifier=GreedyVerifier() if proposer else None)

    plain = engine()
    plain.generate(ids)  # warm-up
    ref = plain.generate(ids)

    class Oracle(PerSequence):
        def draft(self, state):
            k = len(state.tokens) - len(ids) - 1  # tokens committed after the first
            nxt = ref.token_ids[k + 1:k + 3]
            if len(nxt) < 2:
                return None
            return Tree.from_parents([state.tokens[-1], *nxt, (nxt[-1] + 1) % bb.model.args.vocab_size], [-1, 0, 1, 2])

    spec = engine(Oracle())
    spec.generate(ids)
    import time

    def seconds(e):  # best of two, interleaved: another test's load on a shared core only adds time
        t = time.perf_counter()
        gen = e.generate(ids)
        return time.perf_counter() - t, gen

    (s1, got), (p1, _), (s2, _), (p2, _) = seconds(spec), seconds(plain), seconds(spec), seconds(plain)
    spec_s, plain_s = min(s1, s2), min(p1, p2)
    assert got.token_ids == ref.token_ids
    measured = (len(got.token_ids) / spec_s) / (len(ref.token_ids) / plain_s)
    order = [((0,), 1.0), ((0, 0), 1.0), ((0, 0, 0), 0.0)]
    costs = step_costs(slow, [p for p, _ in order], proposal_ms=0.0, prefix=len(ids) + n // 2)
    predicted = next(r for r in choose(order, costs)["table"] if r["nodes"] == 3)["expected_speedup"]
    assert measured > 1.5  # the tree pays here: 3 tokens per step at ~1.3x a plain step's cost
    assert abs(predicted / measured - 1) < 0.15, (predicted, measured)


def test_guard_settings_come_from_the_config(tiny_backbone):
    """`guard.*` reaches the guard (tree_eagle's preset sets its own); a bad value is a one-line error."""
    from pipeline.build import build_engine
    from pipeline.errors import UserError
    base = ["decode=tree_ngram", "model=tiny", "guard=default"]
    engine, _ = build_engine(compose_config([*base, "guard.probe=9", "guard.decay=0.8"]), tiny_backbone)
    assert (engine.guard.probe, engine.guard.decay) == (9, 0.8)
    with pytest.raises(UserError, match="guard"):
        build_engine(compose_config([*base, "guard.probe=0"]), tiny_backbone)
