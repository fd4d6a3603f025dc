"""The fused C++ kernels (components/model/native.py) against their pure-torch references, per
kernel and precision at 1-64 rows: batch-invariant bit for bit (a row's output never depends on the
rows computed with it), and within a stated tolerance of the pure-torch op (they round once in
float32 where torch rounds after each op, so the last bfloat16 bit may differ). Skipped, with the
reason, where the extension is not built (then the pure-torch path runs and the rest of the suite
tests it)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from components.model import native
from components.model.linear import Int4, native_bf16_layout, quantize_q4
from components.model.llama import attention
from components.model.load import from_pretrained
from pipeline.bench import DEFAULT_INPUT
from pipeline.requests import encode, load_requests

from helpers import compose_config

ops = native.load()
pytestmark = pytest.mark.skipif(ops is None, reason=f"native kernels: {native.why()}")
ROWS = (1, 2, 3, 5, 8, 16, 33, 64)
BF16_ULP = 2.0 ** -7  # relative: one bfloat16 step


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def close(got: torch.Tensor, ref: torch.Tensor, ulps: float) -> bool:
    """Within `ulps` bfloat16 steps of the reference's magnitude, element by element."""
    tol = ulps * BF16_ULP * (ref.float().abs() + ref.float().abs().mean())
    return bool(((got.float() - ref.float()).abs() <= tol).all())


def rows_invariant(fn, x: torch.Tensor) -> bool:
    """fn over all rows equals fn row by row and in ragged groups, bit for bit."""
    ref = fn(x)
    for r in (1, 3, 7):
        if not torch.equal(torch.cat([fn(x[i:i + r]) for i in range(0, len(x), r)]), ref):
            return False
    return True


@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm(rows):
    x = torch.randn(rows, 576, generator=gen(rows)).bfloat16()
    w = (1 + 0.1 * torch.randn(576, generator=gen(1))).bfloat16()
    got = ops.rms_norm(x, w, 1e-5)
    assert close(got, F.rms_norm(x, (576,), w, eps=1e-5), 1.0)
    assert rows_invariant(lambda t: ops.rms_norm(t, w, 1e-5), x)


@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul(rows):
    gu = torch.randn(rows, 2 * 1536, generator=gen(rows)).bfloat16()
    g, u = gu.chunk(2, dim=-1)
    assert close(ops.silu_mul(gu), F.silu(g) * u, 1.0)
    assert rows_invariant(ops.silu_mul, gu)


@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (576, 49152), (100, 8)])  # (in, out); 100: a K tail
@pytest.mark.parametrize("rows", ROWS)
def test_bf16_mm(shape, rows):
    """The native bfloat16 product (layer matrices and the LM head): float32 sums of exact bfloat16
    products, so within float32 rounding of the float64 product; bit for bit across row counts."""
    k, n = shape
    w = (torch.randn(n, k, generator=gen(11)) * 0.05).bfloat16()  # (out, in)
    x = torch.randn(rows, k, generator=gen(rows)).bfloat16()
    got = ops.bf16_mm(x, w, False)
    ref = x.double() @ w.double().t()
    assert float((got.double() - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    assert torch.equal(ops.bf16_mm(x, w, True), got.bfloat16())
    assert rows_invariant(lambda t: ops.bf16_mm(t, w, False), x)
    wp = native_bf16_layout(w)  # the layout the model's products read: the same sums, in memory order
    assert (wp.dim() == 4) == (n % 16 == 0 and k % 32 == 0)
    assert torch.equal(ops.bf16_mm(x, wp, False), got)
    assert rows_invariant(lambda t: ops.bf16_mm(t, wp, True), x)


def q4_case(k: int, n: int, seed: int = 5):
    """A random 4-bit matrix (in k, out n) as Int4 on the native product, and its weights as the
    kernel decodes them: (q - 8) scale + zero in float32 with the bfloat16 scale and zero, rounded
    once to bfloat16 ([out, in])."""
    w = torch.randn(n, k, generator=gen(seed)) * 0.05
    codes, scale, zero = quantize_q4(w)
    m = Int4(codes, scale, zero)
    assert m.use_native(ops) and m.native_ok
    sz = m.scale_zeros.float()  # (in / 32, out, 2)
    s, z = sz[..., 0].t().repeat_interleave(32, 1), sz[..., 1].t().repeat_interleave(32, 1)
    return m, ((codes.float() - 8) * s + z).bfloat16()


@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (576, 3072), (64, 16)])  # (in, out)
@pytest.mark.parametrize("rows", ROWS)
def test_q4_mm(shape, rows):
    """The native 4-bit product (q4_mm): float32 sums of exact products of the decoded bfloat16
    weights, rounded once (within a bfloat16 step of the float64 product), bit for bit across row
    counts, and within a few steps of torch's int4 kernel (which multiplies by the float32 weights)."""
    k, n = shape
    m, wd = q4_case(k, n)
    x = torch.randn(rows, k, generator=gen(rows)).bfloat16()
    got = m(x)
    ref = x.double() @ wd.double().t()
    assert close(got, ref, 1.0)
    assert rows_invariant(m, x)
    assert close(got, torch._weight_int4pack_mm_for_cpu(x, m.packed, 32, m.scale_zeros), 4.0)


