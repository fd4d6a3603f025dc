"""`decode(cfg) -> (metrics, objects)`: run every request through the configured pipeline.

Each finished request is appended to `items.jsonl` in the run directory the moment it finishes;
`results.json` is written from those at the end (whole, by rename). Re-running in the same run
directory skips the ids already there. Ctrl-C or SIGTERM stops cleanly: what finished is kept,
`results.json` covers it, and the run can be resumed.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from pipeline.build import ConstraintSpec, build_engine, constraint_spec, is_plain, preset_name, runner_class
from pipeline.core import Engine, Generation, UserError
from pipeline.core.runner import check_prompt
from pipeline.errors import Interrupted
from pipeline.io import append_jsonl, run_dir, write_json
from pipeline.metrics import first_divergence, gen_fields, summarize
from pipeline.report import run_pictures
from pipeline.requests import encode, load_requests
from pipeline.resume import Signals, load_items, request_key
from pipeline.streaming import StreamPrinter
from pipeline.tracking import log_decode


def run_requests(engine: Engine, prompts: list[list[int]], seeds: list[int] | None = None,
                 **callbacks) -> tuple[list[Generation], float]:
    t0 = time.perf_counter()
    gens = engine.run(prompts, seeds, **callbacks)
    return gens, time.perf_counter() - t0


ITEMS = "items.jsonl"  # each finished request, appended as it finishes


@dataclass
class _Run:
    """What `prepare` made of a config: the requests, what an earlier run in this directory finished,
    the runner, and each request's grammar and prompt ids."""
    cfg: DictConfig
    name: str  # the run's name (`preset_name`)
    reqs: list  # every request of the input, in order
    out: Path  # the run directory
    keys: dict[str, str]  # request id -> request_key
    done: dict[str, dict]  # finished earlier: id -> item
    todo: list[int]  # the requests to decode now (indices into reqs)
    constraints: dict  # request index -> its ConstraintSpec (or None)
    runner: object
    backbone: object
    grammar_cache: dict
    grammars: dict  # request index -> its compiled Grammar (or None)
    prompts: dict  # request index -> prompt token ids

    @property
    def items_path(self) -> Path:
        return self.out / ITEMS


def decode(cfg: DictConfig, backbone=None) -> tuple[dict, dict]:
    """prepare -> run -> write: bad input fails before the model loads, each finished request is
    saved at once, results.json covers what finished (also when interrupted)."""
    signals = Signals()
    with signals.installed():  # from here on, SIGTERM is a clean stop like Ctrl-C
        run = prepare(cfg, backbone)
        fresh, wall, interrupted = run_all(run, signals)
        results, interrupted = write(run, fresh, wall, interrupted)
    n = len(results["items"])
    if interrupted:
        raise Interrupted(f"interrupted: {n} of {len(run.reqs)} requests finished"
                          f"{f', kept in {run.items_path}' if n else ''}; rerun with hydra.run.dir={run.out} to resume")
    metrics = {**results["summary"], "results_path": str(run.out / "results.json")}
    return metrics, {"engine": run.runner, "backbone": run.backbone, "results": results}


def prepare(cfg: DictConfig, backbone=None) -> _Run:
    """Check the input (before the model loads), find what an earlier run here finished, build the
    runner (build_engine checks the config), and encode every request still to do."""
    reqs = load_requests(cfg.get("input"), cfg.get("prompt"))
    if cfg.get("verify_lossless") and not runner_class(cfg).plain:
        raise UserError("verify_lossless compares speculation with plain decoding; beam search has no plain "
                        "counterpart: drop verify_lossless=true")
    constraints = request_constraints(cfg, reqs)  # an invalid regex/schema/grammar fails here too
    out = run_dir(cfg)
    keys = {r.id: request_key(cfg, r) for r in reqs}
    done = load_items(out / ITEMS, keys)
    todo = [k for k, r in enumerate(reqs) if r.id not in done]
    runner, backbone = build_engine(cfg, backbone, with_constraint=False)  # each request's is passed
    cache: dict = {}
    grammars = build_grammars(backbone, constraints, todo, cache)
    prompts = {k: encode(backbone.tokenizer, with_constraint_text(reqs[k], grammars[k]), bool(cfg.chat),
                         cfg.get("system_prompt")) for k in todo}
    for k, ids in prompts.items():
        check_prompt(reqs[k].id, ids, backbone.model.args.max_seq_len)
    made_in = {it.get("precision") for it in done.values()} - {None, backbone.precision}
    if made_in:
        raise UserError(f"{out / ITEMS} holds requests decoded in {', '.join(sorted(made_in))}, this run "
                        f"computes in {backbone.precision}: pass model.dtype={sorted(made_in)[0]} to resume, or a new "
                        "hydra.run.dir")
    if done:
        print(f"resuming in {out}: {len(done)} of {len(reqs)} requests already finished", file=sys.stderr)
    return _Run(cfg, preset_name(cfg), reqs, out, keys, done, todo, constraints, runner, backbone, cache, grammars, prompts)


