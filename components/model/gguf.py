"""Reading a Llama GGUF file as shipped: its config, its tensors in our layout, its quantized blocks.

Block formats (ggml's, 32 weights a block, each block's bytes contiguous along a matrix row):
- Q4_1: f16 scale d, f16 minimum m, 16 bytes of 4-bit codes q (low nibbles: weights 0-15, high
  nibbles: 16-31); w = q * d + m.
- Q4_0: f16 d, 16 bytes of codes; w = (q - 8) * d.
- Q8_0: f16 d, 32 int8 codes; w = q * d.
`dequantize` computes exactly what gguf-py's reader (and so transformers' GGUF loader) computes:
the f16 fields widened to float32, then the same float32 operations in the same order.

llama.cpp's converter stores the q and k projections with their rows permuted for its interleaved
RoPE; `row_order` undoes that (a row permutation, so it applies to codes and scales alike).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf import dequantize as gguf_dequantize

from components.model.llama import LlamaArgs
from pipeline.core import UserError

BLOCK = 32
QUANTIZED = ("Q4_0", "Q4_1", "Q8_0")
PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass
class RawTensor:
    """One GGUF tensor: its ggml type name, its torch shape (out, in) and its bytes per row."""
    kind: str
    shape: tuple[int, ...]
    data: np.ndarray  # (rows, bytes per row) uint8 for quantized types, the values for plain ones


@dataclass
class Q4Blocks:
    """A 4-bit matrix as blocks: codes (out, in) uint8 in 0..15, scale and zero (out, in / 32) float32,
    with w = (q - 8) * scale + zero (torch's int4 groupwise convention; Q4_1: scale = d, zero = m + 8d;
    Q4_0: scale = d, zero = 0)."""
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        g = self.codes.shape[1] // self.scale.shape[1]
        q = self.codes.float() - 8
        return (q * self.scale.repeat_interleave(g, 1) + self.zero.repeat_interleave(g, 1))

    def rows(self, order: torch.Tensor) -> "Q4Blocks":
        return Q4Blocks(self.codes[order], self.scale[order], self.zero[order])


def _f16(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x).view(np.float16)).float()


def _blocks(t: RawTensor, block_bytes: int) -> np.ndarray:
    rows, k = t.shape[0], int(np.prod(t.shape[1:]))
    return t.data.reshape(rows, k // BLOCK, block_bytes)  # (rows, blocks, bytes)


def _nibbles(qs: np.ndarray) -> torch.Tensor:
    """(rows, blocks, 16) bytes -> (rows, blocks * 32) codes: low nibbles first, then high ones."""
    q = torch.from_numpy(np.ascontiguousarray(qs))
    return torch.cat((q & 0x0F, q >> 4), dim=-1).reshape(q.shape[0], -1)


def dequantize(t: RawTensor) -> torch.Tensor:
    """float32 weights (out, in), bit for bit what gguf-py's `dequantize` returns."""
    if t.kind in PLAIN:
        data = torch.from_numpy(np.array(t.data))
        if data.dtype == torch.uint8:  # bfloat16 has no numpy dtype: its raw bytes
            data = data.view(PLAIN[t.kind])
        return data.to(PLAIN[t.kind]).float().reshape(t.shape)
    if t.kind == "Q8_0":
        b = _blocks(t, 2 + BLOCK)
        d = _f16(b[..., :2])  # (rows, blocks, 1)
        q = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8)).float()
        return (q * d).reshape(t.shape)
    if t.kind == "Q4_1":
        b = _blocks(t, 4 + BLOCK // 2)
        d, m = _f16(b[..., :2]), _f16(b[..., 2:4])
        q = _nibbles(b[..., 4:]).float().view(*d.shape[:2], BLOCK)
        return ((d * q) + m).reshape(t.shape)
    if t.kind == "Q4_0":
        b = _blocks(t, 2 + BLOCK // 2)
        d = _f16(b[..., :2])
        q = _nibbles(b[..., 2:]).float().view(*d.shape[:2], BLOCK)
        return ((q - 8) * d).reshape(t.shape)
    try:  # the other ggml types (K-quants, ...): gguf-py's own de-quantizer
        return torch.from_numpy(gguf_dequantize(t.data, GGMLQuantizationType[t.kind]).copy()).float().reshape(t.shape)
    except (KeyError, NotImplementedError, ValueError) as e:
        raise UserError(f"GGUF tensor type {t.kind} is not supported here ({e}): convert the file with llama.cpp's "
                        "`llama-quantize` to Q4_1, Q4_0, Q8_0 or F16") from None


def q4_blocks(t: RawTensor) -> Q4Blocks | None:
    """The 4-bit blocks of a Q4_1 / Q4_0 tensor, exactly (None for other types)."""
    if t.kind == "Q4_1":
        b = _blocks(t, 4 + BLOCK // 2)
        d, m = _f16(b[:, :, 0:2])[..., 0], _f16(b[:, :, 2:4])[..., 0]  # (rows, blocks)
        return Q4Blocks(_nibbles(b[..., 4:]), d, m + 8 * d)
    if t.kind == "Q4_0":
        b = _blocks(t, 2 + BLOCK // 2)
        d = _f16(b[:, :, 0:2])[..., 0]
        return Q4Blocks(_nibbles(b[..., 2:]), d, torch.zeros_like(d))
    return None


def q8_blocks(t: RawTensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A Q8_0 tensor's blocks exactly: codes (out, in) int8 and d (out, in / 32) float32, w = d q (None
    for other types)."""
    if t.kind != "Q8_0":
        return None
    b = _blocks(t, 2 + BLOCK)
    d = _f16(b[:, :, 0:2])[..., 0]  # (rows, blocks)
    q = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8)).reshape(t.shape[0], -1)
    return q, d


def row_order(rows: int, n_head: int) -> torch.Tensor:
    """The permutation that undoes llama.cpp's q/k row interleaving (transformers' reverse_permute)."""
    half = rows // n_head // 2
    return torch.arange(rows).view(n_head, half, 2).transpose(1, 2).reshape(-1)


class GGUFFile:
    """A Llama GGUF opened with gguf-py's memory-mapped reader (nothing is de-quantized until asked)."""

    def __init__(self, path: Path):
        self.path = path
        self.reader = GGUFReader(path)
        self.fields = self.reader.fields
        arch = self.value("general.architecture")
        if arch != "llama":
            raise UserError(f"{path.name}: architecture {arch!r} is not supported (Llama-family GGUF files only)")
        self.tensors = {t.name: RawTensor(t.tensor_type.name, tuple(int(s) for s in reversed(t.shape)), t.data)
                        for t in self.reader.tensors}

    def value(self, key: str, default=None):
        f = self.fields.get(key)
        if f is None:
            return default
        v = f.contents()
        return v

    def args(self) -> LlamaArgs:
        a = "llama."
        n_heads = int(self.value(a + "attention.head_count"))
        dim = int(self.value(a + "embedding_length"))
        kind = self.value(a + "rope.scaling.type")
        scaling = None
        if kind not in (None, "none"):
            if kind != "linear":
                raise UserError(f"{self.path.name}: RoPE scaling {kind!r} is not supported (none, linear)")
            scaling = {"rope_type": "linear", "factor": float(self.value(a + "rope.scaling.factor"))}
        if "rope_freqs.weight" in self.tensors:
            raise UserError(f"{self.path.name}: per-frequency RoPE factors (rope_freqs, Llama 3.1+ scaling) are not "
                            "supported: load the model's Hugging Face folder instead (model.path=<folder>)")
        eos = self.value("tokenizer.ggml.eos_token_id")
        bos = self.value("tokenizer.ggml.bos_token_id")
        vocab = self.value(a + "vocab_size") or self.tensors["token_embd.weight"].shape[0]
        return LlamaArgs(
            vocab_size=int(vocab), dim=dim, n_layers=int(self.value(a + "block_count")), n_heads=n_heads,
            n_kv_heads=int(self.value(a + "attention.head_count_kv", n_heads)),
            head_dim=int(self.value(a + "rope.dimension_count", dim // n_heads)),
            hidden_dim=int(self.value(a + "feed_forward_length")),
            norm_eps=float(self.value(a + "attention.layer_norm_rms_epsilon")),
            rope_theta=float(self.value(a + "rope.freq_base", 10000.0)), rope_scaling=scaling,
            tie_embeddings="output.weight" not in self.tensors, qkv_bias="blk.0.attn_q.bias" in self.tensors,
            o_bias="blk.0.attn_output.bias" in self.tensors,
            max_seq_len=int(self.value(a + "context_length", 8192)),
            bos_token_id=None if bos is None else int(bos), eos_token_ids=[] if eos is None else [int(eos)])

    def matrices(self, args: LlamaArgs, i: int) -> dict[str, list[tuple[RawTensor, torch.Tensor | None]]]:
        """Layer i's matrices in our fused order, each part with the row order to apply (or None)."""
        p = f"blk.{i}."
        t = self.tensors
        return {
            "wqkv": [(t[p + "attn_q.weight"], row_order(t[p + "attn_q.weight"].shape[0], args.n_heads)),
                     (t[p + "attn_k.weight"], row_order(t[p + "attn_k.weight"].shape[0], args.n_kv_heads)),
                     (t[p + "attn_v.weight"], None)],
            "wo": [(t[p + "attn_output.weight"], None)],
            "w13": [(t[p + "ffn_gate.weight"], None), (t[p + "ffn_up.weight"], None)],
            "w2": [(t[p + "ffn_down.weight"], None)],
        }

    def raw(self, name: str) -> RawTensor:
        return self.tensors[name]

    def vector(self, name: str) -> torch.Tensor:
        return dequantize(self.tensors[name])


def dense(parts: list[tuple[RawTensor, torch.Tensor | None]]) -> torch.Tensor:
    """float32 (out, in) of the parts stacked along the rows."""
    mats = []
    for t, order in parts:
        w = dequantize(t)
        mats.append(w if order is None else w[order])
    return torch.cat(mats)


def blocks(parts: list[tuple[RawTensor, torch.Tensor | None]]) -> Q4Blocks | None:
    """The parts' 4-bit blocks stacked along the rows, or None when one part is not 4-bit."""
    got = []
    for t, order in parts:
        b = q4_blocks(t)
        if b is None:
            return None
        got.append(b if order is None else b.rows(order))
    return Q4Blocks(*(torch.cat([getattr(b, f) for b in got]) for f in ("codes", "scale", "zero")))
