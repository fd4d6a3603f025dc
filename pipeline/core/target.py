"""The target-distribution stage: the one place where target logits become what the sampler and the
verifiers read. Every row of a step goes through it: a plain step's root, the nodes of a tree, live
beams. Logits processors run in order (transformers' protocol), then a per-row mask of allowed
tokens (constraints), then the softmax: the target distribution p is the processed, masked one.
"""
from __future__ import annotations

from typing import Callable

import torch

from pipeline.core.errors import UserError


class Target:
    """Processed target scores of R rows. scores: (R, V) float32, -inf where a token is not allowed;
    `probs` (R, V), the distribution p the sampler draws from (one-hot on the argmax when decoding
    greedily), and `argmax` (R,) are computed on first use and shared by every consumer."""

    def __init__(self, scores: torch.Tensor, greedy: bool = False):
        self.scores, self.greedy = scores, greedy
        self._probs: torch.Tensor | None = None
        self._argmax: list[int] | None = None

    @property
    def probs(self) -> torch.Tensor:
        if self._probs is None:
            if self.greedy:
                self._probs = torch.zeros_like(self.scores).scatter_(-1, self.scores.argmax(-1, keepdim=True), 1.0)
            else:
                self._probs = self.scores.softmax(-1)
        return self._probs

    @property
    def argmax(self) -> list[int]:
        if self._argmax is None:
            self._argmax = self.scores.argmax(-1).tolist()
        return self._argmax

    def rows(self, start: int, stop: int) -> "Target":
        """The rows [start, stop), sharing whatever was already computed."""
        out = Target(self.scores[start:stop], self.greedy)
        if self._probs is not None:
            out._probs = self._probs[start:stop]
        if self._argmax is not None:
            out._argmax = self._argmax[start:stop]
        return out

    def __len__(self) -> int:
        return self.scores.shape[0]


class TargetStage:
    """logits (R, V) -> Target, through the sampler's processors and the rows' constraint masks."""

    def __init__(self, processors: list | None = None, greedy: bool = False):
        self.processors, self.greedy = list(processors or []), greedy
        self.needs_input_ids = any(getattr(p, "needs_input_ids", False) for p in self.processors)

    def __call__(self, logits: torch.Tensor, input_ids: Callable[[], list[list[int]]] | None = None,
                 allowed: torch.Tensor | None = None, describe: Callable[[int], str] | None = None) -> Target:
        """logits: (R, V) float32. input_ids: builds the context of every row, called only when a
        processor needs it. allowed: (R, V) bool, or None. describe(r): names row r in the error
        raised when its allowed set is empty."""
        scores = logits
        ids = input_ids() if self.needs_input_ids and input_ids is not None else None
        for proc in self.processors:
            scores = proc(ids, scores)
        if allowed is not None:
            empty = ~allowed.any(-1)
            if bool(empty.any()):
                r = int(empty.nonzero()[0])
                raise UserError(f"no token is allowed at {describe(r) if describe else f'row {r}'}: "
                                "the constraint cannot be continued; check it against the prompt")
            scores = scores.masked_fill(~allowed, float("-inf"))
        return Target(scores.float(), self.greedy)
