"""Constrained decoding. The seed's FSM toy on a scripted model through the real engine; packed
allowed sets; the empty-set error and incomplete outputs; multi-byte text; special tokens; start-up
refusal of invalid regexes / schemas / grammars; composition with batching, sampling, tree
speculation (greedy: equal to constrained greedy; exact sampling: the masked distribution); and, on
the real model, constrained tree speculation equal to constrained greedy and JSON outputs that
validate."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from components.constraint.fsm import FSM
from components.constraint.grammar import EBNF, JSONSchema, Regex
from components.sampler.logits import Sampler
from components.verifier.exact import ExactVerifier
from components.verifier.greedy import GreedyVerifier
from pipeline.core import Engine, Tree, UserError
from pipeline.core.bits import allows, pack, tokens_of, unpack, words
from pipeline.core.constrain import walk_tree

from helpers import chi_square_p, compose_config, subprocess_env
from toy import PerSequence, ScriptedModel

A, B, C, D, EOS, BOS = range(6)  # the toy vocabulary
TOY = {"transitions": {0: {A: 1}, 1: {B: 2, C: 2}}, "start": 0, "accept": [2]}  # A (B|C) EOS


def toy_script(ctx):
    """The raw argmax is illegal at every step of A (B|C) EOS: D first, then A, then D; among the
    legal tokens A, then C, then EOS score highest."""
    last = ctx[-1]
    if last == BOS:
        return [2.0, 0.0, 0.0, 3.0, 1.0, -9.0]  # D > A
    if last == A:
        return [3.0, 1.0, 2.0, 0.0, 0.0, -9.0]  # A > C > B
    return [1.0, 0.0, 2.0, 3.0, 0.5, -9.0]  # after C: D > C > A > EOS


def toy_engine(proposer=None, verifier=None, sampler=None, constraint="toy", max_new_tokens=8, script=toy_script,
               vocab=6, batch_size=1):
    model = ScriptedModel(script, vocab, eos_ids=[EOS])
    fsm = FSM(vocab_size=vocab, eos_ids=[EOS], **TOY) if constraint == "toy" else constraint
    return Engine(model, model.kv(), sampler or Sampler(do_sample=False), [EOS], max_new_tokens, proposer=proposer,
                  verifier=verifier, constraint=fsm, batch_size=batch_size)


# --- the seed's toy -------------------------------------------------------------------------------
def test_seed_fsm_toy_masked_greedy_gives_a_c_eos():
    fsm = FSM(vocab_size=6, eos_ids=[EOS], **TOY)
    state, ctx = fsm.start(), [BOS]
    for expected in (A, C):  # the raw argmax is illegal at each step
        bits = torch.zeros(words(6), dtype=torch.int32)
        state.fill(bits)
        raw = int(torch.tensor(toy_script(tuple(ctx))).argmax())
        assert not allows(bits, raw)
        state.advance(expected)
        ctx.append(expected)
    assert state.is_complete() and state.can_end()
    assert toy_engine(constraint=None).generate([BOS]).token_ids[:3] == [D, D, D]  # unconstrained: illegal
    g = toy_engine().generate([BOS])
    assert g.token_ids == [A, C, EOS]
    assert g.finish_reason == "constraint_complete" and g.constraint_complete is True
    assert g.steps == 2  # EOS was the only token allowed: appended without a third forward


class ScriptedDrafts(PerSequence):
    """Fixed trees: every draft the toy language allows and several it does not."""

    def draft(self, state):
        t = state.tokens[-1]  # A, chosen at prefill: B or C may follow, then EOS
        return Tree.from_parents([t, D, C, B, A, EOS], [-1, 0, 0, 0, 2, 2])


def test_tree_pruning_keeps_constrained_greedy_and_counts_what_it_drops():
    g = toy_engine(ScriptedDrafts(), GreedyVerifier()).generate([BOS])
    assert g.token_ids == [A, C, EOS] and g.finish_reason == "constraint_complete"
    assert g.accepted_lengths == [1, 2]  # prefill: A; one tree step: C accepted, EOS the only continuation
    assert g.pruned_drafts == 2  # D after A, A after C


def test_walk_tree_prunes_subtrees_and_gives_each_node_its_own_mask():
    fsm = FSM(vocab_size=6, eos_ids=[EOS], **TOY)
    state = fsm.start()
    tree = Tree.from_parents([BOS, D, A, C, B, EOS, D, A], [-1, 0, 0, 2, 2, 3, 3, 1])
    kept, bits, pruned = walk_tree(state, tree, {EOS}, 6)
    assert kept.tokens.tolist() == [BOS, A, C, B, EOS]  # D and its child A go, D under C goes
    assert pruned == 3
    assert [tokens_of(b, 6) for b in bits[:4]] == [[A], [B, C], [EOS], [EOS]]
    assert state.path == [0]  # the walk leaves the state where it found it


def test_empty_allowed_set_is_a_one_line_error_naming_state_and_text():
    dead = FSM(vocab_size=6, eos_ids=[EOS], transitions={0: {A: 1}}, start=0, accept=[2])  # state 1: nothing
    with pytest.raises(UserError) as e:
        toy_engine(constraint=dead).generate([BOS])
    msg = str(e.value)
    assert "no token is allowed" in msg and "FSM state 1" in msg and "request 0" in msg and "\n" not in msg


def test_pack_and_unpack_roundtrip():
    g = torch.Generator().manual_seed(0)
    for v in (6, 31, 32, 33, 49152, 49155):
        allowed = torch.rand(3, v, generator=g) < 0.3
        allowed[1, v // 2] = True
        bits = pack(allowed)
        assert bits.shape == (3, words(v)) and bits.dtype == torch.int32
        assert torch.equal(unpack(bits, v), allowed)
        t = int(allowed[1].nonzero()[0])
        assert allows(bits[1], t)


# --- exact speculative sampling: p is the masked distribution ---------------------------------------
V5 = 5  # A B C D EOS, random logits per context


def random_script(ctx):
    g = torch.Generator().manual_seed(hash(ctx) % (2 ** 31))
    return (torch.randn(V5, generator=g) * 1.5).tolist()


LOOSE = {"transitions": {0: {A: 1, B: 1, C: 0}, 1: {A: 0, C: 1, D: 2}, 2: {B: 2, A: 1}}, "start": 0, "accept": [0, 2]}


class MixedDrafts(PerSequence):
    """Deterministic drafts, half of them outside the language, or sampled ones (i.i.d. from a fixed
    q that puts mass on illegal tokens) with q on the tree."""
    Q = torch.tensor([0.3, 0.1, 0.2, 0.3, 0.1])

    def __init__(self, sampled: bool):
        self.sampled = sampled

    def draft(self, state):
        t = state.tokens[-1]
        if not self.sampled:
            return Tree.from_parents([t, D, A, C, B], [-1, 0, 0, 2, 2])
        a, b = torch.multinomial(self.Q, 2, replacement=True, generator=state.generator).tolist()
        c = int(torch.multinomial(self.Q, 1, generator=state.generator))
        tree = Tree.from_parents([t, a, b, c], [-1, 0, 0, 1])
        tree.q = self.Q.repeat(4, 1)
        return tree


def masked_truth(n: int, temperature: float) -> dict[tuple, float]:
    fsm = FSM(vocab_size=V5, eos_ids=[EOS], **LOOSE)
    out = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for seq, prob in out.items():
            if seq and seq[-1] == EOS:
                nxt[seq] = prob
                continue
            state = fsm.start()
            for t in seq:
                state.advance(t)
            allowed = unpack(fsm.bits[state.path[-1]], V5)
            logits = torch.tensor(random_script((BOS, *seq))) / temperature
            p = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
            for t in p.nonzero().flatten().tolist():
                nxt[seq + (t,)] = prob * float(p[t])
        out = nxt
    return out


@pytest.mark.parametrize("sampled", [False, True])
def test_exact_speculative_sampling_keeps_the_masked_distribution(sampled):
    """3,000 constrained requests with drafts partly outside the language, verified by
    verifier=exact: the first three tokens follow plain masked sampling (chi-square)."""
    fsm = FSM(vocab_size=V5, eos_ids=[EOS], **LOOSE)
    eng = toy_engine(MixedDrafts(sampled), ExactVerifier(), Sampler(do_sample=True, temperature=1.2), fsm,
                     max_new_tokens=3, script=random_script, vocab=V5, batch_size=64)
    gens = eng.run([[BOS]] * 3000)
    counts = Counter(tuple(g.token_ids[:3]) for g in gens)
    truth = masked_truth(3, 1.2)
    assert sum(g.pruned_drafts for g in gens) > 0
    assert sum(len(g.token_ids) - g.steps for g in gens) > 100, "drafts should be accepted sometimes"
    assert chi_square_p(counts, truth) > 1e-3, (counts, truth)


# --- XGrammar constraints on the tiny model (random weights, the real tokenizer) ---------------------
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                             "city": {"type": "string", "maxLength": 6},
                                             "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                                      "maxItems": 2}},
          "required": ["name", "city"]}


def test_random_model_samples_valid_multibyte_json_and_never_special_tokens(tiny_backbone):
    """A random model sampling under a JSON schema draws from every part of the vocabulary,
    including byte tokens that split multi-byte UTF-8 characters: every finished output is valid
    UTF-8 JSON that validates, and no special token other than EOS ever appears."""
    import jsonschema
    bb = tiny_backbone
    grammar = JSONSchema(bb, schema=json.dumps(PERSON))
    eng = Engine(bb.model, _kv(bb), Sampler(do_sample=True, temperature=1.0), bb.eos_ids, 160, constraint=grammar,
                 batch_size=8, seed=1)
    prompt = bb.tokenizer.encode("Person:", add_special_tokens=False)
    gens = eng.run([prompt] * 16)
    special = set(bb.tokenizer.added_tokens_decoder) - set(bb.eos_ids)
    done = [g for g in gens if g.constraint_complete]
    assert len(done) >= 4
    non_ascii = 0
    for g in gens:
        assert not special & set(g.token_ids)
        assert g.constraint_complete == (g.finish_reason == "constraint_complete") or g.finish_reason == "length"
    for g in done:
        text = bytes(_token_bytes(bb.tokenizer, g.token_ids)).decode("utf-8")  # strict: raises on broken UTF-8
        jsonschema.validate(json.loads(text), PERSON)
        non_ascii += any(ord(ch) > 127 for ch in text)
    assert non_ascii >= 1


def _token_bytes(tok, ids):
    """The raw bytes of byte-level BPE tokens (the decoder's replacement characters would hide a split
    character)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    dec = {v: k for k, v in bytes_to_unicode().items()}
    out = []
    for t in ids:
        if t in tok.added_tokens_decoder:
            continue
        out += [dec[ch] for ch in tok.convert_ids_to_tokens(t)]
    return out


