"""Medusa proposer: the heads' top-k per depth, arranged by a static tree, verified by the target."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from components.heads.medusa import MedusaHeads
from pipeline.core import DecodeState, Proposer, StaticTree, Tree, UserError, dynamic_tree

SHIPPED = Path(__file__).resolve().parent.parent / "heads" / "checkpoints"


def shipped_checkpoint(backbone_name: str) -> Path:
    return SHIPPED / backbone_name / "heads.safetensors"


class MedusaProposer(Proposer):
    def __init__(self, backbone, checkpoint: str | None = None, choices=None, tree_file: str | None = "auto",
                 width: int = 2, depth: int = 3, max_nodes: int = 16, dynamic: bool = False):
        """checkpoint: heads.safetensors (null = the one shipped for this backbone). The tree is
        `choices` when given, else `tree_file` ("auto" = the tree.json written beside the checkpoint
        by `python -m pipeline.tree_search`, when present), else a full width x depth tree pruned to
        max_nodes. `dynamic` instead grows a fresh tree each step from the heads' log-probabilities
        (best-first by cumulative log-probability, top-`width` children, `max_nodes` drafts)."""
        path = Path(checkpoint) if checkpoint else shipped_checkpoint(backbone.name)
        if checkpoint is None and not path.is_file():
            raise UserError(f"no Medusa heads are shipped for model {backbone.name!r}: train them with "
                            "`python -m pipeline.train` and pass proposer.checkpoint=<run dir>/heads.safetensors")
        self.heads = MedusaHeads.load(path, backbone)
        self.checkpoint_path = path
        self.dynamic = bool(dynamic)
        if self.dynamic:
            choices, tree_file = None, None
        if choices is None and tree_file == "auto" and (path.parent / "tree.json").is_file():
            tree_file = str(path.parent / "tree.json")
        if choices is None and tree_file not in (None, "auto"):
            if not Path(tree_file).is_file():
                raise UserError(f"tree file {tree_file} does not exist: run `python -m pipeline.tree_search` or set tree.choices")
            try:
                choices = json.loads(Path(tree_file).read_text())["choices"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise UserError(f"tree file {tree_file} is not a tree: it needs a JSON object with \"choices\" "
                                "(write one with `python -m pipeline.tree_search`)") from None
        if choices is not None:
            self.tree = StaticTree.from_choices(choices)
        else:
            self.tree = StaticTree.from_shape(width, min(depth, self.heads.num_heads), max_nodes)
        if self.tree.depth > self.heads.num_heads:
            raise UserError(f"tree depth {self.tree.depth} exceeds the checkpoint's {self.heads.num_heads} heads: "
                            f"use tree.depth <= {self.heads.num_heads}")

        self.width, self.max_nodes = width, max_nodes

    def propose(self, state: DecodeState) -> Tree | None:
        return self.propose_all([state])[0]

    @torch.inference_mode()
    def propose_all(self, states: list[DecodeState]) -> list[Tree | None]:
        """Every live sequence's heads in one call: h (B, dim) -> (B, K, k) candidates."""
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
                trees.append(tree if depth == self.tree.depth else tree.prune(depth, tree.size))
        return trees
