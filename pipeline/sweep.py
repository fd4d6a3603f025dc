"""The end of a sweep (`python -m pipeline -m decode=tree_ngram tree.width=1,2 tree.depth=1,2`): one
row per job in the multirun directory's summary.csv and summary.md, and summary.png (heatmaps of
tokens/s and mean accepted length against tree.width x tree.depth when both vary, else bars).

`SweepSummary` is a Hydra callback (registered by conf/hydra/callbacks/sweep_summary.yaml). It
reads what the jobs left on disk, `<sweep.dir>/<subdir>/results.json` and the job's
`.hydra/overrides.yaml`, so it works for any launcher. `python -m pipeline.sweep <multirun dir>`
writes the same files again for a finished sweep.
"""
from __future__ import annotations

import csv
import io
import json
import os
import statistics
import sys
from pathlib import Path

import yaml
from hydra.experimental.callback import Callback

from pipeline.core.io import atomic_write

METRICS = ("tokens_per_s", "speedup", "mean_accepted_length", "tree_step_ms", "plain_step_ms")
# overrides that do not change what plain greedy decoding computes: a greedy job that agrees with
# a job on every other override is its baseline
SPEC_ONLY = ("decode", "tree", "proposer", "verifier")


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def load_jobs(sweep_dir: Path) -> list[dict]:
    """One dict per job subdirectory: its overrides {key: value}, and its results summary (None
    if the job left no results.json)."""
    jobs = []
    for sub in sorted((p for p in sweep_dir.iterdir() if (p / ".hydra" / "overrides.yaml").is_file()),
                      key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name)):
        overrides = yaml.safe_load((sub / ".hydra" / "overrides.yaml").read_text()) or []
        res = sub / "results.json"
        results = json.loads(res.read_text()) if res.is_file() else None
        jobs.append({"job": sub.name,
                     "overrides": {_key(o): o.split("=", 1)[1] if "=" in o else "" for o in overrides},
                     "decode": results.get("decode") if results else None,
                     "summary": results.get("summary", {}) if results else None})
    return jobs


def _context(job: dict) -> dict:
    return {k: v for k, v in job["overrides"].items() if k.split(".")[0] not in SPEC_ONLY}


def rows(jobs: list[dict]) -> tuple[list[str], list[dict]]:
    """Columns (job, each override key, decode, METRICS) and one row per job. `speedup` is over the
    median tokens/s of the sweep's greedy jobs in the same context, None without one."""
    keys = list(dict.fromkeys(k for j in jobs for k in j["overrides"]))
    columns = ["job", *keys, *([] if "decode" in keys else ["decode"]), *METRICS]
    greedy = [j for j in jobs if j["decode"] == "greedy" and j["summary"]]
    out = []
    for j in jobs:
        s = j["summary"] or {}
        ref = [g["summary"]["tokens_per_s"] for g in greedy if _context(g) == _context(j)]
        base = statistics.median(ref) if ref else None
        row = {"job": j["job"], **{k: j["overrides"].get(k) for k in keys}, "decode": j["decode"],
               **{m: s.get(m) for m in METRICS if m != "speedup"}}
        tps = s.get("tokens_per_s")
        row["speedup"] = tps / base if base and tps is not None else None
        out.append(row)
    return columns, out


def _fmt(v) -> str:
    if v is None:
        return ""
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def to_csv(columns: list[str], table: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    w.writerows([[_fmt(r[c]) for c in columns] for r in table])
    return buf.getvalue()


def to_markdown(columns: list[str], table: list[dict]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(_fmt(r[c]) or "-" for c in columns) + " |" for r in table]
    return "\n".join(lines) + "\n"


def _num(v: str):
    try:
        return float(v)
    except (TypeError, ValueError):
        return v


def plot(table: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global backend, renders with Agg
    rows_ = [r for r in table if r["tokens_per_s"] is not None]
    widths = sorted({r.get("tree.width") for r in rows_ if r.get("tree.width") is not None}, key=_num)
    depths = sorted({r.get("tree.depth") for r in rows_ if r.get("tree.depth") is not None}, key=_num)
    metrics = [("tokens_per_s", "tokens/s"), ("mean_accepted_length", "mean accepted length")]
    if len(widths) > 1 and len(depths) > 1:  # one row of heatmaps per speculative decode
        cells = [r for r in rows_ if r["decode"] != "greedy"] or rows_
        decodes = list(dict.fromkeys(r["decode"] for r in cells))
        fig = Figure(figsize=(11, 4.5 * len(decodes)), layout="constrained")
        for axes, dec in zip(fig.subplots(len(decodes), 2, squeeze=False), decodes):
            for ax, (m, title) in zip(axes, metrics):
                mine = [r for r in cells if r["decode"] == dec]
                grid = [[_cell(mine, w, d, m) for w in widths] for d in depths]  # (depth, width)
                im = ax.imshow([[float("nan") if v is None else v for v in row] for row in grid],
                               origin="lower", cmap="viridis", aspect="auto")
                for i, row in enumerate(grid):
                    for k, v in enumerate(row):
                        if v is not None:
                            ax.text(k, i, f"{v:.2f}", ha="center", va="center", fontsize=8,
                                    color="black" if im.norm(v) > 0.5 else "white")
                ax.set_xticks(range(len(widths)), widths)
                ax.set_yticks(range(len(depths)), depths)
                ax.set(xlabel="tree.width", ylabel="tree.depth", title=f"{dec}: {title}")
                fig.colorbar(im, ax=ax)
    else:
        fig = Figure(figsize=(11, 4.5), layout="constrained")
        varying = [k for k in (table[0] if table else {}) if k not in ("job", *METRICS)
                   and len({r[k] for r in table}) > 1]
        labels = [" ".join(f"{k}={r[k]}" for k in varying) or r["job"] for r in rows_]
        for ax, (m, title) in zip(fig.subplots(1, 2), metrics):
            ax.bar(range(len(rows_)), [r[m] or 0.0 for r in rows_])
            ax.set_xticks(range(len(rows_)), labels, rotation=30, ha="right", fontsize=8)
            ax.set(title=title)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))


def _cell(rows_: list[dict], w, d, m):
    vals = [r[m] for r in rows_ if r.get("tree.width") == w and r.get("tree.depth") == d and r[m] is not None]
    return statistics.mean(vals) if vals else None


def write_summary(sweep_dir: str | Path) -> list[Path]:
    sweep_dir = Path(sweep_dir)
    jobs = load_jobs(sweep_dir) if sweep_dir.is_dir() else []
    if not any(j["summary"] for j in jobs):
        print(f"sweep summary: no results.json under {sweep_dir}; nothing to summarize", file=sys.stderr)
        return []
    columns, table = rows(jobs)
    out = [sweep_dir / "summary.csv", sweep_dir / "summary.md", sweep_dir / "summary.png"]
    atomic_write(out[0], to_csv(columns, table))
    atomic_write(out[1], to_markdown(columns, table))
    plot(table, out[2])
    print(f"sweep summary: {len(table)} jobs -> {out[0]}, {out[1].name}, {out[2].name}", file=sys.stderr)
    return out


class SweepSummary(Callback):
    def on_multirun_end(self, config, **kwargs) -> None:
        write_summary(config.hydra.sweep.dir)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m pipeline.sweep <multirun dir>")
    write_summary(sys.argv[1])
