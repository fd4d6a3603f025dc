"""The decode loop: greedy against a cache-free reference, speculative presets token-for-token equal
to greedy, stopping inside an accepted path; decode(cfg)'s results.json, input files and run
directory (items.jsonl, resume, names, terminal messages, checks before the model loads);
streaming; and on the real model, greedy against transformers' generate and the speculative presets
against greedy."""
from __future__ import annotations

import json
import random

import pytest
import torch

import pipeline.build
from components.proposer.ngram import NgramProposer
from components.proposer.self_spec import SelfSpecProposer
from components.verifier.greedy import GreedyVerifier
from pipeline.build import build_engine
from pipeline.core import DecodeState, Tree, UserError
from pipeline.decode import decode
from pipeline.requests import Request, encode
from pipeline.streaming import TextStream

from helpers import (REPEAT_TEXT, TEXT_PROMPTS, TINY_VARIANTS, assert_generation_invariants, compose_config,
                     decoder_for, random_prompts, rebuild, reference_greedy)
from toy import PerSequence

# ------------------------------------------------------------------------------------------------
# greedy and the speculative presets on the tiny model
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_greedy_equals_cache_free_reference(tiny_variants, variant):
    bb = tiny_variants[variant]
    dec = decoder_for("greedy", bb, max_new_tokens=24)
    prompts = random_prompts(4, seed=1) + [bb.tokenizer.encode(TEXT_PROMPTS[1], add_special_tokens=False)]
    for prompt in prompts:
        gen = dec.generate(prompt)
        assert gen.token_ids == reference_greedy(bb.model, prompt, 24, bb.eos_ids), f"prompt of {len(prompt)} tokens"
        assert gen.accepted_lengths == [1] * len(gen.token_ids)
        assert_generation_invariants(gen, 24, bb.eos_ids, dec.kv, len(prompt))


PROPOSERS = {"tree_ngram": NgramProposer, "self_spec": SelfSpecProposer}


@pytest.mark.parametrize("preset", list(PROPOSERS))
@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_speculative_presets_equal_greedy(tiny_variants, variant, preset):
    bb = tiny_variants[variant]
    tok = bb.tokenizer
    greedy = decoder_for("greedy", bb, max_new_tokens=40)
    # the untied model's output is a random walk that never repeats a trigram: let the n-gram
    # proposer match single tokens there, so its drafts are built (and rejected) all the same
    extra = ("proposer.min_ngram=1",) if preset == "tree_ngram" and variant == "untied" else ()
    spec = decoder_for(preset, bb, *extra, max_new_tokens=40)
    assert isinstance(spec.proposer, PROPOSERS[preset]) and isinstance(spec.verifier, GreedyVerifier)
    prompts = [tok.encode(p, add_special_tokens=False) for p in TEXT_PROMPTS] + random_prompts(3, seed=2)
    tree_steps = accepted_drafts = 0
    for prompt in prompts:
        ref = greedy.generate(prompt)
        gen = spec.generate(prompt)
        assert gen.token_ids == ref.token_ids, f"{preset}/{variant} diverges on a {len(prompt)}-token prompt"
        assert gen.finish_reason == ref.finish_reason
        assert_generation_invariants(gen, 40, bb.eos_ids, spec.kv, len(prompt))
        tree_steps += sum(n > 1 for n in gen.step_nodes)
        accepted_drafts += len(gen.token_ids) - gen.steps
    assert tree_steps > 0, "the preset never built a tree: the test checked nothing"
    if variant == "tied":  # the tied tiny model repeats itself: drafts of a repetition are accepted
        assert accepted_drafts > 0


