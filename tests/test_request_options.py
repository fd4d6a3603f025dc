"""A request's own options in the engine (pipeline/core/runner.py `Request`): log-probabilities from
the target distribution the step computes (equal to a full forward's, also through accepted tree
paths and under sampling knobs), siblings (n > 1) that fork the prompt's KV and give what separate
requests with their seeds give, and named drafts that share one target forward and stay lossless."""
from __future__ import annotations

import pytest
import torch

from pipeline.build import build_engine
from pipeline.core import Request, SamplingParams, UserError

from helpers import compose_config, random_prompts

REPEATING = [16, 28, 30, 28, 31, 28, 32, 28, 16, 28, 30, 28, 31, 28, 32, 28, 16, 28, 30]  # ngram drafts accept here


def engine(backbone, *overrides: str, max_new_tokens: int = 16):
    cfg = compose_config(["model=tiny", f"max_new_tokens={max_new_tokens}", "~guard", *overrides])
    return build_engine(cfg, backbone)[0]


def drain(runner) -> dict:
    out = {}
    while runner.has_work:
        out.update(runner.step())
    return out


@torch.inference_mode()
def full_logprobs(model, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> list[torch.Tensor]:
    """Each generated token's log-softmax row, from one forward over the whole sequence."""
    seq = prompt + tokens
    logits = model.logits(model(torch.tensor([seq]), torch.arange(len(seq))[None]))[0]  # (T, V)
    lp = torch.log_softmax(logits.float() / temperature, -1)
    return [lp[len(prompt) - 1 + i] for i in range(len(tokens))]


@pytest.mark.parametrize("preset", ["decode=greedy", "decode=tree_ngram"])
def test_logprobs_are_the_target_distributions_along_the_committed_path(tiny_backbone, preset):
    runner = engine(tiny_backbone, preset, "proposer.min_ngram=1" if "ngram" in preset else "batch_size=1")
    h = runner.add(Request(REPEATING, 0, logprobs=3))
    gen = drain(runner)[h]
    if "ngram" in preset:
        assert max(gen.accepted_lengths) > 1, "no draft was accepted: the tree path is not tested"
    assert len(gen.logprobs) == len(gen.token_ids)
    ref = full_logprobs(tiny_backbone.model, REPEATING, gen.token_ids)
    for tok, (lp, top), row in zip(gen.token_ids, gen.logprobs, ref):
        assert lp == pytest.approx(float(row[tok]), abs=1e-4)
        assert [t for t, _ in top] == row.topk(3).indices.tolist()  # greedy: the chosen token is the best
        assert top[0][0] == tok and [v for _, v in top] == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)


def test_logprobs_of_a_sampled_request_are_its_processed_distribution(tiny_backbone):
    runner = engine(tiny_backbone, "decode=greedy")
    h = runner.add(Request(REPEATING, 7, sampling=SamplingParams(0.7), logprobs=0))
    gen = drain(runner)[h]
    ref = full_logprobs(tiny_backbone.model, REPEATING, gen.token_ids, temperature=0.7)
    assert [lp for lp, _ in gen.logprobs] == pytest.approx([float(r[t]) for r, t in zip(ref, gen.token_ids)], abs=1e-4)
    assert all(top == [] for _, top in gen.logprobs)


def test_logprobs_are_refused_out_of_range_and_by_beam_search(tiny_backbone):
    with pytest.raises(UserError, match="logprobs must be an int in 0..20"):
        engine(tiny_backbone, "decode=greedy").add(Request([5, 6], 0, logprobs=21))
    with pytest.raises(UserError, match="BeamSearch takes no per-request logprobs"):
        engine(tiny_backbone, "decode=beam").add(Request([5, 6], 0, logprobs=1))


@pytest.mark.parametrize("kv", ["paged", "contiguous"])
def test_siblings_fork_the_prompt_and_equal_separate_requests(tiny_backbone, kv, monkeypatch):
    prompt = [(37 * i + 11) % 4096 for i in range(40)]  # 3 paged blocks
    knobs = SamplingParams(3.0)  # a flat distribution: seeds give different texts
    alone = engine(tiny_backbone, "decode=greedy", f"kv={kv}")
    ref = [drain_one(alone, Request(prompt, 11 + i, sampling=knobs)) for i in range(3)]
    runner = engine(tiny_backbone, "decode=greedy", f"kv={kv}", "batch_size=4")
    first = runner.add(Request(prompt, 11, sampling=knobs))
    rest = [runner.add(Request(prompt, 11 + i, sampling=knobs, sibling_of=first)) for i in (1, 2)]
    forwarded = []
    model_step = runner.model.step
    monkeypatch.setattr(runner.model, "step", lambda b, *a: forwarded.append(b.tokens.numel()) or model_step(b, *a))
    runner.step()
    assert forwarded[0] == len(prompt), "the siblings' prompts were prefilled again"
    if kv == "paged":  # the forks hold the prompt's full blocks by reference
        assert runner.kv.stats()["blocks_in_use"] < 3 * -(-len(prompt) // runner.kv.block_size)
    done = drain(runner)
    assert [done[h].token_ids for h in [first, *rest]] == ref
    assert len({tuple(r) for r in ref}) > 1, "the seeds gave one text: the siblings' generators are not tested"
    assert runner.kv.stats()["sequences"] == 0


def drain_one(runner, request: Request) -> list[int]:
    h = runner.add(request)
    return drain(runner)[h].token_ids


def test_a_sibling_must_share_prompt_and_knobs(tiny_backbone):
    runner = engine(tiny_backbone, "decode=greedy", "batch_size=2")
    first = runner.add(Request([5, 6, 7], 0))
    with pytest.raises(UserError, match="differs in its prompt, constraint or sampling knobs"):
        runner.add(Request([5, 6, 8], 0, sibling_of=first))


def test_named_drafts_share_one_forward_and_equal_plain_greedy(tiny_backbone, monkeypatch):
    ps = random_prompts(2, seed=9) + [REPEATING]
    plain = engine(tiny_backbone, "decode=greedy")
    ref = [drain_one(plain, Request(p, 0)) for p in ps]
    runner = engine(tiny_backbone, "decode=greedy", "batch_size=9", "+drafts=[tree_ngram,self_spec]",
                    "kv=paged")
    assert sorted(runner.drafts) == ["ngram", "self_spec"] and runner.proposer is None
    rows = []
    model_step = runner.model.step
    monkeypatch.setattr(runner.model, "step", lambda b, *a: rows.append(len(b.seqs)) or model_step(b, *a))
    handles = {d: [runner.add(Request(p, 0, draft=d)) for p in ps] for d in (None, "ngram", "self_spec")}
    done = drain(runner)
    for d, hs in handles.items():
        assert [done[h].token_ids for h in hs] == ref, f"draft {d} is not lossless"
    assert any(max(done[h].accepted_lengths) > 1 for h in handles["self_spec"] + handles["ngram"])
    assert max(rows) == 9  # the three drafts' sequences in one target forward
    assert all(max(done[h].step_nodes) == 1 for h in handles[None])  # no draft asked: plain steps
    with pytest.raises(UserError, match=r"no draft 'medusa' here: this engine has \['ngram', 'self_spec'\]"):
        runner.add(Request(ps[0], 0, draft="medusa"))
