"""python -m pipeline.loadtest url=http://127.0.0.1:8000 | server=ours|vllm|llama_cpp
    [concurrency=[1,4,16]] [requests=48] [max_tokens=64] [served_model_name=null] [prompts=null]
    [chat=true] [temperature=null] [server overrides: decode=tree_eagle kv=paged ...]

An OpenAI-compatible server under load, through the official `openai.AsyncOpenAI` client: for each
concurrency level N, N streaming clients work through `requests` requests (each takes the next prompt
when its last one ends; the prompts cycle), greedy unless `temperature=` is set. One warm-up request
first, not counted. Per level: requests done, errors by kind (an HTTP status or an exception class:
a refused request is counted, never lost), wall time, completion tokens/s (from `usage`, else content
chunks counted), time to first token, inter-token latency (the gaps between content chunks, as vLLM's
benchmark_serving measures it) and TPOT ((latency - ttft) / (tokens - 1) per request), p50 and p99;
how many greedy answers are the text of the same prompt's first answer at the first level
(`same_as_alone`, a batch-invariance check); and the mean accepted length where the server sends our
`speculation` extension. loadtest.json (rewritten after every level, so an interrupted run keeps the
levels it finished) and loadtest.png go into the run directory; a table is printed.

`server=` starts that server itself (pipeline/serve_peers.py), measures it and stops it.
"""
from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import hydra
import numpy as np
import openai
from hydra.types import RunMode
from omegaconf import DictConfig, ListConfig, OmegaConf

from pipeline import serve_peers
from pipeline.bench import DEFAULT_INPUT, cli_overrides, cpu_name
from pipeline.cli import CONF_DIR, check_overrides
from pipeline.errors import Interrupted, UserError, one_line_errors, positive_int
from pipeline.io import hydra_config, run_dir, write_json
from pipeline.requests import Request, load_requests
from pipeline.resume import Signals

# read by the loadtest itself; every other override is the server's (server=ours gets them all)
LOADTEST_KEYS = ("url", "server", "concurrency", "requests", "max_tokens", "prompts", "chat", "temperature")
REQUEST_TIMEOUT_S = 600  # a request queued behind 16 others on a busy CPU can take minutes
PROBE_TIMEOUT_S = 10  # GET /v1/models


@dataclass
class Target:
    """What every request of the run sends, and where."""
    url: str  # ends in /v1
    model: str
    chat: bool
    max_tokens: int
    temperature: float
    extra_body: dict = field(default_factory=dict)


@dataclass
class Outcome:
    """One request as the client saw it. Times in seconds: `start_s` since its level began, the
    others since the request was sent."""
    prompt: int  # index into the prompts
    prompt_id: str
    start_s: float
    text: str = ""
    tokens: int = 0
    usage: bool = False  # `tokens` is the server's usage.completion_tokens (else content chunks counted)
    ttft_s: float | None = None
    latency_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between content chunks
    finish_reason: str | None = None
    steps: int | None = None  # our `speculation` extension, where the server sends it
    mean_accepted_length: float | None = None
    error: str | None = None  # its kind: "HTTP 429", or an exception class
    message: str | None = None
    same_as_alone: bool | None = None  # its text is the first level's first answer to its prompt

    @property
    def tpot_s(self) -> float | None:
        if self.error or self.tokens < 2 or self.ttft_s is None:
            return None
        return (self.latency_s - self.ttft_s) / (self.tokens - 1)


def check_levels(concurrency) -> list[int]:
    levels = list(concurrency) if isinstance(concurrency, (list, ListConfig)) else [concurrency]
    ok = levels and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in levels)
    if not ok or any(a >= b for a, b in zip(levels, levels[1:])):
        given = OmegaConf.to_container(concurrency) if isinstance(concurrency, ListConfig) else concurrency
        raise UserError(f"concurrency must be a list of increasing positive ints, e.g. concurrency=[1,4,16], "
                        f"got {given!r}")
    return levels


def check_temperature(t) -> float:
    if t is None:
        return 0.0
    if not isinstance(t, (int, float)) or isinstance(t, bool) or t < 0:
        raise UserError(f"temperature must be a number >= 0 (or null: greedy), got {t!r}")
    return float(t)


def load_prompts(path) -> list[Request]:
    reqs = load_requests(str(path or DEFAULT_INPUT), None)
    for r in reqs:
        if r.constraint:
            raise UserError(f"prompts: request {r.id} carries a constraint ({', '.join(r.constraint)}); the "
                            "loadtest sends plain prompts: drop it from the file")
    return reqs


