"""The engine over many sequences: batching and KV managers never change tokens, trees stay inside
the budget and the context, failures leak nothing, proposers are told what was committed, logits
processors run in the one target stage; and decode(cfg)'s run directory (items.jsonl, resume,
names, terminal messages)."""
from __future__ import annotations

import json

import pytest
import torch

from components.sampler.logits import RepetitionPenalty
from pipeline.core import StepBatch, Tree, forward_rows, forward_step
from pipeline.decode import decode

from conftest import compose_config
from test_decode import (TEXT_PROMPTS, TINY_VARIANTS, assert_generation_invariants, decoder_for, random_prompts,
                         reference_greedy, replace)
from toy import PerSequence


@pytest.fixture(scope="module")
def tiny_variants():
    from pipeline.build import component
    return {name: component(compose_config(list(ov)).model) for name, ov in TINY_VARIANTS.items()}


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
    from components.kv.paged import PagedKV
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
    from pipeline.build import component
    limit = 48
    bb = component(compose_config(["model=tiny", f"model.max_seq_len={limit}"]).model)
    text = bb.tokenizer.encode(TEXT_PROMPTS[0] * 3, add_special_tokens=False)
    prompts = [text[:n] for n in (20, 30, 40, 44, 46, 47)]
    plain = decoder_for("greedy", bb, max_new_tokens=64)
    ref = [g.token_ids for g in plain.run(prompts)]
    assert all(len(p) + len(r) == limit for p, r in zip(prompts, ref))
    if preset == "oracle":
        eng = replace(decoder_for("tree_ngram", bb, f"batch_size={batch}",
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
    def __init__(self, after: int):
        self.after, self.calls = after, 0

    def draft(self, state):
        self.calls += 1
        if self.calls > self.after:
            raise RuntimeError("proposer failed")
        return Tree.from_paths(state.tokens[-1], [[1, 2, 3]])


@pytest.mark.parametrize("kv", ["contiguous", "paged"])
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_a_failed_or_interrupted_run_leaks_no_block(tiny_variants, kv, exc):
    bb = tiny_variants["tied"]
    eng = decoder_for("tree_ngram", bb, f"kv={kv}", "batch_size=3", max_new_tokens=30)
    failing = Failing(after=7)
    if exc is KeyboardInterrupt:
        failing.draft = lambda state, f=failing.draft: (_ for _ in ()).throw(KeyboardInterrupt) \
            if failing.calls >= 7 else f(state)
    eng = replace(eng, proposer=failing)
    with pytest.raises(exc):
        eng.run(mixed_prompts(bb))
    assert eng.kv.sequences == [] and eng.kv.stats()["bytes_in_use"] == 0


@pytest.mark.parametrize("kv", ["contiguous", "paged"])
@pytest.mark.parametrize("at_call", [1, 4, 9])
def test_a_failure_while_requests_join_or_stream_leaks_no_block(tiny_variants, kv, at_call, monkeypatch):
    """Ctrl-C inside the token callback, at the first prefill (several prefill groups: small
    PREFILL_ROWS), mid-run, or at a later admission: every sequence goes back to the pool."""
    import pipeline.core.engine as engine_module
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
    eng = replace(decoder_for("tree_ngram", bb, "batch_size=2", max_new_tokens=12), proposer=rec)
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
    runs = {}
    for preset, extra in (("greedy", ()), ("tree_ngram", ("proposer.min_ngram=1",))):
        for penalty in (None, 1.5):
            eng = decoder_for(preset, bb, *extra, "batch_size=2", max_new_tokens=20)
            if penalty:
                eng.sampler.processors.append(RepetitionPenalty(penalty))
                eng = replace(eng, target=type(eng.target)(eng.sampler.processors, greedy=eng.sampler.greedy))
            runs[(preset, penalty)] = [g.token_ids for g in eng.run(prompts)]
    assert runs[("greedy", 1.5)] != runs[("greedy", None)], "the penalty changed nothing: the test checks nothing"
    assert runs[("tree_ngram", 1.5)] == runs[("greedy", 1.5)]
    assert runs[("tree_ngram", None)] == runs[("greedy", None)]


def test_processors_from_the_config(tiny_variants):
    eng = decoder_for("greedy", tiny_variants["tied"],
                      "sampler.processors=[{_target_: components.sampler.logits.RepetitionPenalty, penalty: 1.2}]")
    assert isinstance(eng.sampler.processors[0], RepetitionPenalty) and eng.target.needs_input_ids


# ------------------------------------------------------------------------------------------------
# decode(cfg): the run directory
# ------------------------------------------------------------------------------------------------

def write_input(path, n=5):
    rows = [{"id": f"q{i}", "prompt": f"Request number {i}: say something."} for i in range(n)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return rows


def test_items_are_appended_and_a_rerun_resumes(tmp_path):
    inp = tmp_path / "in.jsonl"
    write_input(inp)
    out = tmp_path / "run"
    over = ["model=tiny", "decode=tree_ngram", "max_new_tokens=12", f"input={inp}", "stream=false", "batch_size=2"]
    m1, _ = decode(compose_config(over, output_dir=out))
    lines = (out / "items.jsonl").read_text().splitlines()
    assert sorted(json.loads(x)["id"] for x in lines) == [f"q{i}" for i in range(5)]
    first = json.loads((out / "results.json").read_text())
    # drop two finished requests (as if the run had been stopped), rerun in the same directory
    kept = [x for x in lines if json.loads(x)["id"] not in ("q1", "q3")]
    (out / "items.jsonl").write_text("\n".join(kept) + "\n")
    m2, _ = decode(compose_config(over, output_dir=out))
    assert m2["resumed"] == 3 and m2["finished_now"] == 2
    second = json.loads((out / "results.json").read_text())
    assert [it["id"] for it in second["items"]] == [f"q{i}" for i in range(5)]
    for a, b in zip(first["items"], second["items"]):
        assert a["token_ids"] == b["token_ids"]
    assert len((out / "items.jsonl").read_text().splitlines()) == 5


@pytest.mark.parametrize("overrides,name", [(["decode=tree_ngram"], "tree_ngram"),
                                            (["decode=tree_ngram", "tree.width=3"], "tree_ngram"),
                                            (["decode=greedy", "proposer=ngram", "verifier=greedy"], "greedy proposer=ngram verifier=greedy"),
                                            (["decode=greedy", "sampler=sample"], "greedy sampler=sample"),
                                            (["decode=sample", "kv=paged"], "sample")])
def test_hand_picked_components_are_not_reported_as_a_preset(tmp_path, overrides, name):
    cfg = compose_config(["model=tiny", "max_new_tokens=4", "prompt=hi", "stream=false", *overrides],
                         output_dir=tmp_path)
    _, objs = decode(cfg)
    assert objs["results"]["decode"] == name


def test_context_end_and_lossless_verdict_are_said_on_the_terminal(tmp_path, capsys):
    cfg = compose_config(["model=tiny", "decode=tree_ngram", "model.max_seq_len=80", "max_new_tokens=64",
                          "chat=false", "stream=false", "verify_lossless=true"], output_dir=tmp_path,
                         prompt=TEXT_PROMPTS[0])
    _, objs = decode(cfg)
    err = capsys.readouterr().err
    assert objs["results"]["items"][0]["finish_reason"] == "context"
    assert "context end" in err and "verify_lossless: all 1 requests equal plain decoding" in err


def test_batched_streaming_prints_each_request_whole_in_order(tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    write_input(inp, 4)
    cfg = compose_config(["model=tiny", "decode=greedy", "max_new_tokens=10", f"input={inp}", "batch_size=3",
                          "stream=true"], output_dir=tmp_path)
    _, objs = decode(cfg)
    out = capsys.readouterr().out
    expected = "\n".join(f"[{it['id']}] {it['text']}" for it in objs["results"]["items"]) + "\n"
    assert out == expected


def test_input_and_checkpoints_are_checked_before_the_model_loads(tmp_path, monkeypatch):
    import pipeline.build
    from pipeline.core import UserError

    def no_model(node, backbone=None, **kw):
        if node is not None and "model" in str(node.get("_target_", "")):
            raise AssertionError("the model was loaded before the input was checked")
        return real(node, backbone, **kw)
    real = pipeline.build.component
    monkeypatch.setattr(pipeline.build, "component", no_model)
    cases = [(["input=/nonexistent/in.jsonl"], "/nonexistent/in.jsonl"),
             (["decode=tree_medusa", "prompt=hi", "proposer.checkpoint=/nonexistent/h.safetensors"], "proposer.checkpoint"),
             (["decode=tree_medusa", "prompt=hi", "proposer.tree_file=/nonexistent/tree.json"], "proposer.tree_file")]
    for overrides, name in cases:
        with pytest.raises(UserError, match=name):
            decode(compose_config(["model=tiny", "stream=false", *overrides], output_dir=tmp_path))
