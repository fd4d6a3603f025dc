"""Greedy tree verification: lossless against plain greedy decoding."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.tree import Tree


@dataclass
class Accepted:
    path: list[int]  # packed node indices, root first: the slots to commit
    draft_tokens: list[int]  # the accepted draft tokens (the path without the root)
    bonus_token: int  # the target's own next token after the last accepted node

    @property
    def accept_length(self) -> int:
        return len(self.draft_tokens)


class GreedyVerifier:
    """Accept the longest root path whose every token equals the target's argmax at its parent,
    then add the target's argmax at the last accepted node as the bonus token."""

    def verify(self, tree: Tree, target_logits: torch.Tensor) -> Accepted:
        """target_logits: (N, V), row i = the target's next-token scores after node i."""
        p = target_logits.argmax(-1).tolist()  # the target's greedy choice after each node
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        accepted = [False] * len(tokens)
        accepted[0] = True
        best = 0
        depth = tree.depth.tolist()
        for i in range(1, len(tokens)):
            par = parents[i]
            if accepted[par] and tokens[i] == p[par]:
                accepted[i] = True
                if depth[i] > depth[best]:
                    best = i
        path = tree.path_to(best)
        return Accepted(path=path, draft_tokens=[tokens[i] for i in path[1:]], bonus_token=p[best])