def base_url(url: str) -> str:
    url = str(url).rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise UserError(f"url must be http://host:port, got {url!r}")
    return url if url.endswith("/v1") else f"{url}/v1"


def error_kind(e: Exception) -> tuple[str, str]:
    if isinstance(e, openai.APIStatusError):
        return f"HTTP {e.status_code}", str(e.message)
    return type(e).__name__, str(e)


async def one(client: openai.AsyncOpenAI, target: Target, reqs: list[Request], k: int, t0: float) -> Outcome:
    """Request k of a level (prompt k mod len(reqs)), streamed; a failure is its outcome, not raised."""
    i = k % len(reqs)
    r = reqs[i]
    start = time.perf_counter()
    out = Outcome(i, r.id, start - t0)
    kw = dict(model=target.model, max_tokens=target.max_tokens, temperature=target.temperature, stream=True,
              stream_options={"include_usage": True}, extra_body=target.extra_body or None)
    chunks, last = 0, None
    try:
        if target.chat:
            stream = await client.chat.completions.create(
                messages=r.messages or [{"role": "user", "content": r.prompt}], **kw)
        else:
            stream = await client.completions.create(prompt=r.prompt, **kw)
        async for ch in stream:
            now = time.perf_counter() - start
            if ch.usage is not None:
                out.tokens, out.usage = ch.usage.completion_tokens, True
            if not ch.choices:
                continue
            c = ch.choices[0]
            piece = c.delta.content if target.chat else c.text
            if piece:
                chunks += 1
                out.text += piece
                if last is None:
                    out.ttft_s = now
                else:
                    out.itl_s.append(now - last)
                last = now
            if c.finish_reason:
                out.finish_reason = c.finish_reason
                spec = (ch.model_extra or {}).get("speculation")
                if spec:
                    out.steps, out.mean_accepted_length = spec["steps"], spec["mean_accepted_length"]
        out.latency_s = time.perf_counter() - start
        if not out.usage:
            out.tokens = chunks
        if out.finish_reason is None:  # the stream ended before the answer did (a server gone mid-way)
            out.error, out.message = "incomplete stream", "the stream ended without a finish_reason"
    except Exception as e:  # noqa: BLE001 - any failure is a counted error of its kind
        out.error, out.message = error_kind(e)
        out.latency_s = time.perf_counter() - start
    return out


async def run_level(client: openai.AsyncOpenAI, target: Target, reqs: list[Request], n_clients: int,
                    n_requests: int) -> tuple[list[Outcome], float]:
    """`n_clients` clients through `n_requests` requests: (outcomes in request order, wall seconds)."""
    todo, done = iter(range(n_requests)), {}
    t0 = time.perf_counter()

    async def client_loop():
        for k in todo:  # shared: each client takes the next request when its last one ends
            done[k] = await one(client, target, reqs, k, t0)

    await asyncio.gather(*(client_loop() for _ in range(n_clients)))
    return [done[k] for k in range(n_requests)], time.perf_counter() - t0


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"p50": None, "p99": None}
    return {"p50": float(np.percentile(xs, 50)), "p99": float(np.percentile(xs, 99))}


def level_report(n_clients: int, outcomes: list[Outcome], wall: float, reference: dict[int, str] | None) -> dict:
    """One level's figures. `reference`: prompt index -> the first level's first answer (None when
    sampling: answers may differ by design)."""
    ok = [o for o in outcomes if o.error is None]
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.error:
            errors[o.error] = errors.get(o.error, 0) + 1
    same = None
    if reference is not None:
        for o in ok:
            if o.prompt in reference:
                o.same_as_alone = o.text == reference[o.prompt]
        compared = [o.same_as_alone for o in ok if o.same_as_alone is not None]
        same = {"same": sum(compared), "of": len(compared)}
    spec = [o for o in ok if o.steps]
    tokens = sum(o.tokens for o in ok)
    return {"concurrency": n_clients, "requests": len(outcomes), "done": len(ok), "errors": errors,
            "first_error": next((f"{o.error}: {o.message}" for o in outcomes if o.error), None),
            "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall if wall > 0 else None,
            "tokens_from_usage": all(o.usage for o in ok),
            "ttft_s": percentiles([o.ttft_s for o in ok if o.ttft_s is not None]),
            "itl_s": percentiles([g for o in ok for g in o.itl_s]),
            "tpot_s": percentiles([o.tpot_s for o in ok if o.tpot_s is not None]),
            "same_as_alone": same,
            # tokens per target forward over the level's requests (our server's extension)
            "mean_accepted_length": sum(o.mean_accepted_length * o.steps for o in spec) / sum(o.steps for o in spec)
            if spec else None,
            "outcomes": [rounded(asdict(o)) for o in outcomes]}


