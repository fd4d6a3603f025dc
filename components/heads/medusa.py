"""Medusa heads (group `heads`): K extra decoding heads on the backbone's last hidden state.

Offset convention (stated once, used everywhere): at position t the backbone's LM head predicts
token t+1; Medusa head k (k = 1..K) predicts token t+1+k. In decoding, t is the last accepted node,
t+1 is the bonus token (the next root), so head k drafts the tree's depth-k tokens.

Each head is `num_layers` residual blocks h + SiLU(W h + b) with W zero-initialised (the head starts
as the backbone's own next-token head), then a vocabulary projection: the frozen backbone LM head
shared by all heads (`lm_head: shared`), or a trainable per-head copy of it (`lm_head: copy`).
Projections cover a draft vocabulary: the `draft_vocab` tokens most frequent in the training
answers (null = the full vocabulary). A draft outside it can only cost an accepted token, never
correctness, and a 49k-row projection per head per step is what makes heads slow on a CPU.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from components.model.linear import Int4
from components.heads import checkpoint
from pipeline.core import positive_int

FORMAT = checkpoint.Format(name="llm-decode-medusa-v1", key="medusa", kind="head", title="a Medusa head",
                           train="python -m pipeline.train", fix="re-export or retrain it", frozen="shared_weight")


class ResBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        nn.init.zeros_(self.linear.weight)  # identity at start
        nn.init.zeros_(self.linear.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + F.silu(self.linear(h))


class MedusaHeads(nn.Module):
    sequential = False  # Hydra heads (components/heads/hydra.py): each depth also reads the path before it

    def __init__(self, dim: int, num_heads: int = 3, num_layers: int = 1, lm_head: str = "shared",
                 vocab_ids: torch.Tensor | None = None, lm_weight: torch.Tensor | None = None):
        """vocab_ids: (V',) the draft vocabulary as backbone token ids; lm_weight: (V', dim) the backbone
        LM head rows for them (frozen buffer when shared, initial value of each copy otherwise)."""
        super().__init__()
        positive_int(num_heads, "heads.num_heads"), positive_int(num_layers, "heads.num_layers")
        if lm_head not in ("shared", "copy"):
            raise ValueError(f"`heads.lm_head` must be 'shared' or 'copy', got {lm_head!r}")
        if vocab_ids is None or lm_weight is None or lm_weight.shape != (vocab_ids.numel(), dim):
            raise ValueError("MedusaHeads needs vocab_ids (V',) and lm_weight (V', dim)")
        self.dim, self.num_heads, self.num_layers, self.lm_head_mode = dim, num_heads, num_layers, lm_head
        self.blocks = nn.ModuleList(nn.Sequential(*[ResBlock(dim) for _ in range(num_layers)]) for _ in range(num_heads))
        self.register_buffer("vocab_ids", vocab_ids.long().clone())
        if lm_head == "shared":
            self.register_buffer("shared_weight", lm_weight.float().clone())  # (V', dim), frozen
            self.proj = None
        else:
            self.proj = nn.Parameter(lm_weight.float().clone()[None].repeat(num_heads, 1, 1))  # (K, V', dim)
        self._infer_w: torch.Tensor | None = None
        self._infer_q4: nn.Module | None = None  # quantize_for_decoding
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None  # decode_features' stacked blocks

    def features(self, h: torch.Tensor) -> torch.Tensor:
        """h: (N, dim) -> (K, N, dim)."""
        return torch.stack([blk(h) for blk in self.blocks])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: (N, dim) backbone hidden states -> logits (K, N, V') over the draft vocabulary."""
        f = self.features(h)
        if self.proj is None:
            return f @ self.shared_weight.t()
        return torch.einsum("knd,kvd->knv", f, self.proj)

    @torch.inference_mode()
    def topk(self, h: torch.Tensor, k: int, with_logprobs: bool = False):
        """One decode step: h (dim,) -> (K, k) backbone token ids, best first per head (and their
        log-probabilities over the draft vocabulary with `with_logprobs`); h (B, dim) -> (B, K, k)."""
        f = self.decode_features(h.reshape(-1, h.shape[-1]))  # (K, B, dim)
        ids, logp = self.ranked(self.decode_logits(f), k)  # (K, B, k)
        ids, logp = ids.transpose(0, 1), logp.transpose(0, 1)  # (B, K, k)
        if h.dim() == 1:
            ids, logp = ids[0], logp[0]
        return (ids, logp) if with_logprobs else ids

    def decode_features(self, h: torch.Tensor) -> torch.Tensor:
        """`features` for decoding: with one block a head, the heads' matrices stacked into one
        (K dim, dim) product (one call a step, not K; the rows' sums differ from K products only in
        the last bits, which move drafts, never committed tokens)."""
        if self.sequential or self.num_layers != 1 or self.training:
            return self.features(h)
        if self._stacked is None:
            lins = [blk[0].linear for blk in self.blocks]
            self._stacked = (torch.cat([m.weight for m in lins]).t().contiguous().detach(),
                             torch.cat([m.bias for m in lins]).detach())
        w, b = self._stacked
        y = F.silu(torch.addmm(b, h, w)).view(h.shape[0], self.num_heads, self.dim)  # (B, K, dim)
        return h[None] + y.transpose(0, 1)

    def decode_logits(self, f: torch.Tensor, head: int | None = None) -> torch.Tensor:
        """Decoding's projection: f (K, B, dim) of every head, or (B, dim) of head `head` (0-based)
        -> logits (..., V') over the draft vocabulary, in 4 bits after quantize_for_decoding."""
        if self._infer_q4 is not None:
            return self._infer_q4(f)
        if self.proj is None:
            if self._infer_w is None:  # [in, out] layout reads faster for a few rows
                self._infer_w = self.shared_weight.t().contiguous()
            return f @ self._infer_w
        if head is None:
            return torch.einsum("kbd,kvd->kbv", f, self.proj)
        return f @ self.proj[head].t()

    def ranked(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """logits (..., V') -> the best k as backbone token ids (..., k) and their log-probabilities."""
        top = logits.topk(k, dim=-1)
        return self.vocab_ids[top.indices], top.values - logits.logsumexp(-1, keepdim=True)

    def quantize_for_decoding(self, ops=None) -> "MedusaHeads":
        """Decoding beside a q4 backbone: the shared projection stored as the backbone's matrices are,
        4-bit groups of 32 (components/model/linear.py `Int4`), ~4x fewer bytes read per step than
        float32. Moves which tokens are drafted, never which are committed. Not for training. ops: the
        fused kernels beside a w4a8 backbone (int8 rows, as its matrices multiply)."""
        if self.proj is None:
            self._infer_q4 = Int4.quantized(self.shared_weight, self.shared_weight.device, ops)
        return self

    @property
    def storage(self) -> str:
        """How the projection decodes: q4 (or w4a8) after quantize_for_decoding, else float32."""
        if self._infer_q4 is None:
            return "float32"
        return "w4a8" if self._infer_q4.activations == "int8" else "q4"

    # --- checkpoints: components/heads/checkpoint.py --------------------------------------------
    FORMAT = FORMAT
    OTHERS = {"hydra": "a Hydra heads checkpoint (sequential heads: proposer=medusa decodes them, export and "
                       "tree_search take Medusa heads)", "eagle": "an EAGLE draft (use proposer=eagle)"}

    @classmethod
    def build(cls, backbone, vocab_ids: torch.Tensor, num_heads: int, num_layers: int, lm_head: str) -> "MedusaHeads":
        """Fresh heads of this class for `backbone`, over the draft vocabulary `vocab_ids` (V',)."""
        return cls(backbone.model.args.dim, num_heads, num_layers, lm_head, vocab_ids, draft_lm_weight(backbone, vocab_ids))

    def save(self, path: str | Path, meta: dict) -> Path:
        info = {"dim": self.dim, "num_heads": self.num_heads, "num_layers": self.num_layers,
                "lm_head": self.lm_head_mode, **meta}
        return checkpoint.save(self, path, self.FORMAT, info)

    @classmethod
    def load(cls, path: str | Path, backbone) -> "MedusaHeads":
        info, tensors = checkpoint.read(path, cls.FORMAT, backbone, cls.OTHERS)
        heads = cls.build(backbone, tensors["vocab_ids"], info["num_heads"], info["num_layers"], info["lm_head"])
        checkpoint.load_state(heads, tensors, path, cls.FORMAT)
        heads.info = info
        return heads.to(backbone.model.device).eval().requires_grad_(False)


def draft_lm_weight(backbone, vocab_ids: torch.Tensor) -> torch.Tensor:
    """(V', dim) rows of the backbone's output projection for the draft vocabulary."""
    return backbone.model.lm_head.detach().t()[vocab_ids].float()


def select_draft_vocab(token_counts: torch.Tensor, size: int | None, always: list[int]) -> torch.Tensor:
    """The `size` most frequent answer tokens plus `always` (EOS), as ascending ids; all when None."""
    vocab = token_counts.numel()
    if size is None or size >= vocab:
        return torch.arange(vocab)
    if not isinstance(size, int) or size < 8:
        raise ValueError(f"`heads.draft_vocab` must be an int >= 8 or null, got {size}")
    counts = token_counts.clone().float()
    counts[always] = float("inf")
    return counts.topk(size).indices.sort().values


def build_heads(backbone, token_counts: torch.Tensor, num_heads: int = 3, num_layers: int = 1,
                lm_head: str = "shared", draft_vocab: int | None = 8192) -> MedusaHeads:
    """The `heads` group's target: fresh heads for a backbone, their draft vocabulary chosen from the
    training answers' token counts (V,)."""
    return MedusaHeads.build(backbone, select_draft_vocab(token_counts, draft_vocab, backbone.eos_ids),
                             num_heads, num_layers, lm_head)
