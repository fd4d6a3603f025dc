"""data.prompts: the sources of self-distillation prompts. The Magpie source (the backbone's own user
turns) makes distinct, length-filtered prompts, some of them [user, assistant, user] conversations,
cached in rounds and reused; the mix keeps its weights in every prefix and is deterministic; a JSONL
file (the server's record_prompts= format) is a source; bad specs are one-line UserErrors; and no
training prompt of any source is a near copy of a held-out test question (vicuna80)."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from components.data.magpie import Magpie
from components.data.prompts import (HELD_OUT, PromptMix, held_out, mix_order, normalized, parse_sources,
                                     training_prompts, user_turns)
from components.data.self_distill import build_self_distill, data_dir, encode_prompt, prompt_mix
from pipeline.errors import UserError

# the tiny random model repeats itself and rarely ends a turn: short turns, kept unfinished, 1 word up
MAGPIE = dict(max_new_tokens=6, answer_tokens=4, min_words=1, max_words=6, multi_turn=0.5, batch_size=8,
              keep_unfinished=True)
VICUNA = HELD_OUT[0]


@pytest.fixture(scope="module")
def magpie_root(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def made(tiny_backbone, magpie_root):
    """Twelve Magpie prompts of the tiny model, and the source that made them."""
    source = Magpie(tiny_backbone, magpie_root, **MAGPIE)
    return source.prompts(12), source


@pytest.fixture
def traffic(tmp_path):
    """A user's prompts, as the server records them: a text, a conversation, a duplicate, a
    benchmark prompt's near copy (left out)."""
    path = tmp_path / "traffic.jsonl"
    rows = [{"prompt": "Tell me about the migration of arctic terns over the year."},
            {"messages": [{"role": "user", "content": "Plan a three day trip to Lisbon on a budget."},
                          {"role": "assistant", "content": "Day one: the old town."},
                          {"role": "user", "content": "Make day two about food."}]},
            {"prompt": "tell me about the migration of Arctic terns over the year"},
            {"prompt": "Define the word 'photosynthesis'."}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_magpie_prompts_are_distinct_filtered_and_some_multi_turn(made, tiny_backbone):
    prompts, source = made
    assert len(prompts) == 12
    assert len({normalized(p) for p in prompts}) == 12  # no duplicate
    for p in prompts:
        assert all(1 <= len(t.split()) <= 6 and t == t.strip() for t in user_turns(p))
    turns = [p for p in prompts if isinstance(p, list)]
    assert turns and any(isinstance(p, str) for p in prompts)
    for p in turns:
        assert [m["role"] for m in p] == ["user", "assistant", "user"]
        ids = encode_prompt(tiny_backbone.tokenizer, p)  # the whole conversation, ready for the answer
        assert tiny_backbone.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
        assert ids.count(tiny_backbone.tokenizer.convert_tokens_to_ids("<|im_start|>")) == 5  # system, 3 turns, answer


def test_magpie_rounds_are_reused_and_grow(made, tiny_backbone, magpie_root):
    prompts, source = made
    rounds = sorted(p.name for p in source.dir.glob("round-*.jsonl"))
    again = Magpie(tiny_backbone, magpie_root, **MAGPIE)
    assert again.dir == source.dir and again.prompts(12) == prompts  # read back, nothing made
    assert sorted(p.name for p in source.dir.glob("round-*.jsonl")) == rounds
    assert again.prompts(5) == prompts[:5]  # a smaller set is a prefix
    stricter = Magpie(tiny_backbone, magpie_root, **dict(MAGPIE, min_words=3))  # filters apply on read: same rounds
    assert stricter.dir == source.dir and stricter.describe() != source.describe()
    other = Magpie(tiny_backbone, magpie_root, **dict(MAGPIE, seed=1))
    assert other.dir != source.dir


def test_magpie_reads_rounds_through_its_filters(tiny_backbone, tmp_path):
    """Unfinished turns (null), too short or long ones, duplicates and benchmark paraphrases are left
    out; a follow-up that fails leaves its prompt single-turn."""
    source = Magpie(tiny_backbone, tmp_path, **dict(MAGPIE, keep_unfinished=False, min_words=2, max_words=8))
    source.dir.mkdir(parents=True)
    rows = [[None], ["Hi"], ["What is a good name for a cat?"], ["what is a GOOD name for a cat"],
            ["Define the word 'photosynthesis'."], ["Name a red fruit.", "An apple.", None],
            ["Name a blue bird.", "A jay.", "And a green one?"], [None, "x", "Never read."]]
    (source.dir / "round-000000.jsonl").write_text("".join(json.dumps({"turns": t}) + "\n" for t in rows))
    assert source.prompts(3) == ["What is a good name for a cat?", "Name a red fruit.", [
        {"role": "user", "content": "Name a blue bird."}, {"role": "assistant", "content": "A jay."},
        {"role": "user", "content": "And a green one?"}]]


def test_the_magpie_opening_is_the_template_up_to_the_user_turn(tiny_backbone, magpie_root):
    source = Magpie(tiny_backbone, magpie_root, **MAGPIE)
    tok = tiny_backbone.tokenizer
    first = tok.decode(source._opening([]))
    assert first.startswith("<|im_start|>system\n") and first.endswith("<|im_end|>\n<|im_start|>user\n")
    second = tok.decode(source._opening([{"role": "user", "content": "Hi there."},
                                         {"role": "assistant", "content": "Hello!"}]))
    assert second.endswith("Hi there.<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n")


def test_the_mix_keeps_its_weights_in_every_prefix_and_is_deterministic():
    order = mix_order([0.6, 0.3, 0.1], [None, None, None], 200)
    for n in (10, 50, 200):
        counts = Counter(s for s, _ in order[:n])
        for s, w in enumerate((0.6, 0.3, 0.1)):
            assert abs(counts[s] - w * n) <= 1
    assert mix_order([0.6, 0.3, 0.1], [None, None, None], 50) == order[:50]
    assert [j for s, j in order if s == 1] == list(range(sum(1 for s, _ in order if s == 1)))
    spent = mix_order([0.5, 0.5], [3, None], 10)  # a source that runs out leaves its share to the others
    assert sum(1 for s, _ in spent if s == 0) == 3 and len(spent) == 10
    with pytest.raises(UserError, match="hold 4 prompts"):
        mix_order([0.5, 0.5], [3, 1], 5)


def test_a_mix_of_magpie_templates_and_a_file(made, tiny_backbone, magpie_root, traffic):
    prompts, _ = made
    spec = ["magpie:0.5", "templates:0.3", f"{traffic}:0.2"]
    mix = prompt_mix(tiny_backbone, spec, 0, magpie_root, MAGPIE)
    got = mix.take(10)
    assert got == prompt_mix(tiny_backbone, spec, 0, magpie_root, MAGPIE).take(10)  # deterministic
    assert got[:5] == mix.take(5)  # a prefix: the set grows
    magpie, file = [p for p in got if p in prompts], [p for p in got if normalized(p) in (
        normalized("Tell me about the migration of arctic terns over the year."), "plan a three day trip to lisbon "
        "on a budget make day two about food")]
    assert len(magpie) == 5 and magpie == prompts[:5] and len(file) == 2
    assert [p for p in got if p not in magpie and p not in file] == training_prompts(3)
    described = mix.describe()
    assert [d["source"] for d in described] == ["magpie", "templates", "file"] and described[2]["sha1"]
    assert prompt_mix(tiny_backbone, None).describe() is None  # the pool alone: the sets made so far keep their key


def test_a_file_source_filters_and_trains(tiny_backbone, traffic, tmp_path):
    mix = prompt_mix(tiny_backbone, str(traffic), seed=0)
    got = mix.take(2)  # the duplicate and the benchmark paraphrase are left out
    assert sorted(map(type, got), key=str) == [list, str]
    with pytest.raises(UserError, match="hold 2 prompts"):
        mix.take(3)
    root = tmp_path / "data"
    ds = build_self_distill(tiny_backbone, max_samples=2, max_new_tokens=4, batch_size=2, save_every=1,
                            root=str(root), prompts=[{"source": "file", "path": str(traffic)}])
    assert ds.samples == 2
    (made,) = [p for p in root.iterdir() if p.name.startswith("self_distill-")]
    config = json.loads((made / "config.json").read_text())
    assert config["prompts"][0]["source"] == "file"
    assert made != data_dir(root, {k: v for k, v in config.items() if k != "prompts"})  # another mix, another set


@pytest.mark.parametrize("spec, match", [
    (["nonsense"], "unknown source 'nonsense'"),
    (["missing.jsonl"], "no file missing.jsonl"),
    (["magpie:-1"], "must be a positive number"),
    ([{"source": "magpie", "weight": "lots"}], "must be a positive number"),
    ([{"source": "magpie", "oops": 1}], "needs `source`"),
    (["templates", "templates:2"], "listed twice"),
    ([{"source": "templates", "path": "x.jsonl"}], "takes no path"),
])
def test_bad_sources_are_one_line_user_errors(spec, match):
    with pytest.raises(UserError, match=match) as e:
        parse_sources(spec)
    assert "\n" not in str(e.value)


def test_the_syntaxes_agree(traffic):
    assert parse_sources(None) == parse_sources([]) == parse_sources("templates") == parse_sources(["templates:1"])
    assert parse_sources(["magpie:0.6", f"{traffic}:0.4"]) == parse_sources(
        [{"source": "magpie", "weight": 0.6}, {"source": "file", "path": str(traffic), "weight": 0.4}])


@pytest.mark.skipif(not VICUNA.is_file(), reason="../shared/eval/vicuna80.jsonl is absent")
def test_no_training_prompt_is_a_near_copy_of_a_vicuna80_question(made, tiny_backbone, magpie_root, tmp_path):
    """vicuna80 is a test set: whatever the source, no training prompt may be `similar` to one of its
    questions (the trigram test the benchmark prompts get)."""
    questions = [json.loads(line)["prompt"] for line in VICUNA.read_text().splitlines() if line.strip()]
    assert all(held_out(q) for q in questions)
    pool = training_prompts(5000)
    assert not any(held_out(p) for p in pool)
    traffic = tmp_path / "traffic.jsonl"  # a user's file with vicuna questions in it: left out
    traffic.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in questions[:5] + pool[-3:]))
    mixed = prompt_mix(tiny_backbone, ["magpie", "templates", str(traffic)], 0, magpie_root, MAGPIE).take(12)
    assert not any(held_out(t) for p in made[0] + mixed for t in user_turns(p))
    assert not set(questions) & {t for p in mixed for t in user_turns(p)}