class OracleProposer(PerSequence):
    """Proposes the true greedy continuation (from a precomputed run), corrupted at a random depth,
    plus sibling branches of wrong tokens, ignoring the budget. Records how many drafts of each
    proposal are correct, which is exactly what the verifier must accept."""

    def __init__(self, prompt_len: int, greedy_tokens: list[int], depth: int = 6, seed: int = 0,
                 corrupt: bool = True, vocab: int = 49152):
        self.prompt_len, self.greedy, self.depth, self.corrupt = prompt_len, greedy_tokens, depth, corrupt
        self.rng, self.vocab = random.Random(seed), vocab
        self.expected: list[int] = []

    def wrong(self, avoid: set[int]) -> int:
        while True:
            t = self.rng.randrange(self.vocab)
            if t not in avoid:
                return t

    def draft(self, state: DecodeState) -> Tree | None:
        k = len(state.tokens) - self.prompt_len  # tokens generated so far; the root is greedy[k - 1]
        assert state.tokens[self.prompt_len:] == self.greedy[:k], "the decoder committed a wrong token"
        truth = self.greedy[k:k + self.depth]
        if not truth:
            return None
        good = self.rng.randint(0, len(truth)) if self.corrupt else len(truth)
        main = truth[:good] + [self.wrong({*truth}) for _ in range(self.depth - good)]
        paths = [main]
        for _ in range(self.rng.randint(0, 2) if self.corrupt else 0):  # rejected siblings
            d = self.rng.randint(0, good)  # branch off the true prefix at depth d
            paths.append(truth[:d] + [self.wrong({*truth}) for _ in range(self.rng.randint(1, 3))])
        self.expected.append(good)
        return Tree.from_paths(state.tokens[-1], paths)


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_partial_acceptance_at_every_depth(tiny_variants, variant):
    bb = tiny_variants[variant]
    greedy = decoder_for("greedy", bb, max_new_tokens=60)
    for seed, prompt in enumerate(random_prompts(3, seed=3)):
        ref = greedy.generate(prompt).token_ids
        oracle = OracleProposer(len(prompt), ref, seed=seed)
        spec = rebuild(greedy, proposer=oracle, verifier=GreedyVerifier())
        gen = spec.generate(prompt)
        assert gen.token_ids == ref
        # each tree step commits exactly the correct drafts plus the bonus token, except a final
        # step cut short by max_new_tokens (steps without a proposal, when budget <= 1, are plain)
        tree_steps = [(i, a) for i, (a, n) in enumerate(zip(gen.accepted_lengths[1:], gen.step_nodes)) if n > 1]
        assert len(tree_steps) == len(oracle.expected)
        last = gen.steps - 2
        for (i, a), good in zip(tree_steps, oracle.expected):
            assert a == good + 1 if i < last else a <= good + 1, f"step {i}"
        assert len(set(oracle.expected)) > 2, "the oracle should have exercised several depths"
        assert_generation_invariants(gen, 60, bb.eos_ids, spec.kv, len(prompt))


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 5, 8, 12])
def test_max_new_tokens_inside_an_accepted_path(tiny_variants, max_new_tokens):
    bb = tiny_variants["untied"]
    prompt = random_prompts(4, seed=4)[3]
    plain = decoder_for("greedy", bb, max_new_tokens=max_new_tokens)
    ref = plain.generate(prompt)
    full = decoder_for("greedy", bb, max_new_tokens=40).generate(prompt).token_ids
    oracle = OracleProposer(len(prompt), full, depth=5, corrupt=False)
    spec = rebuild(plain, proposer=oracle, verifier=GreedyVerifier())
    gen = spec.generate(prompt)
    assert gen.token_ids == ref.token_ids == full[:max_new_tokens]
    assert gen.finish_reason == ref.finish_reason == "length"
    assert_generation_invariants(gen, max_new_tokens, bb.eos_ids)


@pytest.mark.parametrize("eos_at", [1, 2, 4, 7])
def test_eos_inside_an_accepted_path(tiny_variants, eos_at):
    """Make the token greedy emits at index `eos_at` an EOS id: plain greedy stops there, and so
    must a decoder whose accepted path runs past it."""
    bb = tiny_variants["untied"]
    prompt = random_prompts(4, seed=5)[2]
    full = decoder_for("greedy", bb, max_new_tokens=40).generate(prompt).token_ids
    assert full[eos_at] not in full[:eos_at], "pick an index whose token is new"
    eos = [full[eos_at]]
    plain = rebuild(decoder_for("greedy", bb, max_new_tokens=40), eos_ids=eos)
    ref = plain.generate(prompt)
    assert ref.token_ids == full[:eos_at + 1] and ref.finish_reason == "eos"
    for depth in (3, 6, 10):
        oracle = OracleProposer(len(prompt), full, depth=depth, corrupt=False)
        gen = rebuild(plain, proposer=oracle, verifier=GreedyVerifier()).generate(prompt)
        assert gen.token_ids == ref.token_ids and gen.finish_reason == "eos"
        assert_generation_invariants(gen, 40, eos)


