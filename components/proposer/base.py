"""The proposer interface: `propose(state) -> Tree | None` (None = take a plain decode step)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.tree import Tree


@dataclass
class DecodeState:
    tokens: list[int]  # prompt + every committed token, the root (newest) last
    hidden: torch.Tensor  # (dim,) the target's last hidden state: the one that chose the root
    model: object  # the backbone Transformer, for self-drafting proposers
    kv: object  # its KV manager; a draft may write tentative slots and must discard them
    budget: int  # tokens still allowed after the root: a deeper tree cannot pay off


class Proposer:
    def propose(self, state: DecodeState) -> Tree | None:
        raise NotImplementedError

    def reset(self) -> None:
        """Called at the start of every request."""