def rounded(obj):
    """Seconds to the microsecond, in what loadtest.json keeps."""
    if isinstance(obj, float):
        return round(obj, 6)
    if isinstance(obj, dict):
        return {k: rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [rounded(v) for v in obj]
    return obj


async def probe(client: openai.AsyncOpenAI, url: str, model: str | None) -> str:
    """The model to ask for: `model`, else the first id of GET /v1/models (which must answer)."""
    try:
        models = await client.with_options(timeout=PROBE_TIMEOUT_S).models.list()
    except openai.APIConnectionError as e:
        raise UserError(f"nothing answers at {url} ({e.__cause__ or e}): start the server first "
                        "(python -m pipeline.serve ...) or pass server=ours|vllm|llama_cpp") from None
    except openai.APIStatusError as e:
        raise UserError(f"GET {url}/models answered HTTP {e.status_code}: url= must be an OpenAI-compatible "
                        "server (python -m pipeline.serve, vLLM, llama_cpp.server)") from None
    ids = [m.id for m in models.data]
    if model is None and not ids:
        raise UserError(f"GET {url}/models lists no model: pass served_model_name=<id>")
    return str(model) if model is not None else ids[0]


async def drive(target: Target, reqs: list[Request], levels: list[int], n_requests: int, greedy: bool,
                on_level, served_model: str | None) -> dict:
    """The warm-up, then every level (`on_level(report)` after each one); returns the warm-up's outcome."""
    async with openai.AsyncOpenAI(base_url=target.url, api_key="none", max_retries=0,
                                  timeout=REQUEST_TIMEOUT_S) as client:
        target.model = await probe(client, target.url, served_model)
        warm = await one(client, target, reqs, 0, time.perf_counter())
        if warm.error:  # every request would fail the same way: say it once
            raise UserError(f"the warm-up request failed: {warm.error}: {warm.message}")
        reference = None
        for n in levels:
            outcomes, wall = await run_level(client, target, reqs, n, n_requests)
            if reference is None and greedy:
                reference = {}
                for o in outcomes:
                    if o.error is None:
                        reference.setdefault(o.prompt, o.text)
            on_level(level_report(n, outcomes, wall, reference))
        return rounded(asdict(warm))


def loadtest(cfg: DictConfig, overrides: list[str] | None = None) -> tuple[dict, dict]:
    """`overrides`: the command line's (default: read from Hydra); those that are not the loadtest's
    own keys are the server's."""
    given = cli_overrides() if overrides is None else list(overrides)
    server_overrides = [o for o in given if serve_peers.override_key(o) not in LOADTEST_KEYS]
    levels = check_levels(cfg.concurrency)
    n_requests = positive_int(cfg.requests, "requests")
    temperature = check_temperature(cfg.get("temperature"))
    target = Target("", "", bool(cfg.chat), positive_int(cfg.max_tokens, "max_tokens"), temperature)
    reqs = load_prompts(cfg.get("prompts"))
    out = run_dir(cfg)
    reason = serve_peers.not_installed(str(cfg.server)) if cfg.get("server") else None
    hc = hydra_config()
    if reason and hc is not None and hc.mode == RunMode.MULTIRUN:  # the other servers of the sweep still run
        print(f"loadtest: skipping {reason}", file=sys.stderr, flush=True)
        return {"skipped": reason}, {}
    result = {"command": " ".join(["python -m pipeline.loadtest", *given]),
              "config": {**{k: OmegaConf.to_container(cfg[k]) if isinstance(cfg[k], ListConfig) else cfg[k]
                            for k in LOADTEST_KEYS}, "served_model_name": cfg.get("served_model_name"),
                         "server_overrides": server_overrides},
              "machine": {"cpu": cpu_name()}, "prompts": [r.id for r in reqs], "levels": []}
    paths = {"json": out / "loadtest.json", "png": out / "loadtest.png"}

    def on_level(report: dict) -> None:
        result["server"]["model"] = target.model
        result["levels"].append(report)
        write_json(paths["json"], result)
        plot(result, paths["png"])
        print(f"loadtest: concurrency {report['concurrency']}: {report['done']} of {report['requests']} done, "
              f"{sum(report['errors'].values())} errors, {report['wall_s']:.1f} s", file=sys.stderr, flush=True)

    with Signals().installed(), serving(cfg, server_overrides, max(levels), out) as (url, launched):
        target.url = base_url(url)
        if launched is not None:
            target.extra_body = launched.extra_body
        result["server"] = launched.describe() if launched else {"name": None, "url": url}
        try:
            result["warmup"] = asyncio.run(drive(target, reqs, levels, n_requests, temperature == 0.0, on_level,
                                                 cfg.get("served_model_name")))
        except KeyboardInterrupt:
            done = len(result["levels"])
            raise Interrupted(f"interrupted: {done} of {len(levels)} levels finished"
                              + (f", kept in {paths['json']}" if done else "")) from None
    write_json(paths["json"], result)
    return {**result, "loadtest_path": str(paths["json"])}, {"paths": paths}


@contextlib.contextmanager
def serving(cfg: DictConfig, server_overrides: list[str], slots: int, out: Path):
    """(url, the Launched server or None): `url=` as given, or `server=` started for the block."""
    url, name = cfg.get("url"), cfg.get("server")
    if url and name:
        raise UserError(f"give url= (a running server) or server={name} (started here), not both")
    if not url and not name:
        raise UserError("nothing to measure: pass url=http://host:port (a running server) or "
                        "server=ours|vllm|llama_cpp (started here)")
    if url:
        other = [o for o in server_overrides if serve_peers.override_key(o) != "served_model_name"]
        if other:
            raise UserError(f"{other[0]} configures a server the loadtest starts, and url= is already running: "
                            "drop it, or pass server=ours instead of url=")
        yield str(url), None
        return
    with serve_peers.launched(str(name), cfg, server_overrides, slots, out) as launched:
        yield launched.url, launched


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def markdown_table(result: dict) -> str:
    rows = ["| concurrency | done | errors | wall s | tokens/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
            "TPOT p50 / p99 ms | same as alone | accepted length |",
            "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for lv in result["levels"]:
        errors = ", ".join(f"{k} x{v}" for k, v in lv["errors"].items()) or "0"
        same = "-" if lv["same_as_alone"] is None else f"{lv['same_as_alone']['same']} of {lv['same_as_alone']['of']}"
        mal = "-" if lv["mean_accepted_length"] is None else f"{lv['mean_accepted_length']:.2f}"
        tps = "-" if lv["tokens_per_s"] is None else f"{lv['tokens_per_s']:.1f}"
        rows.append(f"| {lv['concurrency']} | {lv['done']} | {errors} | {lv['wall_s']:.1f} | {tps} | "
                    + " | ".join(f"{ms(lv[k]['p50'])} / {ms(lv[k]['p99'])}" for k in ("ttft_s", "itl_s", "tpot_s"))
                    + f" | {same} | {mal} |")
    return "\n".join(rows)


def plot(result: dict, path: Path) -> None:
    """Latency (TTFT and ITL, p50 and p99) and throughput against concurrency."""
    from matplotlib.figure import Figure  # matplotlib is heavy: loaded only to draw (a Figure saves through Agg)
    from matplotlib.ticker import NullFormatter, ScalarFormatter
    levels = result["levels"]
    xs = [lv["concurrency"] for lv in levels]
    fig = Figure(figsize=(10, 4))
    lat, thr = fig.subplots(1, 2)
    for key, label, color in (("ttft_s", "TTFT", "C0"), ("itl_s", "ITL", "C1")):
        for q, style in (("p50", "-o"), ("p99", "--o")):
            ys = [np.nan if lv[key][q] is None else lv[key][q] * 1e3 for lv in levels]
            lat.plot(xs, ys, style, color=color, label=f"{label} {q}")
    lat.set(xlabel="concurrency", ylabel="ms", yscale="log", title="latency")
    lat.yaxis.set_major_formatter(ScalarFormatter())
    lat.yaxis.set_minor_formatter(NullFormatter())
    lat.legend()
    thr.plot(xs, [np.nan if lv["tokens_per_s"] is None else lv["tokens_per_s"] for lv in levels], "-o")
    thr.set(xlabel="concurrency", ylabel="completion tokens/s", title="throughput", ylim=(0, None))
    for ax in (lat, thr):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.grid(alpha=0.3)
    server = result.get("server", {})
    fig.suptitle(f"{server.get('name') or server.get('url')}: {server.get('model')}, "
                 f"{result['config']['max_tokens']} tokens per request; {result['machine']['cpu']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="loadtest")
@one_line_errors
def main(cfg: DictConfig) -> dict:
    result, _ = loadtest(cfg)
    if "skipped" in result:
        return result
    print(markdown_table(result), flush=True)
    print(f"-> {result['loadtest_path']}", file=sys.stderr)
    return result


if __name__ == "__main__":
    check_overrides(sys.argv[1:], "loadtest")
    main()
