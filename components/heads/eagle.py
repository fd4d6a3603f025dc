"""EAGLE draft (`heads=eagle`): one decoder layer that drafts in feature space.

Features are the backbone's last hidden states (after its final norm: what its LM head reads). At a
committed position t the draft reads concat(f_t, embed(y_{t+1})), projects it to the hidden size,
runs one decoder layer of the backbone's block shape (its own attention over the earlier positions
of the answer, and of the prompt for a draft trained with `data.context=true`: the draft keeps its
own KV cache) and a norm, and predicts
f_{t+1}; the frozen backbone LM head, restricted to a draft vocabulary (EAGLE-3's reduced
vocabulary: the answers' most frequent tokens), turns a predicted feature into draft tokens. Drafting
deeper feeds the predicted feature back with the drafted token's embedding (EAGLE-1/2).

Training (components/heads/module.py: EagleModule) on self-distilled answers:
loss = smooth-L1(f_hat_{t+1}, f_{t+1}) + ce_weight x CE(LM head(f_hat_{t+1}), y_{t+2}) (EAGLE-1), with
uniform noise on the input features, teacher-forced (`module.unroll: 1`), or unrolled over `unroll`
depths as drafting runs (EAGLE-3's training-time test, `EagleDraft.unrolled`): at depth j > 1 the
draft reads its own depth j-1 prediction and attends to the true positions up to the chain's start
and to its own earlier depths, exactly the cache a drafted chain sees.
The layer starts as a copy of the backbone's last block (de-quantized), the projection as
[identity | 0]: at step 0 the draft already predicts roughly what the last block would
(`heads.init=<draft.safetensors>` starts from a trained draft instead).

EAGLE-3's feature fusion (`heads.fuse_layers`, `resolve_fuse_layers`): the feature of a committed
position is fuse(concat(the backbone's states entering a low, a middle and a high block)), a linear
k dim -> dim starting as the highest of them; the backbone keeps those states in its normal forward
(`Transformer.tap`) and the engine and the data hand [those states | the last state] per position,
(k + 1) dim wide (`features`). Drafting deeper reads the draft's own predictions as before. Its
training is EAGLE-3's: the training-time test on the tokens, the feature term off unless asked
(`module.feature_weight`). `fuse_layers: null` is the EAGLE-1/2 draft, tensor for tensor.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from components.heads import checkpoint
from components.heads.medusa import draft_lm_weight, select_draft_vocab
from components.model.linear import Int4
from components.model.llama import Block, RMSNorm, cached_attention, rope_inv_freq
from pipeline.core import UserError

FORMAT = checkpoint.Format(name="llm-decode-eagle-v1", key="eagle", kind="draft", title="an EAGLE draft",
                           train="python -m pipeline.train heads=eagle", fix="retrain it", frozen="lm_weight")


def resolve_fuse_layers(spec, n_layers: int) -> tuple[int, ...] | None:
    """`heads.fuse_layers`: null (no fusion: EAGLE-1/2's last-layer features), auto, or a list of
    layers in 0..n_layers (the input of each block, n_layers: the last block's output). auto is
    EAGLE-3's choice, the inputs of blocks 2, n // 2 and n - 3 (a low, a middle and a high layer);
    a backbone under 7 layers has no three such: 0, n // 2 and n (distinct ones only)."""
    if spec is None:
        return None
    if spec == "auto":
        return tuple(sorted({2, n_layers // 2, n_layers - 3} if n_layers >= 7 else {0, n_layers // 2, n_layers}))
    if isinstance(spec, str) or not all(isinstance(i, int) and not isinstance(i, bool) for i in spec) or not spec:
        raise UserError(f"`heads.fuse_layers` must be null, auto or a list of layer indices, got {spec!r}")
    if any(not 0 <= i <= n_layers for i in spec) or len(set(spec)) != len(spec):
        raise UserError(f"`heads.fuse_layers` must list distinct layers in 0..{n_layers} (this backbone's depth), got {list(spec)}")
    return tuple(int(i) for i in spec)


class EagleDraft(nn.Module):
    def __init__(self, args, vocab_ids: torch.Tensor, lm_weight: torch.Tensor, embedding: torch.Tensor,
                 fuse_layers: tuple[int, ...] | None = None):
        """args: the backbone's LlamaArgs (the layer takes its block shape); vocab_ids (V',) draft
        vocabulary; lm_weight (V', dim) the backbone LM head rows for it; embedding (vocab, dim) the
        backbone's token embedding. The last three are frozen buffers, never stored in checkpoints.
        fuse_layers: EAGLE-3's fusion, the backbone layers whose states (concatenated) a linear
        `fuse` (k dim -> dim) turns into the feature of a committed position; None: the last state."""
        super().__init__()
        self.args = replace(args, n_layers=1)
        dim = args.dim
        self.dim, self.num_heads = dim, 1
        self.fuse_layers = None if fuse_layers is None else tuple(fuse_layers)
        if self.fuse_layers is not None:
            self.fuse = nn.Linear(len(self.fuse_layers) * dim, dim, bias=False)
            with torch.no_grad():  # starts as the highest layer's state: the one nearest the last block's input
                self.fuse.weight.zero_()
                self.fuse.weight[:, -dim:] = torch.eye(dim)
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
        self._lm_q4: nn.Module | None = None  # quantize_for_decoding
        self.native = None  # the fused kernels the layer decodes on (quantize_for_decoding beside a w4a8 backbone)

    STORED = ("fc.weight", "norm.weight", "vocab_ids")  # plus every block.* tensor, and fuse.weight when fused

    @property
    def fused(self) -> bool:
        return self.fuse_layers is not None

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

    def features(self, feats: torch.Tensor) -> torch.Tensor:
        """The f_t a row reads (..., dim) from what it is given: a predicted feature (dim wide) as it
        is; the target's states of a committed position, [fused layers' states | last state]
        ((k + 1) dim, `pipeline.core.engine` and the data hand them so), fused by `fuse`, or for an
        unfused draft the last state alone."""
        feats, dim = feats.float(), self.dim
        if feats.shape[-1] == dim:
            return feats
        if not self.fused:
            return feats[..., -dim:]
        k = len(self.fuse_layers) * dim
        if feats.shape[-1] != k + dim:
            raise ValueError(f"a fused draft over layers {list(self.fuse_layers)} reads states {k + dim} wide "
                             f"(those layers' and the last), got {feats.shape[-1]}: the backbone keeps other layers")
        return self.fuse(feats[..., :k])

    def inputs(self, feats: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """concat(f_t, embed(y_{t+1})) projected: (..., dim)."""
        return self.fc(torch.cat((self.features(feats), self.embedding[tokens]), dim=-1))

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

    def unrolled(self, feats: torch.Tensor, tokens: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """Training-time test: drafting `depth` deep from every position at once. feats (B, T, dim) = f_t,
        tokens (B, T) = y_{t+1} (padding past an answer's end is never read by a query before it).
        Returns preds[j] (B, T, dim) for j = 0..depth-1: preds[j][:, q] is the draft's prediction of
        f_{q+1} on the chain started at i = q - j, that is, having read the true (f_s, y_{s+1}) for
        s <= i and its own predictions preds[k-1][:, i+k-1] with the true y_{i+k+1}, k = 1..j: what
        `step` computes when drafting that chain (queries with q < j have no chain and are junk).
        preds[0] is `forward`. Each depth's keys stay for the later depths, gradients flow through."""
        B, T = tokens.shape
        cos, sin = self.rope(torch.arange(T, device=feats.device)[None].expand(B, T))
        q = torch.arange(T, device=feats.device)[:, None]
        p = torch.arange(T, device=feats.device)[None]
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        preds: list[torch.Tensor] = []
        f = feats.float()
        for j in range(depth):
            if j:
                f = torch.cat((torch.zeros_like(preds[-1][:, :1]), preds[-1][:, :-1]), dim=1)  # f_hat at q-1
            # the chain from i = q - j: true slots s <= i, then its own slot i + k at each depth k <= j
            allowed = torch.cat([p <= q - j] + [p == q - j + k for k in range(1, j + 1)], dim=1)  # (T, (j+1) T)

            def attend(layer, qh, k, v, allowed=allowed):
                keys.append(k)
                values.append(v)
                K, V = torch.cat(keys, dim=1), torch.cat(values, dim=1)
                y = F.scaled_dot_product_attention(qh.transpose(1, 2), K.transpose(1, 2), V.transpose(1, 2),
                                                   attn_mask=allowed, enable_gqa=self.args.n_kv_heads != self.args.n_heads)
                return y.transpose(1, 2).reshape(B, T, -1)
            preds.append(self.norm(self.block(self.inputs(f, tokens), cos, sin, attend)))
        return preds

    def logits(self, f: torch.Tensor) -> torch.Tensor:
        """(..., dim) predicted features -> (..., V') logits over the draft vocabulary."""
        if self.training:
            return f @ self.lm_weight.t()
        if self._lm_q4 is not None:
            return self._lm_q4(f)
        if self._lm_t is None:
            self._lm_t = self.lm_weight.t().contiguous()
        return f @ self._lm_t

    def quantize_for_decoding(self, ops=None) -> "EagleDraft":
        """Decoding beside a q4 backbone: the input projection, the layer's matrices and the draft LM
        head stored as the backbone's are, 4-bit groups of 32 (components/model/linear.py `Int4`: the weight-only int4
        kernel, bfloat16 inside, float32 around). Each draft depth then reads ~5 MB of weights, not ~36:
        a depth costs a fraction of a verification row. A draft's rounding moves which tokens are
        proposed, never which are committed. Not for training (the matrices are no longer parameters).
        ops: the fused kernels beside a w4a8 backbone: the matrices then multiply int8 rows, as its do."""
        device = self.lm_weight.device
        for name in ("fc", "fuse") if self.fused else ("fc",):  # the input projections, (dim, 2 dim) and (dim, k dim)
            q4 = Int4.quantized(getattr(self, name).weight, device, ops)
            if q4 is not None:
                setattr(self, name, q4)
        for name in Block.MATRICES:
            q4 = Int4.quantized(getattr(self.block, name).dense().t(), device, ops)
            if q4 is not None:
                setattr(self.block, name, q4)
        self._lm_q4 = Int4.quantized(self.lm_weight, device, ops)
        if ops is not None and hasattr(ops, "pre_attention") and device.type == "cpu":
            # the layer's glue on the fused kernels too, as the backbone's layers: bfloat16 rows and
            # cache, norms in bfloat16 (what the kernels read), three native calls a depth
            with torch.no_grad():
                for norm in (self.block.attn_norm, self.block.mlp_norm):
                    norm.weight.data = norm.weight.data.to(torch.bfloat16)
            self.native = ops
        return self

    @property
    def storage(self) -> str:
        """How the draft decodes: q4 (or w4a8) after quantize_for_decoding, else float32."""
        if self._lm_q4 is None:
            return "float32"
        return "w4a8" if self._lm_q4.activations == "int8" else "q4"

    @torch.inference_mode()
    def step(self, batch, kv, feats: torch.Tensor) -> torch.Tensor:
        """Decoding: the rows of `batch` (StepBatch over the draft's own KV pool, its plan set:
        `pipeline.core.forward_step`; `batch.tokens` are the y_{t+1}) with their features feats
        (R, dim) -> predicted features (R, dim). On the fused kernels (`native`) the layer runs as a
        backbone layer does (`Block.native_forward`), its cache in bfloat16."""
        if self.native is not None:
            x = self.inputs(feats, batch.tokens).to(torch.bfloat16)  # (R, dim)
            freqs = batch.positions[:, None].float() * self.inv_freq  # (R, hs / 2)
            return self.norm(self.block.native_forward(x, freqs.cos(), freqs.sin(), batch, kv, self.native).float())
        x = self.inputs(feats, batch.tokens)[None]  # (1, R, dim)
        cos, sin = self.rope(batch.positions[None])
        attend = cached_attention(batch, kv, torch.float32, self.args.n_kv_heads != self.args.n_heads)
        x = self.block(x, cos, sin, attend)
        return self.norm(x)[0]

    # --- checkpoints: components/heads/checkpoint.py --------------------------------------------
    def save(self, path: str | Path, meta: dict) -> Path:
        """Weights in bfloat16 (half the file; a draft's rounding only moves acceptance, never tokens)."""
        fused = {} if not self.fused else {"fuse_layers": list(self.fuse_layers)}  # an unfused draft's header as before
        return checkpoint.save(self, path, FORMAT, {"dim": self.dim, "kind": "eagle", **fused, **meta}, torch.bfloat16)

    @classmethod
    def load(cls, path: str | Path, backbone) -> "EagleDraft":
        info, tensors = checkpoint.read(path, FORMAT, backbone,
                                        others={"medusa": "a Medusa head checkpoint (use proposer=medusa)"})
        vocab_ids = tensors["vocab_ids"]
        fuse = info.get("fuse_layers")
        if fuse is not None and any(not 0 <= i <= backbone.model.args.n_layers for i in fuse):
            raise UserError(f"EAGLE draft {path} fuses layers {fuse}, beyond this backbone's {backbone.model.args.n_layers}: "
                            "it was trained on another backbone")
        draft = cls(backbone.model.args, vocab_ids, draft_lm_weight(backbone, vocab_ids), backbone_embedding(backbone),
                    None if fuse is None else tuple(fuse))
        checkpoint.load_state(draft, tensors, path, FORMAT)
        draft.info = info
        return draft.to(backbone.model.device).eval().requires_grad_(False)


def backbone_embedding(backbone) -> torch.Tensor:
    return backbone.model.tok_embeddings.weight.detach().float()


def build_eagle(backbone, token_counts: torch.Tensor, draft_vocab: int | None = 8192, init: str = "last_block",
                num_heads: int = 1, fuse_layers=None) -> EagleDraft:
    """The `heads=eagle` target: a fresh draft for a backbone, its draft vocabulary chosen from the
    training answers' token counts (V,); init = last_block (a copy of the backbone's last block),
    random, or the path of a trained draft (.safetensors) to go on training (its vocabulary kept).
    fuse_layers: `resolve_fuse_layers` (EAGLE-3's fusion; null: EAGLE-1/2's last-layer features)."""
    fuse = resolve_fuse_layers(fuse_layers, backbone.model.args.n_layers)
    if init not in ("last_block", "random"):
        if not str(init).endswith(".safetensors"):
            raise UserError(f"`heads.init` must be last_block, random or a draft .safetensors path, got {init!r}")
        draft = EagleDraft.load(init, backbone)  # strict: a missing tensor or another backbone is an error
        if draft.fuse_layers != fuse:
            raise UserError(f"heads.init={init} fuses layers {draft.fuse_layers}, heads.fuse_layers asks for {fuse}: "
                            "set heads.fuse_layers to the draft's")
        return draft.train().requires_grad_(True)
    vocab_ids = select_draft_vocab(token_counts, draft_vocab, backbone.eos_ids)
    model = backbone.model
    draft = EagleDraft(model.args, vocab_ids, draft_lm_weight(backbone, vocab_ids), backbone_embedding(backbone), fuse)
    if init == "last_block":
        draft.init_from(model.layers[-1], model.norm)
    return draft
