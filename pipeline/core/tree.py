"""Candidate trees: plain data, in topological packed order (a core type: components import it from
`pipeline.core`).

Node 0 is the root: the newest committed token, whose keys/values are not in the cache yet (the
bonus token of the previous step). Every other node is a draft token with `parents[i] < i`.
`depth` counts from the root (root 0), so a node's position id is P + depth, P being the committed
cache length, and never its packed index (seed 000, "Packed tree attention").
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache

import torch

from pipeline.errors import positive_int


@dataclass
class Tree:
    tokens: torch.Tensor  # (N,) long
    parents: torch.Tensor  # (N,) long, parents[0] = -1
    depth: torch.Tensor  # (N,) long, depth[0] = 0
    mask: torch.Tensor  # (N, N) bool: node i may attend to node j iff j is i or an ancestor of i
    # q: the draft distribution each node was drawn from, for exact speculative sampling: row i is
    # the proposer's distribution over node i's children (N, V); None for deterministic drafts
    # (argmax / top-k ranks / n-gram lookups: q is one-hot on the drafted token)
    q: torch.Tensor | None = None

    @classmethod
    def root(cls, token: int) -> "Tree":
        """The one-node tree of a plain decode step."""
        return cls.from_parents([token], [-1])

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())

    @classmethod
    def from_parents(cls, tokens: list[int], parents: list[int]) -> "Tree":
        depth, mask = _structure(tuple(parents))
        return cls(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long), depth, mask)

    @classmethod
    def from_paths(cls, root: int, paths: list[list[int]]) -> "Tree":
        """A trie of token paths under `root`; shared prefixes become shared nodes."""
        tokens, parents, index = [root], [-1], {(): 0}
        for path in paths:
            for d in range(1, len(path) + 1):
                key = tuple(path[:d])
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(path[d - 1])
                    parents.append(index[key[:-1]])
        return cls.from_parents(tokens, parents)

    def prune(self, max_depth: int, max_size: int) -> "Tree":
        """The first nodes (packed order, so every parent is kept before its children) with depth <=
        max_depth, at most max_size of them including the root."""
        return self.keep((self.depth <= max_depth).nonzero().squeeze(-1)[:max(1, max_size)])

    def keep(self, keep: torch.Tensor) -> "Tree":
        """The nodes at packed indices `keep` (ascending, the root first, every kept node's parent
        kept): a sub-tree with its q."""
        if keep.numel() == self.size:
            return self
        new = {old: i for i, old in enumerate(keep.tolist())}
        parents = [-1] + [new[p] for p in self.parents[keep[1:]].tolist()]
        tree = Tree.from_parents(self.tokens[keep].tolist(), parents)
        tree.q = None if self.q is None else self.q[keep]
        return tree

    def children(self) -> list[list[int]]:
        """Each node's children, in packed order (the proposer's preference)."""
        out: list[list[int]] = [[] for _ in range(self.size)]
        for i, par in enumerate(self.parents.tolist()[1:], 1):
            out[par].append(i)
        return out

    def path_to(self, node: int) -> list[int]:
        """Packed indices from the root down to `node`, both included."""
        parents, path = self.parents.tolist(), []
        while node != -1:
            path.append(node)
            node = parents[node]
        return path[::-1]


@lru_cache(maxsize=256)
def _structure(parents: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Depths and ancestry mask of a parent list; cached, so a static tree shape is built once."""
    n = len(parents)
    if n == 0 or parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(parents) if i):
        raise ValueError(f"parents must be topologically ordered with a single root, got {list(parents)}")
    depth = [0] * n
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
        mask[i] |= mask[parents[i]]
    return torch.tensor(depth, dtype=torch.long), mask