def _kv(bb):
    from components.kv.contiguous import ContiguousKV
    return ContiguousKV(bb)


def test_a_grammar_that_cannot_finish_ends_at_length_and_says_so(tmp_path, tiny_backbone, capsys):
    from pipeline.decode import decode
    cfg = compose_config(["model=tiny", "constraint=regex", "max_new_tokens=6", "stream=false"],
                         prompt="count", output_dir=tmp_path)
    cfg.constraint.pattern = "a{40}"
    decode(cfg, tiny_backbone)
    item = json.loads((tmp_path / "results.json").read_text())["items"][0]
    assert item["finish_reason"] == "length" and item["constraint_complete"] is False
    assert set(item["text"]) == {"a"} and len(item["text"]) < 40 and item["new_tokens"] == 6
    assert "the output is incomplete" in capsys.readouterr().err


def test_batches_mix_constraints_and_equal_batch_one(tmp_path, tiny_backbone):
    """Requests with their own regex, schema, grammar, and none, decoded greedily and by sampling at
    batch 1 and batch 3: the same tokens, and every complete output in its language."""
    from pipeline.decode import decode
    lines = [{"id": "re", "prompt": "a date", "regex": "20[0-9]{2}-(0[1-9]|1[0-2])"},
             {"id": "js", "prompt": "a person", "json_schema": PERSON},
             {"id": "cfg", "prompt": "yes or no", "grammar": 'root ::= ("yes" | "no") " please"'},
             {"id": "free", "prompt": "anything"}]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(json.dumps(x) for x in lines))
    for decode_name in ("greedy", "sample"):
        runs = []
        for batch in (1, 3):
            out = tmp_path / f"{decode_name}-{batch}"
            cfg = compose_config(["model=tiny", f"decode={decode_name}", f"batch_size={batch}", "max_new_tokens=48",
                                  "stream=false"], input=str(inp), output_dir=out)
            decode(cfg, tiny_backbone)
            runs.append({it["id"]: it for it in json.loads((out / "results.json").read_text())["items"]})
        assert {k: v["token_ids"] for k, v in runs[0].items()} == {k: v["token_ids"] for k, v in runs[1].items()}
        items = runs[1]
        assert "constraint" not in items["free"]
        assert items["re"]["constraint"] == "regex" and items["cfg"]["constraint"] == "ebnf"
        if items["re"]["constraint_complete"]:
            assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])", items["re"]["text"])
        if items["cfg"]["constraint_complete"]:
            assert items["cfg"]["text"] in ("yes please", "no please")
        if items["js"]["constraint_complete"]:
            json.loads(items["js"]["text"])


