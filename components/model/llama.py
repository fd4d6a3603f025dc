"""A compact Llama-family transformer (RMSNorm, RoPE, GQA, SwiGLU) built for decoding.

The forward pass takes explicit position ids and an explicit per-query attention mask over the
cached keys plus the new ones: exactly the two hooks that packed tree attention needs. It returns
hidden states; the LM head is a separate call (`logits`), so Medusa heads and early-exit drafts can
share the trunk.

Each layer's four matrices (q/k/v fused, the output projection, gate/up fused, down) are modules of
components/model/linear.py: `Dense` ([in, out], float32 or bfloat16, with the kernel measured
fastest per row count) or `Int4` (the GGUF's 4-bit blocks as shipped). The activation dtype is the
embedding's: float32 for the float32 mode, bfloat16 for the bfloat16 and q4 modes.

One module (~420 lines), as gpt-fast keeps its model.py: the args, the blocks (torch and native
paths side by side, each the other's reference), the step and the LM head read together.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from components.model import native
from components.model.kernels import KERNELS, PRODUCTS, KernelPlan, matmul
from components.model.linear import Dense, Int4, Int8Blocks, Int8Rows, Packed, quantize_q8
from components.model.tuner import plan_for
from pipeline.core import StepBatch, UserError

HEADS = ("dtype", "int8")  # model.head: the LM head in the model's precision, or (q4) also an 8-bit candidate


@dataclass
class LlamaArgs:
    vocab_size: int = 49152
    dim: int = 576
    n_layers: int = 30
    n_heads: int = 9
    n_kv_heads: int = 3
    head_dim: int = 64
    hidden_dim: int = 1536  # SwiGLU intermediate size
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF `rope_parameters`/`rope_scaling` (linear, llama3)
    tie_embeddings: bool = True
    qkv_bias: bool = False  # biases on q/k/v (transformers' attention_bias sets this and o_bias)
    o_bias: bool = False  # bias on the attention output projection
    max_seq_len: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"`n_heads` ({self.n_heads}) must be a multiple of `n_kv_heads` ({self.n_kv_heads})")

    @classmethod
    def from_hf_config(cls, cfg) -> "LlamaArgs":
        """Map a transformers LlamaConfig (or any config with its field names) to LlamaArgs."""
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        rope = dict(rope)
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
        eos = cfg.eos_token_id
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(
            vocab_size=cfg.vocab_size, dim=cfg.hidden_size, n_layers=cfg.num_hidden_layers,
            n_heads=cfg.num_attention_heads, n_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
            head_dim=head_dim, hidden_dim=cfg.intermediate_size, norm_eps=cfg.rms_norm_eps,
            rope_theta=float(theta), rope_scaling=scaling,
            tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=bool(getattr(cfg, "attention_bias", False)),
            o_bias=bool(getattr(cfg, "attention_bias", False)),
            max_seq_len=getattr(cfg, "max_position_embeddings", 8192),
            bos_token_id=cfg.bos_token_id, eos_token_ids=eos,
        )


def rope_inv_freq(args: LlamaArgs) -> torch.Tensor:
    """Inverse frequencies, with the scaling rules transformers applies for Llama checkpoints."""
    d = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = args.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "linear":
        inv = inv / sc["factor"]
    elif kind == "llama3":
        factor, lo, hi = sc["factor"], sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
        old = sc.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = torch.where(is_mid, mid, scaled)
    elif kind != "default":
        raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")
    return inv


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32: as transformers computes it (normalised, then scaled); bfloat16: normalised and
        # scaled in float32 inside one op, rounded once. Row-local: a row's bits never depend on
        # the other rows.
        if x.dtype == torch.float32:
            return self.weight * F.rms_norm(x, x.shape[-1:], eps=self.eps)
        return F.rms_norm(x, x.shape[-1:], self.weight, eps=self.eps)  # computed in float32, rounded once


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, T, h, hs); cos, sin: (B, T, 1, hs) from `Transformer.rope`, whose sin carries the sign of
    the rotation: x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1), transformers'
    half-split convention, as (x2, x1) * (-sin, sin) (the same bits: negation is exact)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Grouped-query attention for short query blocks (decode steps, trees), where the fused SDPA
    kernel's fixed cost dominates. q: (B, nh, T, hs); k, v: (B, nkv, S, hs); bias: additive
    (B or 1, 1, T, S) or None. Returns (B, nh, T, hs)."""
    B, nh, T, hs = q.shape
    nkv, S = k.shape[1], k.shape[2]
    g = nh // nkv
    qg = q.reshape(B, nkv, g * T, hs)  # heads of one kv group share its keys
    scores = (qg @ k.transpose(-1, -2)).mul_(1.0 / math.sqrt(hs))  # (B, nkv, g T, S)
    if bias is not None:
        scores = (scores.view(B, nkv, g, T, S) + bias.unsqueeze(1)).view(B, nkv, g * T, S)
    probs = torch.softmax(scores if scores.dtype == torch.float64 else scores.float(), dim=-1).to(v.dtype)
    return (probs @ v).view(B, nh, T, hs)


