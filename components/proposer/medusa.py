"""Medusa proposer: the heads' top-k per depth, arranged by a static tree, verified by the target.

With sequential heads (heads=hydra: components/heads/hydra.py; the checkpoint's kind says so) the
tree is grown node by node each step, EAGLE-2's way: head 1 on (h_t, root) gives the root's top
`width` children; at each next depth the best `width` nodes of the newest depth (by cumulative
log-probability, only those still among the best `max_nodes` candidates) are expanded by the head
of their depth on their own path, every node of every sequence in one call of the heads; then the
best `max_nodes` candidates form the tree, and with `nodes: auto` the best prefix of them by
predicted tokens per ms on this machine's measured step costs (policy.best_prefix), none when no
prefix pays. Siblings' children differ: each reads its own path."""
from __future__ import annotations

import hashlib
import heapq
import json
import math
import time
from pathlib import Path

import torch

from components.model.assemble import FOUR_BIT
from components.heads.checkpoint import kind as checkpoint_kind
from components.heads.hydra import HydraHeads
from components.heads.medusa import MedusaHeads
from components.proposer.eagle import _Growing
from components.proposer.policy import chain_costs, size_tree
from pipeline.core import DecodeState, Proposer, StaticTree, Tree, UserError, dynamic_tree, positive_int

SHIPPED = Path(__file__).resolve().parent.parent / "heads" / "checkpoints"


def shipped_checkpoint(backbone_name: str) -> Path:
    return SHIPPED / backbone_name / "heads.safetensors"