@pytest.mark.parametrize("override,needle", [
    (["constraint=regex", "constraint.pattern=a(b"], "invalid regex"),
    (["constraint=json_schema", 'constraint.schema={"type": "frobnicate"}'], "invalid json_schema"),
    (["constraint=ebnf", 'constraint.grammar=root ::= "a" missing'], "invalid grammar"),
    (["constraint=json_schema"], "needs a schema"),
])
def test_invalid_constraints_fail_before_the_model_loads(override, needle, tmp_path, monkeypatch):
    from pipeline.decode import decode

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the constraint was checked")
    monkeypatch.setattr("components.model.load.from_pretrained", no_model)
    monkeypatch.setattr("components.model.load.tiny", no_model)
    cfg = compose_config([o for o in override if "=" in o and not o.startswith("constraint.")], prompt="x",
                         output_dir=tmp_path)
    for o in override:
        if o.startswith("constraint."):
            k, _, v = o.partition("=")
            cfg.constraint[k.split(".", 1)[1]] = v
    with pytest.raises(UserError, match=needle):
        decode(cfg)


def test_invalid_request_constraint_fails_before_the_model_loads(tmp_path, monkeypatch):
    from pipeline.decode import decode
    monkeypatch.setattr("components.model.load.from_pretrained", lambda *a, **k: 1 / 0)
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": "ok", "prompt": "x", "regex": "[0-9]+"}) + "\n" +
                   json.dumps({"id": "bad", "prompt": "x", "json_schema": {"type": "object", "minProperties": "x"}}))
    cfg = compose_config([], input=str(inp), output_dir=tmp_path)
    with pytest.raises(UserError, match="request bad: invalid json_schema"):
        decode(cfg)


