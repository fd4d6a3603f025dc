"""Hydra heads (group `heads`, option `hydra`): Medusa heads that see the tokens drafted before them
(Ankner et al. 2024, "Hydra: Sequentially-Dependent Draft Heads for Medusa Decoding").

Offset convention: components/heads/medusa.py's (head k predicts y_{t+1+k} from h_t). A Medusa head
reads h_t alone, so its accuracy falls quickly with depth; Hydra head k also reads the path to the
node it extends, y_{t+1} .. y_{t+k}: the root (the bonus token, known when drafting) and the k - 1
tokens drafted before it. Head k is the Medusa head with one more term in its first block:

    f_k = h + SiLU(W_k h + b_k + U_k [e(y_{t+1}) | ... | e(y_{t+k})])   (then num_layers - 1 ResBlocks)

e: the backbone's frozen token embedding, scaled to unit RMS (the path's term starts at the size h's
does). U_k (dim, k dim) is zero-initialised, so fresh Hydra heads are fresh Medusa heads (the
backbone's own next-token head), and heads started from trained Medusa heads (`init`) start as
exactly those heads and can only learn to use the path. Trained teacher-forced on the
self-distilled answers (the true y's are the backbone's own greedy tokens); when drafting, each
node's children come from the head of its depth on the node's path (components/proposer/medusa.py).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from components.heads import checkpoint
from components.heads.medusa import MedusaHeads, draft_lm_weight, select_draft_vocab
from components.model.linear import Int4

FORMAT = checkpoint.Format(name="llm-decode-hydra-v1", key="hydra", kind="head", title="a Hydra head",
                           train="python -m pipeline.train heads=hydra", fix="retrain it", frozen="shared_weight")
SHIPPED_MEDUSA = Path(__file__).resolve().parent / "checkpoints"  # <backbone>/heads.safetensors: `init: shipped`


class HydraHeads(MedusaHeads):
    FORMAT = FORMAT
    OTHERS = {"medusa": "a Medusa heads checkpoint (start Hydra heads from it: heads=hydra heads.init=<it>)",
              "eagle": "an EAGLE draft (use proposer=eagle)"}
    sequential = True

    def __init__(self, dim: int, num_heads: int = 3, num_layers: int = 1, lm_head: str = "shared",
                 vocab_ids: torch.Tensor | None = None, lm_weight: torch.Tensor | None = None,
                 embed: torch.Tensor | None = None):
        """embed: (V, dim) the backbone's token embedding (frozen, read in place, never stored)."""
        super().__init__(dim, num_heads, num_layers, lm_head, vocab_ids, lm_weight)
        if embed is None or embed.dim() != 2 or embed.shape[1] != dim:
            raise ValueError(f"HydraHeads needs the backbone's token embedding (V, {dim})")
        self.paths = nn.ModuleList(nn.Linear(k * dim, dim, bias=False) for k in range(1, num_heads + 1))
        for p in self.paths:
            nn.init.zeros_(p.weight)  # start as the Medusa head
        self.register_buffer("embed", embed.detach(), persistent=False)
        self.init_from: str | None = None  # the Medusa heads it started from (build_hydra), kept in its header

    @classmethod
    def build(cls, backbone, vocab_ids: torch.Tensor, num_heads: int, num_layers: int, lm_head: str) -> "HydraHeads":
        return cls(backbone.model.args.dim, num_heads, num_layers, lm_head, vocab_ids,
                   draft_lm_weight(backbone, vocab_ids), backbone.model.tok_embeddings.weight)

    def head(self, k: int, h: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
        """Head k (1-based): h (N, dim) and path (N, k), backbone ids y_{t+1} .. y_{t+k} -> features (N, dim)."""
        e = F.embedding(path, self.embed).float()  # (N, k, dim)
        e = e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + 1e-6)
        first, *rest = self.blocks[k - 1]
        x = h + F.silu(first.linear(h) + self.paths[k - 1](e.flatten(1)))  # (N, dim)
        for blk in rest:
            x = blk(x)
        return x

    def features(self, h: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
        """Teacher-forced: h (N, dim), path (N, K) the true y_{t+1} .. y_{t+K} -> (K, N, dim)."""
        return torch.stack([self.head(k, h, path[:, :k]) for k in range(1, self.num_heads + 1)])

    def forward(self, h: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
        """h (N, dim), path (N, K) -> logits (K, N, V'): head k's over y_{t+1+k} given y_{t+1..t+k}."""
        f = self.features(h, path)
        if self.proj is None:
            return f @ self.shared_weight.t()
        return torch.einsum("knd,kvd->knv", f, self.proj)

    def save(self, path: str | Path, meta: dict) -> Path:
        return super().save(path, {"init": self.init_from, **meta})

    @torch.inference_mode()
    def expand(self, h: torch.Tensor, path: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One depth of drafting, every node at once: h (N, dim) the hidden state of each node's
        sequence, path (N, d) each node's tokens from the root -> its best k children (N, k) as
        backbone ids, and their log-probabilities, from head d."""
        d = path.shape[1]
        return self.ranked(self.decode_logits(self.head(d, h, path), d - 1), k)

    def quantize_for_decoding(self, ops=None) -> "HydraHeads":
        """The shared projection as Medusa's (4-bit groups of 32, int8 rows beside w4a8), and each
        head's path matrix U_k (dim, k dim) too: at depth 3 it is as many bytes as the projection."""
        super().quantize_for_decoding(ops)
        for k, p in enumerate(self.paths):
            q4 = Int4.quantized(p.weight, p.weight.device, ops) if isinstance(p, nn.Linear) else None
            if q4 is not None:
                self.paths[k] = q4
        return self


def build_hydra(backbone, token_counts: torch.Tensor, num_heads: int = 3, num_layers: int = 1,
                lm_head: str = "shared", draft_vocab: int | None = 8192, init: str | None = None) -> HydraHeads:
    """The `heads=hydra` target. init: None = fresh heads over a draft vocabulary chosen from the
    answers' token counts (V,); "shipped" = started from the Medusa heads shipped for this backbone;
    a path = from those Medusa heads (their draft vocabulary and blocks; the shapes must agree)."""
    if init is None:
        return HydraHeads.build(backbone, select_draft_vocab(token_counts, draft_vocab, backbone.eos_ids),
                                num_heads, num_layers, lm_head)
    path = SHIPPED_MEDUSA / backbone.name / "heads.safetensors" if init == "shipped" else Path(init)
    medusa = MedusaHeads.load(path, backbone)
    mine = {"num_heads": num_heads, "num_layers": num_layers, "lm_head": lm_head}
    theirs = {k: medusa.info[k] for k in mine}
    if mine != theirs:
        raise ValueError(f"`heads.init` {path} holds Medusa heads {theirs}; set heads.num_heads, heads.num_layers "
                         f"and heads.lm_head to match (got {mine})")
    heads = HydraHeads.build(backbone, medusa.vocab_ids.cpu(), num_heads, num_layers, lm_head)
    heads.load_state_dict({**heads.state_dict(), **medusa.state_dict()})  # all but the zero path matrices
    heads.init_from = str(path)
    return heads
