"""The HTTP side: FastAPI routes on uvicorn behind the gate (gate.py: host, origin, key, body size),
each request checked (openai_api, admit: parsed, compiled and tokenized off the event loop) before
it reaches the engine thread (loop), its tokens detokenised as they come (pipeline.streaming), cut
at its stop strings, and answered whole or as server-sent events; Prometheus metrics; a uvicorn
server whose SIGTERM drains within `shutdown_timeout` (stops admitting, finishes what is in flight,
exits 0; past the deadline or at a second signal, aborts what is left and exits 1) and which exits
1 if the engine thread dies.

The routes, their streaming and the drain share the request records and the metrics registry; the
wire format is openai_api.py, the engine thread loop.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import sys
import time
from dataclasses import dataclass

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from omegaconf import DictConfig, OmegaConf
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from pipeline.build import build_engine, component_choice, constraint_spec
from pipeline.core import UserError
from pipeline.metrics import depth_acceptance
from pipeline.server.admit import Admitter, PromptRecorder
from pipeline.server.gate import Gate, is_loopback
from pipeline.server.loop import EngineLoop, Job, Refused
from pipeline.server.page import add_page
from pipeline.server.openai_api import (FINISH, Answer, APIError, Limits, Spec, chunk, completion, logprobs_object,
                                        read_body, read_spec, request_schema, response_id, sse, usage)
from pipeline.streaming import TextStream
from pipeline.threads import StepThreads

DYING_S = 1.0  # how long a server whose engine died answers 503 before it exits
KV_STATS = ("sequences", "tokens", "bytes_in_use", "blocks_in_use", "cached_blocks")  # of kv.stats(), where the manager has them


class Metrics:
    """The server's Prometheus metrics, in a registry of its own. The engine thread sets the gauges
    between steps (`publish`); counters and histograms are thread-safe."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("pipeline_requests", "Requests answered, by endpoint and outcome (a finish reason, "
                                "error, rejected, refused or disconnected)", ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("pipeline_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("pipeline_generation_tokens", "Tokens committed", registry=r)
        self.step_seconds = Histogram("pipeline_step_seconds", "Engine step time (admission prefill included)",
                                      buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5), registry=r)
        self.accepted_length = Histogram("pipeline_accepted_length", "Tokens one request committed in one step",
                                         buckets=(1, 2, 3, 4, 5, 6, 8, 12, 16), registry=r)
        self.failed_steps = Counter("pipeline_failed_steps", "Engine steps that raised (their requests got a 500)",
                                    registry=r)
        self.running = Gauge("pipeline_requests_running", "Requests in the engine's batch", registry=r)
        self.waiting = Gauge("pipeline_requests_waiting", "Requests admitted, waiting for a batch slot", registry=r)
        self.kv = {k: Gauge(f"pipeline_kv_{k}", f"KV manager: {k.replace('_', ' ')} (kv.stats())", registry=r)
                   for k in KV_STATS}
        self.prefix_queries = Counter("pipeline_prefix_cache_queries", "Prompt tokens looked up in the KV prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("pipeline_prefix_cache_hits", "Prompt tokens found in the KV prefix cache (not "
                                   "prefilled)", registry=r)
        self.prefix_hit_rate = Gauge("pipeline_prefix_cache_hit_rate", "Prefix cache hits over queries, in prompt "
                                     "tokens, since the server started", registry=r)
        self._prefix_seen = (0, 0)  # the KV manager's counts at the last publish (they go back to 0 on its reset)
        self._prefix_total = (0, 0)  # ... and the counters' totals
        self.guard = Gauge("pipeline_guard_steps", "Speculation guard: steps by kind (tree, plain, held)", ["kind"],
                           registry=r)
        self.guard_pauses = Gauge("pipeline_guard_pauses", "Speculation guard: times it paused drafting", registry=r)
        self.guard_paused = Gauge("pipeline_guard_paused", "Speculation guard: 1 while drafting is paused", registry=r)

    def publish(self, runner, waiting: int) -> None:
        self.running.set(runner.live)
        self.waiting.set(waiting)
        info = runner.describe()
        for k, gauge in self.kv.items():
            if k in info["kv"]:
                gauge.set(info["kv"][k])
        if "prefix_queried_tokens" in info["kv"]:
            self._publish_prefix_cache(info["kv"]["prefix_queried_tokens"], info["kv"]["prefix_hit_tokens"])
        guard = info.get("guard")
        if guard:
            for kind in ("tree", "plain", "held"):
                self.guard.labels(kind).set(guard[f"{kind}_steps"])
            self.guard_pauses.set(guard["pauses"])
            self.guard_paused.set(int(runner.guard.left > 0))

    def _publish_prefix_cache(self, queries: int, hits: int) -> None:
        """The counters go up by what the KV manager counted since the last publish."""
        seen_q, seen_h = self._prefix_seen if queries >= self._prefix_seen[0] else (0, 0)
        self.prefix_queries.inc(queries - seen_q)
        self.prefix_hits.inc(hits - seen_h)
        self._prefix_seen = (queries, hits)
        total_q, total_h = self._prefix_total[0] + queries - seen_q, self._prefix_total[1] + hits - seen_h
        self._prefix_total = (total_q, total_h)
        self.prefix_hit_rate.set(total_h / total_q if total_q else 0.0)


class StopText:
    """Text as it streams, cut before the first stop string. Text that may still begin a stop string
    is held back until the next piece tells."""

    def __init__(self, stops: list[str]):
        self.stops, self.held = stops, ""

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (the text that can go out, whether a stop string was met)."""
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buf[:min(hits)], True
        keep = max((k for s in self.stops for k in range(1, min(len(s), len(buf) + 1)) if buf.endswith(s[:k])),
                   default=0)
        self.held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


@dataclass
class Piece:
    """What one engine event adds to a choice."""
    text: str
    token_ids: list[int]
    logprobs: dict | None = None  # the wire's logprobs object of these tokens, where the request asked
    finish: str | None = None  # OpenAI's finish reason, on the last piece
    speculation: dict | None = None  # on the last piece


def speculation(records: list[tuple[list[int], list[int] | None]]) -> dict:
    """The speculation of one or more choices, each (tokens per step, the deepest draft of each step
    after the first; None where unknown): steps, tokens per step, and the fraction of tree steps
    reaching each depth."""
    accepted = [a for acc, _ in records for a in acc]
    steps = len(accepted)
    whole = all(d is not None for _, d in records)
    return {"steps": steps, "mean_accepted_length": sum(accepted) / steps if steps else 0.0,
            "acceptance_by_depth": depth_acceptance([{"accepted_lengths": a, "tree_depths": d} for a, d in records])
            if whole else None}


def step_threads(cfg: DictConfig, backbone) -> StepThreads | None:
    """The measured thread count per step (`step_threads: measure`), where a row's bits do not depend
    on it: every product and the glue on the native kernels, in bfloat16 or q4."""
    mode = cfg.get("step_threads", "measure")
    if mode not in ("measure", "fixed"):
        raise UserError(f"step_threads must be measure or fixed, got {mode!r}")
    m = backbone.model
    if mode == "fixed" or m.native is None or m.precision == "float32" or m.torch_products():
        return None
    return StepThreads(torch.get_num_threads())


class Service:
    """One runner served: what the routes share. `models`: the served names, each with the draft
    it routes to (`<name>:<draft>`; the bare name: the preset's own pipeline)."""

    def __init__(self, cfg: DictConfig, runner, backbone, model: str, max_queue: int):
        self.cfg, self.model, self.tokenizer = cfg, model, backbone.tokenizer
        self.models = {model: None, **{f"{model}:{d}": d for d in getattr(runner, "drafts", {})}}
        self.metrics = Metrics()
        self.engine = EngineLoop(runner, max_queue, self.metrics, step_threads(cfg, backbone))
        self.admitter = Admitter(cfg, backbone)
        path = cfg.get("record_prompts")  # the server's own config only: a client never names a file
        self.recorder = None if path is None else PromptRecorder(str(path))
        context = backbone.model.args.max_seq_len
        self.limits = Limits(context - 1, _count(cfg, "max_json_depth", 64), _count(cfg, "max_constraint_bytes", 65536))
        self.created = int(time.time())

    def error(self, e: APIError, endpoint: str, outcome: str = "rejected") -> JSONResponse:
        self.metrics.requests.labels(endpoint, outcome).inc()
        return JSONResponse(e.body(), e.status, headers=e.headers)

    def read(self, raw: bytes, kind: str) -> Spec:
        """The checked request of a body (blocking: off the event loop)."""
        return read_spec(read_body(raw, self.limits.json_depth), kind, self.models, self.limits)

    async def answer(self, request: Request, kind: str) -> Response:
        endpoint = request.url.path
        try:
            spec = await asyncio.to_thread(self.read, await request.body(), kind)
            grammar = await self.admitter.grammar(spec)
            req, prompt_tokens = await asyncio.to_thread(self.admitter.to_engine, spec, grammar)
            loop = asyncio.get_running_loop()
            jobs = [Job(req, loop)]
            for i in range(1, spec.n):  # choice i: the same request seeded seed + i, forking the first's prompt
                jobs.append(Job(dataclasses.replace(req, seed=req.seed + i), loop, sibling=jobs[0]))
            self.engine.submit(jobs)
            if self.recorder is not None:  # admitted: its prompt is kept (record_prompts=)
                self.recorder.record(spec)
        except APIError as e:
            return self.error(e, endpoint)
        except Refused as e:
            return self.error(APIError(e.status, str(e), None, "queue_full" if e.status == 429 else "draining",
                                       retry_after=1), endpoint, "refused")
        self.metrics.prompt_tokens.inc(prompt_tokens)
        out = Output(self, jobs, spec, prompt_tokens, endpoint)
        if spec.stream:
            return JobStream(out.events(), out.close, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await out.whole(request.receive)


class Choice:
    """One choice of an admitted request, from its job's events."""

    def __init__(self, output: "Output", job: Job, index: int):
        self.output, self.job, self.index = output, job, index
        self.ended = False  # its last piece was made (or it failed)
        # its speculation as it streams: tokens per step, the deepest draft of each step after the first
        self.record: tuple[list[int], list[int] | None] = ([], [])

    def _outcome(self, outcome: str) -> None:
        self.ended = True
        self.output.service.metrics.requests.labels(self.output.endpoint, outcome).inc()

    async def pieces(self):
        """Text, token ids (and log-probabilities) as the engine commits them, cut at a stop string
        (the request then leaves the engine), ending with a piece that carries the finish reason."""
        svc, spec = self.output.service, self.output.spec
        stream, stops, offset = TextStream(svc.tokenizer), StopText(spec.stop), 0
        while True:
            kind, payload = await self.job.events.get()
            if kind == "tokens":
                accepted, depths = self.record
                accepted.append(len(payload.token_ids))
                if len(accepted) > 1 and depths is not None:  # a step after the prefill's token
                    self.record = (accepted, None if payload.depth is None else depths + [payload.depth])
                text, ids = "", []
                for t in payload.token_ids:  # token by token, so a stop ends the output at the token that made it
                    ids.append(t)
                    piece, hit = stops.push(stream.push([t]))
                    text += piece
                    if hit:
                        svc.engine.abort(self.job)
                        self._outcome("stop")
                        yield Piece(text, ids, self._logprobs(payload, len(ids), offset), "stop",
                                    speculation([self.record]))
                        return
                lps = self._logprobs(payload, len(ids), offset)
                offset += len(text)
                yield Piece(text, ids, lps)
            elif kind == "done":
                piece, hit = stops.push(stream.flush())
                finish = "stop" if hit else FINISH[payload.finish_reason]
                self._outcome(finish)
                self.record = (payload.accepted_lengths, payload.tree_depths)
                yield Piece(piece if hit else piece + stops.flush(), [], None, finish, speculation([self.record]))
                return
            elif kind == "aborted":  # a forced shutdown
                self._outcome("abort")
                yield Piece(stops.flush(), [], None, "abort", speculation([self.record]))
                return
            else:  # its own failure, or the engine's (loop.Failure)
                self._outcome("error")
                raise APIError(payload.status, payload.message, None, payload.code)

    def _logprobs(self, step, n: int, offset: int) -> dict | None:
        """The wire's logprobs object of the first n tokens of an engine step."""
        if step.logprobs is None:
            return None
        decode = self.output.service.tokenizer.decode
        entries = [(decode([t]), lp, [(decode([a]), b) for a, b in top])
                   for t, (lp, top) in zip(step.token_ids[:n], step.logprobs[:n])]
        return logprobs_object(self.output.spec, entries, offset)


class Output:
    """An admitted request's answer: its choices' pieces, whole or streamed."""

    def __init__(self, service: Service, jobs: list[Job], spec: Spec, prompt_tokens: int, endpoint: str):
        self.service, self.spec, self.prompt_tokens, self.endpoint = service, spec, prompt_tokens, endpoint
        self.choices = [Choice(self, job, i) for i, job in enumerate(jobs)]
        self.rid = response_id(spec.kind)

    async def _merged(self):
        """(choice, piece) as the choices make them; an engine failure ends it with the error."""
        if len(self.choices) == 1:
            c = self.choices[0]
            async for p in c.pieces():
                yield c, p
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(c: Choice) -> None:
            try:
                async for p in c.pieces():
                    await queue.put((c, p))
            except APIError as e:
                await queue.put((c, e))
            await queue.put((c, None))

        tasks = [asyncio.ensure_future(pump(c)) for c in self.choices]
        try:
            left = len(tasks)
            while left:
                c, p = await queue.get()
                if p is None:
                    left -= 1
                elif isinstance(p, APIError):
                    raise p
                else:
                    yield c, p
        finally:
            for t in tasks:
                t.cancel()

    async def events(self):
        """The server-sent events of a streamed answer, ending with `data: [DONE]`."""
        spec, n = self.spec, 0
        if spec.kind == "chat":
            for c in self.choices:
                yield chunk(spec, self.rid, c.index, first=True)
        try:
            async for c, p in self._merged():
                n += len(p.token_ids)
                if p.text or (spec.return_token_ids and p.token_ids) or p.logprobs:
                    yield chunk(spec, self.rid, c.index, p.text, token_ids=p.token_ids, logprobs=p.logprobs)
                if p.finish:
                    yield chunk(spec, self.rid, c.index, finish=p.finish, token_ids=[], speculation=p.speculation)
        except APIError as e:  # the headers are sent: the error goes as an event, as OpenAI streams it
            yield sse(e.body())
        else:
            if spec.include_usage:
                yield chunk(spec, self.rid, usage_=usage(self.prompt_tokens, n), empty=True)
        yield sse("[DONE]")

    async def whole(self, receive) -> Response:
        """The answer in one response; a client that goes away first aborts the request."""
        async def collect():
            parts = {c.index: [] for c in self.choices}
            async for c, p in self._merged():
                parts[c.index].append(p)
            return [Answer("".join(p.text for p in ps), ps[-1].finish, [t for p in ps for t in p.token_ids],
                           _joined_logprobs(self.spec, [p.logprobs for p in ps if p.logprobs]))
                    for ps in parts.values()]

        work, gone = asyncio.ensure_future(collect()), asyncio.ensure_future(disconnected(receive))
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not work.done():
            work.cancel()
            self.close()
            return Response(status_code=499)  # nobody reads it
        try:
            answers = work.result()
        except APIError as e:
            self.close()
            return JSONResponse(e.body(), e.status, headers=e.headers)
        return JSONResponse(completion(self.spec, self.rid, answers, self.prompt_tokens,
                                       speculation([c.record for c in self.choices])))

    def close(self) -> None:
        """The response is over, however it ended: a request still in the engine leaves it."""
        for c in self.choices:
            if not c.ended:
                c._outcome("disconnected")
            self.service.engine.abort(c.job)


def _joined_logprobs(spec: Spec, parts: list[dict]) -> dict | None:
    """One choice's logprobs object from its pieces' (None when it asked for none)."""
    if spec.logprobs is None:
        return None
    if spec.kind == "chat":
        return {"content": [e for p in parts for e in p["content"]], "refusal": None}
    return {k: [v for p in parts for v in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


async def disconnected(receive) -> None:
    """Returns once the client has gone (the body is read, so the next message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class JobStream(StreamingResponse):
    """A streamed answer that calls `on_close` when it ends, also when the client went away while the
    stream waited for the engine (noticed at once, not at the next write)."""

    def __init__(self, content, on_close, **kw):
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        watch = asyncio.ensure_future(disconnected(receive))
        watch.add_done_callback(lambda t: t.cancelled() or self.on_close())
        try:
            await super().__call__(scope, receive, send)
        finally:
            watch.cancel()
            self.on_close()


def create_app(service: Service) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.engine.start()
        yield
        await asyncio.to_thread(service.engine.stop)
        if service.recorder is not None:
            service.recorder.close()

    app = FastAPI(title="pipeline.serve", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # unknown routes and methods, as OpenAI errors
        return JSONResponse(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}").body(),
                            e.status_code)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": service.created,
                                            "owned_by": "pipeline", "root": service.model, "draft": draft}
                                           for name, draft in service.models.items()]}

    def body(kind: str) -> dict:  # the request body's schema in the OpenAPI document (what the fuzz test draws from)
        return {"requestBody": {"required": True, "content": {"application/json": {
            "schema": request_schema(kind, list(service.models), service.limits)}}}}

    @app.post("/v1/chat/completions", openapi_extra=body("chat"))
    async def chat(request: Request):
        return await service.answer(request, "chat")

    @app.post("/v1/completions", openapi_extra=body("completion"))
    async def completions(request: Request):
        return await service.answer(request, "completion")

    @app.get("/health")
    async def health():
        """ok; degraded (200) while the latest step failed as the model's failure; draining or
        engine stopped (503)."""
        engine = service.engine
        status = "draining" if engine.draining else "engine stopped" if not engine.alive else \
            "degraded" if engine.degraded else "ok"
        return JSONResponse({"status": status, "failed_steps": engine.failed_steps, "last_failure": engine.last_failure,
                             **({"engine_error": engine.failure} if engine.failure else {})},
                            200 if status in ("ok", "degraded") else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    add_page(app)  # GET /: the chat page to watch speculation (page.py)
    return app


class Server(uvicorn.Server):
    """uvicorn, with a SIGTERM / Ctrl-C that drains: new requests get 503 and what is in flight
    finishes, then the server exits 0. Past `shutdown_timeout` seconds, or at a second signal, what
    is left is aborted (finish_reason "abort") and the server exits 1 (at once, for a second signal).
    If the engine thread dies, the server exits 1 (`exit_code`), for a supervisor to restart it."""

    def __init__(self, config: uvicorn.Config, service: Service, shutdown_timeout: float):
        super().__init__(config)
        self.service, self.shutdown_timeout = service, shutdown_timeout
        self.deadline: float | None = None  # when a drain gives up
        self.dying: float | None = None  # when the engine thread was found dead
        self.exit_code = 0

    def handle_exit(self, sig, frame) -> None:  # uvicorn's re-raises the signal at exit: not here
        engine = self.service.engine
        if engine.draining:
            print(f"second signal: aborting {engine.inflight} requests, exiting now", file=sys.stderr, flush=True)
            self._abort()
            self.should_exit = self.force_exit = True
        else:
            print(f"draining: {engine.inflight} requests in flight, new ones refused (within {self.shutdown_timeout:g} "
                  "s; again to exit at once)", file=sys.stderr, flush=True)
            engine.drain()
            self.deadline = time.monotonic() + self.shutdown_timeout

    def _abort(self) -> None:
        if self.service.engine.inflight:
            self.service.engine.abort_all()
            self.exit_code = 1

    async def on_tick(self, counter: int) -> bool:
        engine = self.service.engine
        if engine.failure is not None and not self.should_exit:
            if self.dying is None:  # a second of 503s (health checks see it), then out
                print(f"the engine thread died ({engine.failure}): exiting 1 for a restart", file=sys.stderr, flush=True)
                self.dying = time.monotonic()
            elif time.monotonic() - self.dying > DYING_S:
                self.exit_code, self.should_exit = 1, True
                self.config.timeout_graceful_shutdown = 5  # the failed requests' answers go out, then exit
        if self.deadline is not None and not self.should_exit:
            left = self.deadline - time.monotonic()
            if left <= 0 and engine.inflight:
                print(f"drain deadline ({self.shutdown_timeout:g} s): aborting {engine.inflight} requests",
                      file=sys.stderr, flush=True)
                self._abort()
            if engine.inflight == 0:
                self.config.timeout_graceful_shutdown = max(1.0, left)  # clients that stop reading: not forever
                self.should_exit = True
        return await super().on_tick(counter)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            print(f"serving {self.service.model} ({self.service.cfg.get('name')}) on http://{host}:{port}",
                  file=sys.stderr, flush=True)


def _count(cfg: DictConfig, key: str, default: int) -> int:
    v = cfg.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise UserError(f"{key} must be a positive int, got {v!r}")
    return v


def _names(cfg: DictConfig, key: str) -> list[str]:
    v = cfg.get(key) or []
    v = OmegaConf.to_container(v) if OmegaConf.is_config(v) else v
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise UserError(f"{key} must be a list of strings, got {v!r}")
    return v


def api_key(cfg: DictConfig) -> str | None:
    """The key clients must send: `api_key`, or the environment variable `api_key_env` names (read
    here, at start); None: no key."""
    key, env = cfg.get("api_key"), cfg.get("api_key_env")
    if key is not None and env is not None:
        raise UserError("give api_key or api_key_env, not both")
    if env is not None:
        key = os.environ.get(str(env))
        if not key:
            raise UserError(f"api_key_env={env}: the environment variable {env} is not set (or empty)")
    if key is not None and (not isinstance(key, str) or not key.strip() or key != key.strip()):
        raise UserError("api_key must be a non-empty string without surrounding spaces")
    return key


def gated(app: FastAPI, cfg: DictConfig):
    """The app behind the gate (and CORS, when cors_origins opens it)."""
    key, origins = api_key(cfg), _names(cfg, "cors_origins")
    loopback = is_loopback(str(cfg.host))
    if not loopback and key is None:
        print(f"warning: serving on {cfg.host} without an API key: whoever reaches the port may call it "
              "(api_key= or api_key_env=)", file=sys.stderr)
    asgi = Gate(app, loopback=loopback, allowed_hosts=_names(cfg, "allowed_hosts"), cors_origins=origins,
                api_key=key, public_routes=_names(cfg, "public_routes"),
                max_body_bytes=_count(cfg, "max_body_bytes", 1 << 20))
    if origins:
        asgi = CORSMiddleware(asgi, allow_origins=origins, allow_methods=["GET", "POST"],
                              allow_headers=["Authorization", "Content-Type"])
    return asgi


def build_server(cfg: DictConfig, backbone=None) -> Server:
    """The server for a composed serve config: the runner built (build_engine checks the config;
    `backbone`: one already loaded), the configured constraint checked, a short warm-up request,
    and the app on uvicorn behind the gate."""
    for key in ("input", "prompt"):
        if cfg.get(key) is not None:
            raise UserError(f"the server takes its prompts over HTTP: drop {key}=")
    port = cfg.get("port")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise UserError(f"port must be an int in 0..65535 (0: any free port), got {port!r}")
    timeout = cfg.get("shutdown_timeout", 30)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout < 0:
        raise UserError(f"shutdown_timeout must be a number of seconds >= 0, got {timeout!r}")
    configured = constraint_spec(cfg)
    if configured is not None:
        configured.check()
    runner, backbone = build_engine(cfg, backbone, with_constraint=False)  # each request's is passed
    if cfg.get("warmup", True):  # first-call costs (allocation, MKL set-up) stay out of the first request
        runner.run([backbone.tokenizer.encode("Hello", add_special_tokens=False)],
                   max_new_tokens=min(4, runner.max_new_tokens))
        runner.reset()  # the guard measures served requests only
    model = cfg.get("served_model_name") or component_choice("model", cfg.model)
    service = Service(cfg, runner, backbone, str(model), cfg.max_queue)
    config = uvicorn.Config(gated(create_app(service), cfg), host=str(cfg.host), port=port, log_level="warning", access_log=False,
                            lifespan="on", timeout_graceful_shutdown=max(1.0, float(timeout)))
    return Server(config, service, float(timeout))