class Block(nn.Module):
    def __init__(self, args: LlamaArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.n_kv, self.hs = args.n_heads, args.n_kv_heads, args.head_dim
        qkv_out = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.wqkv = Dense(args.dim, qkv_out)
        self.bqkv = nn.Parameter(torch.zeros(qkv_out)) if args.qkv_bias else None
        self.wo = Dense(args.n_heads * args.head_dim, args.dim)
        self.bo = nn.Parameter(torch.zeros(args.dim)) if args.o_bias else None
        self.mlp_norm = RMSNorm(args.dim, args.norm_eps)
        self.w13 = Dense(args.dim, 2 * args.hidden_dim)  # gate | up
        self.w2 = Dense(args.hidden_dim, args.dim)
        self.plan = KernelPlan()  # x @ W everywhere until the model is optimized for decoding

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend) -> torch.Tensor:
        """x: (B, T, dim); attend(layer, q, k, v) -> (B, T, nh * hs), with q: (B, T, nh, hs) and
        k, v: (B, T, nkv, hs) after RoPE: the cache-free or the cached attention of the caller."""
        B, T, _ = x.shape
        nq, nkv, hs = self.n_heads, self.n_kv, self.hs
        rows, plan = x.shape[0] * x.shape[1], self.plan
        qkv = self.wqkv(self.attn_norm(x), plan.kernel("wqkv", rows))  # (B, T, (nh + 2 nkv) hs)
        if self.bqkv is not None:
            qkv = qkv + self.bqkv
        qk = apply_rope(qkv[..., :(nq + nkv) * hs].view(B, T, nq + nkv, hs), cos, sin)  # (B, T, nh + nkv, hs)
        v = qkv[..., (nq + nkv) * hs:].view(B, T, nkv, hs)
        y = attend(self.layer_id, qk[:, :, :nq], qk[:, :, nq:], v)  # (B, T, nh hs)
        o = self.wo(y, plan.kernel("wo", rows))
        x = x + (o if self.bo is None else o + self.bo)
        gate, up = self.w13(self.mlp_norm(x), plan.kernel("w13", rows)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up, plan.kernel("w2", rows))

    def native_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: StepBatch, kv, ops) -> torch.Tensor:
        """A cached step through the fused kernels (components/model/native.py): x (R, dim) bfloat16,
        cos / sin (R, hs / 2) float32. One native call on the paged KV (`layer_paged`), else three native
        calls and the KV manager's write."""
        R, plan = x.shape[0], self.plan
        eps = self.attn_norm.eps
        in_place = batch.plan.in_place
        if in_place is not None and getattr(kv, "update_in_place", None) is not None and hasattr(ops, "layer_paged"):
            # the paged KV: the whole layer in one native call, the same functions in the same order
            kp, vp = kv.pools(self.layer_id)  # (n_blocks, block_size, nkv, hs) x 2
            return ops.layer_paged(x, self.attn_norm.weight, eps, *self.wqkv.spec(plan.kernel("wqkv", R)), self.bqkv,
                                   cos, sin, self.n_heads, self.n_kv, self.hs, kp, vp, *in_place, batch.row_index,
                                   batch.width, batch.span, batch.bias, 1.0 / math.sqrt(self.hs), batch.causal,
                                   *self.wo.spec(plan.kernel("wo", R)), self.bo, self.mlp_norm.weight,
                                   *self.w13.spec(plan.kernel("w13", R)), *self.w2.spec(plan.kernel("w2", R)))
        q, k, v = ops.pre_attention(x, self.attn_norm.weight, eps, *self.wqkv.spec(plan.kernel("wqkv", R)), self.bqkv,
                                    cos, sin, self.n_heads, self.n_kv, self.hs)  # (R, nh, hs), (R, nkv, hs) x 2
        y = self.native_attention(q, k, v, batch, kv, ops)  # (R, nh hs)
        return ops.post_attention(x, y, *self.wo.spec(plan.kernel("wo", R)), self.bo, self.mlp_norm.weight, eps,
                                  *self.w13.spec(plan.kernel("w13", R)), *self.w2.spec(plan.kernel("w2", R)))

    def native_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: StepBatch, kv, ops) -> torch.Tensor:
        """The step's attention through the fused kernels, after writing k, v into `kv`: q (R, nh, hs),
        k, v (R, nkv, hs) bfloat16 -> (R, nh hs). A KV manager whose pool the kernel reads where it
        lies (`update_in_place`: the paged KV) hands over its pools and block table, and the packed
        rows go in as they are: no gathered copy of the cache, no padded rows. Else its (B, nkv, S,
        hs) keys and values, the rows padded to (B, T) and back. A row's bits are the same either way."""
        scale = 1.0 / math.sqrt(self.hs)
        in_place = getattr(kv, "update_in_place", None)
        if in_place is not None:
            kp, vp, table = in_place(self.layer_id, k, v, batch.plan)  # (n_blocks, block_size, nkv, hs) x 2, (B, nb)
            y = ops.paged_attention(q, kp, vp, table, batch.row_index, batch.width, batch.span, batch.bias, scale,
                                    batch.causal)  # (R, nh, hs)
            return y.view(q.shape[0], -1)
        K, V = kv.update(self.layer_id, k, v, batch.plan)  # (B, nkv, S, hs): cached + these rows
        B, T = len(batch.seqs), batch.width
        if B == 1:
            qb = q[None]  # (1, T, nh, hs)
        else:  # rows -> the padded (B, T) layout
            qb = q.new_zeros(B * T, self.n_heads, self.hs)
            qb[batch.row_index] = q
            qb = qb.view(B, T, self.n_heads, self.hs)
        y = ops.attention(qb, K, V, batch.bias, scale, batch.causal).view(B * T, -1)
        return y if B == 1 else y[batch.row_index]  # (R, nh hs)

    MATRICES = ("wqkv", "wo", "w13", "w2")

    def matrices(self) -> list[nn.Module]:
        return [getattr(self, n) for n in self.MATRICES]


