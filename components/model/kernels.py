"""Which matmul kernel to use for how many rows, measured on this machine, not assumed.

A decode step multiplies a few rows (1 for a plain step of one sequence, up to ~100 for trees of a
batch) by every weight matrix. Which way of doing it is fastest depends on the CPU (AVX2 or
AVX-512, the BLAS's small-M blocking) and the row count: `x @ W` on the [in, out] layout (a
gemv-like read for one row), `F.linear` on the [out, in] layout, or `(W^T x^T)^T` with the rows
padded to a multiple of 16. Measured once per machine, model shape, dtype and thread count, on the
real shapes of the model, and cached beside the converted weights.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

KERNELS = ("xw", "linear", "padded_t")
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # a row count uses the plan of the first bucket >= it
ROW_BLOCK = 16


def pad_rows(x2: torch.Tensor) -> torch.Tensor:
    """x2: (rows, in) -> (rows rounded up to ROW_BLOCK, in), zero rows appended."""
    extra = -x2.shape[0] % ROW_BLOCK
    return x2 if extra == 0 else torch.cat((x2, x2.new_zeros(extra, x2.shape[1])))


def matmul(x: torch.Tensor, w: torch.Tensor, wt: torch.Tensor | None, kernel: str) -> torch.Tensor:
    """x: (..., in) times the matrix stored as w (in, out) and, optionally, wt (out, in)."""
    if kernel == "xw" or wt is None:
        return x @ w
    x2 = x.reshape(-1, x.shape[-1])
    if kernel == "linear":
        y = F.linear(x2, wt)
    else:
        y = torch.mm(wt, pad_rows(x2).t())[:, :x2.shape[0]].t()  # (rows, out)
    return y.reshape(*x.shape[:-1], wt.shape[0])


class KernelPlan:
    """bucket -> kernel, for the layer matrices and for the LM head."""

    def __init__(self, layers: dict[int, str] | None = None, head: dict[int, str] | None = None):
        self.layers = {int(k): v for k, v in (layers or {}).items()}
        self.head = {int(k): v for k, v in (head or {}).items()}

    @staticmethod
    def bucket(rows: int) -> int:
        return next((b for b in BUCKETS if rows <= b), 0)  # 0: more rows than any bucket

    def layer(self, rows: int) -> str:
        return self.layers.get(self.bucket(rows), "xw")

    def lm_head(self, rows: int) -> str:
        return self.head.get(self.bucket(rows), "xw")


def _time(fn, reps: int = 2) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


@torch.inference_mode()
def measure(model) -> KernelPlan:
    """Time every kernel at every bucket on the model's own matrices (a few seconds for SmolLM2)."""
    from components.model.linear import Dense
    mats = [(m.weight, m.weight_t) for b in model.layers for m in b.matrices() if isinstance(m, Dense)]
    head = (model.lm_head, model.tok_embeddings.weight if model.args.tie_embeddings else model.lm_head_t)
    plan = KernelPlan()
    for rows in BUCKETS:
        xs = [torch.randn(rows, w.shape[0], dtype=w.dtype) for w, _ in mats]
        h = torch.randn(rows, head[0].shape[0], dtype=head[0].dtype)
        head_t = {k: _time(lambda k=k: matmul(h, head[0], head[1], k)) for k in KERNELS}
        if mats:  # q4 layers have one kernel
            layer_t = {k: _time(lambda k=k: [matmul(x, w, wt, k) for x, (w, wt) in zip(xs, mats)]) for k in KERNELS}
            plan.layers[rows] = min(layer_t, key=layer_t.get)
        plan.head[rows] = min(head_t, key=head_t.get)
    return plan


