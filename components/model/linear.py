"""The backbone's weight matrices, one class per storage: `Dense` (float32 / bfloat16, [in, out] with an
optional [out, in] copy for the multi-row kernels of components/model/kernels.py), `Int4` (4-bit
codes in groups of 32 with a scale and a zero per group, bfloat16 activations: the native 4-bit
product where the fused kernels are built, else torch's weight-only int4 kernels) and `Int8Rows` (8-bit codes with one scale per output row: the q4 mode's LM head with
`model.head=int8`, where the machine measures it faster than bfloat16).

In the bfloat16 and q4 modes a row must get the same bits whatever rows are computed with it, so
that a tree's rows equal the plain steps they replace. Each module's `min_rows` (probed per
machine, components/model/tuner.py) pads its input with zero rows to the row count from which
its kernel is invariant: 1 for torch's int4 kernel everywhere seen, 2 for oneDNN's bfloat16 product
on AVX-512 (its one-row gemv differs for a long inner dimension), 32 for it on AMX. The native
products (csrc/decode_ops.cpp `bf16_mm`, `q4_mm`) are invariant by construction; they read bfloat16
matrices in a packed layout (`native_bf16_layout`), made from the [out, in] copy on first use.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from components.model.kernels import at_least, matmul

GROUP = 32


def native_bf16_layout(wt: torch.Tensor) -> torch.Tensor:
    """A bfloat16 [out, in] matrix -> the native product's packed layout (csrc/decode_ops.cpp
    `bf16_mm`): (out / 16, in / 32, 16, 32), block b's chunk g holding its 16 outputs' inputs
    32 g .. 32 g + 31, so the product reads it in memory order (and AMX loads each chunk as one
    tile). A shape that does not divide into blocks is returned as it is ([out, in] is the other
    layout `bf16_mm` takes)."""
    n, k = wt.shape
    if n % 16 or k % 32:
        return wt
    return wt.reshape(n // 16, 16, k // 32, 32).transpose(1, 2).contiguous()


class Packed:
    """The packed copy of a matrix for the native product, made on first use and again whenever the
    matrix is replaced or changed in place."""

    def __init__(self):
        self.key, self.value = None, None

    def __call__(self, wt: torch.Tensor) -> torch.Tensor:
        try:
            version = wt._version
        except RuntimeError:  # an inference tensor: no version counter
            version = None
        key = (wt.data_ptr(), tuple(wt.shape), version)
        if key != self.key:
            self.value, self.key = native_bf16_layout(wt), key
        return self.value


class Dense(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(in_features, out_features))  # [in, out]
        self.weight_t: torch.Tensor | None = None
        self.packed = Packed()  # the native product's layout of weight_t
        self.min_rows = 1  # set by Transformer.optimize_for_decoding from the machine's probe

    def make_transposed(self) -> None:
        """Keep W^T beside W: the kernels that read it (`linear`, `padded_t`) then need no copy."""
        self.weight_t = self.weight.detach().t().contiguous()

    def forward(self, x: torch.Tensor, kernel: str = "xw") -> torch.Tensor:
        return matmul(x, self.weight, self.weight_t, kernel, self.min_rows)

    def spec(self, kernel: str) -> tuple[list[torch.Tensor], list[int]]:
        """This product for the native kernels (csrc/decode_ops.cpp `Product`): tensors, (kind, group,
        min_rows). bfloat16 with its [out, in] copy: the native product (`bf16_mm` on the packed copy,
        invariant at any row count by construction); otherwise the torch kernel `forward` takes for
        this kernel name."""
        if self.native_ok:
            return [self.packed(self.weight_t)], [5, 0, 1]
        if kernel == "linear" and self.weight_t is not None:
            return [self.weight_t], [1, 0, self.min_rows]
        return [self.weight], [0, 0, self.min_rows]

    @property
    def native_ok(self) -> bool:
        """Whether the native path computes this product with its own kernel."""
        wt = self.weight_t
        return wt is not None and wt.dtype == torch.bfloat16 and wt.is_contiguous() and wt.shape[0] % 4 == 0

    def dense(self) -> torch.Tensor:
        return self.weight.detach()


def quantize_q4(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float (out, in) matrix -> codes (out, in) in 0..15, scale and zero (out, in / group) float32,
    w ~ (q - 8) * scale + zero: min/max per group, as ggml's Q4_1 quantizes (for checkpoints that do
    not ship 4-bit blocks)."""
    out, k = w.shape
    g = w.float().view(out, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / 15
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    codes = ((g - lo[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8).view(out, k)
    return codes, scale, lo + 8 * scale


def native_q4_layout(codes: torch.Tensor, scale_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes (out, in) 0..15 and scale_zeros (in / 32, out, 2) bfloat16 -> the native 4-bit product's
    layout (csrc/decode_ops.cpp `q4_mm`): codes (out / 16, in / 32, 256) uint8, outputs 4u .. 4u + 3 of
    each block of 16 in one little-endian 16-bit word per input, a nibble each; sz (out / 16, in / 32,
    32) bfloat16, each output's (scale, zero) for the chunk."""
    out, k = codes.shape
    c = codes.to(torch.int32).view(out // 16, 4, 4, k // 32, 32)
    words = c[:, :, 0] | c[:, :, 1] << 4 | c[:, :, 2] << 8 | c[:, :, 3] << 12  # (out / 16, 4, in / 32, 32)
    packed = torch.stack((words & 0xFF, words >> 8), dim=-1).to(torch.uint8)
    packed = packed.transpose(1, 2).reshape(out // 16, k // 32, 256).contiguous()
    sz = scale_zeros.transpose(0, 1).reshape(out // 16, 16, k // 32, 2).transpose(1, 2)
    return packed, sz.reshape(out // 16, k // 32, 32).contiguous()


class Int4(nn.Module):
    """w = (q - 8) * scale + zero, groups of `group` along the input dimension. The kernels keep scale
    and zero in bfloat16 (torch's only fast activation dtype on CPU): the one place a Q4_1 block's d
    and m + 8d are rounded. Activations go in and come out in bfloat16.

    With the fused kernels (`use_native`), the product is the native one (`q4_mm`): each weight is
    decoded to bfloat16 once per step for all its rows (AMX tiles where the CPU has them), so rows
    cost little, and a row's bits never depend on the others. torch's kernel multiplies by the
    weights in float32 and decodes them again for every 4 rows; the two differ in the last bits."""

    dtype = torch.bfloat16

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, device=None):
        super().__init__()
        out, k = codes.shape
        self.in_features, self.out_features, self.group = k, out, k // scale.shape[1]
        device = torch.device(device or "cpu")
        sz = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous()  # (in / group, out, 2)
        self.register_buffer("scale_zeros", sz.to(device=device, dtype=self.dtype))
        if device.type == "cpu":
            packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        else:  # CUDA's tiled format: two codes a byte, even index in the high nibble
            pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8).to(device)
            tiles = next(t for t in (8, 4, 2) if k % (16 * t) == 0)  # K must divide into 16-wide tiles
            packed = torch._convert_weight_to_int4pack(pairs, tiles)
        self.register_buffer("packed", packed)
        self.min_rows = 1
        self.native = None  # the fused kernels' module where `use_native` turned them on
        fits = device.type == "cpu" and self.group == 32 and out % 16 == 0
        layout = native_q4_layout(codes, self.scale_zeros) if fits else (None, None)
        self.register_buffer("q4_codes", layout[0], persistent=False)
        self.register_buffer("q4_sz", layout[1], persistent=False)

    def use_native(self, ops) -> bool:
        """Compute with the native 4-bit product of `ops` (the fused kernels' module; None: torch's
        kernel). Returns whether it is in use."""
        self.native = ops if ops is not None and self.q4_codes is not None and hasattr(ops, "q4_mm") else None
        return self.native is not None

    @property
    def native_ok(self) -> bool:
        return self.native is not None

    def product(self, x2: torch.Tensor) -> torch.Tensor:
        """x2: (rows, in) bfloat16 -> (rows, out) bfloat16, as the kernel computes it (no padding)."""
        if self.native is not None:
            return self.native.q4_mm(x2, self.q4_codes, self.q4_sz)
        if x2.device.type == "cpu":
            return torch._weight_int4pack_mm_for_cpu(x2, self.packed, self.group, self.scale_zeros)
        return torch._weight_int4pack_mm(x2, self.packed, self.group, self.scale_zeros)

    def forward(self, x: torch.Tensor, kernel: str = "") -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != self.dtype:
            x2 = x2.to(self.dtype)
        n = x2.shape[0]
        y = self.product(x2 if self.native is not None else at_least(x2, self.min_rows))
        if y.shape[0] != n:
            y = y[:n]
        y = y.view(*x.shape[:-1], self.out_features)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def spec(self, kernel: str = "") -> tuple[list[torch.Tensor], list[int]]:
        """This product for the native kernels (csrc/decode_ops.cpp `Product`): the native 4-bit
        product where in use, else torch's int4 kernel with the probed padding."""
        if self.native is not None:
            return [self.q4_codes, self.q4_sz], [6, self.group, 1]
        return [self.packed, self.scale_zeros], [2, self.group, self.min_rows]

    @classmethod
    def quantized(cls, w: torch.Tensor, device=None) -> "Int4 | None":
        """A float (out, in) matrix in 4 bits (`quantize_q4`), or None when `in` is not a multiple of
        GROUP (the kernel's group size): what drafts use to decode beside a q4 backbone."""
        return cls(*quantize_q4(w), device=device) if w.shape[1] % GROUP == 0 else None

    def dense(self) -> torch.Tensor:
        """[in, out] float32 weights, as the kernel sees them (the identity through the kernel)."""
        eye = torch.eye(self.in_features, dtype=self.dtype, device=self.packed.device)
        return self(eye).float()

    def make_transposed(self) -> None:
        """Nothing to keep: the packed blocks are the only layout the int4 kernel reads."""


class Int8Rows(nn.Module):
    """w = q * scale, q int8 in [-127, 127], one bfloat16 scale per output row (torch's weight-only
    int8 kernel, `_weight_int8pack_mm`, bfloat16 activations and result). The scale is rounded to
    bfloat16 before the codes are chosen, so the stored pair is what the kernel multiplies by: a
    weight is off by at most half a step of its row's (max |w| / 127). For the q4 mode's LM head:
    half the bfloat16 head's bytes, ~4x faster for a few rows on a 2-core CPU (measured per
    machine by components/model/tuner.py, which keeps the bfloat16 head where it is not)."""

    dtype = torch.bfloat16

    def __init__(self, w: torch.Tensor):
        """w: (out, in) float."""
        super().__init__()
        w = w.detach().float()
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        scale = (w.abs().amax(1) / 127).clamp_min(1e-12).to(self.dtype)
        codes = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scale", scale)
        self.min_rows = 1  # set from the machine's invariance probe (Transformer.optimize_for_decoding)

    def product(self, x2: torch.Tensor) -> torch.Tensor:
        """x2: (rows, in) -> (rows, out) bfloat16, as the kernel computes it (no padding)."""
        return torch._weight_int8pack_mm(x2.contiguous() if x2.dtype == self.dtype else x2.to(self.dtype).contiguous(),
                                         self.codes, self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        n = x2.shape[0]
        return self.product(at_least(x2, self.min_rows))[:n].view(*x.shape[:-1], self.out_features)

    def dense(self) -> torch.Tensor:
        """[in, out] float32 weights."""
        return (self.codes.float() * self.scale.float()[:, None]).t()
