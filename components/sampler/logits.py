"""Logits processors (transformers' one-method protocol) and the sampler that composes them."""
from __future__ import annotations

import torch


class Temperature:
    def __init__(self, temperature: float):
        if not isinstance(temperature, (int, float)) or temperature <= 0:
            raise ValueError(f"`sampler.temperature` must be a positive float, got {temperature}")
        self.temperature = float(temperature)

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        return scores / self.temperature


class TopK:
    def __init__(self, top_k: int):
        if not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"`sampler.top_k` must be a positive int (or 0 to disable), got {top_k}")
        self.top_k = top_k

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        k = min(self.top_k, scores.shape[-1])
        kth = scores.topk(k, dim=-1).values[..., -1:]  # (B, 1)
        return scores.masked_fill(scores < kth, float("-inf"))


class TopP:
    def __init__(self, top_p: float):
        if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise ValueError(f"`sampler.top_p` must be in (0, 1], got {top_p}")
        self.top_p = float(top_p)

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        drop = cum - sorted_scores.softmax(-1) >= self.top_p  # keep the smallest set reaching top_p
        drop[..., 0] = False
        return scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


class Sampler:
    """Greedy (`do_sample=false`) or multinomial sampling after temperature, top-k and top-p, in that
    order, each optional. `__call__(scores (B, V), generator) -> tokens (B,)`."""

    def __init__(self, do_sample: bool = True, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
        self.do_sample = bool(do_sample)
        self.processors = []
        if temperature != 1.0 or not isinstance(temperature, (int, float)):
            self.processors.append(Temperature(temperature))
        if top_k != 0:
            self.processors.append(TopK(top_k))
        if top_p != 1.0:
            self.processors.append(TopP(top_p))

    @property
    def greedy(self) -> bool:
        return not self.do_sample

    def probs(self, scores: torch.Tensor) -> torch.Tensor:
        for proc in self.processors:
            scores = proc(scores)
        return scores.float().softmax(-1)

    def __call__(self, scores: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        if not self.do_sample:
            return scores.argmax(-1)
        return torch.multinomial(self.probs(scores), 1, generator=generator).squeeze(-1)
