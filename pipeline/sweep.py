"""Sweeps (`python -m pipeline -m decode=tree_ngram tree.width=1,2 tree.depth=1,2`, or `-m sweep=tree_grid`).

A fair baseline: the project's sweepers (hydra_plugins/decode_sweepers) add, first and last in the
sweep, a plain greedy job for every context (the overrides that are not speculative settings: model, dtype,
prompts, lengths, ...) that has a speculative job and no plain job, so `speedup` is always against
greedy measured in the same sweep, on the same machine, precision and prompts. A job is plain when
its composed config has no proposer and a plain runner (pipeline.build.is_plain; results.json `"plain"`); a hand-composed
speculative run (`decode=greedy proposer=ngram verifier=greedy`) is never one.

The end of a sweep: one row per job in the multirun directory's summary.csv and summary.md, and
summary.png (heatmaps of tokens/s, speedup and mean accepted length against tree.width x tree.depth
when both vary, else bars). `SweepSummary` is a Hydra callback (conf/hydra/callbacks/
sweep_summary.yaml); it reads what the jobs left on disk (`<job dir>/results.json`, the job's
`.hydra/overrides.yaml`), so it works for any launcher. `python -m pipeline.report <multirun dir>`
writes the same files again for a finished sweep.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import statistics
import sys
from pathlib import Path

import yaml
from hydra.experimental.callback import Callback

from pipeline.io import atomic_write, write_json
from pipeline.tracking import log_sweep

METRICS = ("tokens_per_s", "speedup", "mean_accepted_length", "tree_step_ms", "plain_step_ms")
# overrides of speculative settings (and of what only names or records a run): a plain job that
# agrees with a job on every other override is its baseline
SPEC_ONLY = ("decode", "tree", "proposer", "verifier", "guard", "record_trees", "logger", "threads")


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def context(overrides: list[str]) -> list[str]:
    """The overrides that a job's baseline must share: every one that is not a speculative setting."""
    return [o for o in overrides if _key(o).split(".")[0] not in SPEC_ONLY]


def baseline_job(overrides: list[str]) -> list[str]:
    return [*context(overrides), "decode=greedy"]


def with_baselines(jobs: list[list[str]], plain) -> list[list[str]]:
    """`jobs` (override lists) bracketed by a greedy job for each context that has a speculative job
    and no plain job: one before them and one after (a machine whose speed drifts during the sweep
    moves both; the speedup is over their median). plain(job) -> bool says whether a job's composed
    config is plain decoding."""
    found: dict[tuple, bool] = {}
    for job in jobs:
        ctx = tuple(context(job))
        found[ctx] = found.get(ctx, False) or plain(job)
    bases = [baseline_job(list(ctx)) for ctx, has in found.items() if not has]
    return bases + [list(j) for j in jobs] + [list(b) for b in bases]


def job_dir(num, overrides) -> str:
    """A job's directory name: its number, then its overrides, readable (`3-tree.depth=2,tree.width=1`);
    the seed, and the sweep config's own selection, left out; '/' in values becomes '_'; long names
    are cut, with a hash of the whole."""
    items = [str(o) for o in (overrides or []) if _key(str(o)) not in ("seed", "sweep")]
    name = ",".join(items).replace("\\", "").replace("/", "_").replace(" ", "_") or "defaults"
    if len(name) > 150:
        name = name[:120] + "~" + hashlib.sha1(name.encode()).hexdigest()[:10]
    return f"{num}-{name}"


def _job_order(p: Path):
    head = p.name.split("-", 1)[0]
    return (not head.isdigit(), int(head) if head.isdigit() else 0, p.name)


def load_jobs(sweep_dir: Path) -> list[dict]:
    """One dict per job subdirectory, in launch order: its overrides {key: value}, and its results
    summary (None if the job left no results.json)."""
    jobs = []
    for sub in sorted((p for p in sweep_dir.iterdir() if (p / ".hydra" / "overrides.yaml").is_file()), key=_job_order):
        overrides = yaml.safe_load((sub / ".hydra" / "overrides.yaml").read_text()) or []
        res = sub / "results.json"
        results = json.loads(res.read_text()) if res.is_file() else None
        jobs.append({"job": sub.name, "path": sub, "override_list": list(overrides),
                     "overrides": {_key(o): o.split("=", 1)[1] if "=" in o else "" for o in overrides},
                     "decode": results.get("decode") if results else None,
                     "plain": results.get("plain", results.get("decode") == "greedy") if results else None,
                     "summary": results.get("summary", {}) if results else None})
    return jobs


def _context(job: dict) -> dict:
    return {k: v for k, v in job["overrides"].items() if k.split(".")[0] not in SPEC_ONLY}