def test_cli_invalid_regex_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pipeline", "model=tiny", "constraint=regex", "constraint.pattern=[0-9",
                        "prompt=x", f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent,
                       env=subprocess_env(), timeout=300)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "invalid regex" in lines[0], r.stderr


def test_fsm_from_config_uses_token_strings(tiny_backbone):
    cfg = compose_config(["model=tiny", "constraint=fsm", "max_new_tokens=5"])
    from pipeline.build import build_engine
    eng = build_engine(cfg, tiny_backbone)[0]
    g = eng.generate(tiny_backbone.tokenizer.encode("Is it?", add_special_tokens=False))
    text = tiny_backbone.tokenizer.decode(g.token_ids, skip_special_tokens=True)
    assert text in ("Yes", "No") and g.finish_reason == "constraint_complete"
    with pytest.raises(UserError, match="not one"):
        FSM(tiny_backbone, transitions={0: {"Supercalifragilistic": 1}}, accept=[1])


def test_add_to_prompt_puts_the_schema_in_the_prompt(tmp_path, tiny_backbone, monkeypatch):
    from pipeline.decode import decode
    cfg = compose_config(["model=tiny", "constraint=json_schema", "constraint.add_to_prompt=true", "max_new_tokens=4",
                          "stream=false"], prompt="a person", output_dir=tmp_path)
    cfg.constraint.schema = json.dumps(PERSON)
    seen = []
    run = Engine.run

    def spy(self, prompts, *a, **k):
        seen.extend(prompts)
        return run(self, prompts, *a, **k)
    monkeypatch.setattr(Engine, "run", spy)  # decode(cfg) builds its own engine: the prompts it is given
    decode(cfg, tiny_backbone)
    assert any('"tags"' in tiny_backbone.tokenizer.decode(p) for p in seen)


