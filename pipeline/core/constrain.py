"""Constraints in the step loop: the walk that prunes a draft tree to the language and gives every
node the mask of its own state (allowed sets packed as pipeline.core.bits packs them).
"""
from __future__ import annotations

import torch

from pipeline.core.bits import allows, unpack, words
from pipeline.core.protocols import Constraint
from pipeline.core.tree import Tree


def walk_tree(constraint: Constraint, tree: Tree, eos_ids: set[int], vocab_size: int,
              narrow=None) -> tuple[Tree, torch.Tensor, int]:
    """Prune `tree` to the drafts the constraint allows and return (tree, bits (N', W), pruned).

    Depth first from the root (the constraint's current state): each node's row of bits is the
    allowed set after the path to it; a child whose token that set excludes, or whose state allows
    nothing (a dead end), is dropped with its subtree (it could never be accepted: the target row of
    its parent is masked with the same set). An EOS draft is kept as a leaf; its row is never read
    (the request ends on it) and allows everything. narrow(bits_row, depth, constraint), when given,
    may shrink a node's set in place (the engine's closing margin). The constraint ends where it started. For a
    tree with sampled drafts, each kept node's q row is masked with the node's set and renormalised:
    children drawn from q and kept because they are allowed are draws from that masked q."""
    n = tree.size
    bits = torch.zeros(n, words(vocab_size), dtype=torch.int32)
    tokens, children, depth = tree.tokens.tolist(), tree.children(), tree.depth.tolist()
    kept = [0]

    def fill(node: int) -> None:
        constraint.fill(bits[node])
        if narrow is not None:
            narrow(bits[node], depth[node], constraint)

    def visit(node: int) -> None:
        for c in children[node]:
            tok = tokens[c]
            if not allows(bits[node], tok):
                continue
            if tok in eos_ids:
                bits[c] = -1
                kept.append(c)
                continue
            if not constraint.advance(tok):
                continue
            fill(c)
            if bool(bits[c].any()):
                kept.append(c)
                visit(c)
            constraint.rollback(1)

    fill(0)
    visit(0)
    kept.sort()
    pruned = n - len(kept)
    if pruned:
        tree = tree.keep(torch.tensor(kept))
        bits = bits[kept]
    if tree.q is not None:
        q = tree.q * unpack(bits, tree.q.shape[-1]).to(tree.q.dtype)
        tree.q = q / q.sum(-1, keepdim=True).clamp_min(torch.finfo(q.dtype).tiny)
    return tree, bits, pruned
