"""python -m pipeline.bench decodes=[greedy,tree_ngram] [input=...] [max_new_tokens=N] [repeats=R] [batch_size=B]

Every listed pipeline runs in this process on the same tokenized requests: a warm-up on its first
batch of requests, then `repeats` rounds, each running every pipeline over the whole set in the
listed order (A B A B ...), so a drift in machine speed hits all of them alike. The first listed is
the baseline. Each entry is composed like `python -m pipeline decode=<name> <common> <entry
overrides>`, where the common overrides are the ones given to the bench itself; one backbone is
loaded per distinct model config and shared. Every runner (our Engine, a Hugging Face peer,
llama.cpp or vLLM: pipeline/llama_cpp_peer.py, pipeline/vllm_peer.py) gets a whole round at once,
`runner.run(prompts, seeds)`, so `batch_size=B` batches every pipeline, the peers included;
request k samples with seed + k. Writes bench.json into the run directory and prints
a Markdown table.

One module (~330 lines) for one command: composing the entries, running the rounds and the
report share the Entry/Pipeline records; the peers live in their own modules.
"""
from __future__ import annotations

import os
import platform
import shlex
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import torch
import yaml
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from components.model.load import smollm2_gguf
from pipeline import llama_cpp_peer, threads, vllm_peer
from pipeline.build import build_engine, component, model_key, needs_invariance, step_rows
from pipeline.cli import CONF_DIR, check_overrides, compose_config, groups
from pipeline.core import Runner
from pipeline.decode import build_grammars, request_constraints, run_requests
from pipeline.errors import UserError, one_line_errors, positive_int
from pipeline.hf_peer import GENERATE_KNOBS, PEERS, HFPeer, to_hf
from pipeline.io import hydra_config, run_dir, write_json
from pipeline.metrics import first_divergence, gen_fields, summarize
from pipeline.requests import encode, load_requests
from pipeline.tracking import log_bench

DEFAULT_INPUT = Path(__file__).resolve().parent / "prompts" / "bench.jsonl"
# peers in other programs, optional installs: name -> their module (available(), INSTALL_HINT)
OUTSIDE_PEERS = {"llama_cpp": llama_cpp_peer, "vllm": vllm_peer}
# read by the bench itself; every other override given to the bench is passed to each pipeline
BENCH_KEYS = ("decodes", "repeats", "input", "prompt", "max_new_tokens", "stream")


@dataclass
class Entry:
    label: str  # its key in bench.json: the name and overrides as given
    name: str  # a decode preset or a peer (pipeline.hf_peer.PEERS)
    overrides: list[str]


@dataclass
class Pipeline:
    entry: Entry
    runner: object  # an Engine or a peer: `.run(prompts, seeds) -> list[Generation]`
    backbone: object
    prompts: list[list[int]]
    seeds: list[int]  # request k: the pipeline's seed + k
    batch_size: int
    walls: list[float] = field(default_factory=list)  # seconds per round
    tokens: list[int] = field(default_factory=list)  # new tokens per round
    gens: list = field(default_factory=list)  # the last round's Generations


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def parse_entries(decodes) -> list[Entry]:
    known = groups()["decode"]
    out: list[Entry] = []
    for raw in [decodes] if isinstance(decodes, str) else list(decodes or []):
        parts = shlex.split(str(raw))
        if not parts:
            raise UserError("decodes holds an empty entry: give preset names, e.g. decodes=[greedy,tree_ngram]")
        name, overrides = parts[0], parts[1:]
        if name not in known and name not in PEERS and name not in OUTSIDE_PEERS:
            raise UserError(f"unknown decode {name!r} in decodes; known: "
                            f"{', '.join(known + sorted(PEERS) + list(OUTSIDE_PEERS))}")
        label = " ".join(parts)
        if any(e.label == label for e in out):
            raise UserError(f"decodes lists {label!r} twice")
        out.append(Entry(label, name, overrides))
        if name == "vllm":  # its options are checked before anything loads, installed or not
            vllm_speculation(out[-1])
    if not out:
        raise UserError("nothing to benchmark: pass decodes=[greedy,tree_ngram]")
    return out


def vllm_speculation(entry: Entry) -> dict | None:
    """A `vllm` entry's speculative_config from its options (`speculative=ngram ...`)."""
    return vllm_peer.speculative_config({_key(o): yaml.safe_load(o.split("=", 1)[1])
                                         for o in entry.overrides if _key(o) in vllm_peer.KNOBS})


