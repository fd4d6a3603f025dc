"""Requests with sampling knobs of their own (`Request.sampling`) in one engine, on model=tiny: in a
batch mixing greedy and sampled requests with different knobs, under greedy, tree_ngram and a
sampling preset, every greedy request gives its plain greedy batch-1 tokens and every request the
tokens it gives decoded alone (seeded per request; a sampled one on a plain preset also those of
the CLI's sampler with its knobs); under speculation sampled requests keep plain sampling's
distribution (chi-square against the exact distribution; a wrong sampling verifier fails it); the
row groups of the target stage process each row as its knobs alone would; knobs are validated."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from components.sampler.logits import RepetitionPenalty, Sampler, Temperature, TopK, TopP
from components.verifier.greedy import GreedyVerifier
from pipeline.core import Request, SamplingParams, TargetStage, UserError
from pipeline.core.target import RowGroup

from helpers import chi_square_p, decoder_for, rebuild, tiny_truth
from toy import GreedyAcceptance, RepeatProposer

GREEDY = SamplingParams(temperature=0.0)
HOT = SamplingParams(temperature=1.5, top_k=3)
WARM = SamplingParams(temperature=0.8, top_p=0.9)
KNOBS = [None, GREEDY, HOT, WARM, HOT]  # the last shares the third's knobs: one row group of two
TEXTS = ["a b a b a b a b", "one two three one two three", "The cat sat on the mat. The cat",
         "1, 2, 3, 1, 2, 3, 1, 2", "hello hello hello"]


def run_all(runner, requests: list[Request]):
    """Every request added at once, steps until all are done; no KV left behind."""
    handles = [runner.add(r) for r in requests]
    done = {}
    while runner.has_work:
        done.update(runner.step())
    assert runner.kv.stats()["sequences"] == 0
    return [done[h] for h in handles]


PRESETS = {"greedy": (), "tree_ngram": ("proposer.min_ngram=1",), "sample": ("sampler.top_k=40",)}


@pytest.mark.parametrize("preset", list(PRESETS))
def test_a_mixed_batch_gives_each_request_its_own_tokens(tiny_backbone, preset):
    bb = tiny_backbone
    prompts = [bb.tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    requests = [Request(p, seed=10 + i, sampling=k) for i, (p, k) in enumerate(zip(prompts, KNOBS))]
    runner = decoder_for(preset, bb, *PRESETS[preset], "batch_size=5", "kv=paged", max_new_tokens=16)
    gens = run_all(runner, requests)
    alone = decoder_for(preset, bb, *PRESETS[preset], max_new_tokens=16)
    for r, g in zip(requests, gens):
        assert g.token_ids == run_all(alone, [r])[0].token_ids
    plain = decoder_for("greedy", bb, max_new_tokens=16)
    greedy = [i for i, k in enumerate(KNOBS) if (k.greedy if k is not None else preset != "sample")]
    for i in greedy:
        assert gens[i].token_ids == plain.run([prompts[i]])[0].token_ids
    sampled = [i for i in range(len(KNOBS)) if i not in greedy]
    assert len({tuple(gens[i].token_ids) for i in sampled}) > 1, "the sampled requests are alike: nothing is tested"
    if preset == "tree_ngram":  # drafts of both kinds were verified, each by the verifier of its kind
        assert any(n > 1 for i in greedy for n in gens[i].step_nodes)
        assert any(n > 1 for i in sampled for n in gens[i].step_nodes)
        assert type(runner.sampling_verifier).__name__ == "ExactVerifier"
    else:  # plain decoding: a request's own knobs sample as the configured sampler with those knobs does
        hot = decoder_for("sample", bb, "sampler.temperature=1.5", "sampler.top_k=3", max_new_tokens=16)
        for i in (2, 4):
            assert gens[i].token_ids == hot.run([prompts[i]], seeds=[10 + i])[0].token_ids


def test_the_samplers_own_knobs_take_the_common_path(tiny_backbone):
    bb = tiny_backbone
    runner = decoder_for("sample", bb, "sampler.temperature=0.8", "batch_size=2", max_new_tokens=8)
    assert runner._knobs(SamplingParams(0.8)) is None and runner._knobs(None) is None
    assert runner._knobs(SamplingParams(0.9)) == SamplingParams(0.9)
    greedy = decoder_for("greedy", bb, max_new_tokens=8)
    assert greedy._knobs(SamplingParams(0.0, top_p=0.5, top_k=7)) is None  # greedy either way
    prompt = bb.tokenizer.encode(TEXTS[0], add_special_tokens=False)
    a, b = run_all(runner, [Request(prompt, 3), Request(prompt, 3, sampling=SamplingParams(0.8))])
    assert a.token_ids == b.token_ids


DRAWS = 1600  # requests of one prompt; every fourth greedy


def test_sampled_requests_keep_plain_sampling_under_speculation(tiny_backbone):
    """A greedy speculative preset, drafts the tied tiny model often accepts: in batches of 64
    mixing greedy requests with sampled ones, the greedy ones give plain greedy tokens and the
    sampled ones' first three tokens follow plain sampling with their knobs (chi-square p > 0.001
    against the exact distribution); the same run fails with sampled requests verified greedily
    (the mistake this guards against) or by a subtly wrong verifier."""
    bb = tiny_backbone
    prompt = bb.tokenizer.encode("a b a b a b a b a", add_special_tokens=False)
    knobs = SamplingParams(temperature=2.0, top_p=0.98, top_k=3)
    eng = rebuild(decoder_for("tree_ngram", bb, "batch_size=64", max_new_tokens=3), proposer=RepeatProposer())
    truth = tiny_truth(bb, prompt, Sampler(do_sample=True, temperature=2.0, top_k=3, top_p=0.98), 3)
    want = decoder_for("greedy", bb, max_new_tokens=3).run([prompt])[0].token_ids

    def counts(engine, n):
        requests = [Request(prompt, seed=i, sampling=None if i % 4 == 0 else knobs) for i in range(n)]
        gens = run_all(engine, requests)
        assert all(g.token_ids == want for g, r in zip(gens, requests) if r.sampling is None)
        sampled = [g for g, r in zip(gens, requests) if r.sampling is not None]
        return Counter(tuple(g.token_ids[:3]) for g in sampled), sum(len(g.token_ids) - g.steps for g in sampled)

    got, accepted = counts(eng, DRAWS)
    assert 100 < accepted < 3 * DRAWS, "the sampled requests' drafts should be accepted sometimes, not always"
    assert chi_square_p(got, truth) > 1e-3, (got, truth)
    for bad in (SamplesGreedily(), GreedyAcceptance()):
        wrong, _ = counts(rebuild(eng, sampling_verifier=bad), DRAWS // 2)
        assert chi_square_p(wrong, truth) < 1e-6, (type(bad).__name__, wrong, truth)


class SamplesGreedily(GreedyVerifier):
    """Greedy verification claiming it may verify sampled rows (the engine's constructor refuses a
    plain GreedyVerifier there): the mistake the test above must catch."""
    samples = True


def test_row_groups_process_each_row_as_its_knobs_alone_would():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    before = logits.clone()
    ids = [[r, r + 1, 7] for r in range(6)]
    shared, own = [RepetitionPenalty(1.3)], [Temperature(0.7)]
    stage = TargetStage(shared, greedy=False, warpers=own)
    groups = [RowGroup([1, 4], [TopK(5), TopP(0.8)], False), RowGroup([2], [], True)]
    p = stage(logits, input_ids=lambda: ids, groups=groups)
    assert torch.equal(logits, before)  # never mutated
    for rows, procs in (([0, 3, 5], own), ([1, 4], groups[0].warpers), ([2], [])):
        ref = TargetStage(shared + procs)(logits[rows], input_ids=lambda: [ids[r] for r in rows])
        assert torch.equal(p.scores[rows], ref.scores)
    assert p.greedy == [False, False, True, False, False, False]
    assert p.rows(2, 3).greedy is True and p.rows(3, 6).greedy is False
    assert torch.equal(p.probs[2], torch.zeros(50).index_fill_(0, p.scores[2].argmax(), 1.0))
    assert torch.equal(p.probs[0], p.scores[0].softmax(-1))
    assert torch.equal(stage(logits, input_ids=lambda: ids).scores,
                       TargetStage(shared + own)(logits, input_ids=lambda: ids).scores)  # no groups: as before


@pytest.mark.parametrize("kwargs,name", [(dict(temperature=-0.1), "temperature"), (dict(temperature="hot"), "temperature"),
                                         (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
                                         (dict(top_k=-1), "top_k"), (dict(top_k=2.5), "top_k")])
def test_knobs_are_validated_with_one_line_errors(kwargs, name):
    with pytest.raises(UserError, match=f"^{name} must"):
        SamplingParams(**kwargs)


def test_runners_without_per_request_knobs_refuse_them(tiny_backbone):
    prompt = tiny_backbone.tokenizer.encode("hi", add_special_tokens=False)
    with pytest.raises(UserError, match="BeamSearch takes no per-request sampling knobs"):
        decoder_for("beam", tiny_backbone).add(Request(prompt, 0, sampling=HOT))
    with pytest.raises(UserError, match="must be SamplingParams"):
        decoder_for("greedy", tiny_backbone).add(Request(prompt, 0, sampling={"temperature": 0.5}))
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=0.01).greedy