def run_all(run: _Run, signals: Signals) -> tuple[dict[str, dict], float, bool]:
    """Decode the requests still to do, saving each as it finishes. Returns (the new items by id,
    wall seconds, whether it was interrupted)."""
    cfg, runner, todo, fresh = run.cfg, run.runner, run.todo, {}
    if todo and cfg.get("warmup", True):  # first-call costs (allocation, MKL set-up) stay out of the timings
        runner.run([run.prompts[todo[0]]], max_new_tokens=min(4, runner.max_new_tokens))
    tok = run.backbone.tokenizer
    printer = StreamPrinter(tok, [run.reqs[k].id for k in todo], show_ids=len(run.reqs) > 1) if cfg.stream else None

    def finished(j: int, g: Generation) -> None:
        r = run.reqs[todo[j]]
        it = item(run, r, g)
        with signals.saving_item():
            append_jsonl(run.items_path, it)
            fresh[r.id] = it
            if printer is not None:
                printer.finish(j)
            for line in finish_notes(r.id, g, run.backbone.model.args.max_seq_len):
                print(line, file=sys.stderr)

    run.out.mkdir(parents=True, exist_ok=True)
    interrupted, t0 = False, time.perf_counter()
    try:
        runner.run([run.prompts[k] for k in todo], [int(cfg.seed) + k for k in todo],
                   on_tokens=printer.push if printer is not None else None, on_finish=finished,
                   grammars=[run.grammars[k] for k in todo])
    except KeyboardInterrupt:
        interrupted = True
    wall = time.perf_counter() - t0
    if printer is not None:
        printer.close()
    return fresh, wall, interrupted


def item(run: _Run, r, g: Generation) -> dict:
    """One finished request as items.jsonl and results.json hold it."""
    tok = run.backbone.tokenizer
    out = {"id": r.id, "prompt": r.prompt, "text": tok.decode(g.token_ids, skip_special_tokens=True),
           **gen_fields(g), "request_key": run.keys[r.id], "precision": run.backbone.precision}
    if g.beams is not None:  # beam search: every returned hypothesis, best first
        out["beams"] = [{"token_ids": ids, "text": tok.decode(ids, skip_special_tokens=True), "score": score}
                        for ids, score in g.beams]
        out["kv_peak_bytes"], out["kv_copy_per_beam_bytes"] = g.kv_peak_bytes, g.kv_copy_per_beam_bytes
    if run.cfg.get("record_trees", False):  # what pipeline.report draws, with each token's text
        piece = lambda ids: [tok.decode([t]) for t in ids]  # noqa: E731
        out["token_texts"] = piece(g.token_ids)
        out["trees"] = [{**t, "texts": piece(t["tokens"])} for t in g.trees]
    return out


def finish_notes(rid: str, g: Generation, limit: int) -> list[str]:
    """What the terminal is told about a request that ended early."""
    notes = []
    if g.finish_reason == "context":
        notes.append(f"[{rid}] stopped at the context end ({limit} tokens): shorten the prompt or raise "
                     "model.max_seq_len")
    if g.constraint_complete is False:
        notes.append(f"[{rid}] the output is incomplete: it stopped ({g.finish_reason}) before its {g.constraint} "
                     "constraint could end; raise max_new_tokens")
    return notes


