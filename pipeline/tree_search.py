"""python -m pipeline.tree_search [proposer.checkpoint=...] [search.max_nodes=64]

The hardware-aware tree: measure, on this machine,
  1. how often each path of head ranks is right, teacher-forced on held-out self-distilled answers
     (P(path) = the fraction of positions where every head on the path ranks the true token at
     exactly the path's rank), and
  2. the latency of a target forward over n tree nodes,
then grow the tree by greedy node addition (the most probable missing path first, as in Medusa's
tree script: a child is never more probable than its parent, so each prefix of the order is a
valid tree), and keep the size that maximises expected tokens per second:
  (1 + sum of P(path) over the tree's nodes) / (latency(n) + head cost).
Writes tree.json (choices, the chosen size, the measured tables) into the run directory and, with
search.install=true, beside the checkpoint, where decode=tree_medusa picks it up.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import hydra
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from components.data.datamodule import head_targets
from components.proposer.policy import choose, step_costs
from pipeline.build import component
from pipeline.cli import CONF_DIR, check_overrides
from pipeline.errors import UserError, one_line_errors
from pipeline.io import run_dir, write_json


def rank_matrix(heads, hidden: torch.Tensor, targets: torch.Tensor, max_rank: int, batch: int = 2048) -> torch.Tensor:
    """(positions, K) rank of the true token y_{t+1+k} among head k's candidates; max_rank = a miss
    (outside the top max_rank, outside the draft vocabulary, or past the answer's end)."""
    lookup = torch.full((int(max(heads.vocab_ids.max(), targets.max())) + 1,), -1, dtype=torch.long)
    lookup[heads.vocab_ids] = torch.arange(heads.vocab_ids.numel())
    out = []
    with torch.inference_mode():
        for s in range(0, hidden.shape[0], batch):
            logits = heads(hidden[s:s + batch].float())  # (K, b, V')
            top = logits.topk(max_rank, dim=-1).indices.permute(1, 0, 2)  # (b, K, r)
            t = targets[s:s + batch]
            dt = torch.where(t >= 0, lookup[t.clamp(min=0)], -1)  # (b, K) draft ids
            hit = top == dt[..., None]
            rank = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(dt, max_rank))
            out.append(torch.where(dt >= 0, rank, torch.full_like(dt, max_rank)))
    return torch.cat(out)


def grow_tree(ranks: torch.Tensor, max_nodes: int, max_rank: int) -> list[tuple[tuple[int, ...], float]]:
    """Greedy node addition: returns [(path, P(path))] in the order the nodes join the tree."""
    K = ranks.shape[1]
    chosen: list[tuple[tuple[int, ...], float]] = []
    prob = lambda p: float((ranks[:, :len(p)] == torch.tensor(p)).all(-1).float().mean())
    frontier = {(r,): prob((r,)) for r in range(max_rank)}
    while frontier and len(chosen) < max_nodes:
        path = max(frontier, key=frontier.get)
        chosen.append((path, frontier.pop(path)))
        if len(path) < K:
            for r in range(max_rank):
                child = path + (r,)
                frontier[child] = prob(child)
    return chosen


def search(cfg: DictConfig) -> tuple[dict, dict]:
    backbone = component(cfg.model)
    proposer = component(cfg.proposer, backbone)
    heads = proposer.heads
    data = instantiate(cfg.data)(backbone=backbone, num_heads=heads.num_heads)
    data.setup("fit")
    val = data.val_set
    if val.tokens.numel() == 0:
        raise UserError("the held-out split is empty: raise data.max_samples or data.val_fraction")
    s = cfg.search
    ranks = rank_matrix(heads, val.hidden, head_targets(val, heads.num_heads), s.max_rank)
    order = grow_tree(ranks, s.max_nodes, s.max_rank)
    t = time.perf_counter()
    for _ in range(20):
        heads.topk(val.hidden[:1].float(), s.max_rank)
    head_ms = (time.perf_counter() - t) / 20 * 1e3
    costs = step_costs(backbone.model, [p for p, _ in order], head_ms, s.prefix, s.repeats)
    best = choose(order, costs, s.get("min_gain", 1.0))
    rows, plain_ms = best.pop("table"), costs[0]
    choices = [list(p) for p, _ in order[:best["nodes"]]]
    result = {"choices": choices, "nodes": best["nodes"], "expected_accept_length": best["expected_accept_length"],
              "expected_speedup": best["expected_speedup"], "plain_step_ms": plain_ms, "head_ms": head_ms,
              "step_ms_by_drafts": {str(k): v for k, v in costs.items()}, "precision": backbone.model.precision,
              "table": rows,
              "path_probability": [[list(p), q] for p, q in order], "held_out_positions": int(ranks.shape[0]),
              "head_top1": [float((ranks[:, k] == 0).float().mean()) for k in range(heads.num_heads)],
              "head_top5": [float((ranks[:, k] < 5).float().mean()) for k in range(heads.num_heads)]}
    path = write_json(run_dir(cfg) / "tree.json", result)
    if s.install:
        write_json(Path(proposer.checkpoint_path).parent / "tree.json", result)
    return result, {"path": path}


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="tree_search")
@one_line_errors
def main(cfg: DictConfig):
    result, objs = search(cfg)
    print(f"tree of {result['nodes']} nodes: expected accept length {result['expected_accept_length']:.2f}, "
          f"expected speedup {result['expected_speedup']:.2f}x -> {objs['path']}", file=sys.stderr)


if __name__ == "__main__":
    check_overrides(sys.argv[1:], "tree_search")
    main()