def test_q4_mm_decodes_the_weights_exactly():
    """Unit rows read the decoded weights back, bit for bit: every code, scale and zero of the
    layout lands where the kernel multiplies by it."""
    m, wd = q4_case(1536, 576)
    assert torch.equal(m(torch.eye(1536, dtype=torch.bfloat16)), wd.t())
    assert ops.product_path() in ("amx", "avx512_bf16", "float32")


def test_q4_mm_other_path_in_a_subprocess():
    """The products' path this process did not take (LLM_DECODE_AMX=0 turns AMX off; where AMX is absent the
    variable changes nothing): the same checks in a fresh process."""
    import os
    import subprocess
    import sys
    code = ("import test_native as t, torch; assert t.ops.product_path() != 'amx'; "
            "[t.test_q4_mm(s, r) for s in [(576, 960), (1536, 576)] for r in (1, 5, 33)]; "
            "[t.test_bf16_mm(s, r) for s in [(576, 960), (1536, 576), (100, 8)] for r in (1, 5, 33)]; "
            "t.test_q4_mm_decodes_the_weights_exactly(); print(t.ops.product_path())")
    env = {**os.environ, "LLM_DECODE_AMX": "0"}
    r = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(__file__), env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def test_avx2_build_in_a_subprocess():
    """The kernels an AVX2-only CPU (Zen 3) gets, built and checked on this one: under the stand-in
    variables (docs/precision.md) the extension is compiled for x86-64-v3 into its own folder and
    takes the float32 path; the kernel checks hold there too. `make setup` builds it where the CPU
    has AVX-512, so this test finds it; it builds it itself (about a minute) otherwise."""
    import os
    import subprocess
    import sys
    if ops.product_path() == "float32":
        pytest.skip("this process already runs the AVX2 kernels")
    code = ("import components.model.native as n; assert n.load(build_if_missing=True), n.why(); "
            "assert '-march=x86-64-v3' in n.isa_flags(); "
            "import test_native as t; assert t.ops.product_path() == 'float32', t.ops.product_path(); "
            "[t.test_q4_mm(s, r) for s in [(576, 960), (1536, 576)] for r in (1, 5, 33)]; "
            "[t.test_bf16_mm(s, r) for s in [(576, 960), (1536, 576), (100, 8)] for r in (1, 5, 33)]; "
            "[t.test_pre_attention(p, r) for p in ('bfloat16', 'q4') for r in (1, 5, 33)]; "
            "t.test_q4_mm_decodes_the_weights_exactly(); print(n.library())")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    r = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(__file__), env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() != str(native.library())  # its own build, never this CPU's