def write(run: _Run, fresh: dict[str, dict], wall: float, interrupted: bool) -> tuple[dict, bool]:
    """results.json from every finished item (earlier ones first where resumed), the summary of this
    run's requests, verify_lossless's verdict, and the logger. Returns (results, interrupted)."""
    cfg, runner, backbone, reqs = run.cfg, run.runner, run.backbone, run.reqs
    items = [run.done.get(r.id) or fresh[r.id] for r in reqs if r.id in run.done or r.id in fresh]
    summary = summarize(list(fresh.values()), wall)  # speed of this run's requests
    summary.update(requests=len(items), finished_now=len(fresh), resumed=len(run.done), interrupted=interrupted,
                   threads=torch.get_num_threads(), **runner.describe(), **backbone.describe())
    policy = speculation_policy(runner, run.name)
    if policy:
        summary["speculation"] = policy
    notice = backbone.lossless_notice(runner.drafting, runner.batch_size > 1)
    if notice:
        summary["lossless_notice"] = notice
    guard = summary.get("guard")
    if guard:
        steps = guard["tree_steps"] + guard["plain_steps"]
        if steps and guard["held_steps"] > steps / 2:
            print(f"{run.name}: drafting did not pay in this run ({guard['held_steps']} of {steps} steps plain, "
                  "paused by the speculation guard); ~guard always drafts", file=sys.stderr)
    if cfg.get("verify_lossless") and not interrupted:
        try:
            summary.update(verify_lossless(runner, backbone, cfg, reqs, items, run.constraints, run.grammar_cache))
        except KeyboardInterrupt:  # the decoding itself is complete: keep it, without a verdict
            interrupted = summary["interrupted"] = True
    results = {"decode": run.name, "plain": is_plain(cfg), "config": OmegaConf.to_container(cfg, resolve=True),
               "summary": summary, "items": items}
    if fresh or not interrupted:  # an interrupted run that finished nothing leaves what is there alone
        write_json(run.out / "results.json", results)
        if cfg.get("logger") is not None:
            log_decode(cfg, results, run.out, run_pictures(run.out, results))
    return results, interrupted


def request_constraints(cfg: DictConfig, reqs) -> dict[int, ConstraintSpec | None]:
    """Each request's constraint (its own, else the configured one), every distinct one checked
    now, before the model loads: an invalid regex, schema or grammar costs nothing. A request line's
    regex, schema or grammar is text, never a path."""
    out, checked = {}, set()
    use_own = cfg.get("request_constraints", True)
    for k, r in enumerate(reqs):
        spec = constraint_spec(cfg, r.constraint if use_own else None)
        if spec is not None and spec.key not in checked:
            where = f"request {r.id}" if r.constraint else "constraint"
            for w in spec.check(where):
                print(f"{where}: the constraint is approximated: {w}", file=sys.stderr)
            checked.add(spec.key)
        out[k] = spec
    return out


def build_grammars(backbone, specs: dict, todo: list[int], made: dict | None = None) -> dict:
    """Compiled grammars per request: one object per distinct constraint (`made` caches them by
    `ConstraintSpec.key` across calls)."""
    made = {} if made is None else made
    out = {}
    for k in todo:
        spec = specs[k]
        if spec is not None and spec.key not in made:
            made[spec.key] = spec.build(backbone)
        out[k] = None if spec is None else made[spec.key]
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


def speculation_policy(engine: Engine, name: str) -> dict | None:
    """The proposer's sizing decision (components/proposer/policy.py), said in one line when it is
    plain decoding; None for proposers without one."""
    policy = None if engine.drafter is None else engine.drafter.describe().get("policy")
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


def verify_lossless(engine: Engine, backbone, cfg, reqs, items, specs: dict, cache: dict) -> dict:
    """Re-run every request with plain decoding (same sampler, no proposer) and report the first
    divergence, if any, on the terminal and in the items."""
    plain = Engine(engine.model, engine.kv, engine.sampler, list(engine.eos_ids), engine.max_new_tokens,
                   seed=engine.seed, batch_size=engine.batch_size, constraint=engine.constraint)
    index = {r.id: k for k, r in enumerate(reqs)}
    ks = [index[it["id"]] for it in items]
    grammars = build_grammars(backbone, specs, ks, cache)
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
