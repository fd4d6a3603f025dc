"""The w4a8 integer products (components/model/csrc/w4a8.h): each ISA path equals the scalar reference
bit for bit at 1-64 rows, K tails and block counts that fill no tile; a row's bits never depend on
the rows computed with it; the quantization and the layouts are what they say; and the real model in
w4a8 decodes batches and trees with batch-1 greedy's tokens, on this CPU's build and under the AVX2
stand-in (docs/precision.md)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from components.model import native
from components.model.linear import Int4, native_w4a8_layout, native_w8a8_layout, quantize_q4, quantize_q8

ops = native.load(build_if_missing=True)
pytestmark = pytest.mark.skipif(ops is None, reason=f"native kernels not built: {native.why()}")

ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 33, 64]
# (out, in): the model's shapes, a K of 3 groups (no multiple of any unroll), one block of 16, odd block counts
SHAPES = [(960, 576), (576, 1536), (48, 96), (16, 32), (80, 160)]


def weights(out: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, k, generator=g) * 0.05


def rows(m: int, k: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[0, :32] = 0.0  # an all-zero block: scale 0
    if m > 1:
        x[1, 5] = 40.0  # one large value: the rest of its block rounds to few levels
    return x.bfloat16()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a.view(torch.int32),
                                              b.view(torch.int16) if b.dtype == torch.bfloat16 else b.view(torch.int32))


@pytest.mark.parametrize("shape", SHAPES)
def test_q4_product_equals_the_scalar_reference_and_is_row_invariant(shape):
    out, k = shape
    c8, dm = native_w4a8_layout(*quantize_q4(weights(out, k)))
    x = rows(64, k)
    full = ops.q4i8_mm(x, c8, dm)
    assert same(full, ops.q4i8_mm(x, c8, dm, ref=True))
    for m in ROWS:  # each row count's passes and tails: every row keeps the bits it has among all 64
        for i in range(0, 64 - m + 1, max(m, 17)):
            assert same(ops.q4i8_mm(x[i:i + m], c8, dm), full[i:i + m]), (m, i)


@pytest.mark.parametrize("shape", [(49152 // 64, 576), (48, 96), (16, 32), (80, 160)])
def test_q8_head_equals_the_scalar_reference_and_is_row_invariant(shape):
    out, k = shape
    w = weights(out, k)
    w[3, :32] *= 40  # codes at the ends of the range
    c8, d = native_w8a8_layout(*quantize_q8(w))
    x = rows(64, k)
    full = ops.q8i8_mm(x, c8, d)
    assert full.dtype == torch.float32  # logits are never rounded
    assert same(full, ops.q8i8_mm(x, c8, d, ref=True))
    for m in ROWS:
        assert same(ops.q8i8_mm(x[-m:], c8, d), full[-m:]), m


@pytest.mark.skipif(ops is None or not ops.amx_emulation(), reason="the AMX emulation needs an AVX-512 build")
@pytest.mark.parametrize("shape", [(48, 96), (80, 160), (16, 32), (960, 576)])
def test_amx_int8_kernel_on_emulated_tiles_equals_the_scalar_reference(shape):
    """The AMX int8 kernel (tdpbsud over one group a tile, two groups in flight) run on tiles emulated
    from the instructions' definitions: its layouts, tile shapes and scaling order give the scalar
    reference's bits at row counts that fill no tile (rows past 16 take a second row tile) and odd
    group counts. On an AMX CPU the same kernel runs on the tiles themselves (w4a8_path amx_int8),
    and the tests above check it there."""
    out, k = shape
    w = weights(out, k)
    w[3, :32] *= 40
    c4, dm = native_w4a8_layout(*quantize_q4(w))
    c8, d = native_w8a8_layout(*quantize_q8(w))
    x = rows(40, k)
    for m in (1, 3, 16, 17, 40):
        assert same(ops.q4i8_mm(x[:m], c4, dm, emulate_amx=True), ops.q4i8_mm(x[:m], c4, dm, ref=True)), m
        assert same(ops.q8i8_mm(x[:m], c8, d, emulate_amx=True), ops.q8i8_mm(x[:m], c8, d, ref=True)), m


@pytest.mark.skipif(ops is None or not ops.amx_emulation(), reason="the AMX emulation needs an AVX-512 build")
def test_the_amx_self_check_passes_on_emulated_tiles():
    """The check an AMX CPU runs before its first w4a8 product (17 rows, 3 groups, Q4 and Q8 against
    the scalar reference; on a mismatch w4a8 keeps its SIMD path) passes where the kernel is right."""
    assert ops.amx_self_check_emulated()
    assert ops.w4a8_path() in ("amx_int8", "avx512_vnni", "avx_vnni", "avx2")  # an AVX-512 build's paths


def test_q8_head_takes_the_full_code_range():
    """-128 (ggml never writes it, a file may hold it) and 127 against -127 and 127 activations: the
    AVX2 path's |q| x sign trick and VNNI's +128 codes must not saturate or wrap."""
    codes = torch.full((16, 32), -128, dtype=torch.int8)
    codes[1] = 127
    codes[2, ::2] = -128
    codes[2, 1::2] = 127
    c8, d = native_w8a8_layout(codes, torch.ones(16, 1))
    x = torch.full((2, 32), 1.0).bfloat16()
    x[1] = -1.0
    y = ops.q8i8_mm(x, c8, d)
    assert same(y, ops.q8i8_mm(x, c8, d, ref=True))
    assert y[0, 0].item() == pytest.approx(-128 * 32, rel=1e-6) and y[1, 1].item() == pytest.approx(-127 * 32, rel=1e-6)


def test_quantization_is_llama_cpps_q8_1():
    """a = round-half-even(x 127 / amax) per block of 32; dx = amax / 127; sx = dx sum(a)."""
    x = rows(9, 96)
    a, dx, sx, asum = ops.quantize_rows(x)
    xf = x.float().view(9, 3, 32)
    amax = xf.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    want = torch.round(xf * inv[..., None]).clamp(-127, 127).to(torch.int8).view(9, 96)
    assert torch.equal(a, want)
    assert torch.equal(dx, amax / 127.0)
    assert torch.equal(asum, want.view(9, 3, 32).int().sum(-1))
    assert torch.equal(sx, dx * asum.float())


def test_products_are_the_block_arithmetic():
    """The reference against float64 math on the same blocks: sum_g d_w d_x isum + m_w s_x."""
    out, k = 48, 96
    codes, scale, zero = quantize_q4(weights(out, k))
    c8, dm = native_w4a8_layout(codes, scale, zero)
    x = rows(5, k)
    a, dx, sx, _ = ops.quantize_rows(x)
    d = dm.view(torch.float16).double()[:, :, 0].permute(0, 2, 1).reshape(out, 3)  # (out, groups)
    m = dm.view(torch.float16).double()[:, :, 1].permute(0, 2, 1).reshape(out, 3)
    isum = torch.einsum("ogi,rgi->rog", codes.view(out, 3, 32).double(), a.view(5, 3, 32).double())
    want = (isum * d[None] * dx.double()[:, None] + m[None] * sx.double()[:, None]).sum(-1)
    got = ops.q4i8_mm(x, c8, dm, ref=True).double()
    assert torch.allclose(got, want, rtol=1e-2, atol=1e-3)  # the result is rounded to bfloat16
    w = (codes.double() - 8) * scale.double().repeat_interleave(32, 1) + zero.double().repeat_interleave(32, 1)
    assert torch.allclose(d.repeat_interleave(32, 1) * codes.double() + m.repeat_interleave(32, 1), w, atol=1e-3)


def test_int4_module_in_int8_mode():
    w = weights(96, 64)
    m = Int4.quantized(w, ops=ops)
    assert m.activations == "int8" and m.native is ops
    x = rows(3, 64)
    y = m(x)
    assert same(y, ops.q4i8_mm(x, m.i8_codes, m.i8_dm))
    assert torch.allclose(m.dense(), w.t(), atol=0.02)  # the weights themselves, not an int8 identity
    assert m.spec()[1][0] == 7


def test_avx2_stand_in_in_a_subprocess(tmp_path):
    """The AVX2 build (x86-64-v3) of the same checks, where this CPU has more: `make setup` builds it."""
    if ops.w4a8_path() in ("avx2", "scalar"):
        pytest.skip("this process already runs the AVX2 build")
    code = ("import test_w4a8 as t; assert t.ops.w4a8_path() == 'avx2', t.ops.w4a8_path(); "
            "[t.test_q4_product_equals_the_scalar_reference_and_is_row_invariant(s) for s in t.SHAPES]; "
            "[t.test_q8_head_equals_the_scalar_reference_and_is_row_invariant(s) for s in [(48, 96), (80, 160)]]; "
            "t.test_q8_head_takes_the_full_code_range(); t.test_quantization_is_llama_cpps_q8_1(); "
            "import torch; x = t.rows(7, 160); c, d = t.native_w4a8_layout(*t.quantize_q4(t.weights(80, 160))); "
            f"torch.save(t.ops.q4i8_mm(x, c, d), {str(tmp_path / 'avx2.pt')!r})")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    here = os.path.dirname(__file__)
    r = subprocess.run([sys.executable, "-c", code], cwd=here, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    # and the two builds agree with each other: integer sums and one float order everywhere
    got = torch.load(tmp_path / "avx2.pt")
    c, d = native_w4a8_layout(*quantize_q4(weights(80, 160)))
    assert same(got, ops.q4i8_mm(rows(7, 160), c, d))
