"""Logits processors (transformers' one-method protocol: `__call__(input_ids, scores) -> scores`) and
the sampler that chooses tokens from the processed target distribution.

The processors run in the core's target-distribution stage (`pipeline.core.TargetStage`), once per
row of a step, in the order of `Sampler.processors`: the configured list first, then temperature,
top-k and top-p (as transformers orders processors before warpers).
"""
from __future__ import annotations

import torch

from pipeline.core import Sampler as SamplerBase
from pipeline.core import SamplingParams, Target, TargetStage


class Temperature:
    def __init__(self, temperature: float):
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or temperature <= 0:
            raise ValueError(f"`sampler.temperature` must be a positive float, got {temperature}")
        self.temperature = float(temperature)

    def __call__(self, input_ids, scores: torch.Tensor) -> torch.Tensor:
        return scores / self.temperature


class TopK:
    def __init__(self, top_k: int):
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            raise ValueError(f"`sampler.top_k` must be a positive int (or 0 to disable), got {top_k}")
        self.top_k = top_k

    def __call__(self, input_ids, scores: torch.Tensor) -> torch.Tensor:
        k = min(self.top_k, scores.shape[-1])
        kth = scores.topk(k, dim=-1).values[..., -1:]  # (R, 1)
        return scores.masked_fill(scores < kth, float("-inf"))


class TopP:
    CANDIDATES = 512  # tokens sorted per row before falling back to the whole vocabulary

    def __init__(self, top_p: float):
        if not isinstance(top_p, (int, float)) or isinstance(top_p, bool) or not 0 < top_p <= 1:
            raise ValueError(f"`sampler.top_p` must be in (0, 1], got {top_p}")
        self.top_p = float(top_p)

    def __call__(self, input_ids, scores: torch.Tensor) -> torch.Tensor:
        # the nucleus almost always lies among the few hundred most likely tokens: sort those, and
        # the whole vocabulary only for a row they do not cover (same result, far cheaper per row)
        k = min(self.CANDIDATES, scores.shape[-1])
        top = scores.topk(k, dim=-1)  # (R, k), descending
        probs = top.values.softmax(-1) * (top.values.logsumexp(-1, keepdim=True) - scores.logsumexp(-1, keepdim=True)).exp()
        if k < scores.shape[-1] and not bool((probs.sum(-1) >= self.top_p).all()):
            top = scores.sort(dim=-1, descending=True)
            probs = top.values.softmax(-1)
        drop = probs.cumsum(-1) - probs >= self.top_p  # keep the smallest set reaching top_p
        drop[..., 0] = False
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top.indices, ~drop)
        return scores.masked_fill(~keep, float("-inf"))


class RepetitionPenalty:
    """CTRL's penalty, as transformers applies it: the score of every token already in the row's
    context is divided by `penalty` when positive, multiplied when negative."""
    needs_input_ids = True

    def __init__(self, penalty: float):
        if not isinstance(penalty, (int, float)) or isinstance(penalty, bool) or penalty <= 0:
            raise ValueError(f"`penalty` of RepetitionPenalty must be a positive float, got {penalty}")
        self.penalty = float(penalty)

    def __call__(self, input_ids: list[list[int]], scores: torch.Tensor) -> torch.Tensor:
        out = scores.clone()
        for r, ids in enumerate(input_ids):
            idx = torch.tensor(sorted(set(ids)), dtype=torch.long, device=scores.device)
            s = out[r, idx]
            out[r, idx] = torch.where(s > 0, s / self.penalty, s * self.penalty)
        return out


class Sampler(SamplerBase):
    """Greedy (`do_sample=false`: the argmax of the processed scores) or multinomial sampling from
    them, each row with its request's own generator. `processors`: extra logits processors
    (instantiated from `sampler.processors` in the config), applied before temperature, top-k, top-p.
    A request with its own knobs (`SamplingParams`) goes through the same extra processors (`shared`)
    and then its own temperature, top-k and top-p (`warpers`)."""

    def __init__(self, do_sample: bool = True, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 processors: list | None = None):
        self.do_sample = bool(do_sample)
        self.shared = list(processors or [])
        for proc in self.shared:
            if not callable(proc):
                raise ValueError(f"`sampler.processors` entries must be logits processors (a _target_), got {proc!r}")
        own = []
        if temperature != 1.0 or not isinstance(temperature, (int, float)):
            own.append(Temperature(temperature))
        if top_k != 0:
            own.append(TopK(top_k))
        if top_p != 1.0:
            own.append(TopP(top_p))
        self.processors = self.shared + own
        self.params = SamplingParams(float(temperature) if self.do_sample else 0.0, float(top_p), top_k)

    @property
    def greedy(self) -> bool:
        return not self.do_sample

    def warpers(self, params: SamplingParams) -> list:
        """Temperature, top-k and top-p of a request's own knobs, each where it is not neutral (none
        for a greedy request: they never change the argmax)."""
        if params.greedy:
            return []
        return ([Temperature(params.temperature)] if params.temperature != 1.0 else []) + \
            ([TopK(params.top_k)] if params.top_k else []) + ([TopP(params.top_p)] if params.top_p != 1.0 else [])

    def probs(self, scores: torch.Tensor) -> torch.Tensor:
        """(R, V) raw scores -> the processed distribution (no per-row context)."""
        return TargetStage(self.processors)(scores).probs

    def __call__(self, scores: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """(R, V) raw scores -> (R,) tokens, every row drawn with `generator`."""
        return torch.tensor(self.choose(TargetStage(self.processors, greedy=self.greedy)(scores),
                                        [generator] * scores.shape[0]))

    def choose(self, p: Target, generators) -> list[int]:
        """One token per row: the argmax where the target says the row is greedy (`Target.greedy`),
        else a draw from p with the row's generator."""
        if p.greedy is True:
            return p.argmax
        greedy = p.greedy if isinstance(p.greedy, list) else [False] * len(p)
        return [p.argmax[r] if greedy[r] else int(torch.multinomial(p.probs[r].cpu(), 1, generator=g))
                for r, g in enumerate(generators)]  # drawn on the host: CPU generators
