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

KERNELS = ("xw", "linear", "padded_t")  # plus "int8" for the q4 mode's LM head (Transformer.head_q8)
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


class KernelPlan:
    """bucket -> kernel, for the layer matrices and for the LM head; and the fewest rows each product
    is computed with (`min_rows`: 2 where the one-row path gives other bits than the multi-row one)."""

    def __init__(self, layers: dict[int, str] | None = None, head: dict[int, str] | None = None,
                 min_rows: dict[str, int] | None = None):
        self.layers = {int(k): v for k, v in (layers or {}).items()}
        self.head = {int(k): v for k, v in (head or {}).items()}
        self.min_rows = {"layers": 1, "head": 1, **(min_rows or {})}
        self.probed = min_rows is not None  # invariance measured on this machine

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


ONE_KERNEL_BUCKETS = (1, 2, 4, 8, 16)  # the row counts of decode steps and trees that the choice weighs


def single(times: dict[int, dict[str, float]], kernels: tuple[str, ...]) -> str:
    """The one kernel with the least total time over the decode-sized buckets."""
    return min(kernels, key=lambda k: sum(times[b][k] for b in ONE_KERNEL_BUCKETS))


@torch.inference_mode()
def measure(model) -> KernelPlan:
    """Time every kernel at every bucket on the model's own matrices (a few seconds for SmolLM2).

    float32 takes the fastest kernel per bucket: its products are not batch-invariant under any
    kernel (a row's last bits depend on the row count), so mixing kernels costs nothing more there.
    bfloat16 products are batch-invariant within one kernel (scripts/kernel_invariance.py), and a
    tree's rows must get the bits of the plain steps they replace: one kernel for every row count,
    and the padded one (which changes the product's shape with the row count) is not a candidate."""
    from components.model.linear import Dense
    mats = [(m.weight, m.weight_t) for b in model.layers for m in b.matrices() if isinstance(m, Dense)]
    head_mats = head = (model.lm_head, model.tok_embeddings.weight if model.args.tie_embeddings else model.lm_head_t)
    head_q8 = getattr(model, "head_q8", None)  # the q4 mode's 8-bit head: a candidate beside the bfloat16 one
    plan, per_bucket = KernelPlan(), {}
    for rows in BUCKETS:
        xs = [torch.randn(rows, w.shape[0], dtype=w.dtype) for w, _ in mats]
        h = torch.randn(rows, head[0].shape[0], dtype=head[0].dtype)
        head_t = {k: _time(lambda k=k: matmul(h, head[0], head[1], k)) for k in KERNELS}
        if head_q8 is not None:
            head_t["int8"] = _time(lambda: head_q8(h))
        layer_t = {k: _time(lambda k=k: [matmul(x, w, wt, k) for x, (w, wt) in zip(xs, mats)])
                   for k in KERNELS} if mats else {}  # q4 layers have one kernel
        per_bucket[rows] = (layer_t, head_t)
    if model.dtype == torch.float32:
        for rows, (layer_t, head_t) in per_bucket.items():
            if layer_t:
                plan.layers[rows] = min(layer_t, key=layer_t.get)
            plan.head[rows] = min(head_t, key=head_t.get)
        return plan
    invariant = ("xw", "linear")
    head = single({b: h for b, (_, h) in per_bucket.items()}, invariant + (("int8",) if head_q8 is not None else ()))
    layer = single({b: l for b, (l, _) in per_bucket.items()}, invariant) if mats else "xw"
    buckets = (*BUCKETS, 0)  # 0: more rows than the last bucket (prompts) take the same kernel
    dt = model.dtype
    head_fn = head_q8 if head == "int8" else (lambda x: matmul(x, *head_mats, head))
    min_rows = {"head": min_invariant_rows(head_fn, head_mats[0].shape[0], dt)}
    if head == "int8" and min_rows["head"] == 0:  # not batch-invariant on this machine: never worth a lossy tree
        head = single({b: h for b, (_, h) in per_bucket.items()}, invariant)
        min_rows["head"] = min_invariant_rows(lambda x: matmul(x, *head_mats, head), head_mats[0].shape[0], dt)
    probes = [min_invariant_rows(lambda x, m=m: m(x, layer), m.in_features, dt) for m in model.layers[0].matrices()]
    min_rows["layers"] = 0 if 0 in probes else max(probes)
    return KernelPlan({b: layer for b in buckets}, {b: head for b in buckets}, min_rows)