# --- the real model ----------------------------------------------------------------------------------
JSON_REQUESTS = [
    ("Give me a person record for Zoë Müller, 34, who lives in 東京.",
     {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                       "city": {"type": "string"}}, "required": ["name", "age", "city"]}),
    ("List three fruits.", {"type": "object", "properties": {"fruits": {"type": "array", "items": {"type": "string"},
                                                                        "minItems": 3, "maxItems": 3}},
                            "required": ["fruits"]}),
    ("Describe a book: title, author, year, and whether it is fiction.",
     {"type": "object", "properties": {"title": {"type": "string"}, "author": {"type": "string"},
                                       "year": {"type": "integer"}, "fiction": {"type": "boolean"}},
      "required": ["title", "author", "year", "fiction"]}),
    ("Weather in Paris today as JSON.",
     {"type": "object", "properties": {"city": {"type": "string"}, "celsius": {"type": "number"},
                                       "sky": {"enum": ["sunny", "cloudy", "rain"]}},
      "required": ["city", "celsius", "sky"]}),
]


@pytest.mark.slow
@pytest.mark.parametrize("preset,extra", [("tree_medusa", ["proposer.nodes=12"]), ("tree_ngram", [])])
def test_constrained_tree_speculation_equals_constrained_greedy_on_the_real_model(real_backbone, preset, extra):
    """float32, JSON-schema requests: every tree preset gives constrained greedy's tokens, and the
    outputs parse and validate."""
    import jsonschema
    from pipeline.build import build_engine
    from pipeline.core import encode_chat
    bb = real_backbone
    prompts = [encode_chat(bb.tokenizer, None, p, True, None) for p, _ in JSON_REQUESTS]
    grammars = [JSONSchema(bb, schema=json.dumps(s)) for _, s in JSON_REQUESTS]
    plain = build_engine(compose_config(["model.dtype=float32", "max_new_tokens=80", "batch_size=2"]), bb)[0]
    ref = plain.run(prompts, grammars=grammars)
    spec = build_engine(compose_config(["model.dtype=float32", f"decode={preset}", "max_new_tokens=80", *extra]), bb)[0]
    got = spec.run(prompts, grammars=grammars)
    assert [g.token_ids for g in got] == [g.token_ids for g in ref]
    assert sum(g.steps for g in got) < sum(g.steps for g in ref)
    for g, (_, schema) in zip(ref, JSON_REQUESTS):
        assert g.finish_reason == "constraint_complete"
        jsonschema.validate(json.loads(bb.tokenizer.decode(g.token_ids, skip_special_tokens=True)), schema)


@pytest.mark.slow
def test_multibyte_literals_through_regex_and_grammar_on_the_real_model(real_backbone):
    """Accented, CJK and emoji literals, which the tokenizer splits into byte tokens, come out whole."""
    from pipeline.core import encode_chat
    bb = real_backbone
    eng = Engine(bb.model, _kv(bb), Sampler(do_sample=False), bb.eos_ids, 24)
    prompt = encode_chat(bb.tokenizer, None, "Name a place and a word.", True, None)
    for grammar, pattern in ((Regex(bb, pattern="(café|東京|🙂) [a-z]+"), r"(café|東京|🙂) [a-z]+"),
                             (EBNF(bb, grammar='root ::= ("naïve" | "日本語" | "🚀🌍") "!"'), r"(naïve|日本語|🚀🌍)!")):
        g = eng.generate(prompt, grammar=grammar)
        text = bb.tokenizer.decode(g.token_ids, skip_special_tokens=True)
        if g.constraint_complete:
            assert re.fullmatch(pattern, text), text
        else:
            assert re.match(pattern.split(" ")[0], text), text


@pytest.mark.slow
def test_jsonschemabench_sample_outputs_all_validate(tmp_path):
    """JSONSchemaBench (tests/data/jsonschemabench: the first two schemas of every category), through
    scripts/jsonschemabench.py at the default precision: every schema compiles or is refused with a one-line reason,
    and every output generated under one that compiled ends complete, parses and validates."""
    data = Path(__file__).resolve().parent / "data" / "jsonschemabench"  # two per category, copied
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import jsonschemabench
    result = jsonschemabench.run(data, tmp_path, max_new_tokens=384, batch_size=6)
    rows = result["rows"]
    assert len(rows) == 18
    for r in rows:
        assert r["compiled"] or (r["refused"] and "\n" not in r["refused"])
    generated = [r for r in rows if r.get("generated")]
    assert len(generated) >= 12
    bad = [(r["category"], r["schema"], r["finish_reason"], r["error"]) for r in generated if not r["valid"]]
    assert not bad
    assert (tmp_path / "coverage.md").read_text().startswith("| category |")
