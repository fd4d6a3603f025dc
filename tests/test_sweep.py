"""Sweeps, searches and pictures: a real `python -m pipeline -m` sweep on model=tiny measures its own
greedy baseline and ends with summary.csv, .md and .png; speedups pair each job with the plain jobs of
the same context; a hand-composed speculative run is never a baseline; the Optuna search records its
best trial; pipeline.report draws trees; wandb logs decoding runs offline."""
from __future__ import annotations

import csv
import json
import subprocess

import pytest
import torch
import yaml

from pipeline.build import is_plain
from pipeline.sweep import load_jobs, rows, with_baselines, write_summary
from pipeline.tracking import log_sweep

from helpers import PYTHON, REPO_ROOT, subprocess_env

PNG = b"\x89PNG"


def not_blank(path) -> bool:
    from matplotlib.image import imread
    img = imread(path)
    return path.read_bytes()[:4] == PNG and img.shape[0] > 50 and float(img[..., :3].std()) > 0.05


def run_sweep(*args, timeout=300):
    proc = subprocess.run([PYTHON, "-m", "pipeline", "-m", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr
    return proc


def test_two_by_two_sweep_measures_its_own_greedy_baseline(tmp_path):
    """A 2 x 2 tree sweep on model=tiny: the sweeper adds a greedy job before and after the others, in
    the same sweep; every speedup is over their median; job directories are named by their
    overrides; the heatmaps are drawn."""
    sweep = tmp_path / "sweep"
    run_sweep("model=tiny", "prompt=one two three one two three", "max_new_tokens=12", "stream=false", "seed=3",
              "decode=tree_ngram", "tree.width=1,2", "tree.depth=1,2", f"hydra.sweep.dir={sweep}")
    with open(sweep / "summary.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 6
    base, cells, last = table[0], table[1:5], table[5]
    for b in (base, last):
        assert b["decode"] == "greedy" and b["plain"] == "True"
    assert base["job"] == "0-model=tiny,prompt=one_two_three_one_two_three,max_new_tokens=12,stream=False,decode=greedy"
    assert last["job"].startswith("5-") and last["job"][2:] == base["job"][2:]
    reference = (float(base["tokens_per_s"]) + float(last["tokens_per_s"])) / 2
    assert [(r["tree.width"], r["tree.depth"]) for r in cells] == [("1", "1"), ("1", "2"), ("2", "1"), ("2", "2")]
    assert all(r["decode"] == "tree_ngram" and r["plain"] == "False" for r in cells)
    for r in cells:  # the speedup is over the baseline jobs of this sweep
        assert abs(float(r["speedup"]) - float(r["tokens_per_s"]) / reference) < 2e-3
        assert "seed" not in r["job"] and f"tree.width={r['tree.width']},tree.depth={r['tree.depth']}" in r["job"]
    baseline = json.loads((sweep / base["job"] / "results.json").read_text())
    assert baseline["config"].get("proposer") is None and baseline["config"]["seed"] == 3  # same context
    assert not_blank(sweep / "summary.png")


def test_hand_composed_speculation_is_never_the_baseline(tmp_path, compose_cfg):
    """`decode=greedy proposer=ngram verifier=greedy` is speculative whatever its preset: its own run
    names it by its components, a sweep adds a real greedy job for it, and its rows never serve as one."""
    sweep = tmp_path / "sweep"
    run_sweep("model=tiny", "prompt=hi", "max_new_tokens=6", "stream=false", "proposer=ngram", "verifier=greedy",
              "tree.width=1,2", f"hydra.sweep.dir={sweep}")
    with open(sweep / "summary.csv") as f:
        table = list(csv.DictReader(f))
    assert [(r["decode"], r["plain"]) for r in table] == [("greedy", "True")] + \
        [("greedy proposer=ngram verifier=greedy", "False")] * 2 + [("greedy", "True")]
    assert table[0].get("proposer") in (None, "")
    plain = lambda job: is_plain(compose_cfg(job))
    jobs = [["proposer=ngram", "verifier=greedy", "tree.width=1"], ["decode=tree_ngram", "model.dtype=bfloat16"],
            ["decode=greedy", "model.dtype=bfloat16"]]
    assert with_baselines(jobs, plain) == [["decode=greedy"], *jobs, ["decode=greedy"]]  # bfloat16 has its own


def test_optuna_search_runs_trials_and_records_the_best(tmp_path):
    sweep = tmp_path / "search"
    run_sweep("sweep=ngram_search", "model=tiny", "prompt=one two three one two three", "max_new_tokens=8",
              "stream=false", "hydra.sweeper.n_trials=3", f"hydra.sweep.dir={sweep}")
    found = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert set(found["best_params"]) == {"tree.width", "tree.depth", "tree.max_nodes"}
    best = json.loads((sweep / "best.json").read_text())
    assert best["trials"] == 3 and best["tokens_per_s"] == found["best_value"]
    assert best["tree"] == {"width": found["best_params"]["tree.width"], "depth": found["best_params"]["tree.depth"],
                            "max_nodes": found["best_params"]["tree.max_nodes"]}
    with open(sweep / "summary.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 5 and table[0]["plain"] == table[4]["plain"] == "True"  # baseline, 3 trials, baseline
    assert all(r["speedup"] for r in table)


def test_report_draws_trees_strips_and_acceptance(tmp_path, compose_cfg):
    from pipeline.decode import decode
    from pipeline.report import layout, main as report_main
    run = tmp_path / "run"
    cfg = compose_cfg(["model=tiny", "decode=tree_ngram", "max_new_tokens=24", "stream=false", "record_trees=true",
                       "chat=false"], output_dir=run, prompt="one two three one two three one two three")
    _, objs = decode(cfg)
    item = objs["results"]["items"][0]
    assert item["trees"] and len(item["token_texts"]) == len(item["token_ids"])
    for t in item["trees"]:
        assert t["path"][0] == 0 and len(t["texts"]) == len(t["tokens"]) == len(t["parents"])
        assert item["accepted_lengths"][t["step"]] <= len(t["path"])
    report_main([str(run)])
    trees = sorted((run / "report").glob("tree-*.png"))
    assert trees and all(not_blank(p) for p in trees)
    assert all(p.with_suffix(".svg").read_text().lstrip().startswith("<?xml") for p in trees)
    assert not_blank(run / "report" / "strip-prompt.png") and not_blank(run / "report" / "acceptance.png")
    depth, y = layout([-1, 0, 0, 1, 1])
    assert depth == [0, 1, 1, 2, 2] and y == [1.25, 0.5, 2.0, 0.0, 1.0]


def test_report_refuses_what_it_cannot_draw(tmp_path, capsys):
    from pipeline.report import main as report_main
    with pytest.raises(SystemExit) as e:
        report_main([str(tmp_path)])
    assert e.value.code == 2 and "neither results.json nor sweep jobs" in capsys.readouterr().err


def test_wandb_logs_a_decoding_run_offline(tmp_path, compose_cfg):
    from pipeline.decode import decode
    cfg = compose_cfg(["model=tiny", "decode=tree_ngram", "max_new_tokens=16", "stream=false", "record_trees=true",
                       "logger=wandb", "chat=false"], output_dir=tmp_path, prompt="one two three one two three")
    decode(cfg)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    media = {p.parent.name for p in (runs[0] / "files" / "media").rglob("*") if p.is_file()}
    assert {"pictures", "decode"} <= media  # the pictures and the per-step table


def test_thread_share_and_job_names(monkeypatch):
    from pipeline import threads
    from pipeline.sweep import job_dir
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "cores", lambda: 8)
    monkeypatch.setattr(threads, "parallel_jobs", lambda: 3)
    assert threads.share("auto") == 2 and threads.share(5) == 5
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert threads.share("auto") == 1
    with pytest.raises(threads.UserError):
        threads.share(0)
    assert job_dir(4, ["seed=1", "tree.width=2", "input=a/b.jsonl"]) == "4-tree.width=2,input=a_b.jsonl"
    long = job_dir(0, [f"prompt={'x' * 400}"])
    assert len(long) < 140 and long.startswith("0-prompt=xxx")


def fake_job(root, n, overrides, decode, tps, mal=1.0, tree_ms=None, tree=None, plain=None):
    d = root / str(n)
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    summary = {"tokens_per_s": tps, "mean_accepted_length": mal, "tree_step_ms": tree_ms, "plain_step_ms": 10.0}
    if tree is not None:
        summary["tree"] = tree
    results = {"decode": decode, "summary": summary, **({} if plain is None else {"plain": plain})}
    (d / "results.json").write_text(json.dumps(results))


def test_speedup_pairs_greedy_of_same_context_and_heatmap(tmp_path):
    n = 0
    for dtype, base in (("float32", 10.0), ("bfloat16", 20.0)):
        fake_job(tmp_path, n, ["decode=greedy", f"model.dtype={dtype}", "tree.width=1", "tree.depth=1"],
                 "greedy", base)
        n += 1
        for w in (1, 2):
            for dep in (1, 2):
                fake_job(tmp_path, n, ["decode=tree_ngram", f"model.dtype={dtype}", f"tree.width={w}",
                                       f"tree.depth={dep}"], "tree_ngram", base * w * dep, 1.5, 30.0)
                n += 1
    (tmp_path / "11").mkdir()  # a job that crashed before writing anything is not a row
    (tmp_path / "12" / ".hydra").mkdir(parents=True)  # one that crashed after Hydra's files is
    (tmp_path / "12" / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["decode=tree_ngram"]))
    columns, table = rows(load_jobs(tmp_path))
    assert columns[:5] == ["job", "decode", "model.dtype", "tree.width", "tree.depth"]
    assert [r["job"] for r in table] == [str(i) for i in range(10)] + ["12"]
    assert [r["speedup"] for r in table[:10]] == [1.0, 1.0, 2.0, 2.0, 4.0] * 2
    assert table[-1]["tokens_per_s"] is None and table[-1]["speedup"] is None
    out = write_summary(tmp_path)
    assert [p.name for p in out] == ["summary.csv", "summary.md", "summary.png"]
    assert out[2].read_bytes()[:4] == PNG
    assert (tmp_path / "summary.csv").read_text().splitlines()[-1].endswith(",,,,,")


def test_nothing_to_summarize(tmp_path):
    assert write_summary(tmp_path) == []
    assert not (tmp_path / "summary.csv").exists()


def test_best_trial_tree_installs_as_a_tree_file(tmp_path, tiny_backbone):
    """write_best picks the fastest speculative job, writes its tree as best_tree.json and, asked to,
    as tree.json beside the checkpoint it used, which a Medusa proposer then loads with its p_min."""
    from components.heads.medusa import build_heads
    from components.proposer.medusa import MedusaProposer
    from pipeline.sweep import write_best
    bb = tiny_backbone
    heads = build_heads(bb, torch.ones(bb.model.args.vocab_size, dtype=torch.long), draft_vocab=None)
    ckpt = heads.save(tmp_path / "heads" / "heads.safetensors", {"vocab_size": bb.model.args.vocab_size,
                                                                 "fingerprint": bb.model.fingerprint()})
    sweep = tmp_path / "sweep"
    fake_job(sweep, "0-decode=greedy", ["decode=greedy"], "greedy", 10.0)
    for n, (w, tps) in enumerate([(1, 9.0), (2, 12.0)], 1):
        fake_job(sweep, f"{n}-tree.width={w}", [f"tree.width={w}"], "tree_medusa", tps, 1.5, 12.0,
                 tree={"choices": [[0], [1]][:w], "p_min": 0.05, "checkpoint": str(ckpt)}, plain=False)
    best = json.loads(write_best(sweep, install=True).read_text())
    assert best["job"] == "2-tree.width=2" and best["speedup"] == 1.2 and best["trials"] == 2
    installed = json.loads((ckpt.parent / "tree.json").read_text())
    assert installed["choices"] == [[0], [1]] and installed["p_min"] == 0.05
    prop = MedusaProposer(bb, checkpoint=str(ckpt), tree_file="auto", nodes=None)
    assert prop.p_min == 0.05 and [list(c) for c in prop.tree.choices] == [[0], [1]]


def test_wandb_logs_a_sweep_summary_offline(tmp_path, compose_cfg):
    fake_job(tmp_path, 0, ["decode=greedy"], "greedy", 10.0)
    fake_job(tmp_path, 1, ["decode=tree_ngram", "tree.width=2"], "tree_ngram", 12.0, 1.4, 12.0)
    made = write_summary(tmp_path)
    columns, table = rows(load_jobs(tmp_path))
    log_sweep(compose_cfg(["logger=wandb"]), tmp_path, columns, table, made[2])
    run = next((tmp_path / "wandb").glob("offline-run-*"))
    media = {p.parent.name for p in (run / "files" / "media").rglob("*") if p.is_file()}
    assert {"sweep"} <= media


def test_step_threads_keep_the_faster_count_per_group_and_retry_the_other():
    """The server's measured thread count (pipeline.threads.StepThreads): each group of step sizes
    probes both counts, then runs the faster, and tries the slower one again every `every` steps, so
    a change in the load around it is seen."""
    from pipeline.threads import StepThreads
    st = StepThreads(2, probe=2, every=10)
    cost = {(1, 2): 0.017, (1, 1): 0.013, (16, 2): 0.050, (16, 1): 0.070}  # one stream: 1 thread faster
    picks = {1: [], 16: []}
    for _ in range(40):
        for live in (1, 16):
            n = st.choose(live)
            picks[live].append(n)
            st.record(live, n, cost[(live, n)])
    assert picks[1][:4] == [2, 2, 1, 1] and picks[16][:4] == [2, 2, 1, 1]  # both probed
    assert picks[1][4:].count(1) > 25 and picks[16][4:].count(2) > 25  # the faster kept
    assert picks[1][4:].count(2) >= 4 and picks[16][4:].count(1) >= 4  # the slower retried
    assert st.describe()["1+"]["1"] == pytest.approx(13.0) and set(st.describe()) == {"1+", "16+"}
    assert StepThreads(1).choose(5) == 1 and StepThreads(1).options == [1]