def test_streamed_tokens_are_exactly_the_committed_ones(tiny_variants):
    bb = tiny_variants["tied"]
    dec = decoder_for("tree_ngram", bb, max_new_tokens=30)
    seen: list[list[int]] = []
    gen = dec.generate(bb.tokenizer.encode(REPEAT_TEXT, add_special_tokens=False), on_tokens=seen.append)
    assert [t for chunk in seen for t in chunk] == gen.token_ids
    assert [len(c) for c in seen] == gen.accepted_lengths


def test_sampling_is_seeded(tiny_variants):
    bb = tiny_variants["untied"]
    dec = decoder_for("sample", bb, "sampler.temperature=1.5", max_new_tokens=20)
    prompt = random_prompts(3, seed=6)[2]
    a, b = dec.generate(prompt, seed=7), dec.generate(prompt, seed=7)
    c = dec.generate(prompt, seed=8)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids
    assert_generation_invariants(a, 20, bb.eos_ids)


def test_proposer_with_sampling_is_refused(tiny_variants):
    with pytest.raises(UserError, match="sampler"):
        decoder_for("tree_ngram", tiny_variants["tied"], "sampler=sample")


# ------------------------------------------------------------------------------------------------
# decode(cfg): results.json and input files
# ------------------------------------------------------------------------------------------------

ITEM_KEYS = {"id", "prompt", "token_ids", "text", "new_tokens", "wall_s", "steps", "accepted_lengths",
             "finish_reason"}
SUMMARY_KEYS = {"requests", "new_tokens", "wall_s", "tokens_per_s", "steps", "mean_accepted_length"}


def check_results(path, cfg, tokenizer, eos_ids) -> dict:
    res = json.loads(path.read_text())
    assert {"decode", "config", "summary", "items"} <= set(res)
    assert res["decode"] == cfg.name
    assert res["config"]["max_new_tokens"] == cfg.max_new_tokens
    assert res["config"]["model"]["_target_"] == cfg.model._target_
    s, items = res["summary"], res["items"]
    assert SUMMARY_KEYS <= set(s)
    assert s["requests"] == len(items)
    assert s["new_tokens"] == sum(it["new_tokens"] for it in items)
    assert s["steps"] == sum(it["steps"] for it in items)
    assert s["mean_accepted_length"] == pytest.approx(s["new_tokens"] / s["steps"])
    assert s["wall_s"] > 0 and s["tokens_per_s"] == pytest.approx(s["new_tokens"] / s["wall_s"], rel=1e-2)
    for it in items:
        assert ITEM_KEYS <= set(it), ITEM_KEYS - set(it)
        assert all(isinstance(t, int) for t in it["token_ids"])
        assert it["new_tokens"] == len(it["token_ids"]) == sum(it["accepted_lengths"])
        assert it["steps"] == len(it["accepted_lengths"])
        assert it["text"] == tokenizer.decode(it["token_ids"], skip_special_tokens=True)
        assert it["finish_reason"] in ("eos", "length", "context")
        if it["finish_reason"] == "eos":
            assert it["token_ids"][-1] in eos_ids
        else:
            assert it["new_tokens"] == cfg.max_new_tokens
    return res


