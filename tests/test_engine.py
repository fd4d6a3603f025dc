"""The engine over many sequences: batching and KV managers never change tokens, trees stay inside
the budget and the context, failures leak nothing, proposers are told what was committed, logits
processors run in the one target stage. decode(cfg)'s run directory is tests/test_decode.py's."""
from __future__ import annotations

import pytest
import torch

import pipeline.core.engine as engine_module
from components.kv.paged import PagedKV
from components.sampler.logits import RepetitionPenalty
from pipeline.build import component
from pipeline.core import StepBatch, Tree, forward_rows, forward_step

from helpers import (TEXT_PROMPTS, TINY_VARIANTS, assert_generation_invariants, compose_config, decoder_for,
                     random_prompts, rebuild, reference_greedy)
from toy import PerSequence


def mixed_prompts(bb) -> list[list[int]]:
    tok = bb.tokenizer
    return [tok.encode(p, add_special_tokens=False) for p in TEXT_PROMPTS] + random_prompts(5, seed=9)


@pytest.mark.parametrize("preset,extra", [("greedy", ()), ("tree_ngram", ("proposer.min_ngram=1",)),
                                          ("self_spec", ()), ("sample", ("sampler.temperature=1.3",))])
@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_batch_size_and_kv_never_change_tokens(tiny_variants, variant, preset, extra):
    """Every preset, both KV managers, batch 1 / 3 / 8 (continuous batching over 8 prompts of mixed
    lengths): identical tokens, seeded sampling included, and nothing left in the pool."""
    bb = tiny_variants[variant]
    prompts = mixed_prompts(bb)
    runs = {}
    for kv in ("contiguous", "paged"):
        for batch in (1, 3, 8):
            eng = decoder_for(preset, bb, *extra, f"kv={kv}", f"batch_size={batch}", max_new_tokens=24)
            gens = eng.run(prompts)
            for g, p in zip(gens, prompts):
                assert_generation_invariants(g, 24, bb.eos_ids, eng.kv, len(p))
            runs[(kv, batch)] = [g.token_ids for g in gens]
    ref = runs[("contiguous", 1)]
    for key, toks in runs.items():
        assert toks == ref, f"{preset}/{variant}: {key} differs from contiguous batch 1"
    if preset != "sample":
        assert ref[0] == reference_greedy(bb.model, prompts[0], 24, bb.eos_ids)


