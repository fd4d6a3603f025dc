"""python -m pipeline.report <run dir | multirun dir> [--requests ID ...] [--steps K ...] [--install]

Pictures of speculation at work, from what a run left on disk (no model is loaded):

- `tree-<id>-step<k>.png/.svg`: the candidate tree of step k of a request, tokens as text, the
  accepted path highlighted (green), the rejected drafts greyed, the root (the token the step starts
  from) in blue. Needs a run decoded with `record_trees=true`; by default three steps of the first
  request: its longest accepted path, its largest tree and its first tree step.
- `strip-<id>.png`: the generated text, each token shaded by how many tokens its step committed
  (1 = a step that accepted no draft), with a mark where each step begins.
- `acceptance.png`: acceptance by depth (how often a step that drafted to depth d accepted a draft
  at depth d) and the histogram of tokens committed per step, over all requests.

A run directory gets them in `<run>/report/`. A multirun directory gets its summary.csv / .md / .png
rebuilt (with the sweep's baselines), best.json after a search (`--install` writes the best trial's
tree as tree.json beside the Medusa checkpoint it used), and each job's pictures in its own
directory.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipeline import sweep
from pipeline.io import atomic_write
from pipeline.errors import UserError, one_line_errors
from pipeline.metrics import depth_acceptance

GREEN, GREY, BLUE, EDGE = "#3aa655", "#d9d9d9", "#4a7fd1", "#9a9a9a"


def show(text: str) -> str:
    """A token as it can be read in a picture: spaces and line breaks made visible."""
    out = text.replace("\n", "\u23ce").replace("\t", "\u21e5").replace(" ", "\u2423")
    return out if out else "\u2205"


def layout(parents: list[int]) -> tuple[list[int], list[float]]:
    """x = depth, y = order of the node's leaves in a depth-first walk (parents centred on their children)."""
    children: dict[int, list[int]] = {i: [] for i in range(len(parents))}
    for i, p in enumerate(parents):
        if p >= 0:
            children[p].append(i)
    depth, y, leaf = [0] * len(parents), [0.0] * len(parents), [0]

    def walk(i: int, d: int) -> None:
        depth[i] = d
        if not children[i]:
            y[i] = float(leaf[0])
            leaf[0] += 1
            return
        for c in children[i]:
            walk(c, d + 1)
        y[i] = sum(y[c] for c in children[i]) / len(children[i])
    walk(0, 0)
    return depth, y


def _save(fig, path: Path, svg: bool = True) -> list[Path]:
    out = [path]
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    if svg:
        svg_path = path.with_suffix(".svg")
        atomic_write(svg_path, lambda tmp: fig.savefig(tmp, format="svg"))
        out.append(svg_path)
    return out


def draw_tree(tree: dict, title: str, path: Path) -> list[Path]:
    from matplotlib.figure import Figure  # matplotlib is heavy: loaded only to draw
    parents, texts, accepted = tree["parents"], tree["texts"], set(tree["path"])
    depth, y = layout(parents)
    width, height = max(depth) + 1, max(y) + 1
    fig = Figure(figsize=(min(1.5 * width + 1.5, 26), 0.42 * height + 1.3), layout="constrained")
    ax = fig.subplots()
    for i, p in enumerate(parents):
        if p >= 0:
            on = i in accepted and p in accepted
            ax.plot([depth[p], depth[i]], [y[p], y[i]], color=GREEN if on else EDGE, lw=2.2 if on else 0.9, zorder=1)
    for i, text in enumerate(texts):
        face, color = (BLUE, "white") if i == 0 else (GREEN, "white") if i in accepted else (GREY, "#6b6b6b")
        ax.text(depth[i], y[i], show(text)[:18], ha="center", va="center", fontsize=9, color=color, zorder=2,
                family="monospace", bbox=dict(boxstyle="round,pad=0.3", fc=face, ec="none"))
    ax.set_xlim(-0.6, width - 0.4)
    ax.set_ylim(height - 0.5, -0.5)
    ax.set_xticks(range(width), ["root"] + [f"depth {d}" for d in range(1, width)])
    ax.set_yticks([])
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_title(title, fontsize=10)
    return _save(fig, path)


