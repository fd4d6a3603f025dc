"""The step loop over many sequences: admit -> propose -> one target forward -> verify -> commit.

Every live sequence's root (a plain step) or tree is packed into one target forward (`StepBatch`:
block-diagonal attention, each row positioned within its own sequence). The target-distribution
stage processes every row once; plain rows are sampled, trees are verified, and each sequence
commits its own accepted path. A request that finishes leaves the batch at once and the next one
is admitted (joining prompts prefilled together) before the next step: continuous batching.

The root of a sequence is its newest token, already chosen and streamed, whose keys/values are not
cached yet; a step with no draft is exactly a plain decode step, and every step commits
accept_length + 1 tokens per target forward.

A request may carry a constraint (a `Grammar`): its sequence then holds a `Constraint` state, every
row of it is masked with the allowed set of its own state in the target stage, drafts that leave the
language are pruned before the forward (`walk_tree`), and committed tokens advance the state. When
nothing but EOS may follow, the request ends (`constraint_complete`) with that EOS appended without
a forward: the masked distribution is one-hot on it.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable

import torch

from pipeline.core.constrain import allows, walk_tree, words
from pipeline.core.errors import UserError
from pipeline.core.target import TargetStage
from pipeline.core.tree import Tree
from pipeline.core.types import DecodeState, Generation, StepBatch


PREFILL_ROWS = 2048  # padded prompt rows (requests x longest prompt) per admission forward


def forward_step(model, kv, batch: StepBatch, *args) -> torch.Tensor:
    """One forward over a step's rows through the KV manager `kv`: the step begins (its plan goes
    with the batch), `model.step(batch, kv, *args)` runs (a backbone's args: the layers to run), and
    the rows become tentative slots. Returns the model's output, (R, dim)."""
    plan = kv.begin_step(batch)
    out = model.step(replace(batch, plan=plan), kv, *args)
    kv.end_step(plan)
    return out


def forward_rows(model, kv, seq: int, tokens: torch.Tensor, depths: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None, layers: list[int] | None = None) -> torch.Tensor:
    """One sequence's forward: tokens (n,) after the slots it holds (a prompt block when depths and
    mask are None, else a tree). Returns hidden (n, dim); the rows become tentative slots."""
    step = StepBatch.build([seq], [tokens], [depths], [mask], [kv.used(seq)], model.attn_dtype)
    return forward_step(model, kv, step, layers)


@dataclass
class _Live:
    index: int  # the request's position in the run
    seq: int  # its sequence id in the KV pool
    prompt_len: int
    tokens: list[int]  # prompt + committed tokens; the last is the root
    hidden: torch.Tensor | None  # (dim,) the target state that chose the root
    gen: Generation
    generator: torch.Generator
    t0: float
    constraint: object = None  # its Constraint state, when the request is constrained
    done: bool = False
    mask_s: float = 0.0  # constraint time (masks, tree walk, advances) in the current step


class Engine:
    """Decodes requests `batch_size` at a time with one model, KV pool, sampler and, optionally, a
    proposer + verifier. Tokens do not depend on the batch size (up to float rounding of batched
    matmuls, see the README) and sampling is seeded per request."""

    def __init__(self, model, kv, sampler, eos_ids: list[int], max_new_tokens: int, proposer=None,
                 verifier=None, seed: int = 0, batch_size: int = 1, constraint=None, guard=None):
        for name, v in (("max_new_tokens", max_new_tokens), ("batch_size", batch_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise UserError(f"{name} must be a positive int, got {v}")
        if proposer is not None and verifier is None:
            raise UserError("a proposer needs a verifier: add verifier=greedy")
        if proposer is not None and not sampler.greedy and not getattr(verifier, "samples", False):
            raise UserError(f"verifier {type(verifier).__name__} is lossless only for sampler=greedy: to sample "
                            "with speculation use verifier=exact (or verifier=typical), or drop the proposer")
        self.model, self.kv, self.sampler = model, kv, sampler
        self.eos_ids, self.max_new_tokens = set(eos_ids), max_new_tokens
        self.idle_proposer = None  # a proposer that will never draft (kept for what it reports)
        if proposer is not None and not proposer.active:
            self.idle_proposer, proposer = proposer, None  # e.g. no tree pays here: plain steps, no overhead
        self.proposer, self.verifier = proposer, verifier
        self.seed, self.batch_size = seed, batch_size
        self.constraint = constraint  # the Grammar every request follows unless it brings its own
        self._pool = None  # a worker thread for constraint masks, made on first use
        self.target = TargetStage(sampler.processors, greedy=sampler.greedy)
        self.record_trees = False  # keep every verified tree in Generation.trees (pipeline.report draws them)
        self.guard = guard  # a SpeculationGuard: pauses drafting while it does not pay (None: always draft)

    # --- public ------------------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], on_tokens: Callable[[list[int]], None] | None = None,
                 seed: int | None = None, grammar=None) -> Generation:
        """One request on its own."""
        cb = None if on_tokens is None else (lambda i, ids, hidden: on_tokens(ids))
        return self.run([prompt_ids], [self.seed if seed is None else seed], on_tokens=cb,
                        grammars=None if grammar is None else [grammar])[0]

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], seeds: list[int] | None = None,
            on_tokens: Callable[[int, list[int], torch.Tensor], None] | None = None,
            on_finish: Callable[[int, Generation], None] | None = None,
            grammars: list | None = None) -> list[Generation]:
        """Decode every prompt. on_tokens(i, ids, hidden): request i committed `ids`, chosen by the
        target states hidden (n, dim); on_finish(i, generation) as soon as request i is done.
        grammars[i]: request i's own constraint (None: the engine's). On any exception (a failure,
        Ctrl-C) every live sequence's memory goes back to the pool first."""
        check_prompts(prompts, self.model.args.max_seq_len)
        seeds = [self.seed + i for i in range(len(prompts))] if seeds is None else list(seeds)
        self._grammars = request_grammars(grammars, self.constraint, len(prompts))
        if self.guard is not None:
            self.guard.reset()
        queue, live = deque(range(len(prompts))), []
        out: list[Generation | None] = [None] * len(prompts)
        try:
            while queue or live:
                joining = []
                while queue and len(live) + len(joining) < self.batch_size:
                    i = queue.popleft()
                    joining.append((i, prompts[i], seeds[i]))
                if joining:
                    self._admit(joining, live, on_tokens)
                if not all(s.done for s in live):
                    self._step([s for s in live if not s.done], on_tokens)
                for s in [s for s in live if s.done]:
                    live.remove(s)
                    self._release(s)
                    s.gen.wall_s = time.perf_counter() - s.t0
                    out[s.index] = s.gen
                    if on_finish is not None:
                        on_finish(s.index, s.gen)
        finally:
            for s in live:
                self._release(s)
        return out

    # --- requests join ------------------------------------------------------------------------------
    def _admit(self, joining: list[tuple[int, list[int], int]], live: list[_Live], on_tokens) -> None:
        """Prefill the joining requests, packed into forwards of at most PREFILL_ROWS padded prompt
        rows (a longer prompt goes alone), choose each one's first token, and add them to `live`
        (as soon as their sequences exist, so a failure releases them with the rest)."""
        group: list[tuple[int, list[int], int]] = []
        for req in joining:
            if group and (len(group) + 1) * max(len(req[1]), *(len(r[1]) for r in group)) > PREFILL_ROWS:
                self._prefill(group, live, on_tokens)
                group = []
            group.append(req)
        self._prefill(group, live, on_tokens)

    def _prefill(self, group: list[tuple[int, list[int], int]], live: list[_Live], on_tokens) -> None:
        t0 = time.perf_counter()
        joined = []
        for i, prompt, seed in group:
            grammar = self._grammars[i]
            joined.append(_Live(i, self.kv.create(), len(prompt), list(prompt), None, Generation(),
                                torch.Generator().manual_seed(seed), t0,
                                None if grammar is None else grammar.start()))
            joined[-1].gen.constraint = None if grammar is None else grammar.kind
            live.append(joined[-1])
        step = StepBatch.build([s.seq for s in joined], [torch.tensor(s.tokens) for s in joined],
                               [None] * len(joined), [None] * len(joined), [0] * len(joined), self.model.attn_dtype)
        masks = self._masks(joined, [None] * len(joined), [1] * len(joined))
        h = forward_step(self.model, self.kv, step)  # (R, dim): every prompt position of every joining request
        last = [o - 1 for o in step.offsets[1:]]
        allowed = masks()
        p = self.target(self.model.logits(h[last]), input_ids=lambda: [s.tokens for s in joined], allowed=allowed,
                        describe=self._describe(joined, [1] * len(joined)))
        self._share_apply(joined, allowed)
        ms = (time.perf_counter() - t0) * 1e3
        for b, s in enumerate(joined):
            self.kv.commit(s.seq)
            first = self.sampler.choose(p.rows(b, b + 1), [s.generator])[0]
            if self.proposer is not None:
                self.proposer.start(s.seq, s.tokens)
                self.proposer.observe(s.seq, s.tokens[1:] + [first], h[step.offsets[b]:step.offsets[b + 1]])
            s.hidden = h[last[b]]
            s.gen.prefill_ms = ms
            self._emit(s, [first], h[last[b]:last[b] + 1], on_tokens)
            self._note_mask(s)

    def _release(self, s: _Live) -> None:
        if s.seq in self.kv.sequences:
            self.kv.free(s.seq)
        if self.proposer is not None:
            self.proposer.release(s.seq)

    # --- one step over every live sequence -------------------------------------------------------
    def _budget(self, s: _Live) -> int:
        """Tokens this sequence may still commit: up to max_new_tokens and the context end."""
        n = len(s.gen.token_ids)
        return min(self.max_new_tokens - n, self.model.args.max_seq_len - s.prompt_len - n)

    def _step(self, live: list[_Live], on_tokens) -> None:
        t = time.perf_counter()
        model, kv = self.model, self.kv
        rank = {seq: r for r, seq in enumerate(kv.batch_order([s.seq for s in live]))}
        live = sorted(live, key=lambda s: rank[s.seq])
        speculate = self.proposer is not None and (self.guard is None or self.guard.speculate())
        drafted = [s for s in live if speculate and self._budget(s) > 1]
        proposals = dict(zip((s.seq for s in drafted), self.proposer.propose(
            [DecodeState(s.seq, s.tokens, s.hidden, model, kv, self._budget(s), s.generator) for s in drafted])
            if drafted else []))
        for s in drafted:
            if self.proposer.sampled and proposals[s.seq] is not None and proposals[s.seq].q is None:
                raise RuntimeError(f"{type(self.proposer).__name__} samples its drafts but gave no q: "
                                   "exact verification needs the draft distribution of every node")
            if kv.pending(s.seq):
                raise RuntimeError(f"{type(self.proposer).__name__} left {kv.pending(s.seq)} tentative KV slots "
                                   "of a sequence: a drafting proposer must discard its own slots")
        trees, node_bits = [], []
        for s in live:
            tree, bits = proposals.get(s.seq), None
            if tree is None:
                tree = Tree.root(s.tokens[-1])
            else:  # never more nodes than tokens left, never a draft past max_new_tokens or the context
                budget = self._budget(s)
                tree = tree.prune(budget - 1, min(budget, model.args.max_seq_len - kv.used(s.seq)))
                if s.constraint is not None and tree.size > 1:  # drafts that leave the language go now
                    t0 = time.perf_counter()
                    tree, bits, pruned = walk_tree(s.constraint, tree, self.eos_ids, model.args.vocab_size,
                                                   self._narrower(s))
                    s.gen.pruned_drafts += pruned
                    s.mask_s += time.perf_counter() - t0
            trees.append(tree)
            node_bits.append(bits)
        step = StepBatch.build([s.seq for s in live], [tr.tokens for tr in trees],
                               [None if tr.size == 1 else tr.depth for tr in trees],
                               [None if tr.size == 1 else tr.mask for tr in trees],
                               [kv.used(s.seq) for s in live], model.attn_dtype)
        sizes = [tr.size for tr in trees]
        masks = self._masks(live, node_bits, sizes)
        h = forward_step(model, kv, step)  # (R, dim)
        allowed = masks()
        p = self.target(model.logits(h), input_ids=lambda: _contexts(live, trees), allowed=allowed,
                        describe=self._describe(live, sizes))
        self._share_apply(live, allowed)
        committed = []
        for s, tree, o in zip(live, trees, step.offsets):
            if tree.size == 1:
                path, new = [0], self.sampler.choose(p.rows(o, o + 1), [s.generator])
                kv.commit(s.seq)
            else:
                acc = self.verifier.verify(tree, p.rows(o, o + tree.size), s.generator)
                path, new = acc.path, acc.tokens
                kv.commit(s.seq, path)
                if self.record_trees:
                    s.gen.trees.append({"step": len(s.gen.accepted_lengths), "tokens": tree.tokens.tolist(),
                                        "parents": tree.parents.tolist(), "path": [int(i) for i in path]})
            hidden = h[o + torch.tensor(path, device=h.device)] if len(path) > 1 else h[o:o + 1]  # (n, dim) along the path
            if self.proposer is not None:
                self.proposer.observe(s.seq, new, hidden)
            s.hidden = hidden[-1]
            committed.append((new, hidden))
        ms = (time.perf_counter() - t) * 1e3
        if self.guard is not None and self.proposer is not None:
            self.guard.record(any(tr.size > 1 for tr in trees), sum(len(new) for new, _ in committed), ms)
        for s, tree, (new, hidden) in zip(live, trees, committed):
            s.gen.step_ms.append(ms)
            s.gen.step_nodes.append(tree.size)
            s.gen.tree_depths.append(tree.max_depth)
            self._emit(s, new, hidden, on_tokens)
            self._note_mask(s)

    # --- constraints -------------------------------------------------------------------------------
    def _masks(self, seqs: list[_Live], node_bits: list, sizes: list[int]) -> Callable[[], torch.Tensor | None]:
        """Start building the (R, W) packed allowed sets of a step's rows: a tree's rows from its
        walk, a root's from its state, an unconstrained sequence's rows all set. The roots' sets are
        computed on a worker thread while the target forward runs (the grammar's state moved with
        the last commit; the forward does not need it); the returned callable waits for them and
        returns the sets (None when no sequence is constrained). Only the wait counts in mask_ms."""
        if all(s.constraint is None for s in seqs):
            return lambda: None
        vocab = self.model.args.vocab_size
        bits = torch.full((sum(sizes), words(vocab)), -1, dtype=torch.int32)
        roots, o = [], 0
        for s, nb, n in zip(seqs, node_bits, sizes):
            if nb is not None:
                bits[o:o + n] = nb
            elif s.constraint is not None:
                roots.append((s, o))
            o += n

        @torch.inference_mode()  # the worker thread's own mode: bits was made under the engine's
        def fill_roots() -> None:
            for s, o in roots:
                s.constraint.fill(bits[o])
                narrow = self._narrower(s)
                if narrow is not None:
                    narrow(bits[o], 0, s.constraint)

        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="constraint-masks")
        job = self._pool.submit(fill_roots) if roots else None

        def finish() -> torch.Tensor:
            t0 = time.perf_counter()
            if job is not None:
                job.result()
            share = (time.perf_counter() - t0) / max(1, len(roots))
            for s, _ in roots:
                s.mask_s += share
            return bits
        return finish

    def _narrower(self, s: _Live):
        """The closing margin: in the last `close_margin` tokens of max_new_tokens, a row's allowed set
        shrinks to the tokens that bring the output closest to a complete one (`Constraint.close`:
        for JSON, those that close strings, arrays and objects, and EOS), so an output that would run
        past the budget still ends in its language. None when the request's grammar has no margin."""
        margin = getattr(self._grammars[s.index], "close_margin", None)
        if not margin:
            return None
        start = self.max_new_tokens - margin - len(s.gen.token_ids)  # depth from which the margin applies

        def narrow(bits: torch.Tensor, depth: int, constraint) -> None:
            if depth >= start:
                constraint.close(bits)
        return narrow

    def _share_apply(self, seqs: list[_Live], allowed) -> None:
        """The target stage's masking time, shared by the step's constrained sequences."""
        if allowed is not None:
            n = sum(s.constraint is not None for s in seqs)
            for s in seqs:
                s.mask_s += self.target.mask_s / n if s.constraint is not None else 0.0

    def _describe(self, seqs: list[_Live], sizes: list[int]) -> Callable[[int], str]:
        """Names the request, node and constraint state of row r (for the empty-allowed-set error)."""
        def describe(r: int) -> str:
            o = 0
            for s, n in zip(seqs, sizes):
                if r < o + n:
                    where = f"request {s.index}" + (f", draft node {r - o}" if n > 1 else "")
                    return f"{where}: {s.constraint.describe() if s.constraint is not None else 'unconstrained'}"
                o += n
            return f"row {r}"
        return describe

    def _note_mask(self, s: _Live) -> None:
        if s.constraint is not None:
            s.gen.mask_ms.append(s.mask_s * 1e3)
        s.mask_s = 0.0

    def _emit(self, s: _Live, new: list[int], hidden: torch.Tensor, on_tokens) -> None:
        """Append committed tokens, stopping exactly where plain decoding would: at the first EOS,
        where the constraint is complete, at max_new_tokens or at the context end, even inside an
        accepted path."""
        gen, out = s.gen, []
        limit = self.model.args.max_seq_len
        c = s.constraint
        for tok in new:
            out.append(tok)
            n = len(gen.token_ids) + len(out)
            if tok in self.eos_ids:
                gen.finish_reason, s.done = "eos", True
            elif c is not None and self._advance(s, tok):
                gen.finish_reason, s.done = "constraint_complete", True
                if n < self.max_new_tokens and s.prompt_len + n < limit:  # the one token it allows
                    out.append(self._end_token(c))
            elif n >= self.max_new_tokens:
                gen.finish_reason, s.done = "length", True
            elif s.prompt_len + n >= limit:
                gen.finish_reason, s.done = "context", True
            if s.done:
                break
        if s.done and c is not None:
            gen.constraint_complete = gen.finish_reason in ("eos", "constraint_complete") or c.can_end()
        gen.token_ids += out
        gen.accepted_lengths.append(len(out))
        s.tokens += new
        if on_tokens is not None and out:
            on_tokens(s.index, out, hidden[:len(out)])


    def _advance(self, s: _Live, tok: int) -> bool:
        """Move the sequence's constraint past a committed token; True when it is then complete."""
        t0 = time.perf_counter()
        if not s.constraint.advance(tok):
            raise RuntimeError(f"request {s.index}: token {tok} was committed but its constraint does not allow it "
                               f"({s.constraint.describe()}): the target rows were not masked with its state")
        complete = s.constraint.is_complete()
        s.mask_s += time.perf_counter() - t0
        return complete

    def _end_token(self, c) -> int:
        bits = torch.zeros(words(self.model.args.vocab_size), dtype=torch.int32)
        c.fill(bits)
        allowed = [e for e in sorted(self.eos_ids) if allows(bits, e)]
        return allowed[0] if allowed else min(self.eos_ids)


def check_prompts(prompts: list[list[int]], limit: int) -> None:
    """Every prompt non-empty and shorter than the context, else a one-line error naming the request."""
    for i, p in enumerate(prompts):
        if not p:
            raise UserError(f"request {i} has an empty prompt: give it some text")
        if len(p) >= limit:
            raise UserError(f"request {i}: prompt is {len(p)} tokens, the model's context is {limit}: "
                            "shorten it or raise model.max_seq_len")


def request_grammars(grammars: list | None, default, n: int) -> list:
    """Each request's constraint: its own where given, else the runner's configured one."""
    return [g or default for g in grammars] if grammars is not None else [default] * n


def _contexts(live: list[_Live], trees: list[Tree]) -> list[list[int]]:
    """The token context each row of a step continues: the committed tokens, then the drafts on
    the path from the root to the row's node."""
    out = []
    for s, tree in zip(live, trees):
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        ctx = [s.tokens]
        for i in range(1, len(tokens)):
            ctx.append(ctx[parents[i]] + [tokens[i]])
        out += ctx
    return out
