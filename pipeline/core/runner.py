"""The admission loop every runner shares (the engine's step loop, beam search), in the style of
vLLM v1's engine core: `add(request) -> handle`, `abort(handle)`, `step()`.

A request waits in the queue until a step has room for it (fewer than `batch_size` live), joins at
the start of that step (its prompt prefilled with the others that join), and leaves as soon as it
is done or aborted, with its KV memory back in the pool. `run()` is the batch form on top: every
prompt added, steps until nothing is left, and on any exception (a failure, Ctrl-C) every live
request's memory returned first. A runner says what it is through two class attributes, which is
what configs are checked against before anything is built: `speculates` (it takes a proposer) and
`plain` (its output is plain decoding's: the baseline of a sweep or a benchmark), and one more,
`per_request`, says whether a request may bring options of its own (sampling knobs, logprobs, a
named draft, siblings).
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable

import torch

from pipeline.errors import UserError, positive_int
from pipeline.core.faults import isolate
from pipeline.core.types import Generation, StepBatch


MAX_LOGPROBS = 20  # top log-probabilities a request may ask for per token (OpenAI's limit)
SEED_RANGE = (0, 2**64 - 1)  # what torch.Generator.manual_seed takes (from 0: a seed is a count here)
GREEDY_BELOW = 1e-5  # a temperature below this is greedy decoding (vLLM's rule): 0 is the usual way to ask


@dataclass(frozen=True)
class SamplingParams:
    """A request's own sampling knobs, as the sampler's config names them (`sampler.temperature`,
    `sampler.top_p`, `sampler.top_k`). temperature 0 is greedy decoding (argmax of the processed
    scores: top-p and top-k never change it); top_p 1.0 and top_k 0 are off."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if not _finite(self.temperature) or self.temperature < 0:
            raise UserError(f"temperature must be a finite number >= 0 (0: greedy), got {self.temperature!r}")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise UserError(f"top_k must be an int >= 0 (0: off), got {self.top_k!r}")
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_seed(seed, name: str = "seed") -> int:
    """A seed torch's generators take: an int in SEED_RANGE, else a UserError naming it."""
    low, high = SEED_RANGE
    if not isinstance(seed, int) or isinstance(seed, bool) or not low <= seed <= high:
        raise UserError(f"{name} must be an int in {low}..{high} (2**64 - 1), got {seed!r}")
    return seed


@dataclass
class Request:
    """One request as a runner takes it."""
    prompt: list[int]  # token ids, chat template applied
    seed: int  # its own generator's seed: tokens never depend on what runs beside it
    grammar: object = None  # its constraint (a Grammar); None: the runner's configured one
    max_new_tokens: int | None = None  # None: the runner's
    sampling: SamplingParams | None = None  # its own sampling knobs; None: the runner's sampler
    logprobs: int | None = None  # None: none; k >= 0: each token's log-probability and the k best (Generation.logprobs)
    draft: str | None = None  # the named draft that proposes its trees (Engine's `drafts`); None: the runner's own
    sibling_of: int | None = None  # the handle of a request with the same prompt and constraint (n > 1): when
    # both join in one step, this one forks that one's prompt KV instead of prefilling it again


# the options only a runner with `per_request` takes
REQUEST_OPTIONS = ("sampling", "logprobs", "draft", "sibling_of")


def check_prompt(index: int, prompt: list[int], limit: int) -> None:
    """A prompt non-empty and shorter than the context, else a one-line error naming the request."""
    if not prompt:
        raise UserError(f"request {index} has an empty prompt: give it some text")
    if len(prompt) >= limit:
        raise UserError(f"request {index}: prompt is {len(prompt)} tokens, the model's context is {limit}: "
                        "shorten it or raise model.max_seq_len")


def forward_step(model, kv, batch: StepBatch, *args) -> torch.Tensor:
    """One forward over a step's rows through the KV manager `kv`: the step begins (its plan goes
    with the batch), `model.step(batch, kv, *args)` runs (a backbone's args: the layers to run), and
    the rows become tentative slots. Returns the model's output, (R, dim)."""
    plan = kv.begin_step(batch)
    out = model.step(replace(batch, plan=plan), kv, *args)
    kv.end_step(plan)
    return out