@pytest.mark.parametrize("preset", ["greedy", "tree_ngram", "self_spec", "sample"])
def test_results_json_schema(tmp_path, preset, tiny_variants):
    cfg = compose_config(["model=tiny", f"decode={preset}", "max_new_tokens=12", "chat=false",
                          f"prompt={REPEAT_TEXT}", "stream=false"], output_dir=tmp_path)
    metrics, objs = decode(cfg)
    path = tmp_path / "results.json"
    assert metrics["results_path"] == str(path)
    res = check_results(path, cfg, objs["backbone"].tokenizer, objs["backbone"].eos_ids)
    assert res["decode"] == preset and res["items"][0]["id"] == "prompt"
    assert res["items"][0]["prompt"] == REPEAT_TEXT
    if preset in ("greedy", "sample"):
        assert res["summary"]["mean_accepted_length"] == 1.0
    if preset != "sample":  # every greedy preset commits greedy's tokens
        ref = reference_greedy(tiny_variants["tied"].model, tiny_variants["tied"].tokenizer.encode(
            REPEAT_TEXT, add_special_tokens=False), 12, objs["backbone"].eos_ids)
        assert res["items"][0]["token_ids"] == ref
    assert not list(tmp_path.glob(".results.json.tmp*")), "temporary file left behind"


def test_input_jsonl_with_prompt_and_messages_lines(tmp_path, tiny_variants):
    messages = [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "Which colour is the sky?"}]
    lines = [{"id": "p1", "prompt": "Tell me a story about a fox."},
             {"id": "m1", "messages": messages},
             {"prompt": "A line without an id."}]
    inp = tmp_path / "requests.jsonl"
    inp.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")  # a trailing blank line is fine
    out = tmp_path / "run"
    cfg = compose_config(["model=tiny", "decode=tree_ngram", "max_new_tokens=10", f"input={inp}",
                          "stream=false"], output_dir=out)
    _, objs = decode(cfg)
    bb = objs["backbone"]
    res = check_results(out / "results.json", cfg, bb.tokenizer, bb.eos_ids)
    assert [it["id"] for it in res["items"]] == ["p1", "m1", "r002"]
    assert [it["prompt"] for it in res["items"]] == [lines[0]["prompt"], messages[-1]["content"], lines[2]["prompt"]]
    tok = bb.tokenizer
    chats = [[{"role": "user", "content": lines[0]["prompt"]}], messages, [{"role": "user", "content": lines[2]["prompt"]}]]
    ref_model = tiny_variants["tied"].model  # same seed and shape as conf/model/tiny.yaml
    for it, msgs in zip(res["items"], chats):
        ids = tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)
        assert it["token_ids"] == reference_greedy(ref_model, ids, 10, bb.eos_ids), it["id"]
    # the chat template really was applied: the system message is in the prompt the model saw
    assert "You answer in one word." in tok.decode(encode(tok, Request("m1", "", messages), True))


def test_stream_prints_exactly_the_text(tmp_path, capsys):
    cfg = compose_config(["model=tiny", "decode=tree_ngram", "max_new_tokens=20", "chat=false",
                          f"prompt={REPEAT_TEXT}", "stream=true"], output_dir=tmp_path)
    _, objs = decode(cfg)
    text = objs["results"]["items"][0]["text"]
    assert capsys.readouterr().out == text + "\n"


def test_verify_lossless_reports_no_divergence(tmp_path):
    cfg = compose_config(["model=tiny", "decode=self_spec", "max_new_tokens=16", "chat=false",
                          "stream=false", "verify_lossless=true"], output_dir=tmp_path, prompt=TEXT_PROMPTS[2])
    metrics, objs = decode(cfg)
    assert metrics["lossless"] is True and metrics["diverged_requests"] == 0
    assert objs["results"]["items"][0]["lossless"] is True


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


# ------------------------------------------------------------------------------------------------
# streaming
# ------------------------------------------------------------------------------------------------

STREAM_TEXT = "Hello 世界! Ünïcödé — naïve café. 🎉 emoji: 😀👍🏽👨‍👩‍👧 中文测试，日本語テキスト。 done"


