"""Exact speculative sampling over a tree: the committed tokens are distributed exactly as plain
sampling from the processed target distribution (SpecInfer's multi-round rejection sampling).

Notation as in the papers: p is the target's distribution (the sampler's processed one: temperature,
top-k, top-p, constraint masks), q the draft's. At a node, the children are tried in packed order:
child x is accepted with probability min(1, p(x) / q(x)); on a rejection p is replaced by the
residual norm(max(0, p - q)) and the next child is tried against it. If every child is rejected,
the recovered token is drawn from what remains of p; past the last accepted node with no children
left, the bonus token is drawn from p there.

For deterministic drafts (argmax, top-k ranks, n-gram lookups: q is one-hot on the drafted token,
`Tree.q is None`) this is sampling without replacement: accept x with probability p(x), else set
p(x) = 0 and renormalise. With a greedy sampler p is one-hot on the argmax, and this verifier
commits exactly what greedy verification commits.
"""
from __future__ import annotations

import torch

from pipeline.core import Accepted, Target, Tree, Verifier


class ExactVerifier(Verifier):
    samples = True  # keeps the distribution of plain sampling

    def verify(self, tree: Tree, p: Target, generator: torch.Generator | None = None) -> Accepted:
        probs = p.probs  # (N, V): row i = p, the target's distribution for the token after node i
        tokens = tree.tokens.tolist()
        children = tree.children()
        node, path = 0, [0]
        while True:
            residual = probs[node]
            chosen = None
            for c in children[node]:
                x = tokens[c]
                if tree.q is None:  # q one-hot on x: accept with p(x), else drop x from p
                    if float(torch.rand((), generator=generator)) < float(residual[x]):
                        chosen = c
                        break
                    residual = _normalise(residual.clone().index_fill_(0, torch.tensor([x], device=residual.device), 0.0), probs[node])
                else:  # q = tree.q[node]: the draft's distribution over this node's children
                    q = tree.q[node]
                    if float(torch.rand((), generator=generator)) * float(q[x]) < float(residual[x]):
                        chosen = c
                        break
                    residual = _normalise((residual - q).clamp_(min=0.0), probs[node])
            if chosen is None:  # every child rejected (recovered token) or a leaf (bonus token)
                token = int(torch.multinomial(residual.cpu(), 1, generator=generator))  # host draw: CPU generator
                return Accepted(path=path, draft_tokens=[tokens[i] for i in path[1:]], bonus_token=token)
            path.append(chosen)
            node = chosen


def _normalise(r: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = float(r.sum())
    return r / total if total > 0 else fallback  # all mass removed: only reachable by rounding