def torch_pre_attention(x, w, wqkv, cos, sin, nh, nkv, hs):
    """The pure-torch order: RMSNorm, the product, RoPE in float32 rounded once."""
    qkv = wqkv(F.rms_norm(x, x.shape[-1:], w, eps=1e-5)).float()
    R = x.shape[0]
    qk = qkv[:, :(nh + nkv) * hs].view(R, nh + nkv, hs)
    c, s = torch.cat((cos, cos), -1)[:, None], torch.cat((-sin, sin), -1)[:, None]
    qk = qk * c + qk.roll(hs // 2, dims=-1) * s
    return qk[:, :nh].bfloat16(), qk[:, nh:].bfloat16(), qkv[:, (nh + nkv) * hs:].view(R, nkv, hs).bfloat16()


@pytest.mark.parametrize("precision", ["bfloat16", "q4", "q4_torch"])
@pytest.mark.parametrize("rows", ROWS)
def test_pre_attention(precision, rows):
    nh, nkv, hs, dim = 9, 3, 64, 576
    w = torch.randn(dim, (nh + 2 * nkv) * hs, generator=gen(2)) * 0.05
    if precision.startswith("q4"):  # the native 4-bit product, or torch's int4 kernel
        m = Int4(*quantize_q4(w.t()))
        assert m.use_native(ops if precision == "q4" else None) == (precision == "q4")
        spec, fn = m.spec(), m
    else:
        wb = w.bfloat16()
        spec, fn = ([wb.t().contiguous()], [5, 0, 1]), (lambda t: t @ wb)  # the native product, as Dense.spec gives it
    x = torch.randn(rows, dim, generator=gen(rows)).bfloat16()
    nw = (1 + 0.1 * torch.randn(dim, generator=gen(3))).bfloat16()
    freqs = torch.arange(rows, dtype=torch.float32)[:, None] * (1 / 10000 ** (torch.arange(0, hs, 2) / hs))
    cos, sin = freqs.cos(), freqs.sin()
    got = ops.pre_attention(x, nw, 1e-5, *spec, None, cos, sin, nh, nkv, hs)
    ref = torch_pre_attention(x, nw, fn, cos, sin, nh, nkv, hs)
    for a, b in zip(got, ref):
        assert close(a, b, 4.0)  # the norm's rounding moves the product by a few steps at most
    whole = torch.cat([t.reshape(rows, -1) for t in got], 1)
    parts = [torch.cat([t.reshape(1, -1) for t in ops.pre_attention(x[i:i + 1], nw, 1e-5, *spec, None, cos[i:i + 1],
                                                                     sin[i:i + 1], nh, nkv, hs)], 1) for i in range(rows)]
    assert torch.equal(torch.cat(parts), whole)


def tree_case(T: int, S0: int, seed: int):
    """One sequence with S0 cached slots and a T-row tree: each row attends to the cache and its
    ancestors (a random tree, parents before children)."""
    g = gen(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, T)]
    allowed = torch.zeros(T, S0 + T, dtype=torch.bool)
    allowed[:, :S0] = True
    for i in range(T):
        j = i
        while j >= 0:
            allowed[i, S0 + j] = True
            j = parents[j]
    bias = torch.zeros(1, 1, T, S0 + T).masked_fill_(~allowed[None, None], float("-inf"))
    return parents, allowed, bias


@pytest.mark.parametrize("cache", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("rows", ROWS)
def test_attention_matches_float64_and_is_invariant_to_siblings(cache, rows):
    """Against the float64 reference attention; and a tree row's output equals, bit for bit, the
    same row attending alone to exactly its allowed slots moved together (its plain step)."""
    nh, nkv, hs, S0 = 9, 3, 64, 40
    _, allowed, bias = tree_case(rows, S0, rows)
    q = torch.randn(1, rows, nh, hs, generator=gen(5)).bfloat16()
    K = torch.randn(1, nkv, S0 + rows, hs, generator=gen(6)).to(torch.bfloat16).to(cache)
    V = torch.randn(1, nkv, S0 + rows, hs, generator=gen(7)).to(torch.bfloat16).to(cache)
    scale = 1 / math.sqrt(hs)
    got = ops.attention(q, K, V, bias, scale, False)  # (1, T, nh, hs)
    ref = attention(q.transpose(1, 2).double(), K.double(), V.double(), bias.double()).transpose(1, 2)
    assert close(got, ref, 1.0)
    for t in range(rows):
        idx = allowed[t].nonzero()[:, 0]
        alone = ops.attention(q[:, t:t + 1], K[:, :, idx], V[:, :, idx], None, scale, False)
        assert torch.equal(alone, got[:, t:t + 1])


def test_attention_causal_and_padded_batch():
    """A causal prompt block equals the same rows with an explicit causal bias, and a row in a
    padded batch equals the row alone."""
    nh, nkv, hs, S0, T = 4, 2, 64, 7, 5
    q = torch.randn(2, T, nh, hs, generator=gen(8)).bfloat16()
    K = torch.randn(2, nkv, S0 + T, hs, generator=gen(9)).bfloat16()
    V = torch.randn(2, nkv, S0 + T, hs, generator=gen(10)).bfloat16()
    causal = torch.ones(T, S0 + T, dtype=torch.bool).tril_(S0)
    bias = torch.zeros(2, 1, T, S0 + T).masked_fill_(~causal, float("-inf"))
    assert torch.equal(ops.attention(q, K, V, None, 0.125, True), ops.attention(q, K, V, bias, 0.125, False))
    assert torch.equal(ops.attention(q[1:], K[1:], V[1:], bias[1:], 0.125, False),
                       ops.attention(q, K, V, bias, 0.125, False)[1:])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["q4", "bfloat16"])