def token_steps(item: dict) -> list[int]:
    """For each generated token, the index of the step (in accepted_lengths) that committed it."""
    out = []
    for k, n in enumerate(item["accepted_lengths"]):
        out += [k] * n
    return out[:len(item["token_ids"])]


def draw_strip(item: dict, path: Path, max_tokens: int = 400, columns: int = 140) -> list[Path]:
    """The text as committed, token by token, shaded by the accepted length of the token's step."""
    from matplotlib import colormaps  # matplotlib is heavy: loaded only to draw
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure
    texts = item.get("token_texts") or [str(t) for t in item["token_ids"]]
    steps = token_steps(item)
    acc = item["accepted_lengths"]
    top = max(acc) if acc else 1
    norm, cmap = Normalize(1, max(top, 2)), colormaps["Greens"]
    cells, x, line = [], 0, 0
    for i, (text, k) in enumerate(zip(texts[:max_tokens], steps)):
        label = show(text)
        if x and x + len(label) > columns:
            x, line = 0, line + 1
        cells.append((x, line, label, acc[k], i == 0 or steps[i - 1] != k))
        x += len(label)
    lines = line + 1
    fig = Figure(figsize=(12, 0.3 * lines + 1.4), layout="constrained")
    ax = fig.subplots()
    for x, line, label, n, first in cells:
        ax.add_patch(_rect(x, line, len(label), cmap(0.15 + 0.85 * norm(n))))
        ax.text(x + len(label) / 2, line, label, ha="center", va="center", fontsize=8, family="monospace",
                color="white" if norm(n) > 0.6 else "black")
        if first:
            ax.plot([x, x], [line - 0.45, line + 0.45], color="#333333", lw=0.8)
    ax.set_xlim(-0.5, columns + 0.5)
    ax.set_ylim(lines - 0.5, -0.5)
    ax.axis("off")
    fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, orientation="horizontal", fraction=0.04,
                 pad=0.02, label="tokens committed by the step (| = a step begins)")
    shown = f" (first {max_tokens} tokens)" if len(texts) > max_tokens else ""
    ax.set_title(f"request {item['id']}: {len(texts)} tokens in {len(acc)} steps{shown}", fontsize=10)
    return _save(fig, path, svg=False)


def _rect(x, line, w, color):
    from matplotlib.patches import Rectangle  # matplotlib is heavy: loaded only to draw
    return Rectangle((x, line - 0.42), w, 0.84, fc=color, ec="white", lw=0.4)


def draw_acceptance(results: dict, path: Path) -> list[Path]:
    from matplotlib.figure import Figure  # matplotlib is heavy: loaded only to draw
    items = results["items"]
    by_depth = depth_acceptance(items)
    lengths = [n for it in items for n in it["accepted_lengths"][1:]]
    fig = Figure(figsize=(11, 4), layout="constrained")
    a, b = fig.subplots(1, 2)
    a.bar([int(d) for d in by_depth], list(by_depth.values()), color=GREEN)
    a.set(xlabel="draft depth", ylabel="acceptance", ylim=(0, 1), title="acceptance by depth")
    if lengths:
        top = max(lengths)
        b.hist(lengths, bins=[k + 0.5 for k in range(top + 1)], color=BLUE, rwidth=0.85)
    b.set(xlabel="tokens committed per step", ylabel="steps",
          title=f"{results.get('decode')}: mean {results['summary'].get('mean_accepted_length', 0):.2f}")
    return _save(fig, path, svg=False)


