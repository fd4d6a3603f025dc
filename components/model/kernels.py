"""The matmul arithmetic of the Dense products: the kernels a product may take for a few rows
(`x @ W` on the [in, out] layout, `F.linear` on the [out, in] layout, `(W^T x^T)^T` with the rows
padded to a multiple of 16), the zero-row padding that makes a kernel batch-invariant, and the
`KernelPlan` that says which kernel each product takes for how many rows.

Which plan is fastest on a machine is measured by components/model/tuner.py; which precision
`model.dtype=auto` runs in, by components/model/cost_model.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

KERNELS = ("xw", "linear", "padded_t")  # Dense products; plus "int4" (q4 layers) and "int8" (the q4 mode's 8-bit head)
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # a row count uses the plan of the first bucket >= it
ROW_BLOCK = 16


def pad_rows(x2: torch.Tensor) -> torch.Tensor:
    """x2: (rows, in) -> (rows rounded up to ROW_BLOCK, in), zero rows appended."""
    extra = -x2.shape[0] % ROW_BLOCK
    return x2 if extra == 0 else torch.cat((x2, x2.new_zeros(extra, x2.shape[1])))


def at_least(x2: torch.Tensor, rows: int) -> torch.Tensor:
    """x2: (n, in) -> at least `rows` rows (zero rows appended): the product then takes the kernel's
    multi-row path, whose bits for a row do not depend on the row count (see `min_invariant_rows`)."""
    return x2 if x2.shape[0] >= rows else torch.cat((x2, x2.new_zeros(rows - x2.shape[0], x2.shape[1])))


def matmul(x: torch.Tensor, w: torch.Tensor, wt: torch.Tensor | None, kernel: str, min_rows: int = 1) -> torch.Tensor:
    """x: (..., in) times the matrix stored as w (in, out) and, optionally, wt (out, in)."""
    x2 = x.reshape(-1, x.shape[-1])
    n = x2.shape[0]
    if n < min_rows:
        x2 = at_least(x2, min_rows)
    if kernel == "xw" or wt is None:
        y = x2 @ w
    elif kernel == "linear":
        y = F.linear(x2, wt)
    else:
        y = torch.mm(wt, pad_rows(x2).t())[:, :x2.shape[0]].t()  # (rows, out)
    if y.shape[0] != n:
        y = y[:n]
    return y.view(*x.shape[:-1], y.shape[-1])


PRODUCTS = ("wqkv", "wo", "w13", "w2", "head")  # a layer's four matrices (the same shapes in every layer) and the LM head


class KernelPlan:
    """For each product (`PRODUCTS`): bucket -> kernel, and the fewest rows it is computed with
    (`min_rows`: a product is padded with zero rows up to it, the smallest row count from which the
    kernel gives a row the same bits whatever rows come with it; 0 where no invariant path was
    found on this machine). `probed`: invariance was measured here."""

    def __init__(self, kernels: dict[str, dict[int, str]] | None = None, min_rows: dict[str, int] | None = None,
                 chosen: bool = False):
        self.kernels = {p: {int(b): k for b, k in v.items()} for p, v in (kernels or {}).items()}
        self.min_rows = {**{p: 1 for p in PRODUCTS}, **(min_rows or {})}
        self.probed = min_rows is not None
        self.chosen = chosen or self.probed  # set for a decoding model (False: a model never optimized)

    @staticmethod
    def bucket(rows: int) -> int:
        return next((b for b in BUCKETS if rows <= b), 0)  # 0: more rows than any bucket

    def kernel(self, product: str, rows: int) -> str:
        return self.kernels.get(product, {}).get(self.bucket(rows), "xw")

    def invariant(self, products=PRODUCTS) -> bool:
        """Every one of `products` has a batch-invariant path here (then a tree's rows get the plain
        steps' bits)."""
        return self.probed and all(self.min_rows[p] > 0 for p in products)

    def lossy(self, products=PRODUCTS) -> list[str]:
        """The products with no invariant path found (all of them where nothing was probed)."""
        return [p for p in products if not self.probed or self.min_rows[p] <= 0]

    def to_json(self) -> dict:
        return {"kernels": self.kernels, "min_rows": self.min_rows}

    @classmethod
    def single(cls, kernel: str) -> "KernelPlan":
        """One kernel everywhere, unprobed (GPUs, `model.kernels=<kernel>`)."""
        return cls({p: {b: kernel for b in (*BUCKETS, 0)} for p in PRODUCTS}, chosen=True)


def dense_kernels(dtype: torch.dtype) -> tuple[str, ...]:
    """The kernels a Dense product may take: all in float32; in bfloat16 not padded_t, which changes
    the product's shape with the row count (never invariant)."""
    return KERNELS if dtype == torch.float32 else ("xw", "linear")


def padded(fn, rows: int):
    """`fn` with its input padded by zero rows to at least `rows` (and the extra rows dropped)."""
    if rows <= 1:
        return fn
    return lambda x: fn(at_least(x, rows))[:x.reshape(-1, x.shape[-1]).shape[0]]


