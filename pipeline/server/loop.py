"""The engine on its own thread. It loops `runner.step()` while there is work and, between steps,
takes commands from a thread-safe inbox (add, abort, abort everything, stop); when idle it sleeps
on the inbox. It never waits on the network: committed tokens, finished generations and failures
are posted to each request's asyncio queue with `loop.call_soon_threadsafe`.

A request whose own work fails (its constraint, its sampling knobs, its seed) fails alone: the
runner redoes the step without it (`pipeline.core.faults`) and it gets an "error" event. A failure
of the model itself (every request of the step failed, or the step raised outside the runner's
isolation) fails the step's requests, is counted (`failed_steps`) and shown by /health
(`degraded` until a step succeeds); requests still waiting stay queued and the thread goes on.

If the thread itself ever dies, it says so first: every request in flight or in its inbox ends with
an error, new requests are refused (503), /health answers 503, and `failure` holds why (the server
then exits non-zero, for its supervisor to restart it)."""
from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch

from pipeline.core import Request, Runner, UserError


class Refused(Exception):
    """Not admitted: the queue is full (429) or the server is draining (503)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(eq=False)
class Job:
    """One request (one choice of an HTTP request) between the HTTP side and the engine thread.
    `events` receives, in order, ("tokens", Step) per step, then one of ("done", Generation),
    ("aborted", None) or ("error", Failure)."""
    request: Request
    loop: asyncio.AbstractEventLoop
    sibling: "Job | None" = None  # the first choice of its HTTP request (n > 1): its prompt KV is forked
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    handle: int | None = None  # the runner's, once added
    started: bool = False  # joined a step (its first token came)
    over: bool = False  # its last event is posted

    def post(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


@dataclass
class Failure:
    """Why a request failed: an HTTP status (400: its own input, found late; 500: the server's), a
    message and an OpenAI error code."""
    status: int
    message: str
    code: str = "request_failed"


@dataclass
class Step:
    """What one engine step committed for one request."""
    token_ids: list[int]
    logprobs: list | None  # Generation.logprobs of these tokens, where the request asked
    depth: int | None  # the deepest draft of the step's tree (0: a plain step); None: the prefill's token


class EngineLoop:
    """Runs `runner` on a thread; admission bounded at `max_queue` requests waiting for a slot."""

    def __init__(self, runner: Runner, max_queue: int, metrics=None, threads=None):
        if not isinstance(max_queue, int) or isinstance(max_queue, bool) or max_queue < 0:
            raise UserError(f"max_queue must be an int >= 0, got {max_queue!r}")
        self.runner, self.max_queue, self.metrics = runner, max_queue, metrics
        self.threads = threads  # pipeline.threads.StepThreads: each step's torch threads, measured; None: as set
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.jobs: dict[int, Job] = {}  # handle -> job, for every job the runner holds (engine thread only)
        self.pending: list[Job] = []  # added, not yet joined, in the runner's queue order (engine thread only)
        self._lock = threading.Lock()
        self.inflight = 0  # admitted and not over
        self.waiting = 0  # admitted and not yet joined a step: the queue depth
        self.draining = False
        self.failure: str | None = None  # why the thread died (None while it lives)
        self.failed_steps = 0  # steps that failed as the model's failure
        self.last_failure: dict | None = None  # the latest of those: {"time", "error"}
        self.degraded = False  # the latest step failed as the model's failure
        self._stop = False
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)
        runner.on_tokens = self._on_tokens

    # --- called from the HTTP side -----------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def submit(self, jobs: list[Job]) -> None:
        """Admit the jobs of one HTTP request (its choices), all or none, or raise Refused."""
        with self._lock:
            if self.failure is not None:
                raise Refused(503, "the engine stopped: the server is restarting")
            if self.draining:
                raise Refused(503, "the server is shutting down: retry on another instance")
            if self.inflight + len(jobs) > self.runner.batch_size + self.max_queue:  # every slot taken, max_queue waiting
                raise Refused(429, f"the queue is full ({self.max_queue} requests waiting): retry shortly")
            self.inflight += len(jobs)
            self.waiting += len(jobs)
        for job in jobs:
            self.inbox.put(("add", job))

    def abort(self, job: Job) -> None:
        """Drop a job (it ended on the HTTP side: a stop string, a client gone). Harmless once over."""
        if not job.over:
            self.inbox.put(("abort", job))

    def abort_all(self) -> None:
        self.inbox.put(("abort_all", None))

    def drain(self) -> None:
        """Stop admitting; what is in flight goes on."""
        with self._lock:
            self.draining = True

    def stop(self) -> None:
        """End the thread (what is still in flight is aborted first)."""
        if self.thread.is_alive():
            self.inbox.put(("stop", None))
            self.thread.join()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and self.failure is None

    # --- the engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while not self._stop:
                    if not self.runner.has_work:
                        self._command(*self.inbox.get())  # idle: sleep until something comes
                    while not self._stop:
                        try:
                            self._command(*self.inbox.get_nowait())
                        except queue.Empty:
                            break
                    if self.runner.has_work and not self._stop:
                        self._step()
                self._abort_all()
        except BaseException as e:  # noqa: BLE001 - the thread never dies silently
            self._die(e)

    def _die(self, e: BaseException) -> None:
        """The thread's last act: refuse new requests, end every request it holds or was sent."""
        with self._lock:
            self.failure = f"{type(e).__name__}: {e}"
        print(f"engine: the engine thread died ({self.failure}); ending every request", file=sys.stderr)
        traceback.print_exception(e, file=sys.stderr)
        failure = Failure(500, f"the engine stopped ({self.failure}): retry shortly", "engine_error")
        for job in list(self.jobs.values()):
            self._drop(job, ("error", failure))
        while True:
            try:
                what, job = self.inbox.get_nowait()
            except queue.Empty:
                break
            if what == "add":
                self._end(job, ("error", failure))
        self._publish()

    def _command(self, what: str, job: Job | None) -> None:
        if what == "add":
            if job.sibling is not None and job.sibling.handle is not None and not job.sibling.over:
                job.request.sibling_of = job.sibling.handle
            try:
                job.handle = self.runner.add(job.request)
            except Exception as e:  # noqa: BLE001 - the HTTP side checks first: this one request fails alone
                self._end(job, ("error", _failure(e)))
                return
            self.jobs[job.handle] = job
            self.pending.append(job)
        elif what == "abort":
            if job.handle is not None and self.runner.abort(job.handle):
                self._drop(job, ("aborted", None))
        elif what == "abort_all":
            self._abort_all()
        elif what == "stop":
            self._stop = True
        self._publish()

    def _step(self) -> None:
        live, n = self.runner.live, None
        if self.threads is not None:  # a step that prefills joining prompts takes every thread, unmeasured
            joining = self.runner.queued > 0 and live < self.runner.batch_size
            n = None if joining else self.threads.choose(live)
            want = self.threads.options[0] if n is None else n
            if torch.get_num_threads() != want:
                torch.set_num_threads(want)
        t0 = time.perf_counter()
        try:
            finished = self.runner.step()
        except Exception as e:  # noqa: BLE001 - any failure fails this step's requests, never the server
            self._fail(e)
            return
        seconds = time.perf_counter() - t0
        if n is not None:
            self.threads.record(live, n, seconds)
        if self.metrics is not None:
            self.metrics.step_seconds.observe(seconds)
        if self.runner.step_failure is not None:
            self._failed_step(self.runner.step_failure)
        else:
            self.degraded = False
        for handle, gen in finished:
            job = self.jobs.get(handle)
            if job is None:
                continue
            if gen.finish_reason == "error":
                if not isinstance(gen.fault, UserError):
                    print(f"engine: request {handle} failed alone: {gen.error}", file=sys.stderr)
                    traceback.print_exception(gen.fault, file=sys.stderr)
                self._drop(job, ("error", _failure(gen.fault)))
            else:
                self._drop(job, ("done", gen))
        self._publish()

    def _failed_step(self, e: BaseException) -> None:
        """A step failed as the model's failure: counted, and shown by /health."""
        self.failed_steps += 1
        self.degraded = True
        self.last_failure = {"time": time.time(), "error": f"{type(e).__name__}: {e}"}
        if self.metrics is not None:
            self.metrics.failed_steps.inc()

    def _fail(self, e: Exception) -> None:
        """Fail every request of the failed step: all the runner holds but those still queued (the
        runner admits in queue order, so they are the last `runner.queued` of `pending`)."""
        print(f"engine: a step failed, failing its requests: {type(e).__name__}: {e}", file=sys.stderr)
        traceback.print_exc(file=sys.stderr)
        queued = self.pending[len(self.pending) - self.runner.queued:] if self.runner.queued else []
        failure = Failure(500, f"the engine failed in a step ({type(e).__name__}: {e})", "engine_error")
        for job in [j for j in self.jobs.values() if j not in queued]:
            self.runner.abort(job.handle)
            self._drop(job, ("error", failure))
        self._failed_step(e)
        self._publish()

    def _abort_all(self) -> None:
        for job in list(self.jobs.values()):
            self.runner.abort(job.handle)
            self._drop(job, ("aborted", None))

    def _on_tokens(self, handle: int, ids: list[int], hidden) -> None:
        job = self.jobs.get(handle)
        if job is None:  # a warm-up request (runner.run) has no job
            return
        if not job.started:
            job.started = True
            self.pending.remove(job)
            with self._lock:
                self.waiting -= 1
        if self.metrics is not None:
            self.metrics.generation_tokens.inc(len(ids))
            self.metrics.accepted_length.observe(len(ids))
        gen = self.runner.peek(handle)
        logprobs = None if gen is None or gen.logprobs is None else gen.logprobs[len(gen.logprobs) - len(ids):]
        depth = gen.tree_depths[-1] if gen is not None and gen.steps > 1 and len(gen.tree_depths) == gen.steps - 1 else None
        job.post(("tokens", Step(list(ids), logprobs, depth)))

    def _drop(self, job: Job, event: tuple) -> None:
        self.jobs.pop(job.handle, None)
        if job in self.pending:
            self.pending.remove(job)
        self._end(job, event)

    def _end(self, job: Job, event: tuple) -> None:
        with self._lock:
            self.inflight -= 1
            self.waiting -= not job.started
        job.over = True
        job.post(event)

    def _publish(self) -> None:
        """The engine's state, as /metrics shows it (read here, between steps, never mid-step)."""
        if self.metrics is not None:
            self.metrics.publish(self.runner, self.waiting)


def _failure(e: BaseException | None) -> Failure:
    """A request's own failure: a 400 where its input was at fault (a UserError: a constraint that
    cannot be continued, ...), else a 500."""
    if isinstance(e, UserError):
        return Failure(400, str(e))
    return Failure(500, f"the request failed in the engine ({type(e).__name__}: {e})")
