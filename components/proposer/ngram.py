"""Prompt lookup: draft the continuation of the latest earlier occurrence of the last n tokens.

Matches are searched in the prompt and the output so far, longest n-gram first; several distinct
continuations become the branches of one tree. When nothing matches there is no proposal and the
step is a plain decode step. After a proposal that is rejected outright the proposer backs off for a
few steps (doubling, capped), so text that matches only by accident costs little; what was accepted
comes from `observe`, per sequence.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.core import DecodeState, Proposer, Tree, positive_int


class NgramProposer(Proposer):
    def __init__(self, max_ngram: int = 4, min_ngram: int = 2, depth: int = 8, width: int = 2,
                 max_nodes: int = 16, max_backoff: int = 8):
        for name, v in (("max_ngram", max_ngram), ("min_ngram", min_ngram), ("depth", depth),
                        ("width", width), ("max_nodes", max_nodes)):
            positive_int(v, f"proposer.{name}")
        if min_ngram > max_ngram:
            raise ValueError(f"`proposer.min_ngram` ({min_ngram}) must be <= `proposer.max_ngram` ({max_ngram})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.depth, self.width, self.max_nodes = depth, width, max_nodes
        if not isinstance(max_backoff, int) or max_backoff < 0:
            raise ValueError(f"`proposer.max_backoff` must be an int >= 0, got {max_backoff}")
        self.max_backoff = max_backoff
        self.seqs: dict[int, _Backoff] = {}

    def describe(self) -> dict:
        """Its "tree": the tree shape it drafts."""
        return {"tree": {"width": self.width, "depth": self.depth, "max_nodes": self.max_nodes}}

    def start(self, seq, prompt_ids) -> None:
        self.seqs[seq] = _Backoff(backoff=min(1, self.max_backoff))

    def release(self, seq) -> None:
        self.seqs.pop(seq, None)

    def observe(self, seq, tokens, hidden) -> None:
        """Learn from the last proposal: a tree rejected outright (only the bonus token committed)
        makes the sequence sit out a few steps."""
        b = self.seqs[seq]
        if not b.proposed:
            return
        if len(tokens) <= 1:
            b.skip, b.backoff = b.backoff, min(2 * b.backoff, self.max_backoff)
        else:
            b.backoff = min(1, self.max_backoff)
        b.proposed = False

    def continuations(self, tokens: list[int], depth: int) -> list[list[int]]:
        arr = np.asarray(tokens, dtype=np.int64)
        n, found, seen = len(arr), [], set()
        for size in range(min(self.max_ngram, n - 1), self.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], size)  # earlier n-grams
            hits = np.flatnonzero((windows == arr[-size:]).all(axis=1))
            # longest continuation first (a match overlapping the end of the text has little to
            # offer), then the most recent
            for start in sorted(hits.tolist(), key=lambda s: (-min(depth, n - s - size), -s)):
                cont = arr[start + size:start + size + depth].tolist()
                if cont and tuple(cont[:2]) not in seen:
                    seen.add(tuple(cont[:2]))
                    found.append(cont)
                    if len(found) == self.width:
                        return found
        return found

    def propose(self, states: list[DecodeState]) -> list[Tree | None]:
        return [self._lookup(s) for s in states]

    def _lookup(self, state: DecodeState) -> Tree | None:
        """One sequence's tree of continuations, or None (backing off, or nothing matches)."""
        b = self.seqs[state.seq]
        if b.skip > 0:
            b.skip -= 1
            return None
        paths = self.continuations(state.tokens, min(self.depth, state.budget - 1))
        if not paths:
            return None
        tree = Tree.from_paths(state.tokens[-1], paths)
        if tree.size - 1 > self.max_nodes:
            keep = list(range(self.max_nodes + 1))  # packed order is breadth-first per path: trim the tail
            tree = Tree.from_parents(tree.tokens[keep].tolist(), tree.parents[keep].tolist())
        b.proposed = True
        return tree


@dataclass
class _Backoff:
    backoff: int  # steps to sit out after the next outright rejection
    skip: int = 0  # steps left to sit out now
    proposed: bool = False  # the last step verified a tree of ours
