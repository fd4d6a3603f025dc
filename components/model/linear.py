"""The backbone's weight matrices, one class per storage: `Dense` (float32 / bfloat16, [in, out] with an
optional [out, in] copy for the multi-row kernels of components/model/kernels.py), `Int4` (4-bit
codes in groups of 32 with a scale and a zero per group, bfloat16 activations: the native 4-bit
product where the fused kernels are built, else torch's weight-only int4 kernels; or int8
activations: the w4a8 integer product), `Int8Blocks` (the w4a8 LM head: Q8_0 blocks times int8
rows) and `Int8Rows` (8-bit codes with one scale per output row: the q4 mode's LM head with
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
ACTIVATIONS = ("bfloat16", "int8")  # what a 4-bit matrix multiplies: q4 and w4a8


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


def native_w4a8_layout(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes (out, in) 0..15, scale and zero (out, in / 32) float32 (w = (q - 8) scale + zero) -> the w4a8
    integer product's layout (csrc/w4a8.h): codes (out / 16, in / 32, 4, 64) uint8, vector j lane n byte i
    holding output n's codes for inputs 4 j + i (low nibble) and 16 + 4 j + i (high nibble); dm
    (out / 16, in / 32, 2, 16) float16 (its bits as int16, which a model's `.to(dtype)` leaves alone), the
    outputs' d = scale and m = zero - 8 scale (w = d q + m: a Q4_1 block's own d and m, exact for a GGUF's
    blocks)."""
    out, k = codes.shape
    c = codes.to(torch.uint8).view(out // 16, 16, k // 32, 2, 4, 4)  # (block, n, group, half, j, i)
    packed = (c[:, :, :, 0] | c[:, :, :, 1] << 4).permute(0, 2, 3, 1, 4).reshape(out // 16, k // 32, 4, 64)
    d, m = scale.double(), zero.double() - 8 * scale.double()
    dm = torch.stack((d, m)).to(torch.float16).view(2, out // 16, 16, k // 32).permute(1, 3, 0, 2)
    return packed.contiguous(), dm.contiguous().view(torch.int16)


def native_w8a8_layout(codes: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks, codes (out, in) int8 and d (out, in / 32) float, w = d q -> the w4a8 head's layout
    (csrc/w4a8.h): codes (out / 16, in / 32, 8, 64) uint8 = q + 128, vector j lane n byte i holding output
    n's input 4 j + i; d (out / 16, in / 32, 16) float16 (its bits as int16)."""
    out, k = codes.shape
    c = (codes.to(torch.int16) + 128).to(torch.uint8).view(out // 16, 16, k // 32, 8, 4)  # (block, n, group, j, i)
    packed = c.permute(0, 2, 3, 1, 4).reshape(out // 16, k // 32, 8, 64)
    return packed.contiguous(), d.to(torch.float16).view(out // 16, 16, k // 32).transpose(1, 2).contiguous().view(torch.int16)


def quantize_q8(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """A float (out, in) matrix -> Q8_0 blocks as ggml quantizes them: d = max |w| / 127 per group of 32,
    rounded to float16 first, q = round(w / d) in -127..127 (for heads a file does not ship in 8 bits)."""
    out, k = w.shape
    g = w.float().view(out, k // group, group)
    d = (g.abs().amax(-1) / 127).to(torch.float16).float()
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (g * inv[..., None]).round().clamp(-127, 127).to(torch.int8).view(out, k), d


class Int8Blocks(nn.Module):
    """The LM head as Q8_0 blocks (w = d q, groups of 32 along the input) for the w4a8 precision's
    integer product (csrc/w4a8.h `q8i8_mm`): activations quantized per row to int8 blocks, float32
    logits. Only the native layout is kept: the module exists where the fused kernels are built."""

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, ops):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        packed, scales = native_w8a8_layout(codes, d)
        self.register_buffer("codes", packed, persistent=False)
        self.register_buffer("d", scales, persistent=False)
        self.native = ops

    @classmethod
    def fits(cls, w: torch.Tensor) -> bool:
        return w.shape[0] % 16 == 0 and w.shape[1] % GROUP == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        y = self.native.q8i8_mm(x2 if x2.dtype == torch.bfloat16 else x2.to(torch.bfloat16), self.codes, self.d)
        return y.view(*x.shape[:-1], self.out_features)


class Int4(nn.Module):
    """w = (q - 8) * scale + zero, groups of `group` along the input dimension. The kernels keep scale
    and zero in bfloat16 (torch's only fast activation dtype on CPU): the one place a Q4_1 block's d
    and m + 8d are rounded. Activations go in and come out in bfloat16.

    With the fused kernels (`use_native`), the product is the native one (`q4_mm`): each weight is
    decoded to bfloat16 once per step for all its rows (AMX tiles where the CPU has them), so rows
    cost little, and a row's bits never depend on the others. torch's kernel multiplies by the
    weights in float32 and decodes them again for every 4 rows; the two differ in the last bits.

    With int8 activations (the w4a8 precision) the product is the integer one (`q4i8_mm`, csrc/w4a8.h)
    over the block's own d and m in float16, unrounded; it needs the fused kernels."""

    dtype = torch.bfloat16

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, device=None,
                 activations: str = "bfloat16"):
        """activations: bfloat16 (the q4 precision), or int8 (w4a8: the integer product, csrc/w4a8.h,
        which runs where the fused kernels are built: `use_native`)."""
        super().__init__()
        if activations not in ACTIVATIONS:
            raise ValueError(f"`activations` must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
        self.activations = activations
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
        int8 = activations == "int8"
        layout = native_q4_layout(codes, self.scale_zeros) if fits and not int8 else (None, None)
        self.register_buffer("q4_codes", layout[0], persistent=False)
        self.register_buffer("q4_sz", layout[1], persistent=False)
        layout = native_w4a8_layout(codes, scale, zero) if fits and int8 else (None, None)
        self.register_buffer("i8_codes", layout[0], persistent=False)
        self.register_buffer("i8_dm", layout[1], persistent=False)

    def use_native(self, ops) -> bool:
        """Compute with the native 4-bit product of `ops` (the fused kernels' module; None: torch's
        kernel): `q4_mm`, or with int8 activations `q4i8_mm`. Returns whether it is in use."""
        if self.activations == "int8":
            ok = ops is not None and self.i8_codes is not None and hasattr(ops, "q4i8_mm")
        else:
            ok = ops is not None and self.q4_codes is not None and hasattr(ops, "q4_mm")
        self.native = ops if ok else None
        return self.native is not None

    @property
    def native_ok(self) -> bool:
        return self.native is not None

    def product(self, x2: torch.Tensor) -> torch.Tensor:
        """x2: (rows, in) bfloat16 -> (rows, out) bfloat16, as the kernel computes it (no padding)."""
        if self.native is not None and self.activations == "int8":
            return self.native.q4i8_mm(x2, self.i8_codes, self.i8_dm)
        if self.native is not None:
            return self.native.q4_mm(x2, self.q4_codes, self.q4_sz)
        if self.activations == "int8":
            raise RuntimeError("int8 activations (w4a8) need the native kernels: `use_native` found none")
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
        if self.native is not None and self.activations == "int8":
            return [self.i8_codes, self.i8_dm], [7, self.group, 1]
        if self.native is not None:
            return [self.q4_codes, self.q4_sz], [6, self.group, 1]
        return [self.packed, self.scale_zeros], [2, self.group, self.min_rows]

    @classmethod
    def quantized(cls, w: torch.Tensor, device=None, ops=None) -> "Int4 | None":
        """A float (out, in) matrix in 4 bits (`quantize_q4`), or None when `in` is not a multiple of
        GROUP (the kernel's group size): what drafts use to decode beside a q4 or w4a8 backbone. With
        `ops` (the fused kernels beside a w4a8 backbone), the integer product where its shape fits."""
        if w.shape[1] % GROUP:
            return None
        int8 = ops is not None and hasattr(ops, "q4i8_mm") and w.shape[0] % 16 == 0
        m = cls(*quantize_q4(w), device=device, activations="int8" if int8 else "bfloat16")
        if int8:
            m.use_native(ops)
        return m

    def dense(self) -> torch.Tensor:
        """[in, out] float32 weights, as the kernel sees them (the identity through the kernel)."""
        eye = torch.eye(self.in_features, dtype=self.dtype, device=self.packed.device)
        if self.activations == "int8":  # the weights themselves (an identity through int8 rows is not exact)
            return torch._weight_int4pack_mm_for_cpu(eye, self.packed, self.group, self.scale_zeros).float()
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
