"""`decode(cfg) -> (metrics, objects)`: run every request through the configured pipeline.

Each finished request is appended to `items.jsonl` in the run directory the moment it finishes;
`results.json` is written from those at the end (whole, by rename). Re-running in the same run
directory skips the ids already there. Ctrl-C or SIGTERM stops cleanly: what finished is kept,
`results.json` covers it, and the run can be resumed.
"""
from __future__ import annotations

import copy
import hashlib
import json
import signal
import statistics
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import replace

import torch
from omegaconf import DictConfig, OmegaConf

from pipeline.build import build_engine, check_constraint, check_paths, constraint_node, positive_int
from pipeline.core import Engine, Generation, UserError
from pipeline.errors import Interrupted
from pipeline.io import append_jsonl, run_dir, write_json
from pipeline.requests import encode, load_requests
from pipeline.streaming import StreamPrinter


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
    pairs = [(ms, n) for it in items for ms, n in zip(it["step_ms"], it["step_nodes"])]
    tree = [ms for ms, n in pairs if n > 1]
    plain = [ms for ms, n in pairs if n == 1]
    nodes = [n for _, n in pairs if n > 1]
    return {"tree_step_ms": statistics.mean(tree) if tree else None,
            "plain_step_ms": statistics.mean(plain) if plain else None,
            "mean_tree_nodes": statistics.mean(nodes) if nodes else None,
            "tree_steps": len(tree), "plain_steps": len(plain)}


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


def gen_fields(g: Generation) -> dict:
    out = {"token_ids": g.token_ids, "new_tokens": len(g.token_ids), "wall_s": round(g.wall_s, 4),
           "steps": g.steps, "accepted_lengths": g.accepted_lengths, "finish_reason": g.finish_reason,
           "prefill_ms": round(g.prefill_ms, 2), "mean_step_ms": statistics.mean(g.step_ms) if g.step_ms else None,
           "step_ms": [round(ms, 3) for ms in g.step_ms], "step_nodes": g.step_nodes, "tree_depths": g.tree_depths}
    if g.constraint is not None:
        out.update(constraint=g.constraint, constraint_complete=g.constraint_complete, pruned_drafts=g.pruned_drafts,
                   mask_ms=[round(ms, 4) for ms in g.mask_ms])
    return out


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_requests(engine: Engine, prompts: list[list[int]], seeds: list[int] | None = None,
                 **callbacks) -> tuple[list[Generation], float]:
    t0 = time.perf_counter()
    gens = engine.run(prompts, seeds, **callbacks)
    return gens, time.perf_counter() - t0


def preset_name(cfg: DictConfig) -> str:
    """The preset's name if the run uses the preset's components, else the preset followed by the
    components that differ (`greedy proposer=ngram verifier=greedy`): a run whose proposer,
    verifier or sampler was picked by hand is never reported, or taken by a sweep, as a preset it
    is not."""
    from pipeline.cli import compose_config, groups
    name = cfg.get("name") or "custom"
    if name not in groups()["decode"]:
        return "custom"
    ref = compose_config([f"decode={name}"])
    differ = [f"{g}={component_choice(g, cfg.get(g))}" for g in ("proposer", "verifier", "sampler")
              if _pick(ref.get(g)) != _pick(cfg.get(g))]
    return " ".join([name, *differ])


def _pick(node):
    """What makes a component this component: its class (and, for samplers, whether it samples)."""
    if node is None:
        return None
    return OmegaConf.select(node, "_target_"), OmegaConf.select(node, "do_sample")


def component_choice(group: str, node) -> str:
    """The config-group option a component node came from (the running Hydra app's choice, else
    the conf/<group>/ file with the same class), for naming runs."""
    if node is None:
        return "null"
    try:
        from hydra.core.hydra_config import HydraConfig
        choice = HydraConfig.get().runtime.choices.get(group)
        if choice:
            return str(choice)
    except ValueError:
        pass
    from pipeline.cli import CONF_DIR
    import yaml
    for f in sorted((CONF_DIR / group).glob("*.yaml")):
        if _pick(OmegaConf.create(yaml.safe_load(f.read_text()) or {})) == _pick(node):
            return f.stem
    return str(OmegaConf.select(node, "_target_")).rsplit(".", 1)[-1]