class MedusaProposer(Proposer):
    def __init__(self, backbone, checkpoint: str | None = None, choices=None, tree_file: str | None = "auto",
                 width: int = 2, depth: int = 3, max_nodes: int = 16, dynamic: bool = False,
                 nodes: int | str | None = "auto", p_min: float | None = None, min_gain: float = 1.05,
                 batch_size: int = 1):
        """checkpoint: heads.safetensors (null = the one shipped for this backbone). The tree is
        `choices` when given, else `tree_file` ("auto" = the tree.json written beside the checkpoint
        by `python -m pipeline.tree_search`, when present), else a full width x depth tree pruned to
        max_nodes. `dynamic` instead grows a fresh tree each step from the heads' log-probabilities
        (best-first by cumulative log-probability, top-`width` children, `max_nodes` drafts).

        nodes: with a tree file from the tree search, how many of its ranked paths to verify: "auto"
        = the count with the best predicted tokens/s on this machine in this precision, which is 0
        (plain decoding) when no tree pays (components/proposer/policy.py); an int = that many;
        None = the file's own choice; min_gain: the predicted speedup a tree must reach under "auto".
        p_min: per step, drafts whose cumulative draft probability
        (the product of the heads' probabilities along the path) is below it are dropped; None = the
        tree file's `p_min` (a tree installed from a search carries its own), else 0. batch_size: the
        run's, at which nodes="auto" weighs the drafts' rows."""
        self.batch_size = positive_int(batch_size, "proposer.batch_size")
        if p_min is not None and (not isinstance(p_min, (int, float)) or isinstance(p_min, bool) or not 0 <= p_min < 1):
            raise UserError(f"proposer.p_min must be a probability in [0, 1), got {p_min}")
        if not (nodes in (None, "auto") or (isinstance(nodes, int) and not isinstance(nodes, bool) and nodes >= 0)):
            raise UserError(f"proposer.nodes must be auto, null or a draft count >= 0, got {nodes!r}")
        if not isinstance(min_gain, (int, float)) or isinstance(min_gain, bool) or min_gain <= 0:
            raise UserError(f"proposer.min_gain must be a positive speedup, got {min_gain}")
        self.p_min, self.min_gain, self.policy = float(p_min or 0.0), float(min_gain), None
        path = Path(checkpoint) if checkpoint else shipped_checkpoint(backbone.name)
        if checkpoint is None and not path.is_file():
            raise UserError(f"no Medusa heads are shipped for model {backbone.name!r}: train them with "
                            "`python -m pipeline.train` and pass proposer.checkpoint=<run dir>/heads.safetensors")
        self.heads = (HydraHeads if checkpoint_kind(path) == "hydra" else MedusaHeads).load(path, backbone)
        if backbone.model.precision in FOUR_BIT:  # the draft projection in 4 bits too (~4x fewer bytes per step)
            self.heads.quantize_for_decoding(backbone.model.native if backbone.model.precision == "w4a8" else None)
        self.checkpoint_path = path
        self.width, self.max_nodes, self.costs = width, max_nodes, None
        if self.heads.sequential:  # a tree grown node by node each step: no static shape, no tree file
            if choices is not None or tree_file not in (None, "auto"):
                raise UserError(f"{path} holds sequential (Hydra) heads, which grow their tree each step: leave "
                                "tree.choices and proposer.tree_file unset, size it with tree.width/depth/max_nodes")
            self.dynamic, self.tree, self.depth = True, None, min(depth, self.heads.num_heads)
            if isinstance(nodes, int):
                self.max_nodes = nodes
            elif nodes == "auto":  # a step with n drafts costs what a chain of n does (the rows')
                self.costs = chain_costs(backbone, max_nodes, self.batch_size)
            return
        self.dynamic = bool(dynamic)
        if self.dynamic:
            choices, tree_file = None, None
        if choices is None and tree_file == "auto" and (path.parent / "tree.json").is_file():
            tree_file = str(path.parent / "tree.json")
        if choices is None and tree_file not in (None, "auto"):
            choices = self._from_tree_file(backbone, Path(tree_file), nodes, p_min)
        if choices == []:  # the policy chose plain decoding
            self.tree = None
        elif choices is not None:
            self.tree = StaticTree.from_choices(choices)
        else:
            self.tree = StaticTree.from_shape(width, min(depth, self.heads.num_heads), max_nodes)
        if self.tree is not None and self.tree.depth > self.heads.num_heads:
            raise UserError(f"tree depth {self.tree.depth} exceeds the checkpoint's {self.heads.num_heads} heads: "
                            f"use tree.depth <= {self.heads.num_heads}")

    def _from_tree_file(self, backbone, tree_file: Path, nodes, p_min) -> list[list[int]]:
        """The paths of a tree search's tree.json (the first `nodes` of its ranking where it ranks
        them), and its p_min unless one was given."""
        if not tree_file.is_file():
            raise UserError(f"tree file {tree_file} does not exist: run `python -m pipeline.tree_search` or set tree.choices")
        try:
            found = json.loads(tree_file.read_text())
            choices = found["choices"]
            if p_min is None:
                self.p_min = float(found.get("p_min", 0.0))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(f"tree file {tree_file} is not a tree: it needs a JSON object with \"choices\" "
                            "(write one with `python -m pipeline.tree_search`)") from None
        order = [(tuple(int(r) for r in path), float(q)) for path, q in found.get("path_probability", [])]
        if nodes is not None and order:
            choices = self._size(backbone, order, nodes, tree_file)
        return choices

    def _size(self, backbone, order, nodes, tree_file: Path) -> list[list[int]]:
        """The first n of the tree search's ranked paths: n given, or chosen by the policy."""
        order = [(p, q) for p, q in order if len(p) <= self.heads.num_heads]
        if nodes != "auto":
            return [list(p) for p, _ in order[:nodes]]
        full = StaticTree.from_choices([p for p, _ in order])
        h = torch.zeros(1, self.heads.dim, device=backbone.model.device)
        t0 = time.perf_counter()
        for _ in range(10):
            ids, _ = self.heads.topk(h, full.max_rank, with_logprobs=True)
            full.fill(0, ids[0].cpu())
        proposal_ms = (time.perf_counter() - t0) / 10 * 1e3
        digest = hashlib.sha1(tree_file.read_bytes()).hexdigest()[:12]
        self.policy = size_tree(backbone, order, proposal_ms, digest, self.min_gain, self.batch_size)
        return self.policy["choices"]

    def describe(self) -> dict:
        """Its "tree": the tree it verifies (a search's best one becomes a tree file); "policy": the
        sizing decision with nodes=auto and a tree file, else None."""
        common = {"p_min": self.p_min, "checkpoint": str(self.checkpoint_path), "draft_storage": self.heads.storage}
        if self.heads.sequential:
            tree = {"dynamic": True, "sequential": True, "width": self.width, "depth": self.depth,
                    "max_nodes": self.max_nodes, "nodes": "auto" if self.costs else self.max_nodes,
                    "step_ms_by_drafts": self.costs, **common}
        elif self.dynamic:
            tree = {"dynamic": True, "width": self.width, "max_nodes": self.max_nodes, **common}
        else:
            tree = {"choices": None if self.tree is None else [list(c) for c in self.tree.choices], **common}
        return {"tree": tree, "policy": self.policy}

    @property
    def active(self) -> bool:
        return self.max_nodes > 0 if self.heads.sequential else self.dynamic or self.tree is not None

    @property
    def floor(self) -> float:
        """p_min as a log-probability."""
        return math.log(self.p_min) if self.p_min > 0 else -math.inf

    @torch.inference_mode()
    def propose(self, states: list[DecodeState]) -> list[Tree | None]:
        if self.heads.sequential:
            return [None if t is None else t.tree(s.tokens[-1], self.max_nodes, self.floor, self.costs, self.min_gain)
                    for s, t in zip(states, self._grow(states))]
        return [t for t, _, _ in self._candidates(states)]

    @torch.inference_mode()
    def scored(self, states: list[DecodeState]) -> list[list[tuple[tuple[int, ...], float]]]:
        """Each sequence's drafts as (draft tokens from the root, the product of the heads'
        probabilities along the path), for a proposer that ranks them with other sources'
        (proposer=hybrid)."""
        if self.heads.sequential:
            return [[] if t is None else t.scored(self.floor) for t in self._grow(states)]
        out = []
        for tree, ids, logp in self._candidates(states):
            if tree is None:
                out.append([])
                continue
            tokens, depth, parents = tree.tokens.tolist(), tree.depth.tolist(), tree.parents.tolist()
            paths, cum = [()], [0.0]
            for i in range(1, len(tokens)):  # a depth's candidates are distinct: a token names its rank
                d = depth[i] - 1
                paths.append(paths[parents[i]] + (tokens[i],))
                cum.append(cum[parents[i]] + float(logp[d][ids[d] == tokens[i]][0]))
            out.append([(p, math.exp(c)) for p, c in zip(paths[1:], cum[1:])])
        return out

    def _grow(self, states: list[DecodeState]) -> list[_Growing | None]:
        """Sequential heads: every sequence's candidates this step (None: no room to draft), grown
        depth by depth, each depth's nodes of every sequence through the heads at once."""
        trees = [_Growing(min(self.depth, s.budget - 1)) for s in states]
        hidden = torch.stack([s.hidden for s in states]).float()  # (B, dim)
        roots = [s.tokens[-1] for s in states]
        grow = [(b, 0) for b, t in enumerate(trees) if t.depth >= 1]  # (sequence, node) to expand
        for d in range(1, self.depth + 1):
            if not grow:
                break
            rows = torch.tensor([b for b, _ in grow], device=hidden.device)
            paths = torch.tensor([path_of(trees[b], n, roots[b]) for b, n in grow], device=hidden.device)  # (N, d)
            ids, logp = self.heads.expand(hidden[rows], paths, self.width)  # (N, width): each node's children
            for (b, n), ids_n, logp_n in zip(grow, ids.cpu(), logp.cpu()):
                trees[b].add_children(n, logp_n, self.width, ids_n, None)
            grow = [(b, n) for b, t in enumerate(trees) if t.depth > d for n in self._to_expand(t, d)]
        return [t if t.depth >= 1 else None for t in trees]

    def _to_expand(self, t: _Growing, d: int) -> list[int]:
        """The best `width` nodes of depth d that can still be drafted: at or above p_min, and among
        the best max_nodes candidates so far (a child never scores above its parent, and the bar only
        rises, so the children of any other node would all be cut)."""
        scores = sorted(t.score[1:], reverse=True)
        bar = max(self.floor, scores[self.max_nodes - 1] if len(scores) >= self.max_nodes else -math.inf)
        return heapq.nlargest(self.width, (n for n in t.frontier(d) if t.score[n] >= bar), key=lambda n: t.score[n])

    def _candidates(self, states: list[DecodeState]) -> list[tuple[Tree | None, torch.Tensor, torch.Tensor]]:
        """Every live sequence's heads in one call: h (B, dim) -> (B, K, k) candidates. Per sequence:
        its tree (None: none), and the heads' candidate ids and log-probabilities (K, k)."""
        if self.tree is None and not self.dynamic:
            return [(None, None, None)] * len(states)  # the policy chose plain decoding
        hidden = torch.stack([s.hidden for s in states]).float()  # (B, dim)
        k = self.width if self.dynamic else self.tree.max_rank
        ids, logp = self.heads.topk(hidden, k, with_logprobs=True)  # (B, K, k): head k drafts depth k
        ids, logp = ids.cpu(), logp.cpu()  # trees are built on the host (one transfer per step)
        trees = []
        for s, ids_b, logp_b in zip(states, ids, logp):
            depth = min(self.tree.depth, s.budget - 1)  # no draft past max_new_tokens / the context end
            if self.dynamic:
                trees.append(dynamic_tree(s.tokens[-1], ids_b[:depth], logp_b[:depth], self.width, self.max_nodes))
            else:
                tree = self.tree.fill(s.tokens[-1], ids_b[:self.tree.depth])
                if self.p_min > 0:
                    tree = self._above_p_min(tree, logp_b)
                trees.append(tree if depth >= tree.max_depth else tree.prune(depth, tree.size))
        return [(t if t is None or t.size > 1 else None, i, lp) for t, i, lp in zip(trees, ids, logp)]

    def _above_p_min(self, tree: Tree, logp: torch.Tensor) -> Tree:
        """Drop the nodes whose cumulative draft probability is below p_min (with their subtrees:
        the product only shrinks along a path)."""
        node_lp = torch.cat((torch.zeros(1), logp[self.tree.head, self.tree.rank].float()))
        cum = node_lp.clone()
        parents = self.tree.parents
        for i in range(1, len(parents)):
            cum[i] += cum[parents[i]]
        return tree.keep((cum >= math.log(self.p_min)).nonzero().squeeze(-1))


def path_of(t: _Growing, n: int, root: int) -> list[int]:
    """Node n's tokens from the root (root included): what the head that extends it reads."""
    return [root, *(t.token[a] for a in reversed(list(t.ancestors(n)))), *([t.token[n]] if n else [])]
