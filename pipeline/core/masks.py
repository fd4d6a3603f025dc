"""What the engine does for constrained requests, in one object with a call for each moment of a
step: `prune` a draft tree before the forward, `start` the rows' allowed sets (the roots' computed
on a worker thread while the forward runs) and wait for them, `charge` the target stage's masking
time, `advance` a sequence's state past each committed token, and `note` the step's time.

A request may carry a constraint (a `Grammar`): its sequence then holds a `Constraint` state, every
row of it is masked with the allowed set of its own state in the target stage, drafts that leave the
language are pruned before the forward (`walk_tree`), and committed tokens advance the state. When
nothing but EOS may follow, the request ends (`constraint_complete`) with that EOS appended without
a forward: the masked distribution is one-hot on it. A sequence here is the engine's live state:
it has `index`, `constraint`, `grammar`, `gen`, `max_new_tokens` and `mask_s` (its constraint time in
the current step).
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from pipeline.core.bits import allows, words
from pipeline.core.constrain import walk_tree
from pipeline.core.faults import blame
from pipeline.core.tree import Tree


class StepConstraints:
    def __init__(self, vocab_size: int, eos_ids: set[int]):
        self.vocab_size, self.eos_ids = vocab_size, eos_ids
        self._pool: ThreadPoolExecutor | None = None  # the mask worker, made on first use

    def prune(self, s, tree: Tree) -> tuple[Tree, torch.Tensor | None]:
        """The tree without the drafts that leave s's language, and its nodes' packed allowed sets
        (None when s is unconstrained or the tree is a lone root)."""
        if s.constraint is None or tree.size == 1:
            return tree, None
        t0 = time.perf_counter()
        with blame(s.index):  # a constraint's failure is its request's
            tree, bits, pruned = walk_tree(s.constraint, tree, self.eos_ids, self.vocab_size, self._narrower(s))
        s.gen.pruned_drafts += pruned
        s.mask_s += time.perf_counter() - t0
        return tree, bits

    def start(self, seqs: list, node_bits: list, sizes: list[int]) -> Callable[[], torch.Tensor | None]:
        """Start building the (R, W) packed allowed sets of a step's rows: a tree's rows from its
        walk, a root's from its state, an unconstrained sequence's rows all set. The roots' sets are
        computed on a worker thread while the target forward runs (the grammar's state moved with
        the last commit; the forward does not need it); the returned callable waits for them and
        returns the sets (None when no sequence is constrained). Only the wait counts in mask_ms."""
        if all(s.constraint is None for s in seqs):
            return lambda: None
        bits = torch.full((sum(sizes), words(self.vocab_size)), -1, dtype=torch.int32)
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
                with blame(s.index):  # a constraint's failure is its request's
                    s.constraint.fill(bits[o])
                    narrow = self._narrower(s)
                    if narrow is not None:
                        narrow(bits[o], 0, s.constraint)

        if roots and self._pool is None:
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

    def charge(self, seqs: list, allowed: torch.Tensor | None, mask_s: float) -> None:
        """The target stage's masking time, shared by the step's constrained sequences."""
        if allowed is not None:
            n = sum(s.constraint is not None for s in seqs)
            for s in seqs:
                s.mask_s += mask_s / n if s.constraint is not None else 0.0

    def where(self, seqs: list, sizes: list[int]) -> Callable[[int], tuple[int | None, str]]:
        """Row r's request (its handle) and a text naming the request, node and constraint state (for
        the empty-allowed-set error, that request's fault)."""
        def where(r: int) -> tuple[int | None, str]:
            o = 0
            for s, n in zip(seqs, sizes):
                if r < o + n:
                    text = f"request {s.index}" + (f", draft node {r - o}" if n > 1 else "")
                    return s.index, f"{text}: {s.constraint.describe() if s.constraint is not None else 'unconstrained'}"
                o += n
            return None, f"row {r}"
        return where

    def advance(self, s, tok: int) -> bool:
        """Move s's constraint past a committed token; True when it is then complete."""
        t0 = time.perf_counter()
        if not s.constraint.advance(tok):
            raise RuntimeError(f"request {s.index}: token {tok} was committed but its constraint does not allow it "
                               f"({s.constraint.describe()}): the target rows were not masked with its state")
        complete = s.constraint.is_complete()
        s.mask_s += time.perf_counter() - t0
        return complete

    def end_token(self, c) -> int:
        """The EOS a complete constraint allows (the one token its masked distribution holds)."""
        bits = torch.zeros(words(self.vocab_size), dtype=torch.int32)
        c.fill(bits)
        allowed = [e for e in sorted(self.eos_ids) if allows(bits, e)]
        return allowed[0] if allowed else min(self.eos_ids)

    def note(self, s) -> None:
        """Close s's step: its constraint time goes to mask_ms."""
        if s.constraint is not None:
            s.gen.mask_ms.append(s.mask_s * 1e3)
        s.mask_s = 0.0

    def _narrower(self, s):
        """The closing margin: in the last `close_margin` tokens of max_new_tokens, a row's allowed set
        shrinks to the tokens that bring the output closest to a complete one (`Constraint.close`:
        for JSON, those that close strings, arrays and objects, and EOS), so an output that would run
        past the budget still ends in its language. None when the request's grammar has no margin."""
        margin = 0 if s.grammar is None else s.grammar.close_margin
        if not margin:
            return None
        start = s.max_new_tokens - margin - len(s.gen.token_ids)  # depth from which the margin applies

        def narrow(bits: torch.Tensor, depth: int, constraint) -> None:
            if depth >= start:
                constraint.close(bits)
        return narrow