def load_items(path, keys: dict[str, str]) -> dict[str, dict]:
    """Finished items of an earlier run in this directory, by id. A torn last line (a kill during
    the append) is cut off so the next append starts a line of its own; an item made from another
    prompt or pipeline is refused."""
    done = {}
    if not path.is_file():
        return done
    text = path.read_text()
    if text and not text.endswith("\n"):
        text = text[:text.rfind("\n") + 1]
        path.write_text(text)
    for line in text.splitlines():
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue
        rid = item.get("id")
        if rid in keys:
            if item.get("request_key") != keys[rid]:
                raise UserError(f"{path} holds request {rid!r} decoded from another prompt or pipeline: "
                                "resume with the same input and settings, or pick a new hydra.run.dir")
            done[rid] = item
    return done


class _Signals:
    """SIGINT/SIGTERM become KeyboardInterrupt, but never while a finished item is being saved."""

    def __init__(self):
        self.saving, self.pending = False, False

    def handler(self, signum, frame):
        if self.saving:
            self.pending = True
        else:
            raise KeyboardInterrupt

    @contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = {s: signal.signal(s, self.handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    @contextmanager
    def saving_item(self):
        self.saving = True
        try:
            yield
        finally:
            self.saving = False
        if self.pending:
            raise KeyboardInterrupt


def request_key(cfg: DictConfig, r) -> str:
    """What decides a request's tokens: its text, its constraint and the pipeline (model, sampler,
    proposer, verifier, constraint, limits, seed, chat). Resuming refuses items made from another."""
    parts = {"prompt": r.prompt, "messages": r.messages,
             "request_constraint": r.constraint if cfg.get("request_constraints", True) else None,
             **{k: OmegaConf.to_container(cfg[k], resolve=True) if isinstance(cfg.get(k), DictConfig) else cfg.get(k)
                for k in ("model", "sampler", "proposer", "verifier", "max_new_tokens", "seed", "chat", "system_prompt",
                          "constraint", "num_beams", "length_penalty", "early_stopping", "num_return_sequences",
                          "num_beam_groups", "diversity_penalty")}}
    return hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def decode(cfg: DictConfig, backbone=None) -> tuple[dict, dict]:
    reqs = load_requests(cfg.get("input"), cfg.get("prompt"))  # bad input fails before the model loads
    positive_int(cfg, "max_new_tokens")
    positive_int(cfg, "batch_size")
    check_paths(cfg)
    if cfg.get("verify_lossless") and cfg.get("num_beams") is not None:
        raise UserError("verify_lossless compares speculation with plain decoding; beam search has no plain "
                        "counterpart: drop verify_lossless=true")
    constraint_nodes = request_constraints(cfg, reqs)  # an invalid regex/schema/grammar fails here too
    name = preset_name(cfg)
    out = run_dir(cfg)
    items_path = out / "items.jsonl"
    keys = {r.id: request_key(cfg, r) for r in reqs}
    done = load_items(items_path, keys)
    todo = [k for k, r in enumerate(reqs) if r.id not in done]
    signals, fresh = _Signals(), {}
    with signals.installed():  # from here on, SIGTERM is a clean stop like Ctrl-C
        engine, backbone = build_engine(cfg, backbone, with_constraint=False)  # each request's is passed
        engine.record_trees = bool(cfg.get("record_trees", False))
        tok, limit = backbone.tokenizer, backbone.model.args.max_seq_len
        grammar_cache: dict = {}
        grammars = build_grammars(backbone, constraint_nodes, todo, grammar_cache)
        prompts = {k: encode(tok, with_constraint_text(reqs[k], grammars[k]), bool(cfg.chat), cfg.get("system_prompt"))
                   for k in todo}
        for k, ids in prompts.items():
            if len(ids) >= limit:
                raise UserError(f"request {reqs[k].id}: prompt is {len(ids)} tokens, the model's context is "
                                f"{limit}: shorten it or raise model.max_seq_len")
        made_in = {it.get("precision") for it in done.values()} - {None, backbone.precision}
        if made_in:
            raise UserError(f"{items_path} holds requests decoded in {', '.join(sorted(made_in))}, this run computes in "
                            f"{backbone.precision}: pass model.dtype={sorted(made_in)[0]} to resume, or a new hydra.run.dir")
        policy = speculation_policy(engine, name)
        if done:
            print(f"resuming in {out}: {len(done)} of {len(reqs)} requests already finished", file=sys.stderr)
        if todo and cfg.get("warmup", True):  # first-call costs (allocation, MKL set-up) stay out of the timings
            warm = copy.copy(engine)
            warm.max_new_tokens = min(4, engine.max_new_tokens)
            warm.run([prompts[todo[0]]])
        printer = StreamPrinter(tok, [reqs[k].id for k in todo], show_ids=len(reqs) > 1) if cfg.stream else None

        def finished(j: int, g: Generation):
            r = reqs[todo[j]]
            item = {"id": r.id, "prompt": r.prompt, "text": tok.decode(g.token_ids, skip_special_tokens=True),
                    **gen_fields(g), "request_key": keys[r.id], "precision": backbone.precision}
            if g.beams is not None:  # beam search: every returned hypothesis, best first
                item["beams"] = [{"token_ids": ids, "text": tok.decode(ids, skip_special_tokens=True), "score": score}
                                 for ids, score in g.beams]
                item["kv_peak_bytes"], item["kv_copy_per_beam_bytes"] = g.kv_peak_bytes, g.kv_copy_per_beam_bytes
            if engine.record_trees:  # what pipeline.report draws, with each token's text
                piece = lambda ids: [tok.decode([t]) for t in ids]
                item["token_texts"] = piece(g.token_ids)
                item["trees"] = [{**t, "texts": piece(t["tokens"])} for t in g.trees]
            with signals.saving_item():
                append_jsonl(items_path, item)
                fresh[r.id] = item
                if printer is not None:
                    printer.finish(j)
                if g.finish_reason == "context":
                    print(f"[{r.id}] stopped at the context end ({limit} tokens): shorten the prompt or raise "
                          "model.max_seq_len", file=sys.stderr)
                if g.constraint_complete is False:
                    print(f"[{r.id}] the output is incomplete: it stopped ({g.finish_reason}) before its {g.constraint} "
                          "constraint could end; raise max_new_tokens", file=sys.stderr)

        out.mkdir(parents=True, exist_ok=True)
        interrupted, t0 = False, time.perf_counter()
        try:
            engine.run([prompts[k] for k in todo], [int(cfg.seed) + k for k in todo],
                       on_tokens=printer.push if printer is not None else None, on_finish=finished,
                       grammars=[grammars[k] for k in todo])
        except KeyboardInterrupt:
            interrupted = True
        wall = time.perf_counter() - t0
        if printer is not None:
            printer.close()
        items = [done.get(r.id) or fresh[r.id] for r in reqs if r.id in done or r.id in fresh]
        summary = summarize(list(fresh.values()), wall)  # speed of this run's requests
        summary.update(requests=len(items), finished_now=len(fresh), resumed=len(done), interrupted=interrupted,
                       threads=torch.get_num_threads(),
                       kv=engine.kv.stats(), **backbone.describe(), **({"speculation": policy} if policy else {}))
        notice = backbone.lossless_notice(engine.proposer is not None, engine.batch_size > 1)
        if notice:
            summary["lossless_notice"] = notice
        tree = proposer_report(engine).get("tree")
        if tree is not None:
            summary["tree"] = tree
        if engine.guard is not None and engine.proposer is not None:
            guard = summary["guard"] = engine.guard.describe()
            steps = guard["tree_steps"] + guard["plain_steps"]
            if steps and guard["held_steps"] > steps / 2:
                print(f"{name}: drafting did not pay in this run ({guard['held_steps']} of {steps} steps plain, "
                      "paused by the speculation guard); speculation_guard=false always drafts", file=sys.stderr)
        if cfg.get("verify_lossless") and not interrupted:
            try:
                summary.update(verify_lossless(engine, backbone, cfg, reqs, items, constraint_nodes, grammar_cache))
            except KeyboardInterrupt:  # the decoding itself is complete: keep it, without a verdict
                interrupted = summary["interrupted"] = True
        results = {"decode": name, "plain": cfg.get("proposer") is None and cfg.get("num_beams") is None,
                   "config": OmegaConf.to_container(cfg, resolve=True), "summary": summary, "items": items}
        path = out / "results.json"
        if fresh or not interrupted:  # an interrupted run that finished nothing leaves what is there alone
            write_json(path, results)
            if cfg.get("logger") is not None:
                from pipeline.tracking import log_decode
                log_decode(cfg, results, out)
    if interrupted:
        raise Interrupted(f"interrupted: {len(items)} of {len(reqs)} requests finished"
                          f"{f', kept in {items_path}' if items else ''}; rerun with hydra.run.dir={out} to resume")
    return {**summary, "results_path": str(path)}, {"engine": engine, "backbone": backbone, "results": results}


def request_constraints(cfg: DictConfig, reqs) -> dict[int, DictConfig | None]:
    """Each request's constraint node (its own, else the configured one), every distinct one checked
    now, before the model loads: an invalid regex, schema or grammar costs nothing."""
    out, checked = {}, set()
    use_own = cfg.get("request_constraints", True)
    for k, r in enumerate(reqs):
        node = constraint_node(cfg, r.constraint if use_own else None)
        key = None if node is None else OmegaConf.to_yaml(node)
        if key is not None and key not in checked:
            where = f"request {r.id}" if r.constraint else "constraint"
            for w in check_constraint(node, where):
                print(f"{where}: the constraint is approximated: {w}", file=sys.stderr)
            checked.add(key)
        out[k] = node
    return out


def build_grammars(backbone, nodes: dict, todo: list[int], made: dict | None = None) -> dict:
    """Compiled grammars per request: one object per distinct constraint node (`made` caches them
    by node across calls)."""
    from pipeline.build import component
    made = {} if made is None else made
    out = {}
    for k in todo:
        node = nodes[k]
        key = None if node is None else OmegaConf.to_yaml(node)
        if key is not None and key not in made:
            made[key] = component(node, backbone)
        out[k] = None if key is None else made[key]
    return out


def with_constraint_text(r, grammar):
    """The request with its constraint's text added to the prompt (`add_to_prompt`)."""
    if grammar is None or not grammar.add_to_prompt or not grammar.text():
        return r
    if r.messages is not None:
        msgs = [dict(m) for m in r.messages]
        msgs[-1]["content"] = f"{msgs[-1]['content']}\n\n{grammar.text()}"
        return replace(r, messages=msgs, prompt=msgs[-1]["content"])
    return replace(r, prompt=f"{r.prompt}\n\n{grammar.text()}")


def proposer_report(engine: Engine) -> dict:
    """What the engine's proposer (drafting or idle) says of itself (`Proposer.describe`); {} without one."""
    proposer = engine.proposer or engine.idle_proposer
    return {} if proposer is None else proposer.describe()


def speculation_policy(engine: Engine, name: str) -> dict | None:
    """The proposer's sizing decision (components/proposer/policy.py), said in one line when it is
    plain decoding; None for proposers without one."""
    policy = proposer_report(engine).get("policy")
    if not policy:
        return None
    out = {k: policy[k] for k in ("nodes", "expected_speedup", "expected_accept_length", "precision")}
    if policy["nodes"] == 0:
        best = max(policy["table"][1:], key=lambda r: r["expected_speedup"], default=None)
        why = "" if best is None else f" (the best tree, {best['nodes']} drafts, predicts {best['expected_speedup']:.2f}x)"
        print(f"{name}: no draft tree pays on this machine in {policy['precision']}{why}: decoding plainly; "
              "proposer.nodes=<n> forces a tree", file=sys.stderr)
        out["active"] = False
    else:
        out["active"] = True
    return out


def verify_lossless(engine: Engine, backbone, cfg, reqs, items, nodes: dict, cache: dict) -> dict:
    """Re-run every request with plain decoding (same sampler, no proposer) and report the first
    divergence, if any, on the terminal and in the items."""
    plain = Engine(engine.model, engine.kv, engine.sampler, list(engine.eos_ids), engine.max_new_tokens,
                   seed=engine.seed, batch_size=engine.batch_size, constraint=engine.constraint)
    index = {r.id: k for k, r in enumerate(reqs)}
    ks = [index[it["id"]] for it in items]
    grammars = build_grammars(backbone, nodes, ks, cache)
    prompts = [encode(backbone.tokenizer, with_constraint_text(reqs[k], grammars[k]), bool(cfg.chat),
                      cfg.get("system_prompt")) for k in ks]
    ref, _ = run_requests(plain, prompts, [int(cfg.seed) + k for k in ks], grammars=[grammars[k] for k in ks])
    diverged = 0
    for item, r in zip(items, ref):
        d = first_divergence(item["token_ids"], r.token_ids)
        item["lossless"] = d is None
        item["first_divergence"] = d
        diverged += d is not None
    verdict = (f"verify_lossless: all {len(items)} requests equal plain decoding" if not diverged else
               f"verify_lossless: {diverged} of {len(items)} requests diverge from plain decoding")
    print(verdict, file=sys.stderr)
    return {"lossless": diverged == 0, "diverged_requests": diverged}