class Runner(ABC):
    """Requests in, Generations out, `batch_size` live at a time. Subclasses implement `_join`
    (prefill the joining requests and return their live state), `_step` (one step over the live
    ones), `_release` (return one's memory) and `_finish` (its Generation); the live state of a
    request is any object with `index` and `done`."""
    speculates = False  # takes a proposer (tree speculation)
    plain = False  # with no proposer its tokens are plain decoding's
    per_request = False  # takes a request's own options (REQUEST_OPTIONS)
    rewinds = False  # a failed step can be undone (`_snapshot`, `_rewind`): one request's failure fails it alone

    def __init__(self, model, kv, sampler, eos_ids: list[int], max_new_tokens: int, seed: int = 0,
                 batch_size: int = 1, constraint=None):
        positive_int(max_new_tokens, "max_new_tokens"), positive_int(batch_size, "batch_size")
        self.model, self.kv, self.sampler = model, kv, sampler
        self.eos_ids, self.max_new_tokens = set(eos_ids), max_new_tokens
        self.seed, self.batch_size = seed, batch_size
        self.constraint = constraint  # the Grammar every request follows unless it brings its own
        self.on_tokens: Callable | None = None  # on_tokens(handle, ids, hidden): committed tokens, as they come
        self._queue: deque[tuple[int, Request]] = deque()
        self._live: list = []
        self._failed: list[tuple[int, Generation]] = []  # failed before they were live, reported by the next step()
        self.step_failure: BaseException | None = None  # the last step's, when it was the model's
        self._next = 0

    # --- the engine-core API ---------------------------------------------------------------------
    def add(self, request: Request) -> int:
        """Queue a request; it joins at the next step with room. Returns its handle."""
        check_prompt(self._next, request.prompt, self.model.args.max_seq_len)
        check_seed(request.seed, f"request {self._next}'s seed")
        if request.max_new_tokens is not None:
            positive_int(request.max_new_tokens, "max_new_tokens")
        given = [k for k in REQUEST_OPTIONS if getattr(request, k) is not None]
        if given and not self.per_request:
            what = {"sampling": "sampling knobs", "sibling_of": "siblings (n > 1)"}.get(given[0], given[0])
            raise UserError(f"{type(self).__name__} takes no per-request {what}")
        if request.sampling is not None and not isinstance(request.sampling, SamplingParams):
            raise UserError(f"a request's sampling must be SamplingParams, got {request.sampling!r}")
        if request.logprobs is not None and (not isinstance(request.logprobs, int) or isinstance(request.logprobs, bool)
                                             or not 0 <= request.logprobs <= MAX_LOGPROBS):
            raise UserError(f"logprobs must be an int in 0..{MAX_LOGPROBS}, got {request.logprobs!r}")
        sibling = next((r for h, r in self._queue if h == request.sibling_of), None) if request.sibling_of is not None else None
        if sibling is not None and (sibling.prompt != request.prompt or sibling.grammar is not request.grammar
                                    or sibling.sampling != request.sampling):
            raise UserError(f"request {self._next} names request {request.sibling_of} as its sibling but differs in its "
                            "prompt, constraint or sampling knobs: siblings share those (n > 1)")
        handle, self._next = self._next, self._next + 1
        self._queue.append((handle, request))
        return handle

    def abort(self, handle: int) -> Generation | None:
        """Drop a request, queued or live, at once (its memory back in the pool). Returns what it
        had made so far (finish_reason "abort"; empty if it was still queued), None if unknown."""
        for item in self._queue:
            if item[0] == handle:
                self._queue.remove(item)
                return Generation(finish_reason="abort")
        for s in self._live:
            if s.index == handle:
                self._live.remove(s)
                self._release(s)
                gen = self._finish(s)
                gen.finish_reason = "abort"
                return gen
        return None

    def peek(self, handle: int) -> Generation | None:
        """What a live request has made so far, to read (None: not live, or a runner that keeps no
        Generation while it runs)."""
        return None

    @property
    def has_work(self) -> bool:
        return bool(self._queue or self._live)

    @property
    def live(self) -> int:
        return len(self._live)

    @property
    def queued(self) -> int:
        return len(self._queue)

    @torch.inference_mode()
    def step(self) -> list[tuple[int, Generation]]:
        """Admit what fits, run one step over the live requests, and return the (handle, Generation)
        of each request that finished in it (its memory already back in the pool). A request whose
        own work failed finishes alone with finish_reason "error" (`pipeline.core.faults`);
        `step_failure` holds the cause when every request of the step failed unexplained (the
        model's failure), else None."""
        self.step_failure = None
        joining = []
        while self._queue and len(self._live) + len(joining) < self.batch_size:
            joining.append(self._queue.popleft())
        if joining:
            self._join(joining)
        live = [s for s in self._live if not s.done]
        if live and self.rewinds:
            saved: list = []

            def run(part: list) -> None:
                saved[:] = [self._snapshot(part)]
                self._step(part)

            failed = isolate(live, run, lambda part: self._rewind(part, saved[0]), lambda s: s.index)
            for s, cause, _ in failed:
                s.done, s.error = True, cause
            if failed and all(not blamed for _, _, blamed in failed) and len(failed) == len(live):
                self.step_failure = failed[-1][1]
        elif live:
            self._step(live)
        finished, self._failed = self._failed, []
        for s in [s for s in self._live if s.done]:
            self._live.remove(s)
            self._release(s)
            gen = self._finish(s)
            if getattr(s, "error", None) is not None:
                _failed(gen, s.error)
            finished.append((s.index, gen))
        return finished

    def _fail_joining(self, handle: int, cause: BaseException) -> None:
        """A request that failed before it was live (its prefill): it finishes at the end of the step."""
        self._failed.append((handle, _failed(Generation(), cause)))

    def abort_all(self) -> None:
        """Every request gone, its memory back in the pool."""
        self._queue.clear()
        self._failed.clear()
        while self._live:
            self._release(self._live.pop())

    # --- the batch form ---------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, prompts: list[list[int]], seeds: list[int] | None = None,
            on_tokens: Callable[[int, list[int], torch.Tensor | None], None] | None = None,
            on_finish: Callable[[int, Generation], None] | None = None,
            grammars: list | None = None, max_new_tokens: int | None = None) -> list[Generation]:
        """Decode every prompt. on_tokens(i, ids, hidden): request i committed `ids`; on_finish(i,
        generation) as soon as request i is done. grammars[i]: request i's own constraint (None: the
        runner's); seeds default to seed + i."""
        if self.has_work:
            raise RuntimeError("run() needs an idle runner: it numbers its requests from 0")
        self._next = 0
        for i, p in enumerate(prompts):
            check_prompt(i, p, self.model.args.max_seq_len)
        seeds = [self.seed + i for i in range(len(prompts))] if seeds is None else list(seeds)
        grammars = [None] * len(prompts) if grammars is None else list(grammars)
        on_tokens, self.on_tokens = self.on_tokens, on_tokens  # a server's callback comes back after
        self.reset()
        out: list[Generation | None] = [None] * len(prompts)
        try:
            for p, s, g in zip(prompts, seeds, grammars):
                self.add(Request(list(p), s, g, max_new_tokens))
            while self.has_work:
                for i, gen in self.step():
                    if gen.finish_reason == "error":  # a batch run ends on any request's failure
                        raise gen.fault
                    out[i] = gen
                    if on_finish is not None:
                        on_finish(i, gen)
        finally:
            self.abort_all()
            self.on_tokens = on_tokens
        return out

    def generate(self, prompt_ids: list[int], on_tokens: Callable[[list[int]], None] | None = None,
                 seed: int | None = None, grammar=None) -> Generation:
        """One request on its own."""
        cb = None if on_tokens is None else (lambda i, ids, hidden: on_tokens(ids))
        return self.run([prompt_ids], [self.seed if seed is None else seed], on_tokens=cb, grammars=[grammar])[0]

    @property
    def drafting(self) -> bool:
        """Whether steps may verify drafted trees (what a lossless guarantee has to cover)."""
        return False

    @property
    def drafter(self):
        """The proposer, also one that decided never to draft (for what it reports); None if none."""
        return None

    def describe(self) -> dict:
        """What the run reports about its runner's components (results.json's summary)."""
        return {"kv": self.kv.stats()}

    # --- what a runner implements ---------------------------------------------------------------
    def reset(self) -> None:
        """Per-run state starts afresh (run() calls it; a server after its warm-up): the KV manager's
        prefix cache too, so that one run's timings never ride on what an earlier one prefilled."""
        self.kv.reset_prefix_cache()

    def _grammar(self, request: Request):
        return request.grammar or self.constraint

    def _budget_of(self, request: Request) -> int:
        return self.max_new_tokens if request.max_new_tokens is None else request.max_new_tokens

    def _snapshot(self, live: list):
        """What `_rewind` needs to undo a step over `live` (runners with `rewinds`)."""
        raise NotImplementedError

    def _rewind(self, live: list, snapshot) -> None:
        """Undo a step over `live` that raised before it committed anything."""
        raise NotImplementedError

    @abstractmethod
    def _join(self, joining: list[tuple[int, Request]]) -> None:
        """Prefill the joining requests and append their live state to self._live (as soon as their
        sequences exist, so a failure releases them with the rest)."""

    @abstractmethod
    def _step(self, live: list) -> None:
        """One step over the live requests that are not done."""

    @abstractmethod
    def _release(self, s) -> None:
        """Return a live request's memory."""

    @abstractmethod
    def _finish(self, s) -> Generation:
        """The Generation of a request that is done (its memory is already released)."""


def _failed(gen: Generation, cause: BaseException) -> Generation:
    """gen as a failed request's: finish_reason "error", the cause kept (`fault`) and said (`error`)."""
    gen.finish_reason, gen.fault = "error", cause
    gen.error = str(cause) if isinstance(cause, UserError) else f"{type(cause).__name__}: {cause}"
    return gen
