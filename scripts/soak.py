"""A soak test of the OpenAI-compatible server (docs/serve.md): minutes of mixed traffic, good, bad and
broken, while the server's memory and KV gauges are watched for leaks. Not part of `make test`.

    .venv/bin/python scripts/soak.py [--minutes 10] [--url http://127.0.0.1:8000 [--pid PID] | --serve "decode=greedy"]
        [--concurrency 8] [--seed 0] [--api-key KEY] [--out outputs/soak/<timestamp>]

`--serve` (default "decode=greedy"; a dry run: `--serve "model=tiny" --minutes 0.5`) starts `python -m
pipeline.serve port=0 <overrides>` (output in <out>/server.log), reads its URL from the `serving ... on
http://...` line and stops it at the end (SIGTERM, SIGKILL after 60 s); `--url` soaks a running server
(`--pid`: its process, for RSS).

Workers (httpx, not the openai client: raw bodies and hang-ups) draw TRAFFIC kinds, seeded: whole and
streamed chats, greedy or sampled; streams dropped mid-way; requests abandoned by a 0.2 s timeout; BAD
requests, owed a 4xx with an OpenAI error body; json_schema and regex answers, validated; `n: 3`; raw
completions. Outcomes: ok, expected_4xx, disconnected, aborted, refused_429 (refused, not lost), or errors:
unexpected_status:<code>, bad_error_body, bad_response, incomplete_stream, stream_error, invalid_output,
exception:<class>. The server's VmRSS and /metrics gauges are sampled after a warm-up request, every minute
and once idle at the end; <out>/soak.json is rewritten at each sample. Exit 0 when no request was lost or
wrongly answered, no KV sequence or block is in use at the end, and RSS grew under 10% from the 1-minute
sample to the end (runs under 2 minutes skip this); else 1, naming what failed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from pipeline.io import write_json  # noqa: E402

PROMPTS = ROOT / "pipeline/prompts/bench.jsonl"
GAUGES = ("pipeline_kv_sequences", "pipeline_kv_blocks_in_use", "pipeline_kv_bytes_in_use",
          "pipeline_requests_running", "pipeline_requests_waiting")
TRAFFIC = {"chat": 20, "stream": 20, "disconnect": 8, "abort": 6, "bad": 14, "json_schema": 8, "regex": 8,
           "n3": 6, "completion": 10}  # weights
PASSED = {"ok", "expected_4xx", "disconnected", "aborted", "refused_429"}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40}, "score": {"type": "integer"}},
          "required": ["answer", "score"], "additionalProperties": False}
# bad requests: (what changes in a good request's body, or the raw body; the statuses that pass, 200 among
# them where serving it is fine too)
BAD = {"malformed_json": (b'{"model": "x", "messages": [', {400}),
       "unknown_model": ({"model": "no-such-model"}, {400, 404}),
       "negative_temperature": ({"temperature": -1}, {400}),
       "top_p_above_1": ({"top_p": 1.5}, {400}),
       "nan_temperature": ({"temperature": float("nan")}, {400}),  # json.dumps writes the bare NaN token: not JSON
       "seed_65_bits": ({"seed": 2**64}, {400}),
       "invalid_regex": ({"regex": "a("}, {400}),
       "unknown_field": ({"frobnicate": True}, {400}),
       "huge_max_tokens": ({"max_tokens": 10**9}, {400, 200}),
       "body_over_2mb": ({"messages": [{"role": "user", "content": "x " * 1_100_000}]}, {413}),
       "deep_nesting": (b"[" * 5000 + b"]" * 5000, {400})}  # valid JSON, 5000 deep: a recursive parser's 500
SERVING = re.compile(r"serving (\S+) \((.*)\) on (http://\S+)")
TIMEOUT_S = 600  # a request queued behind the others on a busy CPU can take minutes
ABORT_S = 0.2  # the client gives up on an "abort" request after this
START_S = 900  # the default model loads (and may quantize) before it serves
MAX_GROWTH_PCT = 10


def answered(r: httpx.Response, n: int = 1, check=None) -> tuple[str, int, str]:
    """A whole answer to a request that should be served: (outcome, completion tokens, detail)."""
    if r.status_code == 429:
        return "refused_429", 0, ""
    if r.status_code != 200:
        return f"unexpected_status:{r.status_code}", 0, r.text[:300]
    try:
        data = r.json()
        choices, tokens = data["choices"], data["usage"]["completion_tokens"]
    except (ValueError, KeyError, TypeError):
        return "bad_response", 0, r.text[:300]
    if len(choices) != n or any(c.get("finish_reason") is None for c in choices):
        return "bad_response", 0, f"expected {n} choices, each with a finish_reason: {r.text[:300]}"
    for c in choices:
        text = c["message"]["content"] if "message" in c else c["text"]
        if check and (why := check(text, c["finish_reason"])):
            return "invalid_output", 0, why
    return "ok", tokens, ""


def refused(r: httpx.Response, expect: set[int]) -> tuple[str, int, str]:
    """The answer to a bad request: one of the `expect`ed 4xx with an OpenAI error body."""
    if r.status_code not in expect or r.status_code < 400:
        return answered(r) if 200 in expect else (f"unexpected_status:{r.status_code}", 0, r.text[:300])
    try:
        error = r.json()["error"]
        shaped = isinstance(error, dict) and isinstance(error.get("message"), str)
    except (ValueError, KeyError, TypeError):
        shaped = False
    return ("expected_4xx", 0, "") if shaped else ("bad_error_body", 0, r.text[:300])


def valid_json(text: str, finish: str) -> str | None:
    """Why a json_schema answer is wrong (None: it is right, or cut short by max_tokens)."""
    if finish != "stop":
        return None
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError) as e:
        return f"{type(e).__name__}: {str(e)[:200]} in {text[:200]!r}"


def yes_or_no(text: str, finish: str) -> str | None:
    """Why a `(yes|no)` answer is wrong: it must end complete (max_tokens is >= 16) and be yes or no."""
    return None if finish == "stop" and text in ("yes", "no") else f"{text[:200]!r} (finish_reason {finish})"


def rss_mb(pid: int | None) -> float | None:
    """A process's resident memory (VmRSS), None when unknown."""
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        kb = next(line.split()[1] for line in status if line.startswith("VmRSS:"))
        return round(int(kb) / 1024, 1)
    except (OSError, StopIteration):
        return None


