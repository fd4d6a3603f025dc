"""The run metrics, from result items alone: what `results.json`'s summary, the bench, the sweep
and the report pictures all compute the same way. A leaf: it imports nothing of the project."""
from __future__ import annotations

import statistics


def depth_acceptance(items: list[dict]) -> dict[str, float]:
    """Fraction of tree steps reaching depth d among steps whose tree had a draft at depth d."""
    hit, tried = {}, {}
    for it in items:
        for acc, depth in zip(it["accepted_lengths"][1:], it["tree_depths"]):
            for d in range(1, depth + 1):
                tried[d] = tried.get(d, 0) + 1
                hit[d] = hit.get(d, 0) + (acc - 1 >= d)
    return {str(d): hit[d] / tried[d] for d in sorted(tried)}


def step_latency(items: list[dict]) -> dict[str, float | None]:
    """Mean step latency of tree steps and of plain steps; where the items split their steps (ours),
    a tree step's time as drafting, verifying (the target's forward, masks, logits and processors)
    and the rest (deciding, committing, the proposers' bookkeeping)."""
    pairs = [(ms, n) for it in items for ms, n in zip(it["step_ms"], it["step_nodes"])]
    tree = [ms for ms, n in pairs if n > 1]
    plain = [ms for ms, n in pairs if n == 1]
    nodes = [n for _, n in pairs if n > 1]
    out = {"tree_step_ms": statistics.mean(tree) if tree else None,
           "plain_step_ms": statistics.mean(plain) if plain else None,
           "mean_tree_nodes": statistics.mean(nodes) if nodes else None,
           "tree_steps": len(tree), "plain_steps": len(plain)}
    split = [(ms, d, v) for it in items if it.get("step_draft_ms")
             for ms, n, d, v in zip(it["step_ms"], it["step_nodes"], it["step_draft_ms"], it["step_verify_ms"]) if n > 1]
    if split:
        out.update(tree_draft_ms=statistics.mean(d for _, d, _ in split),
                   tree_verify_ms=statistics.mean(v for _, _, v in split),
                   tree_rest_ms=statistics.mean(ms - d - v for ms, d, v in split))
    return out


def constraint_stats(items: list[dict]) -> dict:
    """For constrained requests: how many ended complete, drafts pruned for leaving the language, and
    the constraint's cost per committed token (masks, tree walks, advances, applying the mask), the
    median over steps."""
    cons = [it for it in items if it.get("constraint")]
    if not cons:
        return {}
    per_token = [ms * 1e3 / n for it in cons for ms, n in zip(it["mask_ms"], it["accepted_lengths"]) if n]
    return {"constrained_requests": len(cons),
            "constraint_complete": sum(bool(it["constraint_complete"]) for it in cons),
            "pruned_drafts": sum(it["pruned_drafts"] for it in cons),
            "mask_us_per_token": statistics.median(per_token) if per_token else None}


def summarize(items: list[dict], wall_s: float) -> dict:
    """items: result items (or `gen_fields` of Generations). Step latencies are per request-step:
    with batching, one step is shared by every sequence in it."""
    new = sum(len(it["token_ids"]) for it in items)
    steps = sum(len(it["accepted_lengths"]) for it in items)
    return {"requests": len(items), "new_tokens": new, "wall_s": round(wall_s, 4),
            "tokens_per_s": new / wall_s if wall_s > 0 else 0.0, "steps": steps,
            "mean_accepted_length": new / steps if steps else 0.0,
            "acceptance_by_depth": depth_acceptance(items), **step_latency(items), **constraint_stats(items)}


def gen_fields(g) -> dict:
    """A finished `pipeline.core.Generation` as the fields of a result item."""
    out = {"token_ids": g.token_ids, "new_tokens": len(g.token_ids), "wall_s": round(g.wall_s, 4),
           "steps": g.steps, "accepted_lengths": g.accepted_lengths, "finish_reason": g.finish_reason,
           "prefill_ms": round(g.prefill_ms, 2), "mean_step_ms": statistics.mean(g.step_ms) if g.step_ms else None,
           "step_ms": [round(ms, 3) for ms in g.step_ms], "step_nodes": g.step_nodes, "tree_depths": g.tree_depths,
           "step_draft_ms": [round(ms, 3) for ms in getattr(g, "step_draft_ms", [])],
           "step_verify_ms": [round(ms, 3) for ms in getattr(g, "step_verify_ms", [])]}
    if g.constraint is not None:
        out.update(constraint=g.constraint, constraint_complete=g.constraint_complete, pruned_drafts=g.pruned_drafts,
                   mask_ms=[round(ms, 4) for ms in g.mask_ms])
    return out


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where token lists a and b differ (the shorter one's length when one is a
    prefix of the other), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