@dataclass(frozen=True)
class StaticTree:
    """A tree shape given as Medusa `choices`: each path lists top-k ranks per depth, e.g.
    [[0], [0, 0], [1]] = the best first token, the best second token after it, the runner-up first
    token. Compiled once into buffers; `fill` turns per-depth top-k ids into a Tree."""
    choices: tuple[tuple[int, ...], ...]
    parents: tuple[int, ...]
    head: torch.Tensor  # (N-1,) which depth's candidates (0-based) each non-root node takes
    rank: torch.Tensor  # (N-1,) which rank among them

    @classmethod
    def from_choices(cls, choices) -> "StaticTree":
        paths = sorted({tuple(int(r) for r in c) for c in choices}, key=lambda c: (len(c), c))
        if not paths or any(len(p) == 0 or min(p) < 0 for p in paths):
            raise ValueError(f"`tree.choices` must be non-empty lists of ranks >= 0, got {choices}")
        index = {(): 0}
        parents = [-1]
        for p in paths:
            if p[:-1] not in index:
                raise ValueError(f"`tree.choices` path {list(p)} has no parent path {list(p[:-1])} in the list")
            index[p] = len(parents)
            parents.append(index[p[:-1]])
        return cls(tuple(paths), tuple(parents), torch.tensor([len(p) - 1 for p in paths]),
                   torch.tensor([p[-1] for p in paths]))

    @classmethod
    def from_shape(cls, width: int, depth: int, max_nodes: int | None = None) -> "StaticTree":
        """A full `width`-ary tree of `depth` levels, pruned to the first `max_nodes` drafts in
        breadth-first rank order (lower ranks and shallower nodes first)."""
        for name, v in (("width", width), ("depth", depth)):
            positive_int(v, f"tree.{name}")
        paths, frontier = [], [()]
        for _ in range(depth):
            frontier = [p + (r,) for p in frontier for r in range(width)]
            paths += frontier
        paths.sort(key=lambda p: (sum(p), len(p), p))
        if max_nodes is not None:
            paths = paths[:max_nodes]
        return cls.from_choices(paths)

    @property
    def structure(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(depth (N,), ancestry mask (N, N)) of the tree, root included."""
        return _structure(self.parents)

    @property
    def max_rank(self) -> int:
        return int(self.rank.max()) + 1

    @property
    def depth(self) -> int:
        return max(len(c) for c in self.choices)

    def fill(self, root: int, topk_ids: torch.Tensor) -> Tree:
        """topk_ids: (depth, k) candidate ids per depth, best first."""
        tokens = torch.cat((torch.tensor([root]), topk_ids[self.head, self.rank]))
        depth, mask = _structure(self.parents)
        return Tree(tokens, torch.tensor(self.parents), depth, mask)


def dynamic_tree(root: int, topk_ids: torch.Tensor, topk_logp: torch.Tensor, width: int, max_nodes: int) -> Tree:
    """Best-first tree: start from the root, repeatedly add the missing node with the highest
    cumulative log-probability among the top-`width` children of the nodes already in the tree, until
    `max_nodes` drafts. topk_ids / topk_logp: (depth, k >= width) candidates per depth, best first
    (for Medusa heads a depth's candidates do not depend on the parent, so a path's score is the sum
    of its nodes' log-probabilities)."""
    depth = topk_ids.shape[0]
    ids, logp = topk_ids.tolist(), topk_logp.tolist()
    tokens, parents, heap = [root], [-1], []
    node_depth, node_score = [0], [0.0]

    def push_children(node: int):
        d = node_depth[node]
        if d < depth:
            for r in range(width):
                heapq.heappush(heap, (-(node_score[node] + logp[d][r]), len(tokens), node, r))

    push_children(0)
    while heap and len(tokens) - 1 < max_nodes:
        neg, _, parent, r = heapq.heappop(heap)
        d = node_depth[parent]
        tokens.append(ids[d][r])
        parents.append(parent)
        node_depth.append(d + 1)
        node_score.append(-neg)
        push_children(len(tokens) - 1)
    return Tree.from_parents(tokens, parents)
