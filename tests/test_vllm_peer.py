"""The `vllm` benchmark peer (pipeline/vllm_peer.py): its entry and options, the skip line when
.venv-vllm is absent, and the subprocess protocol against a fake worker that speaks it (this
interpreter, no vLLM). With the real .venv-vllm present, a slow test decodes through vLLM itself."""
from __future__ import annotations

import json
import sys
import textwrap

import pytest

from pipeline import vllm_peer
from pipeline.bench import bench, parse_entries, vllm_speculation
from pipeline.core import UserError

from helpers import REPO_ROOT, compose_config

# Answers every request with its prompt's last three tokens, reversed, then the first stop id, within
# max_new_tokens; one step per token. Writes what it was given to $FAKE_VLLM_RECORD; dies before
# it is ready when $FAKE_VLLM_FAIL is set, as a vLLM that cannot start would.
FAKE_WORKER = textwrap.dedent('''
    import json, os, sys
    settings = json.loads(sys.argv[1])
    if os.environ.get("FAKE_VLLM_FAIL"):
        print("RuntimeError: not enough memory for the KV cache", file=sys.stderr)
        sys.exit(1)
    record = {"settings": settings, "kv_gb": os.environ["VLLM_CPU_KVCACHE_SPACE"],
              "bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"], "jobs": []}
    print(json.dumps({"ready": True, "vllm": "fake", "startup_s": 1.5}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        record["jobs"].append(job)
        outs = []
        for p in job["prompts"]:
            toks = (p[::-1][:3] + job["stop_token_ids"][:1])[:job["max_new_tokens"]]
            eos = bool(toks) and toks[-1] in job["stop_token_ids"]
            outs.append({"token_ids": toks, "finish_reason": "eos" if eos else "length",
                         "accepted_lengths": [1] * len(toks), "step_ms": [2.0] * (len(toks) - 1),
                         "prefill_ms": 5.0, "wall_s": 0.01})
        print(json.dumps({"outputs": outs, "wall_s": 0.02}), flush=True)
    with open(os.environ["FAKE_VLLM_RECORD"], "w") as f:
        json.dump(record, f)
''')


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """pipeline.vllm_peer pointed at this interpreter and the fake worker; returns its record file."""
    worker = tmp_path / "fake_worker.py"
    worker.write_text(FAKE_WORKER)
    monkeypatch.setattr(vllm_peer, "VENV_PYTHON", sys.executable)
    monkeypatch.setattr(vllm_peer, "WORKER", worker)
    record = tmp_path / "record.json"
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(record))
    return record


def test_entries_parse_and_speculation_options():
    plain, ngram, tuned = parse_entries(["vllm", "vllm speculative=ngram",
                                         "vllm speculative=ngram num_speculative_tokens=3 prompt_lookup_max=2"])
    assert plain.name == ngram.name == "vllm" and ngram.label == "vllm speculative=ngram"
    assert vllm_speculation(plain) is None
    assert vllm_speculation(ngram) == {"method": "ngram", **vllm_peer.NGRAM_DEFAULTS}
    assert vllm_speculation(tuned) == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}


@pytest.mark.parametrize("entry, fix", [
    ("vllm num_speculative_tokens=3", "add speculative=ngram"),
    ("vllm speculative=medusa", "give speculative=ngram, eagle, eagle3"),
    ("vllm speculative=ngram draft=d.safetensors", "not ngram: drop it"),
    ("vllm speculative=eagle prompt_lookup_max=2", "n-gram speculation's"),
    ("vllm speculative=eagle draft=/nonexistent/d.safetensors", "does not exist"),
    ("vllm speculative=ngram num_speculative_tokens=0", "must be a positive int"),
    ("vllm speculative=ngram prompt_lookup_min=5 prompt_lookup_max=2", "lower it"),
])
def test_bad_options_are_one_line(entry, fix):
    with pytest.raises(UserError, match=fix) as e:
        parse_entries([entry])  # checked whether vLLM is installed or not
    assert "\n" not in str(e.value)


