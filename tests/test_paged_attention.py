"""Attention over the paged KV's pool in place (`paged_attention`, components/model/csrc/attention.h).

A row's output equals, bit for bit, what the gathered path gives it (the sequences' blocks copied
into a padded (B, nkv, S, hs), the rows padded to (B, T), `ops.attention`: what `Block.native_forward`
ran before) and what the row gives as a plain batch-1 step; the vector kernel (AVX-512, or AVX2 + FMA)
equals its scalar reference (`ref=True`) bit for bit, for head dims 64 and 128, GQA groups of 1 to 8,
ragged lengths, tree masks, several sequences and 1-64 rows. All of it on this CPU's build and, in a
subprocess, on the AVX2 stand-in's (docs/precision.md), which must also give this build's bits."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from components.kv.paged import PagedKV
from components.model import native
from pipeline.core import StepBatch

ops = native.load()
pytestmark = pytest.mark.skipif(ops is None, reason=f"native kernels: {native.why()}")
ROWS = (1, 2, 3, 5, 8, 16, 33, 64)
HEADS = [(9, 3), (8, 8), (12, 2), (8, 1)]  # (nh, nkv): SmolLM2's groups of 3; 1; 6 (a pass of 4 and one of 2); 8
STAND_IN = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def tree(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random tree of n rows, row 0 its root: (depths (n,), ancestry (n, n) bool)."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask.sum(1) - 1, mask


def case(seed: int, starts: list[int], counts: list[int], nh: int, nkv: int, hs: int, bs: int = 16,
         cache: torch.dtype = torch.bfloat16, trees: bool = True, visible: bool = False, spread: float = 2.0):
    """A step over a paged pool: sequence b holds starts[b] slots and adds counts[b] rows (a random
    tree, or a causal block), its blocks scattered over the pool in random order; padded tables as
    PagedKV's plan pads them. visible: each row sees a random part of its cached slots."""
    g = gen(seed)
    lens = [s + n for s, n in zip(starts, counts)]
    need = sum(-(-n // bs) for n in lens)
    n_blocks = need + 5
    perm = torch.randperm(n_blocks, generator=g).tolist()
    tables, at = [], 0
    for n in lens:
        tables.append(perm[at:at + -(-n // bs)])
        at += len(tables[-1])
    shapes = [tree(n, g) if trees else (None, None) for n in counts]
    vis = [torch.rand(n, s, generator=g) < 0.6 if visible else None for s, n in zip(starts, counts)]
    batch = StepBatch.build(list(range(len(starts))), [torch.zeros(n, dtype=torch.long) for n in counts],
                            [d for d, _ in shapes], [m for _, m in shapes], starts, visible=vis)
    nb = -(-batch.span // bs)
    table = torch.tensor([t[:nb] + [t[0]] * (nb - len(t[:nb])) for t in tables])  # (B, nb)
    pool = (spread * torch.randn(2, n_blocks, bs, nkv, hs, generator=g)).bfloat16().to(cache)
    q = torch.randn(sum(counts), nh, hs, generator=g).bfloat16()  # (R, nh, hs)
    return SimpleNamespace(q=q, kp=pool[0], vp=pool[1], table=table, batch=batch, scale=1 / math.sqrt(hs))


def paged(c, ref: bool = False, **over) -> torch.Tensor:
    b = SimpleNamespace(**{**vars(c.batch), **over})
    return ops.paged_attention(c.q, c.kp, c.vp, c.table, b.row_index, b.width, b.span, b.bias, c.scale, b.causal, ref=ref)


def gathered(c) -> torch.Tensor:
    """The path before: the blocks gathered into (B, nkv, S, hs), the rows padded to (B, T) and back."""
    b, (R, nh, hs) = c.batch, c.q.shape
    B, T, S = len(b.seqs), b.width, b.span
    shape = (B, c.table.shape[1] * c.kp.shape[1], c.kp.shape[2], hs)
    K = c.kp[c.table].view(shape)[:, :S].transpose(1, 2)  # (B, nkv, S, hs)
    V = c.vp[c.table].view(shape)[:, :S].transpose(1, 2)
    qb = c.q.new_zeros(B * T, nh, hs)
    qb[b.row_index if B > 1 else slice(0, R)] = c.q
    y = ops.attention(qb.view(B, T, nh, hs), K, V, b.bias, c.scale, b.causal).view(B * T, nh, hs)
    return y[b.row_index] if B > 1 else y


def ragged(rows: int, g: torch.Generator, most: int = 4) -> tuple[list[int], list[int]]:
    """rows split over up to `most` sequences, each after a random number of cached slots."""
    B = min(rows, 1 + int(torch.randint(0, most, (1,), generator=g)))
    cuts = sorted(torch.randperm(rows - 1, generator=g)[:B - 1].add(1).tolist())
    counts = [b - a for a, b in zip([0, *cuts], [*cuts, rows])]
    return [int(torch.randint(0, 90, (1,), generator=g)) for _ in counts], counts


def test_the_kernel_is_vectorized_where_the_cpu_allows():
    kernel = ops.attention_kernel()
    assert kernel in ("avx512", "avx2", "scalar")
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert kernel != "scalar"


@pytest.mark.parametrize("hs", [64, 128])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("rows", ROWS)
def test_in_place_equals_the_gathered_path_and_the_reference(rows, heads, hs):
    """One sequence's tree after 37 cached slots, and the rows split over ragged sequences: the pool
    read in place gives the gathered path's bits, and the vector kernel its scalar reference's."""
    nh, nkv = heads
    g = gen(rows * 1000 + nh * 10 + hs)
    for i, (starts, counts) in enumerate([([37], [rows]), ragged(rows, g)]):
        c = case(rows + 7 * i + hs, starts, counts, nh, nkv, hs, visible=i == 1 and rows % 2 == 1)
        got = paged(c)
        assert got.shape == c.q.shape and got.dtype == torch.bfloat16
        assert torch.equal(got, gathered(c))
        assert torch.equal(got, paged(c, ref=True))


@pytest.mark.parametrize("rows", ROWS)
def test_rows_equal_their_plain_batch1_steps(rows):
    """Each row of a batch of trees equals its sequence's step alone and the row attending alone to
    exactly its allowed slots (a plain step over them), bit for bit."""
    nh, nkv, hs = 9, 3, 64
    starts, counts = ragged(rows, gen(rows), most=5)
    c = case(rows, starts, counts, nh, nkv, hs)
    got, b = paged(c), c.batch
    T = b.width
    for s, (lo, hi) in enumerate(zip(b.offsets, b.offsets[1:])):
        n, span = hi - lo, starts[s] + hi - lo  # the sequence's step alone: its rows, its own slots and tree
        bias = b.bias[s:s + 1, :, :n, :span] if b.bias is not None else None
        alone = SimpleNamespace(**{**vars(c), "q": c.q[lo:hi], "table": c.table[s:s + 1]})
        alone.batch = SimpleNamespace(row_index=None, width=n, span=span, bias=bias, causal=False)
        assert torch.equal(paged(alone), got[lo:hi])
        for r in range(lo, hi):
            ri = int(b.row_index[r]) if b.row_index is not None else r
            slots = (b.bias[s, 0, ri % T] == 0).nonzero()[:, 0] if b.bias is not None else torch.arange(b.span)
            blk = c.table[s][slots // c.kp.shape[1]]
            K = c.kp[blk, slots % c.kp.shape[1]].transpose(0, 1)[None]  # (1, nkv, n, hs)
            V = c.vp[blk, slots % c.kp.shape[1]].transpose(0, 1)[None]
            plain = ops.attention(c.q[r][None, None], K, V, None, c.scale, False)[0]
            assert torch.equal(plain, got[r:r + 1])


@pytest.mark.parametrize("hs", [64, 128])
def test_vector_kernel_equals_the_reference_on_long_and_peaked_rows(hs):
    """Longer contexts (up to 700 slots, block sizes 16 and 5), a plain step with no bias, 24
    sequences of one row each, and scores far apart (keys x 30: most weights underflow)."""
    for i, (starts, counts, bs, spread) in enumerate([([700], [1], 16, 2.0), ([333], [3], 5, 2.0),
                                                      ([200 + 3 * k for k in range(24)], [1] * 24, 16, 2.0),
                                                      ([90, 7, 0], [4, 1, 6], 5, 30.0)]):
        for heads in ((9, 3), (16, 4)):
            c = case(100 + i, starts, counts, *heads, hs, bs=bs, trees=len(starts) > 1 or counts[0] > 1,
                     spread=spread)
            if len(starts) == 1 and counts[0] == 1:
                assert c.batch.bias is None  # a plain step: every slot, no bias
            got = paged(c)
            assert torch.equal(got, paged(c, ref=True))
            assert torch.equal(got, gathered(c))


@pytest.mark.parametrize("rows", [2, 5, 64])
def test_a_causal_prompt_block(rows):
    """A prompt on an empty cache (no bias, `causal`) equals the same rows under an explicit causal
    bias, the gathered path and the reference."""
    c = case(rows, [0], [rows], 9, 3, 64, trees=False)
    assert c.batch.causal and c.batch.bias is None
    got = paged(c)
    bias = torch.zeros(1, 1, rows, rows).masked_fill_(~torch.ones(rows, rows, dtype=torch.bool).tril_(), float("-inf"))
    assert torch.equal(got, paged(c, bias=bias, causal=False))
    assert torch.equal(got, gathered(c))
    assert torch.equal(got, paged(c, ref=True))


@pytest.mark.parametrize("cache", [torch.float32, torch.float64])
@pytest.mark.parametrize("hs", [64, 48])
def test_float_caches_and_other_head_dims(cache, hs):
    """float32 / float64 pools and head dims the vector kernel does not cover: the scalar kernel,
    in place as gathered."""
    for i, (starts, counts) in enumerate([([37], [5]), ([12, 0, 50], [3, 7, 1])]):
        c = case(i, starts, counts, 9, 3, hs, cache=cache)
        assert torch.equal(paged(c), gathered(c))
    c = case(3, [20], [4], 9, 3, hs)  # bfloat16 at a head dim of its own: reference and kernel are one
    assert torch.equal(paged(c), paged(c, ref=True))


def test_table_forms_and_bad_tables():
    """An int32 table and a pool that is a view of the whole (layers, 2, ...) pool read the same;
    a block outside the pool or a pool whose blocks are not contiguous is refused."""
    c = case(5, [30, 9], [3, 4], 9, 3, 64)
    ref = paged(c)
    c32 = SimpleNamespace(**{**vars(c), "table": c.table.int()})
    assert torch.equal(paged(c32), ref)
    whole = torch.stack([c.kp, c.vp])[None].expand(3, -1, -1, -1, -1, -1).contiguous()  # (L, 2, n_blocks, bs, nkv, hs)
    view = SimpleNamespace(**{**vars(c), "kp": whole[1, 0], "vp": whole[1, 1]})
    assert torch.equal(paged(view), ref)
    bad = SimpleNamespace(**{**vars(c), "table": c.table.clone().fill_(c.kp.shape[0])})
    with pytest.raises(RuntimeError, match="outside the pool"):
        paged(bad)
    strided = SimpleNamespace(**{**vars(c), "kp": c.kp[:, :8], "vp": c.vp[:, :8]})  # 8 of each block's 16 slots
    with pytest.raises(RuntimeError, match="consecutive"):
        paged(strided)


def test_paged_kv_hands_over_its_pool_and_table():
    """PagedKV.update_in_place writes the rows as `update` does and returns the layer's pools and the
    step's block table: attention over them in place equals the gathered path, step after step, for
    one sequence (consecutive blocks: the plan's slice) and for ragged batches of trees."""
    nh, nkv, hs, layers = 9, 3, 64, 2
    kv = PagedKV(n_layers=layers, n_kv_heads=nkv, head_dim=hs, dtype=torch.bfloat16, block_size=4, num_blocks=2)
    g = gen(0)
    seqs = [kv.create() for _ in range(3)]
    for step in range(6):
        group = seqs[:1] if step < 2 else seqs
        counts = [1 + int(torch.randint(0, 5, (1,), generator=g)) for _ in group]
        shapes = [tree(n, g) for n in counts]
        batch = StepBatch.build(group, [torch.zeros(n, dtype=torch.long) for n in counts], [d for d, _ in shapes],
                                [m for _, m in shapes], [kv.used(s) for s in group])
        batch.plan = kv.begin_step(batch)
        assert isinstance(batch.plan.read, slice) == (step < 2)
        for layer in range(layers):
            q = torch.randn(sum(counts), nh, hs, generator=g).bfloat16()
            k, v = (torch.randn(sum(counts), nkv, hs, generator=g).bfloat16() for _ in range(2))
            kp, vp, table = kv.update_in_place(layer, k, v, batch.plan)
            assert kp.data_ptr() == kv.pool[layer, 0].data_ptr() and table.shape == (len(group), -(-batch.span // 4))
            c = SimpleNamespace(q=q, kp=kp, vp=vp, table=table, batch=batch, scale=1 / math.sqrt(hs))
            got = paged(c)
            K, V = kv.update(layer, k, v, batch.plan)  # the same rows again, and the gathered view
            assert torch.equal(K, kp[table].view(len(group), -1, nkv, hs)[:, :batch.span].transpose(1, 2))
            assert torch.equal(got, gathered(c))
        kv.end_step(batch.plan)
        for s in group:
            kv.commit(s)


def test_native_forward_reads_the_pool_in_place():
    """A bfloat16 model's cached steps on the paged KV go through `paged_attention` (inside the fused
    `layer_paged`) and give the hidden states of the gathered path (a paged KV that offers no
    `update_in_place`), bit for bit."""
    from components.model.load import tiny
    from pipeline.core import forward_step

    class Gathering(PagedKV):
        update_in_place = None

    class Counting:
        def __init__(self, mod):
            self.mod, self.calls = mod, {"attention": 0, "paged_attention": 0, "layer_paged": 0}

        def __getattr__(self, name):
            fn = getattr(self.mod, name)
            if name not in self.calls:
                return fn
            self.calls[name] += 1
            return fn

    model = tiny(dim=256, n_heads=4, n_kv_heads=2, dtype="bfloat16").model
    if model.native is None:
        pytest.skip("the model does not run the native kernels")
    g, outs = gen(1), {}
    for kind in (PagedKV, Gathering):
        model.native = counting = Counting(ops)
        kv = kind(None, n_layers=model.args.n_layers, n_kv_heads=model.args.n_kv_heads,
                  head_dim=model.args.head_dim, dtype=model.attn_dtype, block_size=4, num_blocks=4)
        seqs, hidden = [kv.create() for _ in range(3)], []
        g.manual_seed(1)
        with torch.inference_mode():
            for step in range(4):
                counts = [7, 1, 3] if step == 0 else [1 + int(torch.randint(0, 4, (1,), generator=g)) for _ in seqs]
                shapes = [tree(n, g) if step else (None, None) for n in counts]
                tokens = [torch.randint(0, 1000, (n,), generator=g) for n in counts]
                batch = StepBatch.build(seqs, tokens, [d for d, _ in shapes], [m for _, m in shapes],
                                        [kv.used(s) for s in seqs], model.attn_dtype)
                hidden.append(forward_step(model, kv, batch))
                for s in seqs:
                    kv.commit(s, [0]) if step else kv.commit(s)
        outs[kind] = torch.cat(hidden)
        in_place = counting.calls["paged_attention"] + counting.calls["layer_paged"]  # a layer in one call, or three
        assert (in_place if kind is PagedKV else counting.calls["attention"]) > 0
        assert (counting.calls["attention"] if kind is PagedKV else in_place) == 0
    model.native = ops
    assert torch.equal(outs[PagedKV], outs[Gathering])


FIXED = [(11, [37], [5], 9, 3, 64), (12, [200, 3, 77], [1, 6, 2], 9, 3, 128), (13, [0], [9], 8, 1, 64),
         (14, [500], [1], 12, 2, 128)]


def fixed_outputs() -> list[torch.Tensor]:
    return [paged(case(seed, starts, counts, nh, nkv, hs, trees=counts[0] > 1 and starts[0] > 0))
            for seed, starts, counts, nh, nkv, hs in FIXED]


def assert_bits(path: str) -> None:
    """This build's outputs on the fixed cases equal those another build saved at `path`."""
    for got, want in zip(fixed_outputs(), torch.load(path), strict=True):
        assert torch.equal(got, want)


@pytest.mark.skipif(__import__("platform").machine() != "x86_64", reason="the stand-in variables are x86's")
def test_stand_in_avx2_build_in_a_subprocess(tmp_path):
    """The AVX2 stand-in's build (x86-64-v3: its own library, built here if `make setup` did not):
    its kernel is the AVX2 one, this module's tests pass there, and it gives this build's bits on
    the fixed cases (the AVX2 kernel keeps the AVX-512 kernel's order of sums)."""
    if ops.attention_kernel() == "avx2":
        pytest.skip("this process already runs the AVX2 kernels")
    bits = tmp_path / "bits.pt"
    torch.save(fixed_outputs(), bits)
    code = ("import sys, pytest, components.model.native as n; assert n.load(build_if_missing=True), n.why(); "
            "import test_paged_attention as t; assert t.ops.attention_kernel() == 'avx2', t.ops.attention_kernel(); "
            f"t.assert_bits({str(bits)!r}); "
            "sys.exit(pytest.main(['-q', '-x', '-p', 'no:cacheprovider', t.__file__, '-k', 'not stand_in']))")
    env = {**os.environ, **STAND_IN}
    r = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(__file__), env=env, capture_output=True, text=True)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert " passed" in r.stdout and " skipped" not in r.stdout, r.stdout[-2000:]