class Server:
    """`python -m pipeline.serve port=0 <overrides>`, in a session of its own: a Ctrl-C of this script
    does not reach it, `stop` does."""

    def __init__(self, overrides: str, out: Path):
        self.cmd = [sys.executable, "-m", "pipeline.serve", "port=0", *shlex.split(overrides)]
        self.log = out / "server.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=log, stderr=log, start_new_session=True)

    def url(self) -> tuple[str, str]:
        """Its URL and `<model> (<preset>)`, from its start-up line, once it serves."""
        end = time.monotonic() + START_S
        while time.monotonic() < end and self.proc.poll() is None:
            if m := SERVING.search(self.log.read_text(errors="replace")):
                return m.group(3), f"{m.group(1)} ({m.group(2)})"
            time.sleep(0.5)
        self.stop()
        tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-15:])
        raise SystemExit(f"the server did not start ({shlex.join(self.cmd)}); {self.log} ends:\n{tail}")

    def stop(self) -> int:
        """SIGTERM (it drains), SIGKILL after 60 s: its exit code (-9 when killed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


class Soak:
    """The traffic, its outcomes and the samples, all kept in `report` (saved as soak.json)."""

    def __init__(self, client: httpx.AsyncClient, model: str, pid: int | None, seed: int, report: dict, out: Path):
        self.client, self.model, self.pid, self.seed, self.report, self.out = client, model, pid, seed, report, out
        self.prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]
        self.t0 = time.monotonic()

    def body(self, rng: random.Random, chat: bool = True, **kw) -> dict:
        """A good request: a bench prompt, max_tokens 16..128, greedy or sampled (seeded)."""
        prompt = rng.choice(self.prompts)
        b = {"model": self.model, "max_tokens": rng.randint(16, 128), "temperature": 0}
        b.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
        if rng.random() < 0.5:
            b.update(temperature=0.8, top_p=0.95, seed=rng.randrange(2**31))
        return b | kw

    async def post(self, body: dict, n: int = 1, check=None, path: str = "/v1/chat/completions"):
        return answered(await self.client.post(path, json=body, timeout=TIMEOUT_S), n, check)

    async def send(self, kind: str, rng: random.Random) -> tuple[str, int, str]:
        """One request of a TRAFFIC kind (`bad:<name>` for a BAD one): (outcome, completion tokens, detail)."""
        if kind.startswith("bad:"):
            change, expect = BAD[kind[4:]]
            raw = change if isinstance(change, bytes) else json.dumps(self.body(rng, max_tokens=16) | change).encode()
            return refused(await self.client.post("/v1/chat/completions", content=raw, timeout=TIMEOUT_S,
                                                  headers={"Content-Type": "application/json"}), expect)
        if kind in ("stream", "disconnect"):
            return await self.stream(rng, drop_after=rng.randint(1, 4) if kind == "disconnect" else None)
        if kind == "abort":
            body = self.body(rng, max_tokens=128)
            try:
                r = await self.client.post("/v1/chat/completions", json=body, timeout=ABORT_S)
            except httpx.TimeoutException:
                return "aborted", 0, ""
            return answered(r)  # answered within ABORT_S: served as any other
        if kind == "completion":
            stop = rng.random() < 0.5
            check = lambda text, _: "the stop string is in the text" if stop and "\n\n" in text else None  # noqa: E731
            body = self.body(rng, chat=False, **({"stop": ["\n\n"]} if stop else {}))
            return await self.post(body, check=check, path="/v1/completions")
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
        extra, n, check = {"chat": ({}, 1, None), "n3": ({"n": 3}, 3, None),
                           "regex": ({"regex": "(yes|no)"}, 1, yes_or_no),
                           "json_schema": ({"response_format": fmt}, 1, valid_json)}[kind]
        return await self.post(self.body(rng, **extra), n, check)

    async def stream(self, rng, drop_after: int | None = None) -> tuple[str, int, str]:
        """A streamed chat completion read to `data: [DONE]`, or dropped after `drop_after` events."""
        body = self.body(rng, stream=True, stream_options={"include_usage": True})
        finish, tokens, events = None, None, 0
        async with self.client.stream("POST", "/v1/chat/completions", json=body, timeout=TIMEOUT_S) as r:
            if r.status_code != 200:
                await r.aread()
                return answered(r)
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    if finish is None or tokens is None:
                        return "bad_response", 0, f"[DONE] after finish_reason {finish}, usage {tokens}"
                    return "ok", tokens, ""
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return "stream_error", 0, line[:300]
                events += 1
                if drop_after and events >= drop_after:
                    return "disconnected", 0, ""  # leaving the block closes the connection mid-stream
                finish = finish or next((c["finish_reason"] for c in chunk["choices"] if c.get("finish_reason")), None)
                tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
        return "incomplete_stream", 0, f"the stream ended after {events} events without [DONE]"

    def record(self, kind: str, outcome: str, tokens: int, detail: str) -> None:
        rep = self.report
        rep["requests"], rep["tokens"] = rep["requests"] + 1, rep["tokens"] + tokens
        for counts in (rep["outcomes"], rep["by_kind"].setdefault(kind, {})):
            counts[outcome] = counts.get(outcome, 0) + 1
        if outcome not in PASSED and outcome not in rep["first_error"]:
            rep["first_error"][outcome] = {"kind": kind, "detail": detail}

    async def worker(self, i: int, deadline: float) -> None:
        """Requests one after another until the deadline (the last one is let finish)."""
        rng = random.Random(f"{self.seed}:{i}")
        kinds, weights = zip(*TRAFFIC.items())
        while time.monotonic() < deadline:
            kind = rng.choices(kinds, weights)[0]
            if kind == "bad":
                kind = f"bad:{rng.choice(list(BAD))}"
            try:
                result = await self.send(kind, rng)
            except Exception as e:  # connection errors, timeouts, unparseable answers: lost requests
                result = f"exception:{type(e).__name__}", 0, (str(e) or repr(e))[:300]
            self.record(kind, *result)

    async def gauges(self) -> dict:
        """The GAUGES of GET /metrics (a missing one: None)."""
        try:
            r = (await self.client.get("/metrics", timeout=30)).raise_for_status()
            values = dict(ln.rsplit(" ", 1) for ln in r.text.splitlines() if ln and not ln.startswith("#"))
            return {g: float(values[g]) if g in values else None for g in GAUGES}
        except (httpx.HTTPError, ValueError) as e:
            return {g: None for g in GAUGES} | {"metrics_error": f"{type(e).__name__}: {e}"}

    async def sample(self, label: str) -> None:
        s = {"label": label, "t_s": round(time.monotonic() - self.t0, 1), "rss_mb": rss_mb(self.pid)}
        self.report["samples"].append(s | await self.gauges())
        write_json(self.out / "soak.json", self.report)

    async def sampler(self, deadline: float) -> None:
        """A sample at every whole minute of traffic before the deadline."""
        minute = 1
        while (at := self.t0 + 60 * minute) < deadline:
            await asyncio.sleep(at - time.monotonic())
            await self.sample(f"{minute} min")
            minute += 1

    async def wait_idle(self, timeout_s: float = 30) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            g = await self.gauges()
            if g["pipeline_requests_running"] == 0 and g["pipeline_kv_sequences"] == 0:
                return
            await asyncio.sleep(0.5)


async def soak(args, url: str, pid: int | None, report: dict) -> None:
    """Warm-up, the start sample, `minutes` of traffic with a sample every minute, the idle end sample."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=httpx.Limits(max_connections=None)) as client:
        models = (await client.get("/v1/models", timeout=30)).raise_for_status().json()
        model = report["model"] = models["data"][0]["id"]
        s = Soak(client, model, pid, args.seed, report, args.out)
        report["warmup"] = await s.post({"model": model, "messages": [{"role": "user", "content": "Hi"}],
                                         "max_tokens": 8})
        s.t0 = time.monotonic()
        await s.sample("start")
        deadline = s.t0 + args.minutes * 60
        sampler = asyncio.create_task(s.sampler(deadline))
        await asyncio.gather(*(s.worker(i, deadline) for i in range(args.concurrency)))
        sampler.cancel()
        wall = report["traffic_s"] = round(time.monotonic() - s.t0, 1)
        report["requests_per_s"] = round(report["requests"] / wall, 2)
        report["served_per_s"] = round(report["outcomes"].get("ok", 0) / wall, 2)
        await s.wait_idle()
        await s.sample("end")


