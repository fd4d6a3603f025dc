"""What a request becomes in the engine. `Admitter.to_engine` is the one mapping from a checked
`Spec` to the runner's `Request`, done the way `python -m pipeline` does a request line: the same
chat template and encode path, the same constraint path (`constraint_spec` -> a compiled grammar,
`add_to_prompt` included), the request's `seed` or else the config's, and its sampling knobs over
the preset's (`SamplingParams`: what it gives of temperature, top_p and top_k, the preset's sampler
for the rest). A runner that takes no per-request knobs (beam search) refuses them, naming the field.

A request's constraint is plain data (`ConstraintSpec`): its text is never resolved, interpolated
or opened as a path. Grammars compile in `GrammarCache`, off the event loop, bounded in time and
kept up to a byte budget. `PromptRecorder` (record_prompts=, the server's own config) appends each
admitted request's prompt, and nothing else, to a JSONL file that `data.prompts` trains on.
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from omegaconf import DictConfig

from pipeline.build import ConstraintSpec, constraint_spec, runner_class
from pipeline.core import Request, SamplingParams, UserError
from pipeline.decode import with_constraint_text
from pipeline.requests import encode
from pipeline.server.openai_api import APIError, Spec, bad, unsupported

# a request's constraint field (as a CLI request line names it) -> the request field it came from
PARAMS = {"json_schema": "response_format", "regex": "regex", "grammar": "grammar"}
COMPILE_THREADS = 2  # grammars compiled at once (XGrammar releases the GIL while it compiles)


class GrammarCache:
    """Compiled grammars by `ConstraintSpec.key`, the most recently used kept up to `max_bytes` of
    compiled size. A miss compiles on the cache's own threads; requests asking for a grammar being
    compiled wait for that one compile, each at most `timeout` seconds (then a 400; the compile goes
    on, as XGrammar cannot be interrupted, and its grammar is kept for the next request). Hits never
    wait behind a compile."""

    def __init__(self, backbone, max_bytes: int, timeout: float):
        self.backbone, self.max_bytes, self.timeout = backbone, max_bytes, timeout
        self._done: OrderedDict[str, tuple[object, int]] = OrderedDict()  # key -> (grammar, bytes)
        self._pending: dict[str, tuple[Future, list[int]]] = {}  # key -> (its compile, [requests waiting])
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="constraint-compile")
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._done)

    async def get(self, spec: ConstraintSpec, field: str):
        """The grammar of spec, compiled once; an invalid one or a compile past the time cap is a
        400 naming `field`."""
        key = spec.key
        with self._lock:
            if key in self._done:
                self._done.move_to_end(key)
                return self._done[key][0]
            if key not in self._pending:
                self._pending[key] = (self._pool.submit(self._compile, key, spec), [0])
            future, waiting = self._pending[key]
            waiting[0] += 1
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.timeout)
        except asyncio.TimeoutError:
            raise bad(field, f"compiling it took over {self.timeout:g} s (constraint_timeout_s): simplify it",
                      "constraint_timeout") from None
        except (UserError, ValueError) as e:
            raise bad(field, str(e)) from None
        finally:
            with self._lock:
                waiting[0] -= 1
                if not waiting[0] and future.cancel():  # nobody waits and it has not started: it never will
                    self._pending.pop(key, None)

    def _compile(self, key: str, spec: ConstraintSpec):
        try:
            spec.check()
            grammar = spec.build(self.backbone)
        finally:
            with self._lock:
                self._pending.pop(key, None)
        size = int(getattr(getattr(grammar, "compiled", None), "memory_size_bytes", 0)) + len(key)
        with self._lock:
            self._done[key] = (grammar, size)
            self.bytes += size
            while self.bytes > self.max_bytes and len(self._done) > 1:
                _, (_, freed) = self._done.popitem(last=False)
                self.bytes -= freed
        return grammar


class PromptRecorder:
    """Appends one JSON line per admitted request to `path`, its prompt only: {"messages": [...]}
    (chat) or {"prompt": "..."} (completions), never an answer. Each line is one write to a file
    opened for appending, under a lock: lines never interleave. A write that fails leaves the request
    as it is and is reported once on stderr."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError as e:
            raise UserError(f"record_prompts={path}: cannot open it for appending ({e.strerror}): "
                            "give a writable file, or record_prompts=null") from None
        self._lock = threading.Lock()
        self.failed = False

    def record(self, spec: Spec) -> None:
        r = spec.request
        row = {"messages": r.messages} if spec.kind == "chat" and r.messages else {"prompt": r.prompt}
        line = (json.dumps(row, ensure_ascii=False) + "\n").encode()
        try:
            with self._lock:
                while line:  # a regular file takes the whole line at once, short of a full disk
                    line = line[os.write(self._fd, line):]
        except OSError as e:
            if not self.failed:
                self.failed = True
                print(f"warning: record_prompts: cannot write to {self.path} ({e.strerror}); requests are served, "
                      "their prompts are not recorded", file=sys.stderr, flush=True)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