def pick_steps(trees: list[dict], n: int = 3) -> list[int]:
    """Steps worth a look: the longest accepted path, the largest tree, the first tree step."""
    if not trees:
        return []
    picks = [max(trees, key=lambda t: (len(t["path"]), -t["step"]))["step"],
             max(trees, key=lambda t: (len(t["tokens"]), -t["step"]))["step"], trees[0]["step"]]
    return list(dict.fromkeys(picks))[:n]


def draw_run(run: Path, results: dict | None = None, requests: list[str] | None = None,
             steps: list[int] | None = None) -> list[Path]:
    run = Path(run)
    if results is None:
        path = run / "results.json"
        if not path.is_file():
            raise UserError(f"{run} holds no results.json: pass a run directory of `python -m pipeline` or a multirun directory")
        results = json.loads(path.read_text())
    items = results["items"]
    out_dir = run / "report"
    out_dir.mkdir(exist_ok=True)
    made = draw_acceptance(results, out_dir / "acceptance.png")
    recorded = [it for it in items if it.get("trees")]
    if requests:
        known = {it["id"] for it in items}
        missing = [r for r in requests if r not in known]
        if missing:
            raise UserError(f"no request {missing[0]!r} in {run}: known ids are {', '.join(sorted(known)[:10])}")
        chosen = [it for it in items if it["id"] in requests]
    else:
        chosen = (recorded or items)[:1]
    for it in chosen:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(it["id"]))
        made += draw_strip(it, out_dir / f"strip-{safe}.png")
        trees = {t["step"]: t for t in it.get("trees") or []}
        for k in (steps or pick_steps(list(trees.values()))):
            if k not in trees:
                raise UserError(f"request {it['id']} has no recorded tree at step {k}: its tree steps are "
                                f"{', '.join(map(str, list(trees)[:20]))}")
            t = trees[k]
            title = (f"{results.get('decode')}, request {it['id']}, step {k}: {len(t['tokens']) - 1} drafts, "
                     f"{len(t['path']) - 1} accepted (+1 from the target)")
            made += draw_tree(t, title, out_dir / f"tree-{safe}-step{k}.png")
    if not recorded:
        print(f"report: {run} recorded no trees (decode with record_trees=true for the tree pictures)", file=sys.stderr)
    return made


def run_pictures(run: Path, results: dict) -> list[Path]:
    """What a logger shows of a decode run: `draw_run`'s pictures when it recorded trees, else none."""
    return draw_run(run, results) if any(it.get("trees") for it in results["items"]) else []


def report(path: Path, requests=None, steps=None, install: bool = False) -> list[Path]:
    if not path.is_dir():
        raise UserError(f"{path} is not a directory: pass a run directory or a multirun directory")
    if (path / "results.json").is_file():
        return draw_run(path, requests=requests, steps=steps)
    jobs = sweep.load_jobs(path)
    if not jobs:
        raise UserError(f"{path} holds neither results.json nor sweep jobs: pass a run or multirun directory")
    made = sweep.write_summary(path)
    if (path / "best.json").is_file() or install:
        best = sweep.write_best(path, install=install)
        made += [best] if best else []
    for job in jobs:
        res = job["path"] / "results.json"
        if res.is_file():
            results = json.loads(res.read_text())
            if any(it.get("trees") for it in results["items"]):
                made += draw_run(job["path"], results, requests, steps)
    return made


@one_line_errors
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pipeline.report", description=__doc__.split("\n")[0])
    ap.add_argument("path", type=Path, help="a run directory (results.json) or a multirun directory")
    ap.add_argument("--requests", nargs="+", help="request ids to draw (default: the first with trees)")
    ap.add_argument("--steps", nargs="+", type=int, help="step indices to draw (default: three picked)")
    ap.add_argument("--install", action="store_true",
                    help="after a search: write the best tree as tree.json beside its Medusa checkpoint")
    a = ap.parse_args(argv)
    made = report(a.path, a.requests, a.steps, a.install)
    for p in made:
        print(p)


if __name__ == "__main__":
    main()
