"""A scripted toy model for the seeds' small examples, run through the real engine, KV pool, target
stage and verifiers: its logits are a function of the context a row continues (`script(ctx)`), so a
test states exactly which token wins where. The context is read back from the KV cache (each slot
stores its token id as the key), so it is what the row attends to: cached slots plus its tree
ancestors. `PerSequence` is the base of the tests' scripted proposers."""
from __future__ import annotations

from abc import abstractmethod
from types import SimpleNamespace
from typing import Callable

import torch

from components.kv.contiguous import ContiguousKV
from pipeline.core import DecodeState, Proposer, Tree


class PerSequence(Proposer):
    """A test proposer that drafts each sequence on its own: subclasses define `draft(state)`."""

    def propose(self, states: list[DecodeState]) -> list[Tree | None]:
        return [self.draft(s) for s in states]

    @abstractmethod
    def draft(self, state: DecodeState) -> Tree | None: ...


class ScriptedModel:
    def __init__(self, script: Callable[[tuple[int, ...]], list[float]], vocab_size: int, max_seq_len: int = 64,
                 eos_ids: list[int] | None = None):
        self.script = script
        self.args = SimpleNamespace(vocab_size=vocab_size, max_seq_len=max_seq_len, n_layers=1, n_kv_heads=1,
                                    head_dim=1, eos_token_ids=list(eos_ids or []))
        self.attn_dtype, self.device, self.precision = torch.float32, torch.device("cpu"), "float32"

    def kv(self) -> ContiguousKV:
        return ContiguousKV(max_len=self.args.max_seq_len, n_layers=1, n_kv_heads=1, head_dim=1)

    def step(self, batch, kv, layers=None) -> torch.Tensor:
        k = batch.tokens.float().view(-1, 1, 1)
        K, _ = kv.update(0, k, k, batch.plan)  # (B, 1, S, 1): each sequence's cached slots and its new rows
        width = self.args.max_seq_len
        out = torch.full((batch.tokens.shape[0], width), -1.0)
        r = 0
        for b, n in enumerate(batch.counts):
            start = batch.starts[b]
            for j in range(n):
                if batch.bias is None:  # one sequence, causal
                    seen = torch.arange(start + j + 1)
                else:
                    seen = (batch.bias[b, 0, j] == 0).nonzero().flatten()
                ctx = K[b, 0, seen, 0]
                out[r, :ctx.numel()] = ctx
                r += 1
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = []
        for h in hidden:
            ctx = tuple(int(t) for t in h.tolist() if t >= 0)
            rows.append(torch.tensor(self.script(ctx), dtype=torch.float32))
        return torch.stack(rows)
