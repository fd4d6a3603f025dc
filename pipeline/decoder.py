"""The decode loop: propose -> tree forward -> verify -> commit, one readable step at a time.

Plain decoding is the same loop with a tree of one node (the root). The root is the newest token:
already chosen and streamed, its keys/values not yet computed. A step runs the target over the
root plus the drafts, keeps the accepted path's slots, and takes the target's bonus token as the
next root, so every step commits accept_length + 1 tokens for one target forward.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from components.proposer.base import DecodeState
from pipeline.errors import UserError


@dataclass
class Generation:
    token_ids: list[int]
    finish_reason: str  # eos | length
    accepted_lengths: list[int]  # tokens committed per target forward (prefill included)
    step_ms: list[float]  # wall time per target step (prefill excluded)
    step_nodes: list[int]  # tree nodes per step (1 = plain step)
    tree_depths: list[int]  # deepest draft per step (0 = plain step)
    wall_s: float = 0.0
    prefill_ms: float = 0.0

    @property
    def steps(self) -> int:
        return len(self.accepted_lengths)


@dataclass
class Decoder:
    model: object  # Transformer
    kv: object  # KVManager
    sampler: object  # Sampler
    eos_ids: list[int]
    max_new_tokens: int
    proposer: object | None = None
    verifier: object | None = None
    seed: int = 0
    generator: torch.Generator = field(init=False)

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise UserError(f"max_new_tokens must be a positive int, got {self.max_new_tokens}")
        if self.proposer is not None and self.verifier is None:
            raise UserError("a proposer needs a verifier: add verifier=greedy")
        if self.proposer is not None and not self.sampler.greedy:
            raise UserError("verifier=greedy is lossless only for sampler=greedy; drop the proposer to sample")
        self.generator = torch.Generator().manual_seed(self.seed)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], on_tokens: Callable[[list[int]], None] | None = None,
                 seed: int | None = None) -> Generation:
        model, kv = self.model, self.kv
        limit = model.args.max_seq_len
        if len(prompt_ids) >= limit:
            raise UserError(f"prompt is {len(prompt_ids)} tokens, the model's context is {limit}: "
                            "shorten the prompt or raise model.max_seq_len")
        self.generator.manual_seed(self.seed if seed is None else seed)
        if self.proposer is not None:
            self.proposer.reset()
        t0 = time.perf_counter()
        kv.allocate(1, min(limit, len(prompt_ids) + self.max_new_tokens + 256))
        prompt = torch.tensor([prompt_ids])
        hidden = model(prompt, torch.arange(len(prompt_ids))[None], kv)[0, -1]  # (dim,)
        kv.commit()
        root = int(self.sampler(model.logits(hidden)[None], self.generator)[0])
        gen = Generation([], "length", [], [], [], [], prefill_ms=(time.perf_counter() - t0) * 1e3)
        done = self._emit(gen, [root], on_tokens)
        tokens = list(prompt_ids) + [root]
        while not done:
            t = time.perf_counter()
            budget = min(self.max_new_tokens - len(gen.token_ids), limit - kv.length - 1)
            tree = None
            if self.proposer is not None and budget > 1:
                tree = self.proposer.propose(DecodeState(tokens, hidden, model, kv, budget))
            if tree is None or tree.size == 1:
                hidden = model(torch.tensor([[root]]), torch.tensor([[kv.length]]), kv)[0, -1]
                kv.commit()
                new = [int(self.sampler(model.logits(hidden)[None], self.generator)[0])]
                gen.step_nodes.append(1)
                gen.tree_depths.append(0)
            else:
                h = model(tree.tokens[None], tree.positions(kv.length), kv, tree.attention_mask(kv.length))[0]
                acc = self.verifier.verify(tree, model.logits(h))  # h: (N, dim)
                kv.commit(acc.path)
                hidden = h[acc.path[-1]]
                new = acc.draft_tokens + [acc.bonus_token]
                gen.step_nodes.append(tree.size)
                gen.tree_depths.append(tree.max_depth)
            gen.step_ms.append((time.perf_counter() - t) * 1e3)
            done = self._emit(gen, new, on_tokens)
            tokens += new
            root = new[-1]
            if kv.length + 1 >= limit:
                done = True
        kv.discard()
        gen.wall_s = time.perf_counter() - t0
        return gen

    def _emit(self, gen: Generation, new: list[int], on_tokens) -> bool:
        """Append committed tokens, stopping exactly where plain decoding would: at the first EOS or
        at max_new_tokens, even inside an accepted path."""
        out = []
        for tok in new:
            out.append(tok)
            if tok in self.eos_ids:
                gen.finish_reason = "eos"
                break
            if len(gen.token_ids) + len(out) >= self.max_new_tokens:
                gen.finish_reason = "length"
                break
        gen.token_ids += out
        gen.accepted_lengths.append(len(out))
        if on_tokens is not None and out:
            on_tokens(out)
        return len(out) < len(new) or gen.finish_reason == "eos" or len(gen.token_ids) >= self.max_new_tokens