def test_skipped_with_one_line_when_absent(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(vllm_peer, "VENV_PYTHON", tmp_path / "no-venv" / "bin" / "python")
    overrides = ["model=tiny", "decodes=[greedy,vllm]", "prompt=hi", "max_new_tokens=3", "repeats=1"]
    res, _ = bench(compose_config(overrides, config_name="bench", output_dir=tmp_path), overrides)
    assert list(res["pipelines"]) == ["greedy"]  # the other entries still run
    skip = [ln for ln in capsys.readouterr().err.splitlines() if "vllm" in ln]
    assert skip == [f"bench: skipping vllm: not installed ({vllm_peer.INSTALL_HINT})"]
    assert "make peer-vllm" in skip[0]
    with pytest.raises(UserError, match="nothing to benchmark: vllm is not installed"):
        only = ["model=tiny", "decodes=[vllm]", "prompt=hi"]
        bench(compose_config(only, config_name="bench", output_dir=tmp_path), only)


def test_protocol_with_fake_worker(tmp_path, fake_vllm):
    peer = vllm_peer.VllmPeer(tmp_path, eos_ids=[2, 7], max_new_tokens=3, max_model_len=64, batch_size=2,
                              threads=2, log_path=tmp_path / "vllm.log")
    assert peer.version == "fake" and peer.startup_s == 1.5
    gens = peer.run([[5, 6, 9, 8], [4, 3]], [0, 1])
    assert [g.token_ids for g in gens] == [[8, 9, 6], [3, 4, 2]]
    assert [g.finish_reason for g in gens] == ["length", "eos"]
    assert gens[0].accepted_lengths == [1, 1, 1] and gens[0].step_ms == [2.0, 2.0] and gens[0].prefill_ms == 5.0
    assert gens[0].step_nodes == [1, 1]  # plain steps
    assert peer.describe()["engine_wall_s"] == 0.02
    with pytest.raises(UserError, match="empty prompt"):
        peer.run([[]])
    peer.close()
    rec = json.loads(fake_vllm.read_text())
    assert rec["settings"]["model"] == str(tmp_path) and rec["settings"]["dtype"] == "bfloat16"
    assert rec["settings"]["max_num_seqs"] == 2 and rec["settings"]["speculative_config"] is None
    assert rec["settings"]["skip_tokenizer_init"] is True  # token ids in, token ids out
    assert rec["kv_gb"] == str(vllm_peer.KV_CACHE_GB) and rec["bind"] == "0-1"
    assert rec["jobs"] == [{"prompts": [[5, 6, 9, 8], [4, 3]], "max_new_tokens": 3, "stop_token_ids": [2, 7],
                            "max_running": 2}]


def test_failed_start_is_one_line(tmp_path, fake_vllm, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")
    with pytest.raises(UserError, match="vllm failed: it exited: RuntimeError: not enough memory") as e:
        vllm_peer.VllmPeer(tmp_path, [2], 3, 64, log_path=tmp_path / "vllm.log")
    assert "\n" not in str(e.value) and str(tmp_path / "vllm.log") in str(e.value)


def test_bench_runs_the_peer(tmp_path, fake_vllm):
    """Through the bench, on model=tiny: its weights written as an HF folder in the run directory,
    the prompts the bench encoded, the entry's speculation, what was measured in bench.json."""
    overrides = ["model=tiny", 'decodes=[greedy,"vllm speculative=ngram num_speculative_tokens=2"]',
                 "prompt=hi", "max_new_tokens=3", "repeats=1", "batch_size=2"]
    res, objs = bench(compose_config(overrides, config_name="bench", output_dir=tmp_path), overrides)
    v = json.loads((tmp_path / "bench.json").read_text())["pipelines"]["vllm speculative=ngram num_speculative_tokens=2"]
    assert v["measured"] == vllm_peer.MEASURED and v["precision"] == "bfloat16 (vLLM)" and v["startup_s"] == 1.5
    assert v["speculative_config"]["num_speculative_tokens"] == 2 and v["batch_size"] == 2
    args = objs["backbones"][0].model.args
    hf = json.loads((tmp_path / "vllm_model" / "config.json").read_text())  # the weights vLLM was given
    assert (hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]) == (args.dim, args.n_layers, args.vocab_size)
    # the worker's stderr goes to the entry's log: the fake one says nothing when it starts
    assert (tmp_path / "vllm_speculative=ngram_num_speculative_tokens=2.log").read_text() == ""
    rec = json.loads(fake_vllm.read_text())  # written when the bench closed the peer
    assert rec["settings"]["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 2,
                                                     "prompt_lookup_max": 4}
    prompt = objs["pipelines"][0].prompts[0]
    assert [j["prompts"] for j in rec["jobs"]] == [[prompt], [prompt]]  # the warm-up, then the round
    assert v["new_tokens"] == 3


@pytest.mark.slow
@pytest.mark.skipif(not vllm_peer.available(),
                    reason="vLLM is not installed (make peer-vllm)")
def test_real_vllm_decodes_the_default_model(tmp_path):
    """The real vLLM on SmolLM2 in bfloat16, three of the bench's prompts beside our bfloat16 greedy
    (vLLM's start-up, 1-3 minutes, dominates)."""
    lines = (REPO_ROOT / "pipeline" / "prompts" / "bench.jsonl").read_text().splitlines()[:3]
    (tmp_path / "req.jsonl").write_text("\n".join(lines) + "\n")
    overrides = ["model.dtype=bfloat16", "decodes=[greedy,vllm]", "max_new_tokens=16", "repeats=1",
                 f"input={tmp_path / 'req.jsonl'}"]
    cfg = compose_config(overrides, config_name="bench", output_dir=tmp_path)
    res, objs = bench(cfg, overrides)
    v = res["pipelines"]["vllm"]
    assert v["tokens_per_s"] > 0 and v["startup_s"] > 0 and v["mean_accepted_length"] == 1.0
    greedy, peer = objs["pipelines"][0], objs["pipelines"][1]
    same = sum(g.token_ids[:4] == b.token_ids[:4] for g, b in zip(peer.gens, greedy.gens))
    assert same >= len(greedy.gens) // 2  # bfloat16 kernels differ, but not from the first tokens on
