"""Self-speculation: the target drafts with a subset of its own layers, the full model verifies.

The draft runs the chosen blocks (early exit = the first k, layer skipping = any subset), then the
shared final norm and LM head. For the committed prefix it reads the full model's cached keys and
values of those layers (Draft & Verify); its own draft tokens go into tentative slots, which are
discarded before the verifier recomputes them with every layer. The draft is a chain of the draft's
top-1 tokens; `width` > 1 adds the draft's runners-up at each depth as extra leaves.
"""
from __future__ import annotations

import torch

from pipeline.core import DecodeState, Proposer, Tree, forward_rows


def parse_layers(spec, n_layers: int) -> list[int]:
    """A list of block indices, or a slice string like "0:12" or "0:30:2"."""
    if isinstance(spec, str):
        parts = [int(p) if p else None for p in spec.split(":")]
        layers = list(range(n_layers))[slice(*parts)]
    else:
        layers = sorted(int(i) for i in spec)
    if not layers or any(not 0 <= i < n_layers for i in layers) or len(set(layers)) != len(layers):
        raise ValueError(f"`proposer.layers` must pick distinct blocks in [0, {n_layers}), got {spec!r}")
    return layers


class SelfSpecProposer(Proposer):
    def __init__(self, backbone, layers="0:12", depth: int = 4, width: int = 1, min_prob: float = 0.0):
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"`proposer.depth` must be a positive int, got {depth}")
        if not isinstance(width, int) or width < 1:
            raise ValueError(f"`proposer.width` must be a positive int, got {width}")
        if not 0.0 <= min_prob < 1.0:
            raise ValueError(f"`proposer.min_prob` must be in [0, 1), got {min_prob}")
        self.model = backbone.model
        self.layers = parse_layers(layers, self.model.args.n_layers)
        self.depth, self.width, self.min_prob = depth, width, min_prob

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> Tree | None:
        kv, model = state.kv, self.model
        tok, tokens, parents = state.tokens[-1], [state.tokens[-1]], [-1]
        chain = 0  # packed index of the newest chain node
        for d in range(min(self.depth, state.budget - 1)):
            h = forward_rows(model, kv, state.seq, torch.tensor([tok]), layers=self.layers)  # (1, dim)
            probs = model.logits(h)[-1].softmax(-1)
            top = probs.topk(self.width)
            ids, ps = top.indices.tolist(), top.values.tolist()
            if ps[0] < self.min_prob and d > 0:  # the draft is unsure: stop the chain here
                break
            for rank, t in enumerate(ids):
                tokens.append(t)
                parents.append(chain)
                if rank == 0:
                    new_chain = len(tokens) - 1
            chain, tok = new_chain, ids[0]
        kv.discard(state.seq)  # the verifier rewrites these slots with every layer
        return Tree.from_parents(tokens, parents) if len(tokens) > 1 else None