def rows(jobs: list[dict]) -> tuple[list[str], list[dict]]:
    """Columns (job, each override key, decode, plain, METRICS) and one row per job. `speedup` is over
    the median tokens/s of the sweep's plain jobs in the same context (the baseline jobs before and
    after the others), None without one."""
    keys = list(dict.fromkeys(k for j in jobs for k in j["overrides"]))
    columns = ["job", *keys, *([] if "decode" in keys else ["decode"]), "plain", *METRICS]
    plain = [j for j in jobs if j["plain"] and j["summary"]]
    out = []
    for j in jobs:
        s = j["summary"] or {}
        ref = [g["summary"]["tokens_per_s"] for g in plain if _context(g) == _context(j)]
        base = statistics.median(ref) if ref else None
        row = {"job": j["job"], **{k: j["overrides"].get(k) for k in keys}, "decode": j["decode"], "plain": j["plain"],
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
    from matplotlib.figure import Figure  # heavy, loaded to draw; no pyplot: no global backend, renders with Agg
    rows_ = [r for r in table if r["tokens_per_s"] is not None]
    widths = sorted({r.get("tree.width") for r in rows_ if r.get("tree.width") is not None}, key=_num)
    depths = sorted({r.get("tree.depth") for r in rows_ if r.get("tree.depth") is not None}, key=_num)
    metrics = [("tokens_per_s", "tokens/s"), ("speedup", "speedup over greedy"),
               ("mean_accepted_length", "mean accepted length")]
    if not any(r["speedup"] is not None for r in rows_):
        metrics.pop(1)
    if len(widths) > 1 and len(depths) > 1:  # one row of heatmaps per speculative decode
        cells = [r for r in rows_ if not r["plain"]] or rows_
        decodes = list(dict.fromkeys(r["decode"] for r in cells))
        fig = Figure(figsize=(5.5 * len(metrics), 4.5 * len(decodes)), layout="constrained")
        for axes, dec in zip(fig.subplots(len(decodes), len(metrics), squeeze=False), decodes):
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
        fig = Figure(figsize=(5.5 * len(metrics), 4.5), layout="constrained")
        varying = [k for k in (table[0] if table else {}) if k not in ("job", "plain", *METRICS)
                   and len({r[k] for r in table}) > 1]
        labels = [" ".join(f"{k}={r[k]}" for k in varying) or r["job"] for r in rows_]
        for ax, (m, title) in zip(fig.subplots(1, len(metrics)), metrics):
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
    bases = sum(bool(r["plain"]) for r in table)
    missing = [r["job"] for r in table if not r["plain"] and r["tokens_per_s"] is not None and r["speedup"] is None]
    print(f"sweep summary: {len(table)} jobs ({bases} plain baselines) -> {out[0]}, {out[1].name}, {out[2].name}"
          + (f"; no baseline in the same context for {len(missing)} jobs" if missing else ""), file=sys.stderr)
    return out


def write_best(sweep_dir: str | Path, install: bool = False) -> Path | None:
    """After a search: best.json with the best job (tokens/s) among the speculative ones, its
    overrides, speedup over the sweep's baseline and the tree it verified. install=true also
    writes that tree as tree.json beside the Medusa checkpoint the job used (what decode=tree_medusa
    loads by default)."""
    sweep_dir = Path(sweep_dir)
    jobs = load_jobs(sweep_dir)
    columns, table = rows(jobs)
    ranked = [(r, j) for r, j in zip(table, jobs) if not r["plain"] and r["tokens_per_s"] is not None]
    if not ranked:
        print(f"search: no finished trial under {sweep_dir}", file=sys.stderr)
        return None
    best, job = max(ranked, key=lambda rj: rj[0]["tokens_per_s"])
    results = json.loads((job["path"] / "results.json").read_text())
    tree = results["summary"].get("tree")
    out = {"job": job["job"], "overrides": job["override_list"], "decode": best["decode"],
           "tokens_per_s": best["tokens_per_s"], "speedup": best["speedup"],
           "mean_accepted_length": best["mean_accepted_length"], "tree": tree,
           "trials": len(ranked)}
    path = sweep_dir / "best.json"
    write_json(path, out)
    said = f"{best['speedup']:.2f}x greedy" if best["speedup"] is not None else "no baseline"
    print(f"search: best of {len(ranked)} trials {' '.join(job['override_list'])}: {best['tokens_per_s']:.1f} tokens/s "
          f"({said}) -> {path}", file=sys.stderr)
    if tree and tree.get("choices"):
        tree_file = sweep_dir / "best_tree.json"
        write_json(tree_file, {"choices": tree["choices"], "p_min": tree.get("p_min", 0.0),
                               "source": str(sweep_dir), "tokens_per_s": best["tokens_per_s"], "speedup": best["speedup"]})
        print(f"search: its tree -> {tree_file} (decode with proposer.tree_file={tree_file})", file=sys.stderr)
        if install and tree.get("checkpoint"):
            target = Path(tree["checkpoint"]).parent / "tree.json"
            atomic_write(target, tree_file.read_text())
            print(f"search: installed as {target}", file=sys.stderr)
    return path


class SweepSummary(Callback):
    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        out = write_summary(sweep_dir)
        if out and config.get("logger") is not None:
            columns, table = rows(load_jobs(sweep_dir))
            log_sweep(config, sweep_dir, columns, table, out[2])


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m pipeline.sweep <multirun dir>")
    write_summary(sys.argv[1])