def cached_attention(batch: StepBatch, kv, adt: torch.dtype, gqa: bool):
    """The `attend(layer, q, k, v)` of a cached step (`Block.forward`): the rows' keys/values go into
    their sequences' caches in `kv`, where the step's plan (`batch.plan`) says, and each row attends,
    in dtype `adt`, to its sequence's cached slots plus what the step's tree mask allows among its rows."""
    B, T = len(batch.seqs), batch.width

    def attend(layer, q, k, v):  # q: (1, R, nh, hs); k, v: (1, R, nkv, hs)
        xdt = q.dtype
        K, V = kv.update(layer, k[0].to(adt), v[0].to(adt), batch.plan)  # (B, nkv, S, hs): cached + these rows
        q = q.to(adt)
        if B == 1:
            qb = q.transpose(1, 2)  # (1, nh, R, hs)
        else:  # rows -> the padded (B, T) layout
            qb = q.new_zeros(B * T, *q.shape[2:])
            qb[batch.row_index] = q[0]
            qb = qb.view(B, T, *q.shape[2:]).transpose(1, 2)  # (B, nh, T, hs)
        if batch.causal:  # a prompt on an empty cache: the fused causal kernel
            y = F.scaled_dot_product_attention(qb, K, V, is_causal=True, enable_gqa=gqa)
        elif T > 64:
            y = F.scaled_dot_product_attention(qb, K, V, attn_mask=batch.bias, enable_gqa=gqa)
        else:
            y = attention(qb, K, V, batch.bias)
        y = y.transpose(1, 2).reshape(B * T, -1).to(xdt)  # (B T, nh hs)
        return (y if B == 1 else y[batch.row_index])[None]  # (1, R, nh hs)
    return attend