def test_real_model_native_step_agrees_with_the_pure_torch_path(dtype):
    """On the real model: the logits after each of the 24 benchmark prompts are close through the
    fused kernels and through the pure-torch path (within 3% of the largest logit: both round
    every layer's output to bfloat16, at other places), and the next token differs at most at two
    prompts, each a near-tie of the pure-torch path (its top two closer than the deviation; one
    benchmark prompt is an exact tie in q4)."""
    from pipeline.core import StepBatch, forward_step
    from components.kv.contiguous import ContiguousKV
    bbs = {n: from_pretrained(dtype=dtype, native=n) for n in (False, True)}
    assert bbs[True].model.native is ops and bbs[False].model.native is None  # the loaded kernels, or none
    tok = bbs[True].tokenizer
    prompts = [encode(tok, r, True) for r in load_requests(str(DEFAULT_INPUT), None)]
    out = {}
    for n, bb in bbs.items():
        m, rows = bb.model, []
        for p in prompts:
            kv = ContiguousKV(bb, max_len=len(p) + 1)
            seq = kv.create()
            h = forward_step(m, kv, StepBatch.build([seq], [torch.tensor(p)], [None], [None], [0], m.attn_dtype))
            rows.append(m.logits(h[-1:])[0])
            kv.free(seq)
        out[n] = torch.stack(rows)
    dev = (out[True] - out[False]).abs().max()
    assert dev < 0.03 * out[False].abs().max()
    top2 = out[False].topk(2, dim=-1).values
    differ = out[True].argmax(-1) != out[False].argmax(-1)
    assert differ.sum() <= 2 and bool(((top2[:, 0] - top2[:, 1])[differ] <= dev).all())  # only near-ties flip


@pytest.mark.parametrize("dtype", ["bfloat16", "q4"])
def test_tiny_native_model_batches_and_trees_equal_batch_one(dtype):
    """The native step end to end on a tiny model optimized for decoding (so its bfloat16 products
    and head are native): ragged batches (padded rows, row_index scatter) and trees give the tokens
    of greedy at batch 1, and the model says it is batch-invariant."""
    from components.model.load import tiny
    from pipeline.build import build_engine
    bb = tiny(dtype=dtype)
    bb.model.optimize_for_decoding(cache=None)
    assert bb.model.native is ops and bb.batch_invariant  # the fused kernels run its steps
    texts = ["Once upon a time, in a land far away,", "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3", "Hi"]
    prompts = [bb.tokenizer.encode(t, add_special_tokens=False) for t in texts]

    def run(preset, batch, *extra):
        cfg = compose_config(["model=tiny", f"model.dtype={dtype}", f"decode={preset}", "max_new_tokens=24",
                              f"batch_size={batch}", *extra])
        return [g.token_ids for g in build_engine(cfg, bb)[0].run(prompts)]
    ref = run("greedy", 1)
    assert run("greedy", 3) == ref
    assert run("tree_ngram", 3, "proposer.min_ngram=1") == ref
    assert run("self_spec", 2) == ref


@pytest.mark.skipif(__import__("platform").machine() != "x86_64", reason="the stand-in variables are x86's")
def test_isa_flags_follow_the_stand_in_variables():
    """Each CPU kind the stand-in variables name gets a build without the instruction sets it lacks."""
    assert native.isa_flags({}) == ["-march=native"]
    assert native.isa_flags({"ATEN_CPU_CAPABILITY": "avx2"})[0] == "-march=x86-64-v3"
    assert native.isa_flags({"ONEDNN_MAX_CPU_ISA": "avx2_vnni"})[0] == "-march=x86-64-v3"
    assert native.isa_flags({"ATEN_CPU_CAPABILITY": "default"})[0] == "-march=x86-64-v2"
    bf16 = native.isa_flags({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"})
    assert "-mno-amx-tile" in bf16 and "-mno-avx512bf16" not in bf16
    assert "-mno-avx512bf16" in native.isa_flags({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"})
