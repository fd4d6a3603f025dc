"""Self-speculation: the target drafts with a subset of its own layers, the full model verifies.

The draft runs the chosen blocks (early exit = the first k, layer skipping = any subset), then the
shared final norm and LM head. For the committed prefix it reads the full model's cached keys and
values of those layers (Draft & Verify); its own draft tokens go into tentative slots, which are
discarded before the verifier recomputes them with every layer. The draft is a chain of the draft's
top-1 tokens; `width` > 1 adds the draft's runners-up at each depth as extra leaves.
"""
from __future__ import annotations

import torch

from pipeline.core import DecodeState, Proposer, StepBatch, Tree, forward_step, positive_int


def parse_layers(spec, n_layers: int) -> list[int]:
    """A list of block indices, a slice string like "0:12" or "::2", or None: every second block of
    the backbone (0, 2, 4, ...), whatever its depth."""
    if spec is None:
        return list(range(0, n_layers, 2))
    if isinstance(spec, str):
        parts = [int(p) if p else None for p in spec.split(":")]
        layers = list(range(n_layers))[slice(*parts)]
    else:
        layers = sorted(int(i) for i in spec)
    if not layers or any(not 0 <= i < n_layers for i in layers) or len(set(layers)) != len(layers):
        raise ValueError(f"`proposer.layers` must pick distinct blocks in [0, {n_layers}), got {spec!r}")
    return layers


class SelfSpecProposer(Proposer):
    def __init__(self, backbone, layers=None, depth: int = 4, width: int = 1, min_prob: float = 0.0):
        positive_int(depth, "proposer.depth"), positive_int(width, "proposer.width")
        if not 0.0 <= min_prob < 1.0:
            raise ValueError(f"`proposer.min_prob` must be in [0, 1), got {min_prob}")
        self.model = backbone.model
        self.layers = parse_layers(layers, self.model.args.n_layers)
        self.depth, self.width, self.min_prob = depth, width, min_prob

    @torch.inference_mode()
    def propose(self, states: list[DecodeState]) -> list[Tree | None]:
        """Every sequence's chain in lockstep: one draft forward (a row per sequence still drafting)
        per depth."""
        kv, model = states[0].kv, self.model
        chains = [_Chain(s.tokens[-1], min(self.depth, s.budget - 1)) for s in states]
        for d in range(max(c.limit for c in chains)):
            live = [(s, c) for s, c in zip(states, chains) if not c.stopped and d < c.limit]
            if not live:
                break
            step = StepBatch.build([s.seq for s, _ in live], [torch.tensor([c.tok]) for _, c in live],
                                   [None] * len(live), [None] * len(live), [kv.used(s.seq) for s, _ in live],
                                   model.attn_dtype)
            top = model.logits(forward_step(model, kv, step, self.layers)).softmax(-1).topk(self.width)  # (B, width)
            for (_, c), ids, ps in zip(live, top.indices.tolist(), top.values.tolist()):
                if ps[0] < self.min_prob and d > 0:  # the draft is unsure: stop the chain here
                    c.stopped = True
                    continue
                for rank, t in enumerate(ids):
                    c.tokens.append(t)
                    c.parents.append(c.chain)
                    if rank == 0:
                        new_chain = len(c.tokens) - 1
                c.chain, c.tok = new_chain, ids[0]
        for s in states:
            kv.discard(s.seq)  # the verifier rewrites these slots with every layer
        return [Tree.from_parents(c.tokens, c.parents) if len(c.tokens) > 1 else None for c in chains]


class _Chain:
    """One sequence's draft: a chain of top-1 tokens, runners-up as extra leaves."""

    def __init__(self, root: int, limit: int):
        self.tok, self.tokens, self.parents = root, [root], [-1]
        self.chain, self.limit, self.stopped = 0, limit, False  # chain: packed index of the newest chain node