class Transformer(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        # [in, out] copy of the output projection; tied models keep it equal to the embedding
        self.lm_head = nn.Parameter(torch.empty(args.dim, args.vocab_size))
        self.register_buffer("inv_freq", rope_inv_freq(args).float(), persistent=False)
        self.head_q8: nn.Module | None = None  # q4 mode: the LM head in 8 bits where measured faster
        self.activations = "bfloat16"  # what the 4-bit matrices multiply: bfloat16 (q4) or int8 (w4a8)
        self.head_blocks: tuple[torch.Tensor, torch.Tensor] | None = None  # w4a8: the head's Q8_0 codes, d as shipped
        self.head_w8: nn.Module | None = None  # w4a8 with the fused kernels: the head's integer product (Int8Blocks)
        self.native = None  # the fused kernels' module (`use_native`), None: the pure-torch path
        self.head_packed = Packed()  # the native product's layout of `head_t`
        self.taps: tuple[int, ...] = ()  # layers whose input states a full forward keeps (`tap`)
        self.tapped: torch.Tensor | None = None  # (..., len(taps) dim): those states, of the last full forward

    @property
    def dtype(self) -> torch.dtype:
        """The activation (and KV cache) dtype."""
        return self.tok_embeddings.weight.dtype

    @property
    def attn_dtype(self) -> torch.dtype:
        """The KV cache's and the cached attention's dtype. float32 models attend in float32. With
        the native kernels, bfloat16 and q4 keep the cache in bfloat16 (the keys and values are
        bfloat16 products: stored exactly) and attend in float32 over each row's allowed slots in
        slot order, so a masked sibling or a padding row changes no bit. On the pure-torch path they
        attend in float64: attention sums over a length that differs between a plain step, a tree
        (masked siblings between a row's ancestors) and a padded batch, and no torch kernel keeps a
        row's bits across those; in float64 the differences (~1e-16 relative) are far below what
        rounding the result to bfloat16 can reveal (measured: scripts/kernel_invariance.py)."""
        if self.dtype == torch.float32:
            return torch.float32
        return torch.bfloat16 if self.native is not None else torch.float64

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    @property
    def precision(self) -> str:
        """float32, bfloat16, q4 (4-bit layer matrices, bfloat16 activations) or w4a8 (4-bit layer
        matrices and the 8-bit head times int8 activations)."""
        if any(not isinstance(m, Dense) for blk in self.layers for m in blk.matrices()):
            return "w4a8" if self.activations == "int8" else "q4"
        return str(self.dtype).removeprefix("torch.")

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions: (B, T) -> cos, sin: (B, T, 1, hs)."""
        freqs = positions[..., None].float() * self.inv_freq  # (B, T, hs/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None]
        sin = emb.sin().to(dtype)
        half = sin.shape[-1] // 2
        return emb.cos().to(dtype), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None = None,
                layers: list[int] | None = None) -> torch.Tensor:
        """Cache-free forward (references, tests). tokens, positions: (B, T) long; mask: bool
        (B or 1, 1, T, T), True = may attend (None = causal). Returns hidden (B, T, dim) after the
        final norm."""
        x = self.tok_embeddings(tokens)  # (B, T, dim)
        cos, sin = self.rope(positions, x.dtype)

        def attend(layer, q, k, v):  # (B, T, h, hs) each
            B, T = q.shape[:2]
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               attn_mask=mask, is_causal=mask is None and T > 1,
                                               enable_gqa=self.args.n_kv_heads != self.args.n_heads)
            return y.transpose(1, 2).reshape(B, T, -1)

        return self._blocks(x, layers, lambda i, x: self.layers[i](x, cos, sin, attend))

    def tap(self, layers) -> None:
        """Keep, on every full forward (all blocks: not a layer-skipping draft's), the states entering
        the given blocks in `tapped`, concatenated in this order (EAGLE-3's feature fusion: Hugging
        Face's hidden_states[i], i in 0..n_layers, n_layers being the last block's output before the
        final norm). An empty tuple keeps none: the plain forward's cost."""
        layers = tuple(int(i) for i in layers)
        if any(not 0 <= i <= self.args.n_layers for i in layers):
            raise ValueError(f"tapped layers must lie in 0..{self.args.n_layers} (the input of each block, "
                             f"then the last block's output), got {list(layers)}")
        self.taps, self.tapped = layers, None

    def _blocks(self, x: torch.Tensor, layers: list[int] | None, block) -> torch.Tensor:
        """x through block(i, x) for the layers run, then the final norm; a full forward keeps the
        tapped layers' inputs (`tap`) on the way."""
        if not self.taps or layers is not None:
            for i in (range(len(self.layers)) if layers is None else layers):
                x = block(i, x)
            return self.norm(x)
        kept = {}
        for i in range(len(self.layers)):
            if i in self.taps:
                kept[i] = x
            x = block(i, x)
        kept[len(self.layers)] = x
        self.tapped = torch.cat([kept[i] for i in self.taps], dim=-1)
        return self.norm(x)

    def step(self, batch: StepBatch, kv, layers: list[int] | None = None) -> torch.Tensor:
        """One forward over the packed rows of several sequences (`pipeline.core.StepBatch`), through
        their caches in `kv`, written where the step's plan says (`batch.plan`: the caller begins and
        ends the step, `pipeline.core.forward_step`): each row sees its own sequence's cached slots
        and, among the step's rows, what its tree mask allows. `layers` runs a subset of the blocks
        (layer-skipping drafts). Returns hidden (R, dim) after the final norm."""
        if batch.plan is None:
            raise ValueError("the step has no KV plan: run it through pipeline.core.forward_step (kv.begin_step ... kv.end_step)")
        batch = batch.to(self.device)
        if self.native is not None:
            return self._native_step(batch, kv, layers)
        x = self.tok_embeddings(batch.tokens)[None]  # (1, R, dim): every row of every sequence
        cos, sin = self.rope(batch.positions[None], x.dtype)
        attend = cached_attention(batch, kv, self.attn_dtype, self.args.n_kv_heads != self.args.n_heads)
        h = self._blocks(x, layers, lambda i, x: self.layers[i](x, cos, sin, attend))[0]
        if self.taps and layers is None:
            self.tapped = self.tapped[0]  # (R, len(taps) dim), as the rows
        return h

    def _native_step(self, batch: StepBatch, kv, layers: list[int] | None) -> torch.Tensor:
        x = self.tok_embeddings(batch.tokens)  # (R, dim)
        freqs = batch.positions[:, None].float() * self.inv_freq  # (R, hs / 2)
        cos, sin = freqs.cos(), freqs.sin()
        return self._blocks(x, layers, lambda i, x: self.layers[i].native_forward(x, cos, sin, batch, kv, self.native))

    @property
    def plan(self) -> KernelPlan:
        """The kernel plan every layer shares (x @ W everywhere until optimized for decoding)."""
        return self.layers[0].plan if self.layers else KernelPlan()

    @property
    def head_t(self) -> torch.Tensor | None:
        """The LM head as [vocab, dim] (tied models: the embedding), None before optimization."""
        return self.tok_embeddings.weight if self.args.tie_embeddings else getattr(self, "lm_head_t", None)

    def native_head(self, rows: int) -> bool:
        """Whether `logits` takes the native bfloat16 product for this many rows."""
        wt = self.head_t
        int8 = self.plan.kernel("head", rows) == "int8" and self.head_q8 is not None
        if self.head_w8 is not None:
            return True
        return self.native is not None and not int8 and wt is not None and wt.shape[0] % 4 == 0

    def torch_products(self) -> list[str]:
        """The products (kernels.PRODUCTS) computed by torch's kernels, whose batch invariance the
        plan's probe vouches for; the native path computes the others with its own kernels,
        invariant by construction (tests/test_native.py)."""
        if self.native is None:
            return list(PRODUCTS)
        out = [n for n in Block.MATRICES if self.layers and not getattr(getattr(self.layers[0], n), "native_ok", False)]
        return out if self.native_head(1) else [*out, "head"]

    def use_native(self, enable: bool = True) -> bool:
        """Run cached steps through the fused kernels where they are built (bfloat16 and q4 on CPU;
        float32 stays on torch's path, equal to transformers). Returns whether they are in use. Set
        before KV managers are made: it decides `attn_dtype`."""
        ok = enable and self.dtype == torch.bfloat16 and self.device.type == "cpu"
        self.native = native.load() if ok else None
        if self.activations == "int8" and (self.native is None or not hasattr(self.native, "q4i8_mm")):
            why = "model.native=false" if not enable else native.why() or "no integer products in this build"
            raise UserError(f"model.dtype=w4a8 runs on the fused native kernels ({why}): build them with "
                            "`make setup` and keep model.native=true, or use model.dtype=q4")
        for blk in self.layers:
            for m in blk.matrices():
                if isinstance(m, Int4) and not m.use_native(self.native) and m.activations == "int8":
                    raise UserError(f"model.dtype=w4a8 needs layer matrices with outputs a multiple of 16 and groups "
                                    f"of 32 inputs, got {m.out_features} x {m.in_features}: use model.dtype=q4")
        self.head_w8 = None
        if self.activations == "int8" and self.head_t is not None and Int8Blocks.fits(self.head_t):
            codes, d = self.head_blocks if self.head_blocks is not None else quantize_q8(self.head_t.float())
            self.head_w8 = Int8Blocks(codes, d, self.native)
        return self.native is not None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (..., dim) -> fp32 logits (..., vocab), with the measured kernel for this many rows
        (tied models also hold the head as [vocab, dim]: the embedding)."""
        rows = hidden.numel() // hidden.shape[-1]
        wt, plan = self.head_t, self.plan
        kernel = plan.kernel("head", rows)
        if self.head_w8 is not None:  # w4a8: the head's Q8_0 blocks times int8 rows, float32 logits
            return self.head_w8(hidden)
        if kernel == "int8" and self.head_q8 is not None:
            return self.head_q8(hidden).float()
        if self.native_head(rows):  # float32 logits, never rounded
            h = hidden.reshape(-1, hidden.shape[-1])
            return self.native.bf16_mm(h if h.dtype == torch.bfloat16 else h.bfloat16(), self.head_packed(wt), False).view(
                *hidden.shape[:-1], wt.shape[0])
        return matmul(hidden, self.lm_head, wt, "xw" if kernel == "int8" else kernel, plan.min_rows["head"]).float()

    def optimize_for_decoding(self, cache=None, head: str = "dtype", kernels: str = "auto"):
        """Trade memory for multi-row speed: transposed weight copies, and the fastest kernel per row
        count measured on this machine (cached under `cache`, see components/model/tuner.py).
        head, kernels: `model.head` and `model.kernels` (see `decoding_choices`)."""
        head, kernels = decoding_choices(head, kernels)
        for blk in self.layers:
            for m in blk.matrices():
                m.make_transposed()
        if not self.args.tie_embeddings:
            self.lm_head_t = self.lm_head.detach().t().contiguous()
        if self.precision == "q4" and self.device.type == "cpu" and head == "int8":
            # opt-in: an 8-bit head (kept if measured faster) re-quantizes the Q8_0 head per row and
            # moves greedy further from float32 (README, "Agreement with float32")
            self.head_q8 = Int8Rows(self.lm_head.detach().t())
        plan = plan_for(self, cache, kernels)
        if "int8" not in plan.kernels.get("head", {}).values():
            self.head_q8 = None  # not chosen here: no memory held for it
        elif self.head_q8 is not None:
            self.head_q8.min_rows = max(plan.min_rows["head"], 1)
        for blk in self.layers:
            blk.plan = plan
            for name in blk.MATRICES:
                getattr(blk, name).min_rows = max(plan.min_rows[name], 1)
        return self

    @torch.no_grad()
    def tie_lm_head(self):
        self.lm_head.copy_(self.tok_embeddings.weight.t())

    def fingerprint(self) -> str:
        """A short id of the weights, to refuse heads trained on another backbone."""
        return getattr(self, "source_fingerprint", None) or fingerprint_of(
            self.args, self.layers[0].wqkv.dense(), self.tok_embeddings.weight.detach())


def decoding_choices(head: str = "dtype", kernels: str = "auto") -> tuple[str, str]:
    """`model.head` (one of HEADS: `int8` lets the q4 mode's LM head run in 8 bits where the
    machine measures it faster) and `model.kernels` (`auto`: the kernel per row count measured on
    this machine; a name of kernels.KERNELS: that kernel everywhere, not probed), checked. The
    environment variables LLM_DECODE_HEAD and LLM_DECODE_KERNELS, when set, override them."""
    head = os.environ.get("LLM_DECODE_HEAD") or head
    kernels = os.environ.get("LLM_DECODE_KERNELS") or kernels
    if head not in HEADS:
        raise ValueError(f"model.head (or LLM_DECODE_HEAD) must be one of {', '.join(HEADS)}, got {head!r}")
    if kernels != "auto" and kernels not in KERNELS:
        raise ValueError(f"model.kernels (or LLM_DECODE_KERNELS) must be auto or one of {', '.join(KERNELS)}, "
                         f"got {kernels!r}")
    return head, kernels


def fingerprint_of(a: LlamaArgs, wqkv: torch.Tensor, embedding: torch.Tensor) -> str:
    """wqkv: layer 0's fused q/k/v [in, out]; embedding: (vocab, dim); both as loaded (float32)."""
    probe = float(wqkv[:8, :8].float().sum()) + float(embedding[:4, :4].float().sum())
    return f"llama-{a.n_layers}x{a.dim}-v{a.vocab_size}-{probe:.6e}"