def common_overrides(cfg: DictConfig, given: list[str]) -> list[str]:
    """The bench's own command-line overrides that every pipeline gets, plus its defaults that
    differ from a plain decode run (max_new_tokens, no streaming)."""
    if any(_key(o) == "decode" for o in given):
        raise UserError("the bench takes decodes=[a,b,...] (a list), not decode=")
    passed = [o for o in given if _key(o).split(".")[0] not in BENCH_KEYS]
    return [*passed, f"max_new_tokens={cfg.max_new_tokens}", "stream=false"]


def compose(entry: Entry, common: list[str]) -> DictConfig:
    """The decode config of one entry; a peer composes decode=greedy (model, max_new_tokens, seed)
    and keeps its `generate` knobs out of it. A transformers peer computes in a dense precision:
    `auto` / `q4` become float32 for it (its fastest on CPU; `"hf_greedy model.dtype=bfloat16"`
    measures the other)."""
    peer = entry.name in PEERS or entry.name in OUTSIDE_PEERS
    knobs = vllm_peer.KNOBS if entry.name == "vllm" else GENERATE_KNOBS
    own = [o for o in entry.overrides if not (peer and _key(o) in knobs)]
    overrides = [f"decode={'greedy' if peer else entry.name}", *common, *own]
    try:
        cfg = compose_config(overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise UserError(f"decodes entry {entry.label!r}: {e}") from e
    if entry.name in PEERS and cfg.model.get("dtype") in ("auto", "q4", "w4a8"):
        cfg.model.dtype = "float32"
    return cfg


def cli_overrides() -> list[str]:
    hc = hydra_config()
    return [] if hc is None else list(hc.overrides.task)


def cpu_name() -> str:
    """The CPU as a benchmark table names it: its model name, family and model, and the vector
    features that decide which kernels run (AVX2, AVX-512, avx512_bf16, AMX)."""
    info = Path("/proc/cpuinfo")
    if not info.is_file():
        return platform.processor() or platform.machine()
    fields = dict(line.split(":", 1) for line in info.read_text().split("\n\n")[0].splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    isa = [name for flag, name in (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_bf16", "avx512_bf16"),
                                   ("amx_tile", "AMX")) if flag in flags]
    return (f"{fields.get('model name', platform.processor())} (family {fields.get('cpu family', '?')} model "
            f"{fields.get('model', '?')}; {', '.join(isa) or 'no AVX2'})")


def bench(cfg: DictConfig, overrides: list[str] | None = None) -> tuple[dict, dict]:
    """`overrides`: the bench's command-line overrides (default: read from Hydra)."""
    given = cli_overrides() if overrides is None else list(overrides)
    repeats = positive_int(cfg.repeats, "repeats")
    entries = parse_entries(cfg.decodes)
    reqs = load_requests(None if cfg.get("prompt") is not None else str(cfg.get("input") or DEFAULT_INPUT),
                         cfg.get("prompt"))
    for name, peer in OUTSIDE_PEERS.items():
        if any(e.name == name for e in entries) and not peer.available():
            print(f"bench: skipping {name}: not installed ({peer.INSTALL_HINT})", file=sys.stderr)
            entries = [e for e in entries if e.name != name]
            if not entries:
                raise UserError(f"nothing to benchmark: {name} is not installed ({peer.INSTALL_HINT})")
    pipes, backbones = build_pipelines(entries, common_overrides(cfg, given), reqs, run_dir(cfg))
    try:
        for p in pipes:  # warm-up on one batch: first-call allocations, pool growth, lazy initialisation
            p.runner.run(p.prompts[:p.batch_size], p.seeds[:p.batch_size])  # stay out of the timing
        for r in range(repeats):
            for p in pipes:
                gens, wall = run_requests(p.runner, p.prompts, p.seeds)
                p.walls.append(wall)
                p.tokens.append(sum(len(g.token_ids) for g in gens))
                p.gens = gens
            print(f"round {r + 1}/{repeats}: " + ", ".join(f"{p.entry.label} {p.tokens[-1] / p.walls[-1]:.1f} "
                                                           "tokens/s" for p in pipes), file=sys.stderr, flush=True)
    finally:  # a peer in another process (vLLM) ends with the bench, measured or not
        for p in pipes:
            if isinstance(p.runner, vllm_peer.VllmPeer):
                p.runner.close()
    base = pipes[0]
    result = {"baseline": base.entry.label, "repeats": repeats, "requests": len(reqs),
              "max_new_tokens": int(cfg.max_new_tokens),
              "pipelines": {p.entry.label: pipeline_report(p, base, reqs) for p in pipes},
              "machine": {"cpu": cpu_name(), "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                          "torch": torch.__version__, "python": platform.python_version(),
                          "platform": platform.platform()},
              "command": " ".join(["python -m pipeline.bench", *map(shlex.quote, given)])}
    path = write_json(run_dir(cfg) / "bench.json", result)
    if cfg.get("logger") is not None:
        log_bench(cfg, result, run_dir(cfg))
    return {**result, "bench_path": str(path)}, {"pipelines": pipes, "backbones": backbones}


def build_pipelines(entries: list[Entry], common: list[str], reqs, out_dir: Path) -> tuple[list[Pipeline], list]:
    """One runner per entry; backbones (and their HF copies) are shared between entries with the
    same model config, and requests are tokenized once per model and chat setting. `out_dir`: the
    run directory (a vLLM peer's log, and the HF folder of a model that has no file)."""
    backbones, hf_models, encoded, pipes = {}, {}, {}, []
    composed = [(e, compose(e, common)) for e in entries]
    invariant: dict[str, bool] = {}  # model key -> does any entry on it speculate or batch
    rows: dict[str, int] = {}  # model key -> the largest step any entry on it makes
    for e, pcfg in composed:
        key = model_key(pcfg)
        invariant[key] = invariant.get(key, False) or needs_invariance(pcfg)
        rows[key] = max(rows.get(key, 1), step_rows(pcfg))
    for e, pcfg in composed:
        key = model_key(pcfg)
        if key not in backbones:
            backbones[key] = component(pcfg.model, invariant=invariant[key], step_rows=rows[key])
        bb = backbones[key]
        if e.name == "llama_cpp":
            path = Path(pcfg.model.path).expanduser() if pcfg.model.get("path") else smollm2_gguf()
            runner = llama_cpp_peer.LlamaCppPeer(path, bb.eos_ids, positive_int(pcfg.max_new_tokens, "max_new_tokens"),
                                                 n_ctx=min(bb.model.args.max_seq_len, 4096),
                                                 batch_size=positive_int(pcfg.batch_size, "batch_size"))
        elif e.name == "vllm":
            runner = vllm_peer.VllmPeer(vllm_peer.hf_folder(pcfg.model, bb, out_dir), bb.eos_ids,
                                        positive_int(pcfg.max_new_tokens, "max_new_tokens"), bb.model.args.max_seq_len,
                                        batch_size=positive_int(pcfg.batch_size, "batch_size"), speculative=vllm_speculation(e),
                                        log_path=out_dir / (e.label.replace(" ", "_").replace("/", "_") + ".log"))
        elif e.name in PEERS:
            if key not in hf_models:
                hf_models[key] = to_hf(bb)
            knobs = {**PEERS[e.name], **{_key(o): yaml.safe_load(o.split("=", 1)[1])
                                         for o in e.overrides if _key(o) in GENERATE_KNOBS}}
            runner = HFPeer(hf_models[key], bb.eos_ids, positive_int(pcfg.max_new_tokens, "max_new_tokens"), seed=int(pcfg.seed),
                            batch_size=positive_int(pcfg.batch_size, "batch_size"), **knobs)
        else:
            runner, _ = build_engine(pcfg, bb)
            if pcfg.get("request_constraints", True) and any(r.constraint for r in reqs):
                runner = Constrained(runner, pcfg, bb, reqs)
        tkey = (key, bool(pcfg.chat), pcfg.get("system_prompt"))
        if tkey not in encoded:
            encoded[tkey] = [encode(bb.tokenizer, r, bool(pcfg.chat), pcfg.get("system_prompt")) for r in reqs]
            limit = bb.model.args.max_seq_len
            for r, ids in zip(reqs, encoded[tkey]):
                if len(ids) >= limit:
                    raise UserError(f"request {r.id}: prompt is {len(ids)} tokens, the model's context is "
                                    f"{limit}: shorten it")
        seeds = [int(pcfg.seed) + k for k in range(len(reqs))]
        pipes.append(Pipeline(e, runner, bb, encoded[tkey], seeds, positive_int(pcfg.batch_size, "batch_size")))
    return pipes, list(backbones.values())


class Constrained:
    """An engine that applies each request line's own constraint (json_schema / regex / grammar), the
    configured one to the others: `run(prompts, seeds)` over the first len(prompts) requests."""

    def __init__(self, engine, cfg: DictConfig, backbone, reqs):
        self.engine = engine
        nodes = request_constraints(cfg, reqs)
        grammars = build_grammars(backbone, nodes, list(range(len(reqs))))
        self.grammars = [grammars[k] for k in range(len(reqs))]

    def run(self, prompts, seeds=None, **kw):
        return self.engine.run(prompts, seeds, grammars=self.grammars[:len(prompts)], **kw)

    def __getattr__(self, name):  # only for names it lacks: the engine's kv, proposer, ...
        if name == "engine":
            raise AttributeError(name)
        return getattr(self.engine, name)


def pipeline_report(p: Pipeline, base: Pipeline, reqs) -> dict:
    # steps, accepted length, acceptance by depth, step latency
    s = summarize([gen_fields(g) for g in p.gens], p.walls[-1])
    tps = statistics.median(n / w for n, w in zip(p.tokens, p.walls))
    base_tps = statistics.median(n / w for n, w in zip(base.tokens, base.walls))
    per_request = []
    for r, g, b in zip(reqs, p.gens, base.gens):
        d = first_divergence(g.token_ids, b.token_ids)
        per_request.append({"id": r.id, "new_tokens": len(g.token_ids), "identical": d is None,
                            "first_divergence": d, "finish_reason": g.finish_reason})
    steps_ms = [ms for g in p.gens for ms in g.step_ms]
    rnd = lambda x, n=3: None if x is None else round(x, n)  # noqa: E731
    report = {"tokens_per_s": round(tps, 2), "wall_s": [round(w, 4) for w in p.walls],
              "new_tokens": s["new_tokens"], "steps": s["steps"],
              "mean_accepted_length": rnd(s["mean_accepted_length"]),
              "speedup": round(tps / base_tps, 3) if base_tps > 0 else None,
              "identical_to_baseline": all(x["identical"] for x in per_request),
              "batch_size": p.batch_size,
              **p.backbone.describe(),
              **({"precision": "llama.cpp (the GGUF as shipped)", "sequential": True}
                 if isinstance(p.runner, llama_cpp_peer.LlamaCppPeer) else {}),
              **(p.runner.describe() if isinstance(p.runner, vllm_peer.VllmPeer) else {}),
              "mean_step_ms": rnd(statistics.mean(steps_ms) if steps_ms else None),
              "tree_step_ms": rnd(s["tree_step_ms"]), "plain_step_ms": rnd(s["plain_step_ms"]),
              **({"tree_step_split_ms": {k: rnd(s[f"tree_{k}_ms"]) for k in ("draft", "verify", "rest")}}
                 if "tree_draft_ms" in s else {}),
              "acceptance_by_depth": {d: round(v, 3) for d, v in s["acceptance_by_depth"].items()},
              "constrained": isinstance(p.runner, Constrained) or getattr(p.runner, "constraint", None) is not None}
    if "constrained_requests" in s:  # constraint cost per committed token, drafts pruned, complete outputs
        report.update({k: rnd(s[k]) for k in ("mask_us_per_token", "pruned_drafts", "constraint_complete")})
    if isinstance(p.runner, Runner):  # ours: the KV pool's memory (peak over warm-up and rounds), the guard's last round
        report.update({k: v for k, v in p.runner.describe().items() if k in ("kv", "guard")})
        policy = None if p.runner.drafter is None else p.runner.drafter.describe().get("policy")
        if policy:  # the proposer's tree size for this machine (0 = plain decoding)
            report["speculation"] = {k: policy[k] for k in ("nodes", "expected_speedup", "expected_accept_length")}
    return {**report, "per_request": per_request}


def markdown_table(result: dict) -> str:
    cons = any(p.get("constrained") for p in result["pipelines"].values())
    rows = ["| pipeline | batch | tokens/s | speedup | mean accepted length | identical |" + (
            " constrained | constraint us/token | pruned drafts |" if cons else ""),
            "|---|---:|---:|---:|---:|:---:|" + ("---|---:|---:|" if cons else "")]
    for label, p in result["pipelines"].items():
        mal = "-" if p["mean_accepted_length"] is None else f"{p['mean_accepted_length']:.2f}"
        speed = "-" if p["speedup"] is None else f"{p['speedup']:.2f}"
        extra = ""
        if cons:
            us = p.get("mask_us_per_token")
            extra = (f" {'yes' if p.get('constrained') else 'no'} | {'-' if us is None else f'{us:.1f}'} | "
                     f"{p.get('pruned_drafts', '-')} |")
        rows.append(f"| {label} | {p.get('batch_size', '-')} | {p['tokens_per_s']:.1f} | {speed} | {mal} | "
                    f"{'yes' if p['identical_to_baseline'] else 'no'} |" + extra)
    return "\n".join(rows)


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="bench")
@one_line_errors
def main(cfg: DictConfig) -> dict:
    threads.configure(cfg)
    result, _ = bench(cfg)
    print(markdown_table(result), flush=True)
    print(f"-> {result['bench_path']}", file=sys.stderr)
    return result


if __name__ == "__main__":
    check_overrides(sys.argv[1:], "bench")
    main()
