"""EAGLE draft (`heads=eagle`): one decoder layer that drafts in feature space.

Features are the backbone's last hidden states (after its final norm: what its LM head reads). At a
committed position t the draft reads concat(f_t, embed(y_{t+1})), projects it to the hidden size,
runs one decoder layer of the backbone's block shape (its own attention over the earlier positions
of the answer: the draft keeps its own KV cache, no prompt context) and a norm, and predicts
f_{t+1}; the frozen backbone LM head, restricted to a draft vocabulary (EAGLE-3's reduced
vocabulary: the answers' most frequent tokens), turns a predicted feature into draft tokens. Drafting
deeper feeds the predicted feature back with the drafted token's embedding (EAGLE-1/2).

Training (components/heads/module.py: EagleModule) on self-distilled answers, teacher-forced:
loss = smooth-L1(f_hat_{t+1}, f_{t+1}) + ce_weight x CE(LM head(f_hat_{t+1}), y_{t+2}) (EAGLE-1), with
uniform noise on the input features (what the draft sees at depth > 1 is its own prediction).
The layer starts as a copy of the backbone's last block (de-quantized), the projection as
[identity | 0]: at step 0 the draft already predicts roughly what the last block would.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from components.heads.medusa import check_fits, draft_lm_weight, select_draft_vocab
from components.model.llama import Block, RMSNorm, cached_attention, rope_inv_freq
from pipeline.core import UserError, atomic_write

FORMAT = "llm-decode-eagle-v1"


class EagleDraft(nn.Module):
    def __init__(self, args, vocab_ids: torch.Tensor, lm_weight: torch.Tensor, embedding: torch.Tensor):
        """args: the backbone's LlamaArgs (the layer takes its block shape); vocab_ids (V',) draft
        vocabulary; lm_weight (V', dim) the backbone LM head rows for it; embedding (vocab, dim) the
        backbone's token embedding. The last three are frozen buffers, never stored in checkpoints."""
        super().__init__()
        self.args = replace(args, n_layers=1)
        dim = args.dim
        self.dim, self.num_heads = dim, 1
        self.fc = nn.Linear(2 * dim, dim, bias=False)
        self.block = Block(self.args, 0)
        self.norm = RMSNorm(dim, args.norm_eps)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, :dim] = torch.eye(dim)
            for m in self.block.matrices():
                nn.init.normal_(m.weight, std=0.02)
        self.register_buffer("vocab_ids", vocab_ids.long().clone())
        self.register_buffer("lm_weight", lm_weight.float().clone())  # (V', dim)
        self.register_buffer("embedding", embedding.float().clone(), persistent=False)  # (vocab, dim)
        self.register_buffer("inv_freq", rope_inv_freq(self.args).float(), persistent=False)
        self._lm_t: torch.Tensor | None = None

    STORED = ("fc.weight", "norm.weight", "vocab_ids")  # plus every block.* tensor

    def init_from(self, block: nn.Module, norm: nn.Module) -> None:
        """Start the layer as a copy of a backbone block (de-quantized) and its final norm."""
        with torch.no_grad():
            for mine, theirs in zip(self.block.matrices(), block.matrices()):
                mine.weight.copy_(theirs.dense().float())
            self.block.attn_norm.weight.copy_(block.attn_norm.weight.float())
            self.block.mlp_norm.weight.copy_(block.mlp_norm.weight.float())
            self.norm.weight.copy_(norm.weight.float())

    def rope(self, positions: torch.Tensor):
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None]
        sin = emb.sin()
        half = sin.shape[-1] // 2
        return emb.cos(), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)

    def inputs(self, feats: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """concat(f_t, embed(y_{t+1})) projected: (..., dim)."""
        return self.fc(torch.cat((feats.float(), self.embedding[tokens]), dim=-1))

    def forward(self, feats: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Training / reference: feats (B, T, dim) = f_t, tokens (B, T) = y_{t+1}, causal within each
        row (mask: (B, 1, T, T) bool, True = may attend). Returns predicted f_{t+1} (B, T, dim)."""
        B, T = tokens.shape
        x = self.inputs(feats, tokens)
        cos, sin = self.rope(torch.arange(T, device=x.device)[None].expand(B, T))

        def attend(layer, q, k, v):
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               attn_mask=mask, is_causal=mask is None and T > 1,
                                               enable_gqa=self.args.n_kv_heads != self.args.n_heads)
            return y.transpose(1, 2).reshape(B, T, -1)
        return self.norm(self.block(x, cos, sin, attend))

    def logits(self, f: torch.Tensor) -> torch.Tensor:
        """(..., dim) predicted features -> (..., V') logits over the draft vocabulary."""
        if self._lm_t is None or self.training:
            return f @ self.lm_weight.t()
        return f @ self._lm_t

    @torch.inference_mode()
    def step(self, batch, kv, feats: torch.Tensor) -> torch.Tensor:
        """Decoding: the rows of `batch` (StepBatch over the draft's own KV pool; `batch.tokens` are the
        y_{t+1}) with their features feats (R, dim) -> predicted features (R, dim); the rows become
        tentative slots of the draft cache."""
        if self._lm_t is None:
            self._lm_t = self.lm_weight.t().contiguous()
        x = self.inputs(feats, batch.tokens)[None]  # (1, R, dim)
        cos, sin = self.rope(batch.positions[None])
        attend = cached_attention(batch, kv, torch.float32, self.args.n_kv_heads != self.args.n_heads)
        kv.begin_step(batch)
        x = self.block(x, cos, sin, attend)
        kv.end_step(batch)
        return self.norm(x)[0]

    # --- checkpoints: safetensors only, loaded strictly --------------------------------------------
    def save(self, path: str | Path, meta: dict) -> Path:
        """Weights in bfloat16 (half the file; a draft's rounding only moves acceptance, never tokens)."""
        path = Path(path)
        tensors = {k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach()).contiguous()
                   for k, v in self.state_dict().items() if k != "lm_weight"}
        info = {"format": FORMAT, "dim": self.dim, "kind": "eagle", **meta}
        return atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={"eagle": json.dumps(info)}))

    @classmethod
    def load(cls, path: str | Path, backbone) -> "EagleDraft":
        path = Path(path)
        if not path.is_file():
            raise UserError(f"draft checkpoint {path} does not exist: train one with `python -m pipeline.train "
                            "heads=eagle` or pass proposer.checkpoint=<heads.safetensors>")
        if path.suffix != ".safetensors":
            raise UserError(f"draft checkpoint {path} must be a .safetensors file (pickled checkpoints are refused)")
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
                info = json.loads(meta.get("eagle", "{}"))
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:
            raise UserError(f"draft checkpoint {path} is not a readable safetensors file ({e}): retrain it") from None
        if info.get("format") != FORMAT:
            kind = "a Medusa head checkpoint (use proposer=medusa)" if "medusa" in meta else f"format {info.get('format')!r}"
            raise UserError(f"{path} is not an EAGLE draft checkpoint of this project: it is {kind}")
        args = backbone.model.args
        check_fits(path, info, backbone, "draft")
        if "vocab_ids" not in tensors:
            raise UserError(f"draft checkpoint {path} has no vocab_ids tensor: retrain it")
        vocab_ids = tensors["vocab_ids"]
        draft = cls(args, vocab_ids, draft_lm_weight(backbone, vocab_ids), backbone_embedding(backbone))
        missing, unexpected = draft.load_state_dict(tensors, strict=False)
        missing = [k for k in missing if k != "lm_weight"]  # the backbone's own head, not stored
        if missing or unexpected:
            raise UserError(f"draft checkpoint {path} is incomplete or foreign: missing tensors {missing or 'none'}, "
                            f"unexpected {unexpected or 'none'}; retrain it")
        draft.info = info
        return draft.to(backbone.model.device).eval().requires_grad_(False)


def backbone_embedding(backbone) -> torch.Tensor:
    return backbone.model.tok_embeddings.weight.detach().float()


def build_eagle(backbone, token_counts: torch.Tensor, draft_vocab: int | None = 8192, init: str = "last_block",
                num_heads: int = 1) -> EagleDraft:
    """The `heads=eagle` target: a fresh draft for a backbone, its draft vocabulary chosen from the
    training answers' token counts (V,); init = last_block (a copy of the backbone's last block) or
    random."""
    if init not in ("last_block", "random"):
        raise ValueError(f"`heads.init` must be last_block or random, got {init!r}")
    vocab_ids = select_draft_vocab(token_counts, draft_vocab, backbone.eos_ids)
    model = backbone.model
    draft = EagleDraft(model.args, vocab_ids, draft_lm_weight(backbone, vocab_ids), backbone_embedding(backbone))
    if init == "last_block":
        draft.init_from(model.layers[-1], model.norm)
    return draft
