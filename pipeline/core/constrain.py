"""Constraints in the step loop: packed allowed sets, their unpacking for the target stage, and the
walk that prunes a draft tree to the language and gives every node the mask of its own state.

An allowed set is packed as XGrammar and vLLM pack it: (W,) int32 with W = ceil(V / 32), bit v % 32
of word v // 32 set when token v may come next.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import numpy as np
import torch

from pipeline.core.tree import Tree

if TYPE_CHECKING:
    from pipeline.core.protocols import Constraint

_SHIFTS = torch.arange(32, dtype=torch.int32)


def words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def unpack(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(..., W) int32 -> (..., V) bool."""
    if sys.byteorder == "little" and bits.device.type == "cpu" and bits.is_contiguous():  # numpy: 3x faster
        u8 = bits.view(torch.uint8).numpy()
        return torch.from_numpy(np.unpackbits(u8, axis=-1, bitorder="little")).view(torch.bool)[..., :vocab_size]
    return ((bits.unsqueeze(-1) >> _SHIFTS) & 1).bool().flatten(-2)[..., :vocab_size]


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """(..., V) bool -> (..., W) int32."""
    v = allowed.shape[-1]
    if sys.byteorder == "little" and allowed.device.type == "cpu":
        padded = np.zeros((*allowed.shape[:-1], words(v) * 32), dtype=bool)
        padded[..., :v] = allowed.numpy()
        return torch.from_numpy(np.packbits(padded, axis=-1, bitorder="little")).view(torch.int32)
    padded = torch.zeros(*allowed.shape[:-1], words(v) * 32, dtype=torch.int64)
    padded[..., :v] = allowed
    packed = (padded.view(*allowed.shape[:-1], -1, 32) << _SHIFTS.long()).sum(-1)
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)  # two's complement


def allows(bits: torch.Tensor, token: int) -> bool:
    """Whether the packed set bits (W,) holds `token`."""
    return bool((int(bits[token >> 5]) >> (token & 31)) & 1)


def tokens_of(bits: torch.Tensor, vocab_size: int) -> list[int]:
    return unpack(bits, vocab_size).nonzero().flatten().tolist()


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
