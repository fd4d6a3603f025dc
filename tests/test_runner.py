"""The runners' engine-core API (pipeline/core/runner.py): a request added while others are
mid-tree joins at the next step and gives its batch-1 tokens, an aborted one frees its KV in that
step, and run() is the same loop."""
from __future__ import annotations

import random

import pytest

from pipeline.build import build_engine
from pipeline.core import Request

from helpers import compose_config


def runner_for(backbone, *overrides: str, max_new_tokens: int = 24):
    cfg = compose_config(["model=tiny", f"max_new_tokens={max_new_tokens}", *overrides])
    return build_engine(cfg, backbone)[0]


def prompts(n: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(49152) for _ in range(k)] for k in (5, 9, 3, 14, 7)[:n]]


@pytest.mark.parametrize("preset", ["decode=tree_ngram", "decode=greedy", "decode=beam"])
def test_a_request_added_mid_run_joins_at_the_next_step_with_its_batch1_tokens(tiny_backbone, preset):
    extra = ("proposer.min_ngram=1",) if preset == "decode=tree_ngram" else ()
    alone = runner_for(tiny_backbone, preset, *extra)
    ps = prompts(3)
    ref = [alone.run([p])[0].token_ids for p in ps]
    runner = runner_for(tiny_backbone, preset, *extra, "batch_size=4", "kv=paged")
    first = [runner.add(Request(p, seed=0)) for p in ps[:2]]
    done = {}
    for _ in range(3):  # the first two are mid-run (mid-tree for tree_ngram)
        done.update(runner.step())
    assert runner.live == 2 and not done
    if preset == "decode=tree_ngram":
        assert any(n > 1 for s in runner._live for n in s.gen.step_nodes), "no tree was verified: nothing is tested"
    late = runner.add(Request(ps[2], seed=0))
    assert runner.queued == 1
    done.update(runner.step())
    assert runner.queued == 0 and runner.live == 3  # joined at the next step
    while runner.has_work:
        done.update(runner.step())
    assert [done[h].token_ids for h in [*first, late]] == ref
    assert runner.kv.stats()["sequences"] == 0


@pytest.mark.parametrize("kv", ["contiguous", "paged"])
def test_an_aborted_request_frees_its_kv_in_that_step(tiny_backbone, kv):
    runner = runner_for(tiny_backbone, "decode=tree_ngram", "proposer.min_ngram=1", "batch_size=3", f"kv={kv}")
    ps = prompts(3)
    ref = runner.run([ps[1]])[0].token_ids
    a, b, c = (runner.add(Request(p, seed=0)) for p in ps)
    runner.step()
    runner.step()
    held = runner.kv.stats()["sequences"]
    gen = runner.abort(a)
    assert gen is not None and gen.finish_reason == "abort" and gen.token_ids  # what it had made so far
    assert runner.kv.stats()["sequences"] == held - 1 and runner.live == 2
    assert runner.abort(c).finish_reason == "abort" and runner.kv.stats()["sequences"] == held - 2
    assert runner.abort(12345) is None
    done = {}
    while runner.has_work:
        done.update(runner.step())
    assert list(done) == [b] and done[b].token_ids == ref
    assert runner.kv.stats()["sequences"] == 0


def test_a_queued_request_aborts_without_ever_joining(tiny_backbone):
    runner = runner_for(tiny_backbone, "decode=greedy", "batch_size=1")
    runner.add(Request(prompts(1)[0], seed=0))
    b = runner.add(Request(prompts(2)[1], seed=0))
    runner.step()
    assert runner.queued == 1
    gen = runner.abort(b)
    assert gen.finish_reason == "abort" and gen.token_ids == [] and runner.queued == 0
    while runner.has_work:
        runner.step()
    assert runner.kv.stats()["sequences"] == 0


def test_run_needs_an_idle_runner_and_keeps_a_servers_callback(tiny_backbone):
    runner = runner_for(tiny_backbone, "decode=greedy", max_new_tokens=4)
    seen = []
    runner.on_tokens = lambda h, ids, hidden: seen.append((h, ids))
    runner.run([prompts(1)[0]], on_tokens=None)
    assert runner.on_tokens is not None and seen == []  # run's own callback (none) was used, the server's is back
    h = runner.add(Request(prompts(1)[0], seed=0))
    with pytest.raises(RuntimeError, match="idle runner"):
        runner.run([prompts(1)[0]])
    while runner.has_work:
        runner.step()
    assert sum(len(ids) for _, ids in seen) == 4 and {k for k, _ in seen} == {h}


def test_requests_carry_their_own_max_new_tokens(tiny_backbone):
    runner = runner_for(tiny_backbone, "decode=tree_ngram", "proposer.min_ngram=1", "batch_size=2")
    h5 = runner.add(Request(prompts(1)[0], seed=0, max_new_tokens=5))
    h9 = runner.add(Request(prompts(2)[1], seed=0, max_new_tokens=9))
    done = {}
    while runner.has_work:
        done.update(runner.step())
    assert len(done[h5].token_ids) == 5 and len(done[h9].token_ids) == 9
    assert done[h5].finish_reason == done[h9].finish_reason == "length"
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        runner.add(Request(prompts(1)[0], seed=0, max_new_tokens=0))
