"""Allowed sets of tokens, packed as XGrammar and vLLM pack them: (W,) int32 with W = ceil(V / 32),
bit v % 32 of word v // 32 set when token v may come next. The one home of the packing helpers the
constraints, the target stage, the constraint walk and beam search share.
"""
from __future__ import annotations

import sys

import numpy as np
import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)


def words(vocab_size: int) -> int:
    """W: the int32 words of a packed set over `vocab_size` tokens."""
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


def allows(bits: torch.Tensor, tokens: int | torch.Tensor) -> bool | torch.Tensor:
    """Whether packed sets hold tokens: bits (W,) and one token id -> bool; bits (R, W) and token
    ids (R, k) -> (R, k) bool, whether row r's set holds tokens[r, j]."""
    if not torch.is_tensor(tokens) or tokens.dim() == 0:
        t = int(tokens)
        return bool((int(bits[t >> 5]) >> (t & 31)) & 1)
    bits = bits.to(tokens.device)
    return ((bits.gather(-1, tokens >> 5) >> (tokens & 31)) & 1).bool()


def tokens_of(bits: torch.Tensor, vocab_size: int) -> list[int]:
    """The token ids a packed set (W,) holds, ascending."""
    return unpack(bits, vocab_size).nonzero().flatten().tolist()
