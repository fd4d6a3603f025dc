"""Beam search on forked sequences: the seed's toy through the real code path (scripted model),
num_beams=1 equal to greedy, no KV leaks (finished, stopped early, failed), prompt blocks shared
under kv=paged, and on the real model in float32 the hypotheses and scores of transformers'
generate(num_beams=4, num_return_sequences=4) for every early-stopping rule and a length penalty."""
from __future__ import annotations

import json
import math

import pytest
import torch

from components.kv.paged import PagedKV
from components.sampler.logits import Sampler
from pipeline.core import BeamSearch, Engine, UserError

from helpers import compose_config, rebuild
from toy import ScriptedModel

A, B, C, D, EOS, BOS = range(6)


def dist(**p) -> list[float]:
    """Log-probabilities over the toy vocabulary; the rest of the mass spread over the unnamed tokens."""
    names = {"A": A, "B": B, "C": C, "D": D, "EOS": EOS}
    probs = [0.0] * 6
    for k, v in p.items():
        probs[names[k]] = v
    rest = [t for t in range(5) if probs[t] == 0.0]
    mass = 1 - sum(probs)
    for t in rest:
        probs[t] = mass / len(rest)
    return [math.log(max(x, 1e-12)) for x in probs]


def seed_script(ctx):
    """Greedy takes A then EOS (0.5 x 0.4 = 0.20); B A EOS is worth 0.4 x 0.9 x 0.95 = 0.342."""
    tail = ctx[1:]
    if tail == ():
        return dist(A=0.5, B=0.4)
    if tail == (A,):
        return dist(EOS=0.4, C=0.3, D=0.2)
    if tail == (B,):
        return dist(A=0.9)
    if tail == (B, A):
        return dist(EOS=0.95)
    return dist(EOS=0.9)


def toy(num_beams: int, **kw):
    model = ScriptedModel(seed_script, 6, eos_ids=[EOS])
    kv = PagedKV(block_size=4, n_layers=1, n_kv_heads=1, head_dim=1)
    if num_beams == 0:
        return Engine(model, kv, Sampler(do_sample=False), [EOS], 8), kv
    return BeamSearch(model, kv, Sampler(do_sample=False), [EOS], 8, num_beams=num_beams, **kw), kv


def test_seed_toy_greedy_a_eos_beam_b_a_eos():
    greedy, _ = toy(0)
    assert greedy.generate([BOS]).token_ids == [A, EOS]
    beam, kv = toy(2, num_return_sequences=2)
    g = beam.generate([BOS])
    assert g.token_ids == [B, A, EOS]
    (best, s1), (second, s2) = g.beams
    assert best == [B, A, EOS] and second == [A, C, EOS]  # A EOS (0.20) was finished, then outranked
    assert s1 == pytest.approx(math.log(0.4 * 0.9 * 0.95) / 3, abs=1e-6)  # length_penalty 1: / 3 tokens
    assert s2 == pytest.approx(math.log(0.5 * 0.3 * 0.9) / 3, abs=1e-6)
    g = toy(2, num_return_sequences=2, length_penalty=0.0)[0].generate([BOS])  # raw cumulative log-probability
    assert [t for t, _ in g.beams] == [[B, A, EOS], [A, EOS]]
    assert g.beams[0][1] > math.log(0.5 * 0.4) == pytest.approx(g.beams[1][1], abs=1e-6)
    assert kv.sequences == [] and kv.stats()["blocks_in_use"] == 0


def test_num_beams_one_is_greedy(tiny_backbone):
    bb = tiny_backbone
    prompts = [bb.tokenizer.encode(t, add_special_tokens=False) for t in ("The cat", "Once upon a time", "1 2 3")]
    cfg = compose_config(["model=tiny", "max_new_tokens=24"])
    from pipeline.build import build_engine
    greedy = build_engine(cfg, bb)[0].run(prompts)
    beam = build_engine(compose_config(["model=tiny", "decode=beam", "num_beams=1", "max_new_tokens=24"]), bb)[0]
    assert isinstance(beam, BeamSearch)
    assert [g.token_ids for g in beam.run(prompts)] == [g.token_ids for g in greedy]


