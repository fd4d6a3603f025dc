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
from components.verifier.exact import ExactVerifier
from pipeline.core import Accepted, DecodeState, Proposer, Tree


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


class WrongVerifier(ExactVerifier):
    """Walks the tree like the exact verifier, but keeps the child that `pick` chooses at each node
    (None: stop and sample the next token from the untouched p there)."""

    def pick(self, tree, probs, node, tokens, children, generator):
        raise NotImplementedError

    def verify(self, tree, p, generator=None):
        probs = p.probs
        tokens, children = tree.tokens.tolist(), tree.children()
        node, path = 0, [0]
        while (chosen := self.pick(tree, probs, node, tokens, children, generator)) is not None:
            path.append(chosen)
            node = chosen
        tok = int(torch.multinomial(probs[node], 1, generator=generator))
        return Accepted(path, [tokens[i] for i in path[1:]], tok)


class NoRenormalisation(WrongVerifier):
    """Wrong: after a rejection the next child is tested against the untouched p."""

    def pick(self, tree, probs, node, tokens, children, generator):
        for c in children[node]:
            q = 1.0 if tree.q is None else float(tree.q[node][tokens[c]])
            if float(torch.rand((), generator=generator)) * q < float(probs[node][tokens[c]]):
                return c
        return None


class GreedyAcceptance(WrongVerifier):
    """Wrong at temperature 1: a draft is accepted when it is the target's most likely token."""

    def pick(self, tree, probs, node, tokens, children, generator):
        return next((c for c in children[node] if tokens[c] == int(probs[node].argmax())), None)


class RepeatProposer(PerSequence):
    """Deterministic drafts the tied tiny model often agrees with: its last token twice, and the
    token before it as a sibling."""

    def draft(self, state):
        t, u = state.tokens[-1], state.tokens[-2]
        return Tree.from_parents([t, t, u, t], [-1, 0, 0, 1])