def verdict(report: dict) -> list[str]:
    """What failed, one line each (none: the soak passed); sets the report's rss_growth_pct."""
    failed = []
    lost = {k: n for k, n in report["outcomes"].items() if k not in PASSED}
    if lost:
        failed.append("lost or wrongly answered: " + ", ".join(f"{k} x{n}" for k, n in sorted(lost.items())))
    if not report["outcomes"].get("ok"):
        failed.append("no request was served")
    samples = {s["label"]: s for s in report["samples"]}
    end = samples.get("end")
    if end is None:
        failed.append("no end sample (the run was cut short)")
    else:
        failed += [f"{g} = {end[g]} at the end, not 0" for g in GAUGES[:2] if end[g] != 0]
    base = samples.get("1 min", {}).get("rss_mb")
    if base and end and end["rss_mb"]:
        growth = report["rss_growth_pct"] = round(100 * (end["rss_mb"] - base) / base, 1)
        if growth >= MAX_GROWTH_PCT:
            failed.append(f"RSS grew {growth}% from the 1-minute sample to the end ({base} -> {end['rss_mb']} MB)")
    return failed


def summary(report: dict) -> None:
    s = {x["label"]: x for x in report["samples"]}
    at = lambda label, key: s.get(label, {}).get(key)  # noqa: E731
    counts = lambda outcomes: ", ".join(f"{o} {n}" for o, n in sorted(outcomes.items(), key=lambda x: -x[1]))  # noqa
    print(f"\nsoak of {report['server'].get('serving') or report['model']} at {report['server'].get('url')}: "
          f"{report['traffic_s']} s, {report['config']['concurrency']} clients, {report['requests']} requests "
          f"({report['requests_per_s']}/s), {report['outcomes'].get('ok', 0)} served, {report['tokens']} tokens")
    print(f"{'traffic kind':<28}{'requests':>9}  outcomes")
    for kind, outcomes in sorted(report["by_kind"].items()):
        flag = "" if set(outcomes) <= PASSED else "  <-"
        print(f"{kind:<28}{sum(outcomes.values()):>9}  {counts(outcomes)}{flag}")
    print(f"{'all':<28}{report['requests']:>9}  {counts(report['outcomes'])}")
    for outcome, e in report["first_error"].items():
        print(f"  first {outcome} ({e['kind']}): {e['detail'][:160]}")
    growth = report["rss_growth_pct"]
    why = "run under 2 minutes" if at("start", "rss_mb") else "no RSS: --pid"
    print(f"RSS MB: start {at('start', 'rss_mb')}, 1 min {at('1 min', 'rss_mb')}, end {at('end', 'rss_mb')}; "
          f"growth 1 min -> end {f'{growth}%' if growth is not None else f'n/a ({why})'}")
    print("KV at start -> end: " + ", ".join(f"{g[12:]} {at('start', g)} -> {at('end', g)}" for g in GAUGES[:3]))
    print(f"server exit code: {report['server'].get('exit_code')}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--url", help="a running server (else --serve starts one)")
    p.add_argument("--serve", help='overrides for python -m pipeline.serve (default "decode=greedy")')
    p.add_argument("--pid", type=int, help="with --url: the server's process, for its RSS")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", help="sent as Authorization: Bearer <key>")
    p.add_argument("--out", type=Path, default=ROOT / "outputs/soak" / time.strftime("%Y-%m-%d_%H-%M-%S"))
    args = p.parse_args()
    if args.url and args.serve:
        p.error("--url or --serve, not both")
    if args.minutes <= 0 or args.concurrency < 1:
        p.error("--minutes must be > 0 and --concurrency >= 1")
    if args.serve is None and not args.url:
        args.serve = "decode=greedy"
    args.out.mkdir(parents=True, exist_ok=True)
    hide = lambda text: re.sub(r"(api_key=)\S+", r"\1***", text)  # noqa: E731  (a key given as a server override)
    report = {"config": {k: hide(str(v)) if isinstance(v, (str, Path)) else v for k, v in vars(args).items()
                         if k != "api_key"},
              "cpu": next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                           if ln.startswith("model name")), None),
              "server": {}, "model": None, "warmup": None, "samples": [], "requests": 0, "tokens": 0, "outcomes": {},
              "by_kind": {}, "first_error": {}, "traffic_s": None, "requests_per_s": None, "served_per_s": None,
              "rss_growth_pct": None, "failed": []}
    server, pid, url = None, args.pid, (args.url or "").rstrip("/").removesuffix("/v1")
    try:
        if args.serve is not None:
            server = Server(args.serve, args.out)
            report["server"] = {"command": hide(shlex.join(server.cmd)), "log": str(server.log), "pid": server.proc.pid}
            url, report["server"]["serving"] = server.url()
            pid = server.proc.pid
        report["server"]["url"] = url
        print(f"soak: {args.minutes} min, {args.concurrency} clients, {url}; {args.out}/soak.json", flush=True)
        asyncio.run(soak(args, url, pid, report))
    except KeyboardInterrupt:
        report["failed"].append("interrupted")
    except httpx.HTTPError as e:  # GET /v1/models or the warm-up: nothing to soak
        report["failed"].append(f"the server did not answer: {type(e).__name__}: {str(e).splitlines()[0]}")
    finally:  # a server started here is stopped whatever happened
        if server is not None:
            report["server"]["exit_code"] = server.stop()
        report["failed"] += verdict(report)
        write_json(args.out / "soak.json", report)
    if report["samples"]:  # the soak began
        summary(report)
    print("\n".join(["FAILED:", *(f"  {f}" for f in report["failed"])]) if report["failed"] else "PASSED")
    sys.exit(1 if report["failed"] else 0)


if __name__ == "__main__":
    main()