PROBE_GROUPS = (1, 2, 3, 4, 8, 16, 32, 64)


@torch.inference_mode()
def min_invariant_rows(fn, k: int, dtype: torch.dtype, device=None) -> int:
    """The fewest rows from which `fn` (a product on (rows, k) inputs) gives every row the same bits
    whatever number of rows it is computed with: 64 random rows, computed in groups of 1, 2, 3, 4,
    8, 16, 32 and all 64, compared bit for bit. 1: batch-invariant; 2: the one-row path differs
    (oneDNN's bfloat16 gemv with a long inner dimension does, measured); 0: no invariance found."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(PROBE_GROUPS[-1], k, generator=g).to(device=device, dtype=dtype)
    outs = {r: torch.cat([fn(x[i:i + r]) for i in range(0, len(x), r)]) for r in PROBE_GROUPS}
    ref = outs[PROBE_GROUPS[-1]]
    for m in PROBE_GROUPS:
        if all(torch.equal(outs[r], ref) for r in PROBE_GROUPS if r >= m):
            return m if m <= 2 else 0  # beyond 2 rows, padding every product would cost too much
    return 0


def machine_key(model) -> str:
    """CPU model and features, torch version and threads, model shapes and precision, plan version."""
    a = model.args
    parts = [*machine_parts(model.device), f"{a.n_layers}x{a.dim}x{a.hidden_dim}x{a.vocab_size}",
             model.precision, str(a.tie_embeddings), "plan-v4", os.environ.get("LLM_DECODE_HEAD", "")]
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]


def machine_parts(device: torch.device) -> list[str]:
    """What a measurement on this machine depends on: CPU model and features, the device (and its
    GPU), torch version, thread count, the CPU capability torch dispatches to."""
    cpu = ""
    if Path("/proc/cpuinfo").is_file():
        info = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
        cpu = "|".join(line for line in info.splitlines() if line.startswith(("model name", "flags")))
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return [cpu or platform.processor(), str(device), gpu, torch.__version__, str(torch.get_num_threads()),
            torch.backends.cpu.get_cpu_capability()]


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
        atomic_write(path, json.dumps({"layers": plan.layers, "head": plan.head, "min_rows": plan.min_rows}))
    return plan


def _precision_key(args, device: torch.device) -> str:
    parts = [*machine_parts(device), f"{args.n_layers}x{args.dim}x{args.hidden_dim}x{args.n_heads}x{args.n_kv_heads}"]
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]


@torch.inference_mode()
def precision_costs(args, candidates: list[str], device: torch.device, cache: Path | None) -> dict[str, float]:
    """Milliseconds for the layer matrices of one plain step plus one 8-row tree, per precision, on
    random matrices of the model's shapes (one layer, scaled to all): what `precision=auto` picks by.
    About a second; cached per machine, thread count and model shape."""
    path = None if cache is None else cache / f"precisions-{_precision_key(args, device)}.json"
    known = json.loads(path.read_text()) if path is not None and path.is_file() else {}
    todo = [c for c in candidates if c not in known]
    qkv = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
    shapes = [(args.dim, qkv), (args.n_heads * args.head_dim, args.dim), (args.dim, 2 * args.hidden_dim),
              (args.hidden_dim, args.dim)]  # [in, out]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for mode in todo:
        try:
            known[mode] = _precision_cost(mode, args, shapes, device, sync)
        except RuntimeError:  # this device has no kernel for it (e.g. int4 on an old GPU): not a candidate
            known[mode] = float("inf")
    if todo and path is not None:
        from pipeline.core import atomic_write
        atomic_write(path, json.dumps(known))
    out = {c: known[c] for c in candidates if known[c] != float("inf")}
    return out or {"float32": 0.0}


def _precision_cost(mode: str, args, shapes, device, sync) -> float:
    """ms of the model's layer matrices for a plain step plus an 8-row tree in `mode` (one layer, scaled)."""
    from components.model.linear import Int4, quantize_q4
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
    return round(total * args.n_layers * 1e3, 3)
