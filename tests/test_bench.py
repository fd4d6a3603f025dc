"""The benchmark (`python -m pipeline.bench`) and its Hugging Face peers, on model=tiny: the inverse
weight conversion round-trips, hf_greedy equals our greedy token for token (one at a time and
batched, left-padded), and a real bench run writes the contract's bench.json and table."""
from __future__ import annotations

import json
import subprocess

import pytest
import torch

from components.model.load import convert_hf_state_dict
from pipeline.bench import bench, markdown_table
from pipeline.build import build_engine, component
from pipeline.core import UserError
from pipeline.hf_peer import HFPeer, to_hf, to_hf_state_dict
from pipeline.requests import Request, encode

from helpers import PYTHON, REPO_ROOT, compose_config

PROMPTS = ["hi", "Write a poem about the sea, the sea and the sea.", "Count: 1 2 3 4 5 6 7 8 9"]


def test_inverse_conversion_round_trips(tiny_backbone):
    model = tiny_backbone.model
    back = convert_hf_state_dict(to_hf_state_dict(model), model.args)
    ours = model.state_dict()
    assert back.keys() == ours.keys()
    for k, v in ours.items():
        assert torch.equal(back[k], v), k


def test_hf_greedy_equals_our_greedy(tiny_backbone):
    engine, bb = build_engine(compose_config(["model=tiny", "max_new_tokens=16"]), tiny_backbone)
    peer = HFPeer(to_hf(bb), bb.eos_ids, 16)
    for text in PROMPTS:
        ids = encode(bb.tokenizer, Request("r", text), chat=True)
        ours, theirs = engine.generate(ids), peer.generate(ids)
        assert theirs.token_ids == ours.token_ids
        assert theirs.finish_reason == ours.finish_reason
        assert sum(theirs.accepted_lengths) == len(theirs.token_ids) == theirs.steps  # one token a forward


BATCH_PROMPTS = PROMPTS + ["What is the capital city of France, please?",
                           "Summarize: the quick brown fox jumps over the lazy dog."]


def test_batched_hf_greedy_equals_our_greedy():
    """batch_size=3 over 5 prompts of different lengths: groups [0, 1, 2] and [3, 4], left-padded in
    one `generate` call each, give the tokens of our greedy engine one request at a time. The tiny
    model with untied embeddings: with tied ones it repeats its last prompt token whatever the
    context, so a peer attending to its pads would pass too."""
    cfg = compose_config(["model=tiny", "+model.tie_embeddings=false", "max_new_tokens=12"])
    engine, bb = build_engine(cfg, component(cfg.model))
    prompts = [encode(bb.tokenizer, Request(f"r{i}", t), chat=True) for i, t in enumerate(BATCH_PROMPTS)]
    assert len({len(p) for p in prompts}) == len(prompts)  # every group is padded
    ours = engine.run(prompts)
    assert all(len(set(g.token_ids)) > 6 for g in ours)  # the tokens depend on the context
    hf = to_hf(bb)
    peer = HFPeer(hf, bb.eos_ids, 12, batch_size=3)
    theirs = peer.run(prompts, list(range(len(prompts))))
    assert [g.token_ids for g in theirs] == [g.token_ids for g in ours]
    assert [g.finish_reason for g in theirs] == [g.finish_reason for g in ours]
    for g in theirs:
        assert g.accepted_lengths == [1] * len(g.token_ids)  # the prefill, then one token a forward
        assert len(g.step_ms) == len(g.token_ids) - 1 and g.prefill_ms > 0
    assert theirs[0].wall_s == theirs[2].wall_s != theirs[3].wall_s  # a group shares its wall time
    assert peer.generate(prompts[1]).token_ids == ours[1].token_ids  # one prompt still works

    # a request stopping early is cut at its EOS (inclusive); the rest of its group runs on
    stop = ours[1].token_ids[4]
    cut = HFPeer(hf, [*bb.eos_ids, stop], 12, batch_size=3).run(prompts)
    for g, o in zip(cut, ours):
        n = o.token_ids.index(stop) + 1 if stop in o.token_ids else len(o.token_ids)
        assert g.token_ids == o.token_ids[:n]
        assert g.finish_reason == ("eos" if n < len(o.token_ids) or o.token_ids[-1] == stop else "length")
    assert cut[1].finish_reason == "eos" and len(cut[1].token_ids) == 5 and len(cut[0].token_ids) == 12


def test_prompt_lookup_peer_refuses_batches(tiny_backbone):
    hf = to_hf(tiny_backbone)
    with pytest.raises(UserError, match="prompt lookup decodes one request at a time") as e:
        HFPeer(hf, tiny_backbone.eos_ids, 4, batch_size=2, prompt_lookup_num_tokens=10)
    assert "\n" not in str(e.value)
    HFPeer(hf, tiny_backbone.eos_ids, 4, batch_size=1, prompt_lookup_num_tokens=10)


def write_requests(path, n=2):
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS[:n])))
    return path


