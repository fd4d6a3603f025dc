"""A tree size that never loses: how many of a proposer's ranked draft paths to verify per step, on
this machine, in this precision, chosen by predicted tokens per second, where zero (plain decoding)
is a candidate.

Given the paths in the order a tree search grew them, each with its measured acceptance P(path)
(teacher-forced on held-out answers, `python -m pipeline.tree_search`), and the measured wall time
of a whole step with n drafts (target forward over n + 1 rows, LM head, argmax to the host, plus
the proposer's own cost), the expected speedup of the first n paths is

    (1 + sum of P over them) / step_ms(n) * step_ms(0)

and the policy takes the n that maximises it, or 0 (plain decoding) when the best prediction is
under `min_gain` (default 1.05: the prediction's error, measured, is of that order).
Step times are measured once per machine, precision and thread count (about a second for
SmolLM2 in q4) and cached beside the kernel plans.
"""
from __future__ import annotations

import json
import time

import torch

from pipeline.core import StaticTree, StepBatch, atomic_write, forward_step
from components.kv.contiguous import ContiguousKV
from components.model.load import cache_dir
from components.model.tuner import machine_key

SIZES = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # drafts per step at which the cost is measured


@torch.inference_mode()
def step_costs(model, order: list[tuple[int, ...]], proposal_ms: float, prefix: int = 128,
               repeats: int = 5, batch: int = 1) -> dict[int, float]:
    """ms of a whole verification step with the first n paths of `order`, for n in SIZES (capped),
    for `batch` sequences drafting together (the run's batch size: its steps have batch x (n + 1)
    rows, so the rows a draft adds cost what they cost at that size).

    A measuring tool, not a run's cache: its scratch pool is always contiguous, so the costs (cached
    per machine, precision and batch size, never per `kv` option) time the same thing in every run."""
    a = model.args
    kv = ContiguousKV(None, prefix + len(order) + 8, a.n_layers, a.n_kv_heads, a.head_dim, model.attn_dtype,
                      device=model.device)
    g = torch.Generator().manual_seed(0)
    seqs = [kv.create() for _ in range(batch)]
    for seq in seqs:
        forward_step(model, kv, StepBatch.build([seq], [torch.randint(0, a.vocab_size, (prefix,), generator=g)], [None],
                                                [None], [0], model.attn_dtype))
        kv.commit(seq)
    out = {}
    for n in sorted({min(s, len(order)) for s in SIZES}):
        tokens = [torch.randint(0, a.vocab_size, (n + 1,), generator=g) for _ in seqs]
        depth, mask = StaticTree.from_choices(order[:n]).structure if n else (None, None)
        times = []
        for _ in range(repeats + 1):
            t = time.perf_counter()
            h = forward_step(model, kv, StepBatch.build(seqs, tokens, [depth] * batch, [mask] * batch,
                                                        [kv.used(s) for s in seqs], model.attn_dtype))
            model.logits(h).argmax(-1).tolist()
            for seq in seqs:
                kv.discard(seq)
            times.append((time.perf_counter() - t) * 1e3)
        out[n] = sorted(times[1:])[len(times[1:]) // 2] + (batch * proposal_ms if n else 0.0)
    for seq in seqs:
        kv.free(seq)
    return out


def interpolate(table: dict[int, float], n: int) -> float:
    xs = sorted(table)
    if n <= xs[0]:
        return table[xs[0]]
    for a, b in zip(xs, xs[1:]):
        if n <= b:
            return table[a] + (table[b] - table[a]) * (n - a) / (b - a)
    return table[xs[-1]]


def choose(order: list[tuple[tuple[int, ...], float]], costs: dict[int, float], min_gain: float = 1.0) -> dict:
    """The size with the best predicted speedup, and the whole table; 0 (plain decoding) unless
    that speedup reaches `min_gain` (a margin for the prediction's error: measured within ~5-15%)."""
    plain = costs[0]
    rows = [{"nodes": 0, "expected_accept_length": 1.0, "step_ms": plain, "expected_speedup": 1.0}]
    accept = 1.0
    for n, (_, p) in enumerate(order, 1):
        accept += p
        ms = interpolate(costs, n)
        rows.append({"nodes": n, "expected_accept_length": accept, "step_ms": ms, "expected_speedup": accept / ms * plain})
    best = rows[best_prefix([p for _, p in order], costs, min_gain)]
    return {**best, "choices": [list(path) for path, _ in order[:best["nodes"]]], "table": rows}


def best_prefix(probs: list[float], costs: dict[int, float], min_gain: float = 1.0) -> int:
    """Per step: how many of the drafts, ranked by their estimated acceptance probability `probs`
    (descending; for a dynamic draft its cumulative draft probability), to verify: the n with the
    best predicted tokens per ms, (1 + sum of the first n probs) / step_ms(n), or 0 (a plain step)
    unless that beats plain decoding by `min_gain` (at least 1: never a tree predicted slower)."""
    plain = costs[0]
    best, best_rate, accept = 0, max(1.0, min_gain) / plain, 1.0
    for n, p in enumerate(probs, 1):
        accept += p
        rate = accept / interpolate(costs, n)
        if rate > best_rate:
            best, best_rate = n, rate
    return best


def measured_costs(backbone, order: list[tuple[int, ...]], proposal_ms: float, cache_key: str,
                   batch: int = 1) -> dict[int, float]:
    """`step_costs`, measured once per machine, precision, thread count, batch size and `cache_key`,
    then cached beside the kernel plans."""
    native = "native" if backbone.model.native is not None else "torch"
    path = cache_dir() / f"tree-costs-{machine_key(backbone.model)}-{native}-b{batch}-{cache_key}.json"
    if path.is_file():
        return {int(k): v for k, v in json.loads(path.read_text()).items()}
    costs = step_costs(backbone.model, order, proposal_ms, batch=batch)
    atomic_write(path, json.dumps(costs))
    return costs


def size_tree(backbone, order: list[tuple[tuple[int, ...], float]], proposal_ms: float, cache_key: str,
              min_gain: float = 1.0, batch: int = 1) -> dict:
    """`choose` with this machine's step costs for `batch` sequences drafting together (keyed by the
    machine, the precision, the batch size and the paths)."""
    costs = measured_costs(backbone, [p for p, _ in order], proposal_ms, cache_key, batch)
    return {**choose(order, costs, min_gain), "step_ms_by_drafts": costs, "precision": backbone.model.precision,
            "min_gain": min_gain, "batch_size": batch}


def chain_costs(backbone, max_nodes: int, batch: int = 1) -> dict[int, float]:
    """ms of a verification step with n drafts, n up to max_nodes, for a proposer whose trees change
    every step (a chain of n: the cost is the rows'), measured once per machine, precision, batch
    size and max_nodes, then cached (`measured_costs`)."""
    chain = [(0,) * k for k in range(1, max_nodes + 1)]
    return measured_costs(backbone, chain, 0.0, f"chain{max_nodes}", batch)
