"""Which products give a row the same bits whatever number of rows it is computed with, on this machine.

    python scripts/kernel_invariance.py

For each precision's kernel and each of the default model's matrix shapes: 200 random rows, computed
one at a time and in groups of 2, 3, 8, 16, 64; prints how many output values differ from the one-row
results and from the two-row results. Then the attention's reductions (q.k over the head dim,
softmax and p.v over the context) in float32 and float64 for a plain step against a tree row that
sees the same keys with masked siblings between them. This is what components/model/tuner.py
probes at load (`min_invariant_rows`) and why bfloat16/q4 attend in float64 (Transformer.attn_dtype).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from components.model.linear import Int4, quantize_q4

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]  # [in, out]
GROUPS = (2, 3, 8, 16, 64)


def products(k: int, n: int):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(k, n, generator=g) * 0.05
    wb, wbt = w.bfloat16(), w.t().contiguous().bfloat16()
    out = {"float32 x@W": (lambda x: x @ w, torch.float32), "float32 linear": (lambda x, t=w.t().contiguous(): F.linear(x, t), torch.float32),
           "bfloat16 x@W": (lambda x: x @ wb, torch.bfloat16), "bfloat16 linear": (lambda x: F.linear(x, wbt), torch.bfloat16)}
    if n <= 4096:
        m = Int4(*quantize_q4(w.t()))
        out["int4 (q4)"] = (m, torch.bfloat16)
    return out


def mismatches(fn, x: torch.Tensor) -> dict[str, int]:
    one = torch.cat([fn(x[i:i + 1]) for i in range(len(x))])
    two = torch.cat([fn(x[i:i + 2]) for i in range(0, len(x), 2)])
    res = {}
    for r in GROUPS:
        many = torch.cat([fn(x[i:i + r]) for i in range(0, len(x), r)])
        res[r] = (int((many != one).sum()), int((many != two).sum()))
    return res


def attention_check(dtype: torch.dtype, n: int = 2000, S: int = 300) -> tuple[int, float, int]:
    """n queries attending a plain step's S keys, and the same queries as tree rows whose keys have
    7 masked siblings interleaved (as a tree lays them out): (values differing, the largest
    difference, values differing once rounded to bfloat16, what the bfloat16 model consumes)."""
    g = torch.Generator().manual_seed(1)
    bf = lambda *shape: torch.randn(*shape, generator=g).to(torch.bfloat16).to(dtype)  # noqa: E731
    q, k, v, extra = bf(n, 64), bf(S, 64), bf(S, 64), bf(7, 64)
    kt = torch.cat([k[:S - 3], extra[:4], k[S - 3:], extra[4:]])
    vt = torch.cat([v[:S - 3], extra[:4], v[S - 3:], extra[4:]])
    bias = torch.zeros(S + 7, dtype=dtype)
    bias[S - 3:S + 1] = float("-inf")
    bias[S + 4:] = float("-inf")
    plain = torch.softmax((q @ k.t()) / 8.0, -1) @ v
    tree = torch.cat([torch.softmax((q[i:i + 8] @ kt.t()) / 8.0 + bias, -1) @ vt for i in range(0, n, 8)])
    return (int((plain != tree).sum()), float((plain - tree).abs().max()),
            int((plain.bfloat16() != tree.bfloat16()).sum()))


def main():
    print(f"CPU capability: {torch.backends.cpu.get_cpu_capability()}, threads: {torch.get_num_threads()}")
    print("\n| product | [in, out] | values differing from one-row / two-row results, by group size |")
    print("|---|---|---|")
    for k, n in SHAPES:
        x = torch.randn(64 * 3, k, generator=torch.Generator().manual_seed(2))
        for name, (fn, dt) in products(k, n).items():
            res = mismatches(fn, x.to(dt))
            cells = ", ".join(f"{r}: {a}/{b}" for r, (a, b) in res.items())
            print(f"| {name} | [{k}, {n}] | {cells} |")
    print("\n| attention dtype | values differing, plain step vs tree row (of 128,000) | largest difference | "
          "differing after rounding to bfloat16 |")
    print("|---|---:|---:|---:|")
    for dt in (torch.float32, torch.float64):
        a, m, b = attention_check(dt)
        print(f"| {str(dt).removeprefix('torch.')} | {a} | {m:.1e} | {b} |")


if __name__ == "__main__":
    main()
