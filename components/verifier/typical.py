"""Medusa's typical acceptance: a draft x after node u is accepted when the target finds it typical
enough, p_u(x) > min(epsilon, delta * exp(-H(p_u))), H the entropy of the processed target p_u.
The deepest accepted node wins (ties: the first in packed order, i.e. the proposer's preference)
and the next token is sampled from the target there.

Not distribution-preserving: it trades exactness for longer accepted paths at high temperature.
Its measured total-variation distance to plain sampling is in the README. With a greedy sampler (p
one-hot) it accepts exactly the argmax path: greedy verification.
"""
from __future__ import annotations

import torch

from pipeline.core import Accepted, Target, Tree, Verifier


class TypicalVerifier(Verifier):
    samples = True  # works with a sampling sampler (but does not keep its distribution exactly)

    def __init__(self, epsilon: float = 0.09, delta: float = 0.3):
        for name, v in (("epsilon", epsilon), ("delta", delta)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= 1:
                raise ValueError(f"`verifier.{name}` must be in (0, 1], got {v}")
        self.epsilon, self.delta = float(epsilon), float(delta)

    def verify(self, tree: Tree, p: Target, generator: torch.Generator | None = None) -> Accepted:
        probs = p.probs  # (N, V): p at every node
        entropy = torch.special.entr(probs).sum(-1)  # (N,)
        threshold = torch.clamp(self.delta * torch.exp(-entropy), max=self.epsilon)  # (N,)
        tokens, parents, depth = tree.tokens, tree.parents.tolist(), tree.depth.tolist()
        typical = (probs[tree.parents.clamp(min=0), tokens] > threshold[tree.parents.clamp(min=0)]).tolist()
        accepted, best = [True] + [False] * (len(parents) - 1), 0
        for i in range(1, len(parents)):
            accepted[i] = accepted[parents[i]] and typical[i]
            if accepted[i] and depth[i] > depth[best]:
                best = i
        path = tree.path_to(best)
        token = int(torch.multinomial(probs[best].cpu(), 1, generator=generator))  # host draw: CPU generator
        toks = tokens.tolist()
        return Accepted(path=path, draft_tokens=[toks[i] for i in path[1:]], bonus_token=token)
