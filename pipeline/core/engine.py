"""The step loop over many sequences: admit -> propose -> one target forward -> verify -> commit.

Every live sequence's root (a plain step) or tree is packed into one target forward (`StepBatch`:
block-diagonal attention, each row positioned within its own sequence). The target-distribution
stage processes every row once; plain rows are sampled, trees are verified, and each sequence
commits its own accepted path. A request that finishes leaves the batch at once and the next one
is admitted (joining prompts prefilled together) before the next step: continuous batching.

The root of a sequence is its newest token, already chosen and streamed, whose keys/values are not
cached yet; a step with no draft is exactly a plain decode step, and every step commits
accept_length + 1 tokens per target forward.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from pipeline.core.errors import UserError
from pipeline.core.target import TargetStage
from pipeline.core.tree import Tree
from pipeline.core.types import DecodeState, Generation, StepBatch


PREFILL_ROWS = 2048  # padded prompt rows (requests x longest prompt) per admission forward


def forward_rows(model, kv, seq: int, tokens: torch.Tensor, depths: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None, layers: list[int] | None = None) -> torch.Tensor:
    """One sequence's forward: tokens (n,) after the slots it holds (a prompt block when depths and
    mask are None, else a tree). Returns hidden (n, dim); the rows become tentative slots."""
    step = StepBatch.build([seq], [tokens], [depths], [mask], [kv.used(seq)], model.attn_dtype)
    return model.step(step, kv, layers)


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
    done: bool = False


class Engine:
    """Decodes requests `batch_size` at a time with one model, KV pool, sampler and, optionally, a
    proposer + verifier. Tokens do not depend on the batch size (up to float rounding of batched
    matmuls, see the README) and sampling is seeded per request."""

    def __init__(self, model, kv, sampler, eos_ids: list[int], max_new_tokens: int, proposer=None,
                 verifier=None, seed: int = 0, batch_size: int = 1):
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
        self.target = TargetStage(sampler.processors, greedy=sampler.greedy)

    # --- public ------------------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], on_tokens: Callable[[list[int]], None] | None = None,
                 seed: int | None = None) -> Generation:
        """One request on its own."""
        cb = None if on_tokens is None else (lambda i, ids, hidden: on_tokens(ids))
        return self.run([prompt_ids], [self.seed if seed is None else seed], on_tokens=cb)[0]

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], seeds: list[int] | None = None,
            on_tokens: Callable[[int, list[int], torch.Tensor], None] | None = None,
            on_finish: Callable[[int, Generation], None] | None = None) -> list[Generation]:
        """Decode every prompt. on_tokens(i, ids, hidden): request i committed `ids`, chosen by the
        target states hidden (n, dim); on_finish(i, generation) as soon as request i is done. On any
        exception (a failure, Ctrl-C) every live sequence's memory goes back to the pool first."""
        limit = self.model.args.max_seq_len
        for i, p in enumerate(prompts):
            if not p:
                raise UserError(f"request {i} has an empty prompt: give it some text")
            if len(p) >= limit:
                raise UserError(f"request {i}: prompt is {len(p)} tokens, the model's context is {limit}: "
                                "shorten it or raise model.max_seq_len")
        seeds = [self.seed + i for i in range(len(prompts))] if seeds is None else list(seeds)
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
            joined.append(_Live(i, self.kv.create(), len(prompt), list(prompt), None, Generation(),
                                torch.Generator().manual_seed(seed), t0))
            live.append(joined[-1])
        step = StepBatch.build([s.seq for s in joined], [torch.tensor(s.tokens) for s in joined],
                               [None] * len(joined), [None] * len(joined), [0] * len(joined), self.model.attn_dtype)
        h = self.model.step(step, self.kv)  # (R, dim): every prompt position of every joining request
        last = [o - 1 for o in step.offsets[1:]]
        p = self.target(self.model.logits(h[last]), input_ids=lambda: [s.tokens for s in joined])
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
        drafted = [s for s in live if self.proposer is not None and self._budget(s) > 1]
        proposals = dict(zip((s.seq for s in drafted), self.proposer.propose_all(
            [DecodeState(s.seq, s.tokens, s.hidden, model, kv, self._budget(s), s.generator) for s in drafted])
            if drafted else []))
        for s in drafted:
            if self.proposer.sampled and proposals[s.seq] is not None and proposals[s.seq].q is None:
                raise RuntimeError(f"{type(self.proposer).__name__} samples its drafts but gave no q: "
                                   "exact verification needs the draft distribution of every node")
            if kv.pending(s.seq):
                raise RuntimeError(f"{type(self.proposer).__name__} left {kv.pending(s.seq)} tentative KV slots "
                                   "of a sequence: a drafting proposer must discard its own slots")
        trees = []
        for s in live:
            tree = proposals.get(s.seq)
            if tree is None:
                tree = Tree.root(s.tokens[-1])
            else:  # never more nodes than tokens left, never a draft past max_new_tokens or the context
                budget = self._budget(s)
                tree = tree.prune(budget - 1, min(budget, model.args.max_seq_len - kv.used(s.seq)))
            trees.append(tree)
        step = StepBatch.build([s.seq for s in live], [tr.tokens for tr in trees],
                               [None if tr.size == 1 else tr.depth for tr in trees],
                               [None if tr.size == 1 else tr.mask for tr in trees],
                               [kv.used(s.seq) for s in live], model.attn_dtype)
        h = model.step(step, kv)  # (R, dim)
        p = self.target(model.logits(h), input_ids=lambda: _contexts(live, trees))
        committed = []
        for s, tree, o in zip(live, trees, step.offsets):
            if tree.size == 1:
                path, new = [0], self.sampler.choose(p.rows(o, o + 1), [s.generator])
                kv.commit(s.seq)
            else:
                acc = self.verifier.verify(tree, p.rows(o, o + tree.size), s.generator)
                path, new = acc.path, acc.tokens
                kv.commit(s.seq, path)
            hidden = h[o + torch.tensor(path, device=h.device)] if len(path) > 1 else h[o:o + 1]  # (n, dim) along the path
            if self.proposer is not None:
                self.proposer.observe(s.seq, new, hidden)
            s.hidden = hidden[-1]
            committed.append((new, hidden))
        ms = (time.perf_counter() - t) * 1e3
        for s, tree, (new, hidden) in zip(live, trees, committed):
            s.gen.step_ms.append(ms)
            s.gen.step_nodes.append(tree.size)
            s.gen.tree_depths.append(tree.max_depth)
            self._emit(s, new, hidden, on_tokens)

    def _emit(self, s: _Live, new: list[int], hidden: torch.Tensor, on_tokens) -> None:
        """Append committed tokens, stopping exactly where plain decoding would: at the first EOS,
        at max_new_tokens or at the context end, even inside an accepted path."""
        gen, out = s.gen, []
        limit = self.model.args.max_seq_len
        for tok in new:
            out.append(tok)
            n = len(gen.token_ids) + len(out)
            if tok in self.eos_ids:
                gen.finish_reason, s.done = "eos", True
            elif n >= self.max_new_tokens:
                gen.finish_reason, s.done = "length", True
            elif s.prompt_len + n >= limit:
                gen.finish_reason, s.done = "context", True
            if s.done:
                break
        gen.token_ids += out
        gen.accepted_lengths.append(len(out))
        s.tokens += new
        if on_tokens is not None and out:
            on_tokens(s.index, out, hidden[:len(out)])


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
