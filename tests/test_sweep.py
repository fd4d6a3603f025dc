"""Sweep summaries: a real `python -m pipeline -m` sweep on model=tiny ends with summary.csv, .md and
.png in its multirun directory; speedups pair each job with the greedy jobs of the same context."""
from __future__ import annotations

import csv
import json
import subprocess

import yaml
from conftest import PYTHON, REPO_ROOT

from pipeline.sweep import load_jobs, rows, write_summary

PNG = b"\x89PNG"


def test_multirun_writes_summaries(tmp_path):
    sweep = tmp_path / "sweep"
    proc = subprocess.run([PYTHON, "-m", "pipeline", "-m", "model=tiny", "prompt=hi", "max_new_tokens=4",
                           "stream=false", "tree.width=1,2", f"hydra.sweep.dir={sweep}"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    with open(sweep / "summary.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["tree.width"] for r in table] == ["1", "2"]
    assert all(float(r["tokens_per_s"]) > 0 and r["mean_accepted_length"] == "1.000" for r in table)
    assert all(r["speedup"] for r in table)  # decode=greedy jobs: each is its own baseline context
    md = (sweep / "summary.md").read_text().splitlines()
    assert md[0].startswith("| job |") and len(md) == 4
    assert (sweep / "summary.png").read_bytes()[:4] == PNG


def fake_job(root, n, overrides, decode, tps, mal=1.0, tree_ms=None):
    d = root / str(n)
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    summary = {"tokens_per_s": tps, "mean_accepted_length": mal, "tree_step_ms": tree_ms, "plain_step_ms": 10.0}
    (d / "results.json").write_text(json.dumps({"decode": decode, "summary": summary}))


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