@pytest.mark.parametrize("kv", ["paged", "contiguous"])
def test_no_block_leaks_and_shared_prompt(tiny_backbone, kv):
    """After every request (finished, and failed mid-way) the pool is empty; with kv=paged the 4
    beams of a long prompt hold little more than one sequence's blocks."""
    from pipeline.build import build_engine
    bb = tiny_backbone
    eng = build_engine(compose_config(["model=tiny", "decode=beam", f"kv={kv}", "max_new_tokens=12",
                                       "batch_size=2", "num_return_sequences=3"]), bb)[0]
    long = bb.tokenizer.encode("word " * 600, add_special_tokens=False)[:500]
    prompts = [long, bb.tokenizer.encode("Hi", add_special_tokens=False), long[:100]]
    gens = eng.run(prompts)
    assert all(len(g.beams) == 3 for g in gens)
    assert eng.kv.sequences == [] and eng.kv.stats()["bytes_in_use"] == 0
    if kv == "paged":  # one request at a time: the pool's peak is its own
        g = rebuild(eng, batch_size=1).run([long])[0]
        one = (len(long) + 12) * eng.kv.slot_bytes
        assert g.kv_peak_bytes <= 1.3 * one + 4 * eng.kv.block_size * eng.kv.slot_bytes
        assert g.kv_copy_per_beam_bytes > 3 * one * 0.9

    failing = FailsAtStep(eng.model, at=4)
    with pytest.raises(RuntimeError, match="boom"):
        rebuild(eng, model=failing).run(prompts)  # the same KV pool, a model whose 4th forward fails
    assert failing.calls == 4
    assert eng.kv.sequences == [] and eng.kv.stats()["bytes_in_use"] == 0


class FailsAtStep:
    """A model whose `at`-th forward raises; everything else is the wrapped model's."""

    def __init__(self, model, at: int):
        self.model, self.at, self.calls = model, at, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def step(self, batch, kv, layers=None):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("boom")
        return self.model.step(batch, kv, layers)


def test_knobs_that_cannot_apply_are_one_line_errors(tiny_backbone):
    from pipeline.build import build_engine
    for overrides, needle in ((["sampler=sample"], "temperature"), (["num_return_sequences=5"], "exceeds"),
                              (["early_stopping=sometimes"], "early_stopping"),
                              (["proposer=ngram", "verifier=greedy"], "proposer")):
        with pytest.raises(UserError, match=needle):
            build_engine(compose_config(["model=tiny", "decode=beam", *overrides]), tiny_backbone)


def test_results_list_beams(tmp_path, tiny_backbone):
    from pipeline.decode import decode
    cfg = compose_config(["model=tiny", "decode=beam", "num_return_sequences=2", "max_new_tokens=6", "stream=false",
                          "kv=paged"], prompt="hello", output_dir=tmp_path)
    decode(cfg, tiny_backbone)
    res = json.loads((tmp_path / "results.json").read_text())
    item = res["items"][0]
    assert res["decode"] == "beam" and len(item["beams"]) == 2
    assert item["token_ids"] == item["beams"][0]["token_ids"] and item["beams"][0]["score"] >= item["beams"][1]["score"]
    assert item["text"] == item["beams"][0]["text"]


PROMPTS = ["Write a haiku about autumn.", "What is the capital of France?", "Explain gravity to a child."]


def _hf_beams(hf, bb, prompt_ids, max_new_tokens, **kw):
    out = hf.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                      max_new_tokens=max_new_tokens, do_sample=False, num_beams=4, num_return_sequences=4,
                      eos_token_id=bb.eos_ids, pad_token_id=bb.eos_ids[0], return_dict_in_generate=True,
                      output_scores=True, **kw)
    seqs = []
    for row in out.sequences[:, len(prompt_ids):].tolist():
        toks = []
        for t in row:
            toks.append(t)
            if t in bb.eos_ids:
                break
        seqs.append(toks)
    return seqs, out.sequences_scores.tolist()


@pytest.mark.slow
@pytest.mark.parametrize("knobs", [{"early_stopping": False}, {"early_stopping": True}, {"early_stopping": "never"},
                                   {"early_stopping": False, "length_penalty": 0.5},
                                   {"early_stopping": "never", "length_penalty": 2.0}])