class Admitter:
    """Checks and encodes requests for one runner: its backbone's tokenizer and context, the
    config's chat settings, constraint and sampler."""

    def __init__(self, cfg: DictConfig, backbone):
        self.cfg, self.backbone = cfg, backbone
        self.limit = backbone.model.args.max_seq_len
        self.vocab = backbone.model.args.vocab_size
        # the longest token's text in bytes: a text of more than limit x this many bytes is over the
        # context whatever it encodes to (refused before it is tokenized; ~0.4 s at start for 49k tokens)
        tok = backbone.tokenizer
        self.token_bytes = max(len(t.encode()) for t in tok.batch_decode([[i] for i in range(len(tok))]))
        s = cfg.sampler
        # the preset's knobs, which a request's own override (temperature 0: greedy)
        self.sampling = SamplingParams(float(s.temperature) if s.do_sample else 0.0, float(s.top_p), int(s.top_k))
        self.per_request = runner_class(cfg).per_request
        self.grammars = GrammarCache(backbone, int(cfg.get("constraint_cache_bytes", 256 << 20)),
                                     float(cfg.get("constraint_timeout_s", 10)))

    def constraint(self, spec: Spec) -> ConstraintSpec | None:
        """The request's constraint: its own, else the configured one."""
        own = spec.request.constraint
        if own and not self.cfg.get("request_constraints", True):
            raise bad(PARAMS[next(iter(own))], "this server ignores request constraints (request_constraints=false)")
        try:
            return constraint_spec(self.cfg, own)
        except UserError as e:
            raise bad(PARAMS[next(iter(own))] if own else "constraint", str(e)) from None

    async def grammar(self, spec: Spec):
        """The request's compiled grammar (None: unconstrained), from the cache."""
        cspec = self.constraint(spec)
        if cspec is None:
            return None
        own = spec.request.constraint
        return await self.grammars.get(cspec, PARAMS[next(iter(own))] if own else "constraint")

    def to_engine(self, spec: Spec, grammar) -> tuple[Request, int]:
        """The runner's Request for a checked spec and its grammar (its first choice: choice i is
        this with seed + i, a sibling of the first), and its prompt's length. Blocking (the
        tokenizer): call it off the event loop."""
        sampling = self.knobs(spec)
        field = "messages" if spec.kind == "chat" else "prompt"
        r = with_constraint_text(spec.request, grammar)
        size = sum(len(m["content"].encode()) for m in r.messages) if r.messages else len(r.prompt.encode())
        if size > self.limit * self.token_bytes:
            raise APIError(400, f"{field}: the prompt is {size} bytes, more than the model's context of {self.limit} "
                           "tokens can hold: shorten it", field, "context_length_exceeded")
        try:
            ids = encode(self.backbone.tokenizer, r, spec.chat, self.cfg.get("system_prompt"))
        except UserError as e:
            raise bad(field, str(e)) from None
        if len(ids) >= self.limit:
            raise APIError(400, f"{field}: the prompt is {len(ids)} tokens, the model's context is {self.limit}: "
                           "shorten it", field, "context_length_exceeded")
        seed = int(self.cfg.seed) if spec.seed is None else spec.seed
        if (spec.logprobs is not None or spec.n > 1 or spec.draft is not None) and not self.per_request:
            name = "logprobs" if spec.logprobs is not None else "n" if spec.n > 1 else "model"
            raise unsupported(name, f"{name} on this runner ({self.cfg.get('name')}: it takes no per-request options)")
        return Request(ids, seed, grammar, spec.max_tokens, sampling, spec.logprobs, spec.draft), len(ids)

    def knobs(self, spec: Spec) -> SamplingParams | None:
        """The request's sampling knobs: the preset's with what the request gives of temperature,
        top_p and top_k (None when it gives none: the preset's sampler; a top_k of the vocabulary or
        more is off). A runner without per-request knobs honours only what leaves its tokens as they are."""
        asked = {k: getattr(spec, k) for k in ("temperature", "top_p", "top_k") if getattr(spec, k) is not None}
        if not asked:
            return None
        if asked.get("top_k", 0) >= self.vocab:
            asked["top_k"] = 0
        try:
            params = replace(self.sampling, **asked)
        except ValueError as e:
            field = next((k for k in asked if str(e).startswith(k)), next(iter(asked)))
            raise bad(field, str(e)) from None
        if not self.per_request:
            if params != self.sampling and not (params.greedy and self.sampling.greedy):
                k = next(k for k in asked if asked[k] != getattr(self.sampling, k))
                raise unsupported(k, f"{k} {asked[k]} on this runner ({self.cfg.get('name')}: it takes no "
                                  "per-request sampling knobs)")
            return None
        return params