def test_bench_cli_writes_bench_json(tmp_path):
    inp = write_requests(tmp_path / "req.jsonl")
    out = tmp_path / "run"
    proc = subprocess.run([PYTHON, "-m", "pipeline.bench", "decodes=[greedy,sample,hf_greedy]", "model=tiny",
                           f"input={inp}", "max_new_tokens=4", "repeats=2", f"hydra.run.dir={out}"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    res = json.loads((out / "bench.json").read_text())
    assert res["baseline"] == "greedy" and res["repeats"] == 2 and res["requests"] == 2
    assert list(res["pipelines"]) == ["greedy", "sample", "hf_greedy"]
    assert {"torch_threads", "cpu_count"} <= res["machine"].keys() and res["command"].startswith("python -m")
    for p in res["pipelines"].values():
        assert len(p["wall_s"]) == 2 and p["tokens_per_s"] > 0
        assert [r["id"] for r in p["per_request"]] == ["q0", "q1"]
        assert {"mean_step_ms", "tree_step_ms", "plain_step_ms", "acceptance_by_depth"} <= p.keys()
    g, hf = res["pipelines"]["greedy"], res["pipelines"]["hf_greedy"]
    assert g["speedup"] == 1.0 and g["identical_to_baseline"] and g["mean_accepted_length"] == 1.0
    assert hf["identical_to_baseline"] and hf["mean_accepted_length"] == 1.0
    assert "| pipeline | batch | tokens/s | speedup | mean accepted length | identical |" in proc.stdout
    assert "| hf_greedy | 1 |" in proc.stdout


def test_tree_steps_split_into_draft_verify_and_rest():
    """bench.json's tree_step_split_ms: a tree step's mean time drafting, verifying and the rest, over
    tree steps only, and only where the items split their steps (ours, not the peers')."""
    from pipeline.metrics import step_latency
    ours = {"step_ms": [10.0, 4.0, 12.0], "step_nodes": [5, 1, 3], "step_draft_ms": [3.0, 0.0, 1.0],
            "step_verify_ms": [6.0, 3.5, 8.0]}
    s = step_latency([ours, {"step_ms": [9.0], "step_nodes": [1]}])
    assert (s["tree_step_ms"], s["tree_draft_ms"], s["tree_verify_ms"], s["tree_rest_ms"]) == (11.0, 2.0, 7.0, 2.0)
    assert "tree_draft_ms" not in step_latency([{"step_ms": [9.0], "step_nodes": [4]}])


@pytest.mark.parametrize("decodes, message", [
    ("decodes=[greedy,nope]", "unknown decode 'nope' in decodes; known: beam, greedy"),
    ("decode=greedy", "not decode="),
])
def test_bench_bad_input_is_one_line(decodes, message, tmp_path):
    proc = subprocess.run([PYTHON, "-m", "pipeline.bench", decodes, "model=tiny", f"hydra.run.dir={tmp_path}"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and message in proc.stderr
    assert "hf_greedy" in proc.stderr or "decodes=" in proc.stderr


def test_bench_in_process_with_entry_overrides(tmp_path, monkeypatch):
    """Called from Python (no Hydra app): entries carry their own overrides, the model is shared."""
    monkeypatch.chdir(tmp_path)  # outside Hydra, bench.json goes to the working directory
    overrides = ["model=tiny", 'decodes=[greedy,"greedy seed=1","hf_beam num_beams=2"]',
                 "prompt=hi", "max_new_tokens=3", "repeats=1"]
    cfg = compose_config(overrides, config_name="bench")
    res, objs = bench(cfg, overrides)
    assert list(res["pipelines"]) == ["greedy", "greedy seed=1", "hf_beam num_beams=2"]
    assert len(objs["backbones"]) == 1  # one model config, loaded once
    assert res["pipelines"]["greedy seed=1"]["identical_to_baseline"]  # greedy ignores the seed
    assert objs["pipelines"][2].runner.num_beams == 2
    written = json.loads((tmp_path / "bench.json").read_text())
    assert res["bench_path"] == str(tmp_path / "bench.json")
    assert written == {k: v for k, v in res.items() if k != "bench_path"}  # bench.json is what bench() returns
    assert markdown_table(res).count("\n") == 4


def test_bench_batched(tmp_path):
    """batch_size=2 reaches every pipeline, the HF peer included; our engine reports its KV memory."""
    inp = write_requests(tmp_path / "req.jsonl", n=3)
    overrides = ["model=tiny", "decodes=[greedy,hf_greedy]", f"input={inp}", "max_new_tokens=4", "repeats=1",
                 "batch_size=2"]
    res, objs = bench(compose_config(overrides, config_name="bench", output_dir=tmp_path), overrides)
    saved = json.loads((tmp_path / "bench.json").read_text())
    g, hf = saved["pipelines"]["greedy"], saved["pipelines"]["hf_greedy"]
    assert g["batch_size"] == hf["batch_size"] == 2
    assert [p.runner.batch_size for p in objs["pipelines"]] == [2, 2]
    assert {"bytes_in_use", "peak_bytes"} <= g["kv"].keys() and g["kv"]["peak_bytes"] > 0
    assert g["kv"]["bytes_in_use"] == 0  # every sequence went back to the pool
    assert "kv" not in hf
    assert [r["id"] for r in hf["per_request"]] == ["q0", "q1", "q2"]
    assert hf["identical_to_baseline"] and hf["new_tokens"] == g["new_tokens"]
    assert "| greedy | 2 |" in markdown_table(res)
