"""The target-distribution stage: the one place where target logits become what the sampler and the
verifiers read. Every row of a step goes through it: a plain step's root, the nodes of a tree, live
beams. Logits processors run in order (transformers' protocol), then a per-row mask of allowed
tokens (constraints: the masked distribution, renormalised over the allowed set), then the softmax:
the target distribution p is the processed, masked one. Where rows are sampled, the mask comes
first, so top-k and top-p choose among allowed tokens (as vLLM applies a grammar's bitmask before
them): otherwise a row whose allowed tokens all fall outside its top-k would hold none.

Requests with sampling knobs of their own come as row groups (`RowGroup`): the shared processors
still run once over every row, then each group's warpers (temperature, top-k, top-p) over its rows,
and a group says whether its rows are chosen greedily.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from pipeline.core.bits import allows, unpack
from pipeline.core.faults import RequestFault, blame
from pipeline.errors import UserError


@dataclass
class RowGroup:
    """Rows of a step that one set of sampling knobs processes: after the shared processors, its
    `warpers` run over `rows` (indices into the step's rows), and `greedy` says how they are chosen.
    `owners`: the handles of the requests whose rows they are (a failure of the warpers is theirs)."""
    rows: list[int]
    warpers: list
    greedy: bool
    owners: list[int] = field(default_factory=list)


class Target:
    """Processed target scores of R rows. `scores` (R, V) float32, -inf where a token is not allowed;
    `probs` (R, V), the distribution p the sampler draws from (one-hot on the argmax when decoding
    greedily), and `argmax` (R,) are computed on first use and shared by every consumer. `greedy`:
    whether the rows are chosen greedily, a bool, or one per row (list) where the rows' requests differ.

    With a constraint, `allowed` holds the rows' packed allowed sets and the mask is applied only when
    someone reads `scores` or `probs`: a greedy argmax first takes the unmasked argmax and keeps it
    where the row allows it (then it is the masked argmax too: the same maximum, and no allowed token
    before it holds it), so greedy constrained decoding rarely touches the whole vocabulary twice."""

    def __init__(self, scores: torch.Tensor, greedy: bool | list[bool] = False, allowed: torch.Tensor | None = None):
        if isinstance(greedy, list) and len(set(greedy)) <= 1:  # rows that agree: one bool
            greedy = bool(greedy[0]) if greedy else False
        self.greedy, self.allowed = greedy, allowed
        self._raw = scores
        self._scores: torch.Tensor | None = scores if allowed is None else None
        self._probs: torch.Tensor | None = None
        self._argmax: list[int] | None = None

    @property
    def scores(self) -> torch.Tensor:
        if self._scores is None:
            self._scores = _masked(self._raw, self.allowed)
        return self._scores

    @property
    def probs(self) -> torch.Tensor:
        if self._probs is None:
            if self.greedy is True:
                idx = torch.tensor(self.argmax, device=self._raw.device)[:, None]
                self._probs = torch.zeros_like(self._raw).scatter_(-1, idx, 1.0)
            else:
                self._probs = self.scores.softmax(-1)
                if self.greedy is not False:  # mixed rows: the greedy ones one-hot on their argmax
                    rows = [r for r, g in enumerate(self.greedy) if g]
                    idx = torch.tensor(rows, device=self._raw.device)
                    top = torch.tensor([self.argmax[r] for r in rows], device=self._raw.device)[:, None]
                    self._probs[idx] = torch.zeros_like(self._probs[idx]).scatter_(-1, top, 1.0)
        return self._probs

    @property
    def argmax(self) -> list[int]:
        if self._argmax is None:
            if self._scores is not None:
                self._argmax = self._scores.argmax(-1).tolist()
            else:
                raw = self._raw.argmax(-1).cpu()  # (R,)
                ok = allows(self.allowed, raw[:, None])[:, 0]
                out = raw.tolist()
                for r in (~ok).nonzero().flatten().tolist():
                    out[r] = self._masked_argmax(r)
                self._argmax = out
        return self._argmax

    def _masked_argmax(self, r: int, k: int = 32) -> int:
        """Row r's argmax among its allowed tokens: among the k best raw scores when one of them is
        allowed and no tie could hide a lower index, else over the masked row."""
        k = min(k, self._raw.shape[-1])
        top = self._raw[r].topk(k)
        vals, idx = top.values.cpu(), top.indices.cpu()
        ok = allows(self.allowed[r:r + 1], idx[None])[0]
        if bool(ok.any()):
            first = int(ok.nonzero()[0])
            best = vals[first]
            if k == self._raw.shape[-1] or bool(vals[-1] < best):  # every token scoring `best` is among the k
                return int(idx[ok & (vals == best)].min())
        return int(self.scores[r].argmax())

    def rows(self, start: int, stop: int) -> "Target":
        """The rows [start, stop), sharing whatever was already computed."""
        greedy = self.greedy[start:stop] if isinstance(self.greedy, list) else self.greedy
        out = Target(self._raw[start:stop], greedy, None if self.allowed is None else self.allowed[start:stop])
        if self._scores is not None:
            out._scores = self._scores[start:stop]
        if self._probs is not None:
            out._probs = self._probs[start:stop]
        if self._argmax is not None:
            out._argmax = self._argmax[start:stop]
        return out

    def __len__(self) -> int:
        return self._raw.shape[0]


def _masked(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """scores (R, V) with -inf where a row's packed allowed set (R, W) leaves a token out."""
    return scores.masked_fill(~unpack(allowed, scores.shape[-1]).to(scores.device), float("-inf"))


class TargetStage:
    """logits (R, V) -> Target, through the sampler's processors and the rows' constraint masks."""

    def __init__(self, processors: list | None = None, greedy: bool = False, empty_rows: str = "error",
                 warpers: list | None = None):
        """processors run over every row, then `warpers` over the rows of the stage's own knobs (a
        `RowGroup` of a call runs its own instead). empty_rows: what a row with no allowed token is:
        "error" (a constraint that cannot be continued, the engine's case) or "allowed" (it scores
        -inf everywhere: beam search's beams that left their language)."""
        if empty_rows not in ("error", "allowed"):
            raise ValueError(f"empty_rows must be 'error' or 'allowed', got {empty_rows!r}")
        self.processors, self.greedy, self.empty_rows = list(processors or []), greedy, empty_rows
        self.warpers = list(warpers or [])
        self._every = self.processors + self.warpers  # a call without groups: all of them, in order
        self.needs_input_ids = any(getattr(p, "needs_input_ids", False) for p in self._every)
        self.mask_s = 0.0  # time the last call spent applying `allowed`

    def __call__(self, logits: torch.Tensor, input_ids: Callable[[], list[list[int]]] | None = None,
                 allowed: torch.Tensor | None = None, where: Callable[[int], tuple[int | None, str]] | None = None,
                 groups: list[RowGroup] | None = None) -> Target:
        """logits: (R, V) float32. input_ids: builds the context of every row, called only when a
        processor needs it. allowed: the rows' allowed sets, packed (R, ceil(V / 32)) int32 (see
        `pipeline.core.bits`), or None. where(r): the handle of the request row r belongs to (None
        where unknown) and a text naming the row, for the error raised when its allowed set is empty
        (that request's fault). groups: rows whose requests bring knobs of their own (None: every
        row has the stage's)."""
        scores = logits
        sampled = not self.greedy or any(not g.greedy for g in groups or [])
        if allowed is not None and sampled:  # the warpers see the language's distribution: top-k / top-p keep
            scores = _masked(logits, allowed)  # allowed tokens (after them the row could hold none)
        needs = self.needs_input_ids or (groups is not None and any(
            getattr(p, "needs_input_ids", False) for g in groups for p in g.warpers))
        ids = input_ids() if needs and input_ids is not None else None
        greedy = self.greedy
        if groups is None:
            for proc in self._every:
                scores = proc(ids, scores)
        else:
            for proc in self.processors:
                scores = proc(ids, scores)
            scores, greedy = self._warp(scores, ids, groups)
        self.mask_s = 0.0
        if allowed is not None:
            t0 = time.perf_counter()
            empty = None
            if self.empty_rows == "error":
                empty = ~allowed.numpy().any(-1) if allowed.device.type == "cpu" else ~(allowed != 0).any(-1).cpu().numpy()
            if empty is not None and empty.any():
                r = int(empty.nonzero()[0][0])
                handle, text = where(r) if where else (None, f"row {r}")
                err = UserError(f"no token is allowed at {text}: the constraint cannot be continued; "
                                "check it against the prompt")
                raise err if handle is None else RequestFault([handle], err)
            out = Target(scores.float(), greedy, allowed)
            if sampled:
                out._scores = out._raw  # masked before the processors
            self.mask_s = time.perf_counter() - t0
            return out
        return Target(scores.float(), greedy)

    def _warp(self, scores: torch.Tensor, ids: list[list[int]] | None,
              groups: list[RowGroup]) -> tuple[torch.Tensor, list[bool]]:
        """Each group's warpers over its rows (the rows of no group: the stage's own); returns the
        scores (R, V) and whether each row is greedy."""
        greedy = [self.greedy] * scores.shape[0]
        own = set(range(scores.shape[0]))
        todo = []
        for g in groups:
            for r in g.rows:
                greedy[r] = g.greedy
            own.difference_update(g.rows)
            todo.append((g.rows, g.warpers, g.owners))
        todo.append((sorted(own), self.warpers, []))
        out = scores
        for rows, warpers, owners in todo:
            if not rows or not warpers:
                continue
            idx = torch.tensor(rows, device=scores.device)
            sub = scores[idx]  # (n, V)
            with blame(*owners) if owners else contextlib.nullcontext():  # a request's own knobs fail it alone
                for proc in warpers:
                    sub = proc(None if ids is None else [ids[r] for r in rows], sub)
            out = (out.clone() if out is scores else out).index_copy_(0, idx, sub)
        return out, greedy