def test_hypotheses_and_scores_equal_transformers(real_backbone, real_hf, knobs):
    from pipeline.build import build_engine
    from pipeline.core import encode_chat
    bb = real_backbone
    over = [f"{k}={json.dumps(v) if isinstance(v, str) else str(v).lower()}" for k, v in knobs.items()]
    eng = build_engine(compose_config(["model.dtype=float32", "decode=beam", "kv=paged", "num_return_sequences=4",
                                       "max_new_tokens=16", "batch_size=2", *over]), bb)[0]
    prompts = [encode_chat(bb.tokenizer, None, p, True, None) for p in PROMPTS]
    gens = eng.run(prompts)
    for p, g in zip(prompts, gens):
        seqs, scores = _hf_beams(real_hf, bb, p, 16, **knobs)
        assert [t for t, _ in g.beams] == seqs
        assert [s for _, s in g.beams] == pytest.approx(scores, abs=1e-4)
    assert eng.kv.sequences == []


def test_constrained_beams_each_follow_their_own_state(tiny_backbone):
    """A regex per request: every beam carries its own matcher, forked with it; every returned
    hypothesis is in the language, and the pool ends empty."""
    import re as regex
    from components.constraint.grammar import Regex
    bb = tiny_backbone
    eng = BeamSearch(bb.model, PagedKV(bb), Sampler(do_sample=False), bb.eos_ids, 12, num_beams=4,
                     num_return_sequences=4, batch_size=2)
    pattern = "(cat|dog|bird)s? (run|sleep)s?"
    grammar = Regex(bb, pattern=pattern)
    prompts = [bb.tokenizer.encode(t, add_special_tokens=False) for t in ("Animals:", "Pets", "Birds:")]
    gens = eng.run(prompts, grammars=[grammar, grammar, None])
    for g in gens[:2]:
        texts = [bb.tokenizer.decode(t, skip_special_tokens=True) for t, _ in g.beams]
        assert len({tuple(t) for t, _ in g.beams}) == 4  # distinct token paths (texts may repeat: other splits)
        for (toks, _), text in zip(g.beams, texts):
            if toks[-1] in bb.eos_ids:
                assert regex.fullmatch(pattern, text), text
            else:
                assert regex.match(r"(cat|dog|bird)", text), text
    assert eng.kv.sequences == []


def test_diverse_groups_run_and_free_everything(tiny_backbone):
    bb = tiny_backbone
    eng = BeamSearch(bb.model, PagedKV(bb), Sampler(do_sample=False), bb.eos_ids, 10, num_beams=4, num_beam_groups=2,
                     diversity_penalty=1.0, num_return_sequences=4, batch_size=2)
    gens = eng.run([bb.tokenizer.encode(t, add_special_tokens=False) for t in ("One", "Two words", "x")])
    assert all(len(g.beams) == 4 for g in gens)
    assert eng.kv.sequences == []
    with pytest.raises(UserError, match="diversity_penalty"):
        BeamSearch(bb.model, PagedKV(bb), Sampler(do_sample=False), bb.eos_ids, 10, num_beams=4, num_beam_groups=2)


@pytest.mark.slow
def test_diverse_beam_search_equals_transformers_4(real_backbone):
    """Against tests/data/diverse_beam_reference.json: transformers 4.53.3's group beam search on this
    model in float32 (scripts/diverse_beam_reference.py made it), three settings x four prompts."""
    from pathlib import Path
    ref = json.loads((Path(__file__).parent / "data" / "diverse_beam_reference.json").read_text())
    bb = real_backbone
    assert ref["eos_ids"] == bb.eos_ids
    for run in ref["runs"]:
        knobs = run["knobs"]
        eng = BeamSearch(bb.model, PagedKV(bb), Sampler(do_sample=False), bb.eos_ids, ref["max_new_tokens"],
                         num_return_sequences=knobs["num_beams"], **knobs)
        g = eng.generate(run["prompt_ids"])
        assert [t for t, _ in g.beams] == run["sequences"], (knobs, run["prompt"])
        assert [s for _, s in g.beams] == pytest.approx(run["scores"], abs=1e-4)
        assert eng.kv.sequences == []