def machine_key(model) -> str:
    """CPU model and features, torch version and threads, model shapes and dtype."""
    cpu = ""
    if Path("/proc/cpuinfo").is_file():
        info = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
        cpu = "|".join(line for line in info.splitlines() if line.startswith(("model name", "flags")))
    a = model.args
    parts = [cpu or platform.processor(), torch.__version__, str(torch.get_num_threads()),
             torch.backends.cpu.get_cpu_capability(), f"{a.n_layers}x{a.dim}x{a.hidden_dim}x{a.vocab_size}",
             model.precision, str(a.tie_embeddings)]
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]


def plan_for(model, cache: Path | None) -> KernelPlan:
    """The cached plan for this machine and model, measured on first use. LLM_DECODE_KERNELS=xw
    (or linear, padded_t) forces one kernel everywhere."""
    if model.device.type != "cpu":  # GPUs: the [out, in] layout, cuBLAS picks its own kernels
        return KernelPlan({b: "linear" for b in BUCKETS}, {b: "linear" for b in BUCKETS})
    forced = os.environ.get("LLM_DECODE_KERNELS")
    if forced:
        if forced not in KERNELS:
            raise ValueError(f"LLM_DECODE_KERNELS must be one of {', '.join(KERNELS)}, got {forced!r}")
        return KernelPlan({b: forced for b in BUCKETS}, {b: forced for b in BUCKETS})
    path = None if cache is None else cache / f"kernels-{machine_key(model)}.json"
    if path is not None and path.is_file():
        return KernelPlan(**json.loads(path.read_text()))
    plan = measure(model)
    if path is not None:
        from pipeline.core import atomic_write
        atomic_write(path, json.dumps({"layers": plan.layers, "head": plan.head}))
    return plan


def _precision_key(args, device: torch.device) -> str:
    cpu = ""
    if Path("/proc/cpuinfo").is_file():
        info = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
        cpu = "|".join(line for line in info.splitlines() if line.startswith(("model name", "flags")))
    parts = [cpu, str(device), torch.__version__, str(torch.get_num_threads()), torch.backends.cpu.get_cpu_capability(),
             f"{args.n_layers}x{args.dim}x{args.hidden_dim}x{args.n_heads}x{args.n_kv_heads}"]
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]


@torch.inference_mode()
def precision_costs(args, candidates: list[str], device: torch.device, cache: Path | None) -> dict[str, float]:
    """Milliseconds for the layer matrices of one plain step plus one 8-row tree, per precision, on
    random matrices of the model's shapes (one layer, scaled to all): what `precision=auto` picks by.
    About a second; cached per machine, thread count and model shape."""
    from components.model.linear import Int4, quantize_q4
    path = None if cache is None else cache / f"precisions-{_precision_key(args, device)}.json"
    known = json.loads(path.read_text()) if path is not None and path.is_file() else {}
    todo = [c for c in candidates if c not in known]
    qkv = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
    shapes = [(args.dim, qkv), (args.n_heads * args.head_dim, args.dim), (args.dim, 2 * args.hidden_dim),
              (args.hidden_dim, args.dim)]  # [in, out]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for mode in todo:
        total = 0.0
        for k, n in shapes:
            w = torch.randn(k, n, device=device) * 0.02
            if mode == "q4":
                m = Int4(*quantize_q4(w.t().cpu()), device=device)
                fns = {"int4": lambda x, m=m: m(x)}
                dt = torch.bfloat16
            else:
                dt = getattr(torch, mode)
                wd, wt = w.to(dt), w.t().contiguous().to(dt)
                fns = {kern: (lambda x, kern=kern, wd=wd, wt=wt: matmul(x, wd, wt, kern)) for kern in KERNELS}
            for rows in (1, 8):
                x = torch.randn(rows, k, device=device).to(dt)
                total += min(_time(lambda f=f: (f(x), sync()), reps=5) for f in fns.values())
        known[mode] = round(total * args.n_layers * 1e3, 3)
    if todo and path is not None:
        from pipeline.core import atomic_write
        atomic_write(path, json.dumps(known))
    return {c: known[c] for c in candidates}
