"""What a decode step costs per precision, and how far a plain step is from the bytes-per-token floor.

    python scripts/step_costs.py [context=128] [dtypes=float32,bfloat16,q4,w4a8]

For each precision: the wall time of one target forward over R rows (a plain step of one sequence
at R = 1; a tree of R nodes) on a cached context, LM head included, median of 20; the ratio of each
to the plain step; then the bytes a plain step must read (layer matrices, LM head, the KV cache at
this context) against this machine's copy bandwidth, and where the rest of the step goes (the
layer matrices alone, the LM head alone, everything else: norms, RoPE, attention, residuals and
the Python between them).
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

from components.kv.contiguous import ContiguousKV
from components.model.linear import Dense, Int4
from components.model.load import from_pretrained
from pipeline.core import StepBatch, forward_step

ROWS = (1, 2, 4, 8, 16, 32)


def timed(fn, reps: int = 20) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def bandwidth() -> float:
    """GB/s of a large copy (read + write counted)."""
    a = torch.empty(256 * 2**20, dtype=torch.uint8)
    b = torch.empty_like(a)
    ms = timed(lambda: b.copy_(a), 5)
    return 2 * a.numel() / (ms * 1e-3) / 1e9


def nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def matrix_bytes(m) -> int:
    if isinstance(m, Int4) and m.activations == "int8":  # the integer product's layout: 4-bit codes, float16 d and m
        return nbytes(m.i8_codes, m.i8_dm)
    if isinstance(m, Int4):
        return m.packed.numel() * m.packed.element_size() + m.scale_zeros.numel() * m.scale_zeros.element_size()
    return m.weight.numel() * m.weight.element_size()


@torch.inference_mode()
def main():
    opts = dict(a.split("=", 1) for a in sys.argv[1:])
    ctx = int(opts.get("context", 128))
    dtypes = opts.get("dtypes", "float32,bfloat16,q4,w4a8").split(",")
    bw = bandwidth()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"{cpu}, CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, "
          f"copy bandwidth {bw:.1f} GB/s, context {ctx}\n")
    print("| precision | " + " | ".join(f"{r} row{'s' if r > 1 else ''}" for r in ROWS) + " |")
    print("|---|" + "---:|" * len(ROWS))
    floors = []
    for dtype in dtypes:
        m = from_pretrained(dtype=dtype).model
        a = m.args
        kv = ContiguousKV(None, ctx + 64, a.n_layers, a.n_kv_heads, a.head_dim, m.attn_dtype)
        seq = kv.create()
        prompt = torch.randint(0, a.vocab_size, (ctx,))
        forward_step(m, kv, StepBatch.build([seq], [prompt], [None], [None], [0], m.attn_dtype))
        kv.commit(seq)

        def step(r):
            tok = torch.randint(0, a.vocab_size, (r,))
            mask = torch.ones(r, r, dtype=torch.bool).tril_() if r > 1 else None
            depth = torch.arange(r) if r > 1 else None
            h = forward_step(m, kv, StepBatch.build([seq], [tok], [depth], [mask], [kv.used(seq)], m.attn_dtype))
            m.logits(h)
            kv.discard(seq)
        ms = {r: timed(lambda r=r: step(r)) for r in ROWS}
        print(f"| {dtype} | " + " | ".join(f"{ms[r]:.1f} ms ({ms[r] / ms[1]:.2f}x)" for r in ROWS) + " |", flush=True)
        x1 = torch.randn(1, a.dim).to(m.dtype)

        def product(mm, x):  # the product the step takes: the native kernel where it computes this one
            if isinstance(mm, Dense) and mm.native_ok and m.native is not None:
                return m.native.bf16_mm(x, mm.packed(mm.weight_t), True)
            return mm(x)
        mats = timed(lambda: [product(blk.w2, product(blk.w13, product(blk.wo, product(blk.wqkv, x1)[:, :a.dim]))
                                      [:, :a.hidden_dim]) for blk in m.layers])
        head = timed(lambda: m.logits(x1))
        weights = sum(matrix_bytes(mm) for blk in m.layers for mm in blk.matrices())
        head_bytes = nbytes(m.head_w8.codes, m.head_w8.d) if m.head_w8 is not None else nbytes(m.head_t)
        kv_bytes = ctx * kv.slot_bytes
        total = weights + head_bytes + kv_bytes
        floors.append((dtype, total, total / bw / 1e6, ms[1], mats, head))
    print("\n| precision | bytes a plain step reads | floor at copy bandwidth | plain step | layer matrices | "
          "LM head | the rest |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for dtype, total, floor, step_ms, mats, head in floors:
        print(f"| {dtype} | {total / 2**20:.0f} MiB | {floor:.1f} ms | {step_ms:.1f} ms ({step_ms / floor:.1f}x) | "
              f"{mats:.1f} ms | {head:.1f} ms | {step_ms - mats - head:.1f} ms |")


if __name__ == "__main__":
    main()