def test_text_stream_one_token_at_a_time(tiny_backbone):
    tok = tiny_backbone.tokenizer
    ids = tok.encode(STREAM_TEXT, add_special_tokens=False)
    assert tok.decode(ids) == STREAM_TEXT  # precondition: the tokenizer round-trips the string
    assert len(ids) > len(STREAM_TEXT.encode()) // 4, "expected multi-byte characters split over tokens"
    stream, pieces = TextStream(tok), []
    for t in ids:
        piece = stream.push([t])
        assert "\ufffd" not in piece
        pieces.append(piece)
    pieces.append(stream.flush())
    assert "\ufffd" not in pieces[-1]
    assert "".join(pieces) == STREAM_TEXT
    assert sum(1 for p in pieces if p == "") > 0, "some token must end mid-character and be held back"


@pytest.mark.parametrize("seed", range(5))
def test_text_stream_random_chunks_and_special_tokens(tiny_backbone, seed):
    tok = tiny_backbone.tokenizer
    ids = tok.encode(STREAM_TEXT, add_special_tokens=False) + [tok.eos_token_id]
    rng = random.Random(seed)
    stream, out, i = TextStream(tok), [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        piece = stream.push(ids[i:i + n])
        assert "\ufffd" not in piece
        out.append(piece)
        i += n
    out.append(stream.flush())
    assert "".join(out) == STREAM_TEXT  # the EOS is skipped, like results.json's text


# ------------------------------------------------------------------------------------------------
# the real model (slow)
# ------------------------------------------------------------------------------------------------

REAL_PROMPTS = ["What is the capital of France?", "Write a haiku about autumn leaves.",
                "List three uses of a paperclip.", "Explain in one sentence what a CPU does."]
REPEAT_PROMPT = ("Repeat this sentence exactly: The quick brown fox jumps over the lazy dog "
                 "while the cat sleeps on the warm windowsill.")


@pytest.mark.slow
@torch.inference_mode()
def test_real_greedy_equals_transformers_generate(real_backbone, real_hf):
    from transformers import GenerationConfig
    cfg = compose_config(["decode=greedy", "max_new_tokens=24"])
    dec, bb = build_engine(cfg, real_backbone)
    eos = bb.eos_ids
    gc = GenerationConfig(do_sample=False, max_new_tokens=24, eos_token_id=eos, pad_token_id=eos[0])
    for text in REAL_PROMPTS:
        ids = encode(bb.tokenizer, Request("r", text), chat=True)
        ours = dec.generate(ids)
        out = real_hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               generation_config=gc)[0, len(ids):].tolist()
        stop = next((i for i, t in enumerate(out) if t in eos), None)
        theirs = out if stop is None else out[:stop + 1]
        assert ours.token_ids == theirs, f"{text!r}: ours {bb.tokenizer.decode(ours.token_ids)!r} " \
                                         f"vs transformers {bb.tokenizer.decode(theirs)!r}"


@pytest.mark.slow
def test_real_speculative_presets_equal_greedy(tmp_path, real_backbone):
    inp = tmp_path / "req.jsonl"
    rows = [{"id": "repeat", "prompt": REPEAT_PROMPT}, {"id": "haiku", "prompt": REAL_PROMPTS[1]},
            {"id": "cpu", "prompt": REAL_PROMPTS[3]}]
    inp.write_text("\n".join(json.dumps(r) for r in rows))
    results = {}
    for preset in ("greedy", "tree_ngram", "self_spec"):
        cfg = compose_config([f"decode={preset}", "max_new_tokens=32", f"input={inp}", "stream=false"],
                             output_dir=tmp_path / preset)
        _, objs = decode(cfg, backbone=real_backbone)
        results[preset] = check_results(tmp_path / preset / "results.json", cfg, real_backbone.tokenizer,
                                        real_backbone.eos_ids)
    greedy = {it["id"]: it for it in results["greedy"]["items"]}
    for preset in ("tree_ngram", "self_spec"):
        for it in results[preset]["items"]:
            assert it["token_ids"] == greedy[it["id"]]["token_ids"], f"{preset} diverges on {it['id']}"
            assert it["finish_reason"] == greedy[it["id"]]["finish_reason"]
    rep = next(it for it in results["tree_ngram"]["items"] if it["id"] == "repeat")
    assert rep["steps"] < rep["new_tokens"], "prompt lookup accepted nothing on a prompt that repeats its input"