def test_a_mix_needs_its_magpie_source():
    with pytest.raises(ValueError, match="needs `magpie`"):
        PromptMix(parse_sources("magpie"))


def test_prompts_alone_are_written_as_a_prompt_file(made, tiny_backbone, magpie_root, tmp_path):
    """data.only=prompts writes the prompts it made as prompts.jsonl in the run directory: a file
    data.prompts (and the bench's input) reads back as the same prompts."""
    from components.data.datamodule import DistillDataModule
    prompts, _ = made
    data = DistillDataModule(tiny_backbone, num_heads=1, max_samples=6, root=str(magpie_root), only="prompts",
                             prompts=["magpie"], magpie=MAGPIE)
    info = data.make(tmp_path)
    assert info["prompts"] == 6 and info["prompts_file"] == str(tmp_path / "prompts.jsonl")
    lines = [json.loads(x) for x in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert [r.get("messages") or r["prompt"] for r in lines] == prompts[:6]
    assert sum("messages" in r for r in lines) == sum(isinstance(p, list) for p in prompts[:6])


def test_split_prompts_keeps_a_held_out_slice_apart(tmp_path):
    """scripts/split_prompts.py: the last single-turn prompts held out (with ids, for the bench), every
    other line kept for training, none in both."""
    import importlib.util
    from helpers import REPO_ROOT
    spec = importlib.util.spec_from_file_location("split_prompts", REPO_ROOT / "scripts" / "split_prompts.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = [{"prompt": f"question {i}"} for i in range(5)] + [{"messages": [{"role": "user", "content": "last"}]}]
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert mod.main([str(src), str(tmp_path / "t.jsonl"), str(tmp_path / "h.jsonl"), "2"]) == 0
    held = [json.loads(x) for x in (tmp_path / "h.jsonl").read_text().splitlines()]
    train = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert held == [{"id": "h-0", "prompt": "question 3"}, {"id": "h-1", "prompt": "question 4"}]
    assert train == rows[:3] + rows[5:]
    assert mod.main([str(src), str(tmp_path / "t.jsonl"), str(tmp_path / "h.jsonl"), "9"]) == 2  # too few