def test_one_step_packs_every_sequence_block_diagonally(tiny_backbone):
    """A step over three sequences (a tree, a plain root, a prompt block) gives each row what a
    forward of its own sequence alone gives."""
    model = tiny_backbone.model
    kv = PagedKV(tiny_backbone, block_size=4, num_blocks=4)
    a, b, c = kv.create(), kv.create(), kv.create()
    with torch.inference_mode():
        forward_rows(model, kv, a, torch.tensor([5, 6, 7, 8, 9]))
        forward_rows(model, kv, b, torch.tensor([11, 12]))
        kv.commit(a)
        kv.commit(b)
        tree = Tree.from_paths(3, [[4, 5], [6]])
        step = StepBatch.build([a, b, c], [tree.tokens, torch.tensor([13]), torch.tensor([1, 2, 3])],
                               [tree.depth, None, None], [tree.mask, None, None], [5, 2, 0])
        h = forward_step(model, kv, step)
        pa = model(torch.tensor([[5, 6, 7, 8, 9, 3, 4, 5]]), torch.arange(8)[None])[0, -3:]  # root, 4, 5
        pa6 = model(torch.tensor([[5, 6, 7, 8, 9, 3, 6]]), torch.arange(7)[None])[0, -1]  # the sibling branch
        pb = model(torch.tensor([[11, 12, 13]]), torch.arange(3)[None])[0, -1]
        pc = model(torch.tensor([[1, 2, 3]]), torch.arange(3)[None])[0]
    assert tree.tokens.tolist() == [3, 4, 5, 6]  # packed: root, 4, 5 under 4, then 6 under the root
    torch.testing.assert_close(h[:3], pa, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(h[3], pa6, rtol=1e-4, atol=1e-4)  # never sees its sibling branch
    torch.testing.assert_close(h[4], pb, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(h[5:], pc, rtol=1e-4, atol=1e-4)


class GreedyOracle(PerSequence):
    """Proposes the next `depth` tokens of the plain greedy run (then filler), per sequence: its
    trees always reach past max_new_tokens and the context end, which the engine must prune."""

    def __init__(self, prompts, greedy_runs, depth=12):
        self.by_prompt = {tuple(p): g for p, g in zip(prompts, greedy_runs)}
        self.depth, self.state = depth, {}

    def start(self, seq, prompt_ids):
        self.state[seq] = (self.by_prompt[tuple(prompt_ids)], len(prompt_ids))

    def draft(self, state):
        ref, plen = self.state[state.seq]
        n = len(state.tokens) - plen  # generated so far, the root included
        return Tree.from_paths(state.tokens[-1], [(ref[n:] + [1] * self.depth)[:self.depth]])


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("preset", ["greedy", "tree_ngram", "self_spec", "oracle"])
def test_decoding_up_to_the_context_end_equals_plain_greedy(tiny_variants, preset, batch):
    """max_seq_len 48, prompts of 20-47 tokens: every proposer (and an oracle whose trees always run
    past the end) stops where plain greedy does, with finish_reason "context", and no tree ever
    holds more drafts than tokens are left."""
    limit = 48
    bb = component(compose_config(["model=tiny", f"model.max_seq_len={limit}"]).model)
    text = bb.tokenizer.encode(TEXT_PROMPTS[0] * 3, add_special_tokens=False)
    prompts = [text[:n] for n in (20, 30, 40, 44, 46, 47)]
    plain = decoder_for("greedy", bb, max_new_tokens=64)
    ref = [g.token_ids for g in plain.run(prompts)]
    assert all(len(p) + len(r) == limit for p, r in zip(prompts, ref))
    if preset == "oracle":
        eng = rebuild(decoder_for("tree_ngram", bb, f"batch_size={batch}",
                                  max_new_tokens=64), proposer=GreedyOracle(prompts, ref))
    else:
        eng = decoder_for(preset, bb, f"batch_size={batch}", max_new_tokens=64)
    gens = eng.run(prompts)
    for g, p, r in zip(gens, prompts, ref):
        assert g.token_ids == r and g.finish_reason == "context"
        assert_generation_invariants(g, 64, bb.eos_ids, eng.kv, len(p))
        for j, (depth, nodes) in enumerate(zip(g.tree_depths, g.step_nodes)):
            left = limit - len(p) - sum(g.accepted_lengths[:j + 1])  # tokens still allowed at step j
            assert depth <= left - 1 and nodes <= left
    if preset == "oracle":
        assert sum(max(g.tree_depths, default=0) for g in gens) > 0


class Failing(PerSequence):
    """Drafts a fixed chain `after` times, then raises `exc` (an error, or Ctrl-C)."""

    def __init__(self, after: int, exc: type[BaseException] = RuntimeError):
        self.after, self.exc, self.calls = after, exc, 0

    def draft(self, state):
        self.calls += 1
        if self.calls > self.after:
            raise self.exc("proposer failed")
        return Tree.from_paths(state.tokens[-1], [[1, 2, 3]])


@pytest.mark.parametrize("kv", ["contiguous", "paged"])
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_a_failed_or_interrupted_run_leaks_no_block(tiny_variants, kv, exc):
    bb = tiny_variants["tied"]
    failing = Failing(after=7, exc=exc)
    eng = rebuild(decoder_for("tree_ngram", bb, f"kv={kv}", "batch_size=3", max_new_tokens=30), proposer=failing)
    with pytest.raises(exc, match="proposer failed"):
        eng.run(mixed_prompts(bb))
    # Ctrl-C ends the step at once; an error is first isolated (the step redone on halves of its requests)
    assert failing.calls == 8 if exc is KeyboardInterrupt else failing.calls > 8
    assert eng.kv.sequences == [] and eng.kv.stats()["bytes_in_use"] == 0


@pytest.mark.parametrize("kv", ["contiguous", "paged"])
@pytest.mark.parametrize("at_call", [1, 4, 9])
def test_a_failure_while_requests_join_or_stream_leaks_no_block(tiny_variants, kv, at_call, monkeypatch):
    """Ctrl-C inside the token callback, at the first prefill (several prefill groups: small
    PREFILL_ROWS), mid-run, or at a later admission: every sequence goes back to the pool."""
    monkeypatch.setattr(engine_module, "PREFILL_ROWS", 20)
    bb = tiny_variants["tied"]
    eng = decoder_for("greedy", bb, f"kv={kv}", "batch_size=4", max_new_tokens=6)
    calls = []

    def on_tokens(i, ids, hidden):
        calls.append(i)
        if len(calls) == at_call:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        eng.run(mixed_prompts(bb), on_tokens=on_tokens)
    assert eng.kv.sequences == [] and eng.kv.stats()["bytes_in_use"] == 0


class Recorder(PerSequence):
    """Records what `observe` reports, proposes nothing."""

    def __init__(self):
        self.seen = {}

    def start(self, seq, prompt_ids):
        self.seen[seq] = [list(prompt_ids[:1]), []]

    def draft(self, state):
        return Tree.from_paths(state.tokens[-1], [[7, 7], [8]])  # rejected or not, observe must be right

    def observe(self, seq, tokens, hidden):
        assert hidden.shape[0] == len(tokens)
        self.seen[seq][0] += tokens
        self.seen[seq][1].append(hidden)

    def release(self, seq):
        self.done = getattr(self, "done", []) + [self.seen.pop(seq)]


def test_proposers_observe_every_committed_token_with_its_hidden_state(tiny_variants):
    bb = tiny_variants["tied"]
    rec = Recorder()
    eng = rebuild(decoder_for("tree_ngram", bb, "batch_size=2", max_new_tokens=12), proposer=rec)
    prompts = mixed_prompts(bb)[:3]
    gens = eng.run(prompts)
    assert len(rec.done) == 3 and rec.seen == {}
    for tokens, hiddens in rec.done:
        prompt = next(p for p in prompts if p[0] == tokens[0] and tokens[:len(p)] == p)
        g = next(g for g, p in zip(gens, prompts) if p == prompt)
        n = len(prompt) + len(g.token_ids)
        assert tokens[:n] == prompt + g.token_ids  # observed = prompt + committed (the tail may pass EOS)
        hidden = torch.cat(hiddens)[:n - 1]  # hidden[j] chose tokens[j + 1]
        with torch.inference_mode():
            ref = bb.model(torch.tensor([tokens[:n - 1]]), torch.arange(n - 1)[None])[0]
        torch.testing.assert_close(hidden, ref, rtol=1e-4, atol=1e-4)


def test_logits_processors_run_in_the_target_stage_for_trees_too(tiny_variants):
    bb = tiny_variants["tied"]
    prompts = mixed_prompts(bb)[:4]
    penalty = "sampler.processors=[{_target_: components.sampler.logits.RepetitionPenalty, penalty: 1.5}]"
    runs = {}
    for preset, extra in (("greedy", ()), ("tree_ngram", ("proposer.min_ngram=1",))):
        for processors in ((), (penalty,)):
            eng = decoder_for(preset, bb, *extra, *processors, "batch_size=2", max_new_tokens=20)
            assert [type(p) for p in eng.sampler.processors] == [RepetitionPenalty] * len(processors)
            runs[(preset, bool(processors))] = [g.token_ids for g in eng.run(prompts)]
    assert runs[("greedy", True)] != runs[("greedy", False)], "the penalty changed nothing: the test checks nothing"
    assert runs[("tree_ngram", True)] == runs[("greedy", True)]
    assert runs[("tree_ngram", False)] == runs[("greedy", False)]


def test_processors_from_the_config(tiny_variants):
    eng = decoder_for("greedy", tiny_variants["tied"],
                      "sampler.processors=[{_target_: components.sampler.logits.RepetitionPenalty, penalty: 1.2}]")
    assert isinstance(eng.sampler.processors[0], RepetitionPenalty) and eng.target.needs_input_ids
