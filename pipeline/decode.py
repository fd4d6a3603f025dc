"""`decode(cfg) -> (metrics, objects)`: run every request through the configured pipeline and write
results.json into the run directory."""
from __future__ import annotations

import dataclasses
import statistics
import sys
import time

from omegaconf import DictConfig, OmegaConf

from pipeline.build import build_decoder
from pipeline.decoder import Decoder, Generation
from pipeline.errors import UserError
from pipeline.io import run_dir, write_json
from pipeline.requests import encode, load_requests
from pipeline.streaming import TextStream


def depth_acceptance(gens: list[Generation]) -> dict[str, float]:
    """Fraction of tree steps reaching depth d among steps whose tree had a draft at depth d."""
    hit, tried = {}, {}
    for g in gens:
        for acc, depth in zip(g.accepted_lengths[1:], g.tree_depths):
            for d in range(1, depth + 1):
                tried[d] = tried.get(d, 0) + 1
                hit[d] = hit.get(d, 0) + (acc - 1 >= d)
    return {str(d): hit[d] / tried[d] for d in sorted(tried)}


def step_latency(gens: list[Generation]) -> dict[str, float | None]:
    tree = [ms for g in gens for ms, n in zip(g.step_ms, g.step_nodes) if n > 1]
    plain = [ms for g in gens for ms, n in zip(g.step_ms, g.step_nodes) if n == 1]
    nodes = [n for g in gens for n in g.step_nodes if n > 1]
    return {"tree_step_ms": statistics.mean(tree) if tree else None,
            "plain_step_ms": statistics.mean(plain) if plain else None,
            "mean_tree_nodes": statistics.mean(nodes) if nodes else None,
            "tree_steps": len(tree), "plain_steps": len(plain)}


def summarize(gens: list[Generation], wall_s: float) -> dict:
    new = sum(len(g.token_ids) for g in gens)
    steps = sum(g.steps for g in gens)
    return {"requests": len(gens), "new_tokens": new, "wall_s": round(wall_s, 4),
            "tokens_per_s": new / wall_s if wall_s > 0 else 0.0, "steps": steps,
            "mean_accepted_length": new / steps if steps else 0.0,
            "acceptance_by_depth": depth_acceptance(gens), **step_latency(gens)}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_requests(decoder: Decoder, prompts: list[list[int]], stream=None) -> tuple[list[Generation], float]:
    gens, t0 = [], time.perf_counter()
    for i, ids in enumerate(prompts):
        gens.append(decoder.generate(ids, on_tokens=stream(i) if stream else None, seed=decoder.seed + i))
    return gens, time.perf_counter() - t0


def decode(cfg: DictConfig, backbone=None) -> tuple[dict, dict]:
    decoder, backbone = build_decoder(cfg, backbone)
    tok = backbone.tokenizer
    reqs = load_requests(cfg.get("input"), cfg.get("prompt"))
    if any(r.constraint for r in reqs):
        raise UserError("per-request constraints (json_schema/regex/grammar) are not available in this build; "
                        "remove them from the input lines")
    prompts = [encode(tok, r, bool(cfg.chat), cfg.get("system_prompt")) for r in reqs]
    for r, ids in zip(reqs, prompts):
        if len(ids) >= backbone.model.args.max_seq_len:
            raise UserError(f"request {r.id}: prompt is {len(ids)} tokens, the model's context is "
                            f"{backbone.model.args.max_seq_len}: shorten it")
    streams = {}

    def stream(i):
        if not cfg.stream:
            return None
        streams[i] = TextStream(tok)
        if len(reqs) > 1:
            print(f"\n[{reqs[i].id}] ", end="", flush=True)
        return lambda ids: print(streams[i].push(ids), end="", flush=True)

    if cfg.get("warmup", True):  # first-call costs (allocation, MKL set-up) stay out of the timings
        dataclasses.replace(decoder, max_new_tokens=min(4, decoder.max_new_tokens)).generate(prompts[0])
    gens, wall = run_requests(decoder, prompts, stream if cfg.stream else None)
    if cfg.stream:
        print("".join(s.flush() for s in streams.values()), flush=True)
    items = []
    for r, g in zip(reqs, gens):
        items.append({"id": r.id, "prompt": r.prompt, "token_ids": g.token_ids,
                      "text": tok.decode(g.token_ids, skip_special_tokens=True),
                      "new_tokens": len(g.token_ids), "wall_s": round(g.wall_s, 4), "steps": g.steps,
                      "accepted_lengths": g.accepted_lengths, "finish_reason": g.finish_reason,
                      "prefill_ms": round(g.prefill_ms, 2),
                      "mean_step_ms": statistics.mean(g.step_ms) if g.step_ms else None})
    summary = summarize(gens, wall)
    if cfg.get("verify_lossless"):
        summary.update(verify_lossless(decoder, backbone, prompts, gens, items))
    results = {"decode": cfg.get("name", "custom"), "config": OmegaConf.to_container(cfg, resolve=True),
               "summary": summary, "items": items}
    path = write_json(run_dir(cfg) / "results.json", results)
    return {**summary, "results_path": str(path)}, {"decoder": decoder, "backbone": backbone,
                                                    "generations": gens, "results": results}


def verify_lossless(decoder: Decoder, backbone, prompts, gens, items) -> dict:
    """Re-run every request with plain decoding (same sampler, no proposer) and report the first
    divergence, if any."""
    plain = dataclasses.replace(decoder, proposer=None, verifier=None)
    ref, _ = run_requests(plain, prompts)
    diverged = 0
    for item, g, r in zip(items, gens, ref):
        d = first_divergence(g.token_ids, r.token_ids)
        item["lossless"] = d is None
        item["first_divergence"] = d
        diverged += d is not None
    if diverged:
        print(f"verify_lossless: {diverged} of {len(items)} requests diverge from plain greedy", file=sys.stderr)
    return {"lossless": diverged == 0, "diverged_requests": diverged}
