"""Greedy tree verification: lossless against plain greedy decoding."""
from __future__ import annotations

import torch

from pipeline.core import Accepted, Target, Tree, Verifier


class GreedyVerifier(Verifier):
    """Accept the longest root path whose every token equals the target's argmax at its parent,
    then add the target's argmax at the last accepted node as the bonus token."""

    def verify(self, tree: Tree, p: Target, generator: torch.Generator | None = None) -> Accepted:
        """p: the processed target at every node; its argmax is what plain greedy decoding picks."""
        choice = p.argmax  # the target's greedy token after each node
        tokens, parents, depth = tree.tokens.tolist(), tree.parents.tolist(), tree.depth.tolist()
        accepted = [False] * len(tokens)
        accepted[0] = True
        best = 0
        for i in range(1, len(tokens)):
            par = parents[i]
            if accepted[par] and tokens[i] == choice[par]:
                accepted[i] = True
                if depth[i] > depth[best]:
                    best = i
        path = tree.path_to(best)
        return Accepted(path=path, draft_tokens=[tokens[i] for i in path[1:]], bonus_token=choice[best])
