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
        """One kernel everywhere, unprobed (GPUs, LLM_DECODE_KERNELS)."""
        return cls({p: {b: kernel for b in (*BUCKETS, 0)} for p in PRODUCTS}, chosen=True)


def _time(fn, reps: int = 2) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


DECODE_BUCKETS = (1, 2, 4, 8, 16)  # the row counts of decode steps and trees that a kernel choice weighs


def dense_kernels(dtype: torch.dtype) -> tuple[str, ...]:
    """The kernels a Dense product may take: all in float32; in bfloat16 not padded_t, which changes
    the product's shape with the row count (never invariant)."""
    return KERNELS if dtype == torch.float32 else ("xw", "linear")


def padded(fn, rows: int):
    """`fn` with its input padded by zero rows to at least `rows` (and the extra rows dropped)."""
    if rows <= 1:
        return fn
    return lambda x: fn(at_least(x, rows))[:x.reshape(-1, x.shape[-1]).shape[0]]


def candidates(model) -> dict[str, dict[str, list]]:
    """product -> kernel -> [the product's function in every layer] (one for the head): what the
    plan chooses among. Dense matrices take `matmul` with a kernel name, 4-bit ones their one kernel;
    the q4 mode's 8-bit head is a candidate beside the bfloat16 head."""
    from components.model.linear import Dense
    out: dict[str, dict[str, list]] = {}
    for name in PRODUCTS[:-1]:
        mats = [getattr(b, name) for b in model.layers]
        if all(isinstance(m, Dense) for m in mats):
            out[name] = {k: [lambda x, m=m, k=k: matmul(x, m.weight, m.weight_t, k) for m in mats]
                         for k in dense_kernels(model.dtype)}
        else:
            out[name] = {"int4": [lambda x, m=m: m.product(x) for m in mats]}
    w, wt = model.lm_head, (model.tok_embeddings.weight if model.args.tie_embeddings else model.lm_head_t)
    out["head"] = {k: [lambda x, k=k: matmul(x, w, wt, k)] for k in dense_kernels(model.dtype)}
    if getattr(model, "head_q8", None) is not None:
        out["head"]["int8"] = [model.head_q8.product]
    return out


def in_features(model, product: str) -> int:
    return model.args.dim if product == "head" else getattr(model.layers[0], product).in_features


@torch.inference_mode()
def measure(model) -> KernelPlan:
    """Choose each product's kernel on the model's own matrices (a few seconds for SmolLM2).

    float32 takes the fastest kernel per bucket: its products are not batch-invariant under any
    kernel (a row's last bits depend on the row count), so mixing kernels costs nothing more there.
    bfloat16 and q4 need a row's bits to be the same whatever rows come with it, so that a tree's
    rows and a batch's get the bits of the plain steps they replace. For each product and kernel
    the probe finds the fewest rows from which the kernel is invariant (`min_invariant_rows`), and
    the plan takes the invariant (kernel, padding) pair that costs least over the decode-sized row
    counts, one kernel for every row count. Where no pair is invariant, min_rows is 0 and the
    product is reported (`KernelPlan.lossy`)."""
    dt = model.dtype
    kernels, min_rows = {}, {}
    for product, options in candidates(model).items():
        k = in_features(model, product)
        xs = {b: torch.randn(b, k, dtype=dt) for b in BUCKETS}
        if dt == torch.float32:
            kernels[product] = {b: min(options, key=lambda n: _time(lambda: [f(xs[b]) for f in options[n]]))
                                for b in BUCKETS}
            kernels[product][0] = kernels[product][BUCKETS[-1]]
            continue
        best, best_cost, best_rows = None, float("inf"), 0
        for name, fns in options.items():
            rows = min_invariant_rows(fns[0], k, dt)
            if rows == 0:
                continue
            cost = sum(_time(lambda: [padded(f, rows)(xs[b]) for f in fns]) for b in DECODE_BUCKETS)
            if cost < best_cost:
                best, best_cost, best_rows = name, cost, rows
        if best is None:  # nothing invariant: the fastest kernel, and the product is reported lossy
            best = min(options, key=lambda n: sum(_time(lambda: [f(xs[b]) for f in options[n]]) for b in DECODE_BUCKETS))
        kernels[product] = {b: best for b in (*BUCKETS, 0)}
        min_rows[product] = best_rows
    return KernelPlan(kernels, min_rows if dt != torch.float32 else None, chosen=True)


PROBE_ROWS = 128  # a prefill of a few prompts, or a batch of trees, together
PROBE_GROUPS = (1, 2, 3, 4, 5, 8, 13, 16, 24, 32, 48, 64)  # each compared against all PROBE_ROWS at once
PAD_TO = (1, 2, 4, 8, 16, 32, 64)  # the paddings tried, fewest first


@torch.inference_mode()
def min_invariant_rows(fn, k: int, dtype: torch.dtype, device=None) -> int:
    """The fewest rows (one of `PAD_TO`) such that `fn` (a product on (rows, k) inputs), with its
    input padded to that many rows, gives every row the same bits whatever number of rows it is
    computed with: PROBE_ROWS random rows computed at once, then in groups of each PROBE_GROUPS
    size, compared bit for bit (stopping at the first difference). 1: batch-invariant as it is;
    2: the one-row path differs (oneDNN's bfloat16 gemv with a long inner dimension on AVX-512);
    32: oneDNN's bfloat16 product on AMX; 0: no invariance found."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(PROBE_ROWS, k, generator=g).to(device=device, dtype=dtype)
    ref = fn(x)
    for rows in PAD_TO:
        f = padded(fn, rows)
        if all(torch.equal(f(x[i:i + r]), ref[i:i + r]) for r in PROBE_GROUPS for i in range(0, PROBE_ROWS, r)):
            return rows
    return 0


def machine_key(model) -> str:
    """CPU model and features, torch version and threads, model shapes and precision, plan version."""
    a = model.args
    parts = [*machine_parts(model.device), f"{a.n_layers}x{a.dim}x{a.hidden_dim}x{a.vocab_size}",
             model.precision, str(a.tie_embeddings), "plan-v5", os.environ.get("LLM_DECODE_HEAD", "")]
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
        return KernelPlan.single("linear")
    forced = os.environ.get("LLM_DECODE_KERNELS")
    if forced:
        if forced not in KERNELS:
            raise ValueError(f"LLM_DECODE_KERNELS must be one of {', '.join(KERNELS)}, got {forced!r}")
        return KernelPlan.single(forced)
    path = None if cache is None else cache / f"kernels-{machine_key(model)}.json"
    if path is not None and path.is_file():
        return KernelPlan(**json.loads(path.read_text()))
    plan = measure(model)
    if path is not None:
        from pipeline.core import atomic_write
        atomic_write(path, json.dumps(plan.to_json()))
    return plan


def _precision_key(args, device: torch.device, native: bool) -> str:
    parts = [*machine_parts(device), f"{args.n_layers}x{args.dim}x{args.hidden_dim}x{args.n_heads}x{args.n_kv_heads}",
             str(args.vocab_size), f"native={native}", "precision-v3"]
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]


@torch.inference_mode()
def precision_costs(args, candidates: list[str], device: torch.device, cache: Path | None, rows: int = 1,
                    native: bool = True) -> dict[str, dict]:
    """Per precision: `ms`, the products of one step of `rows` rows (the run's batch size times its
    tree's rows: one layer's four matrices scaled to all layers, plus the LM head), on random
    matrices of the model's shapes with the kernels the model will run (the native ones where built
    and `native`), what `precision=auto` picks by; and `invariant`, whether every product torch
    computes has a batch-invariant path here (`min_invariant_rows`; the native products are
    invariant by construction), without which a tree or a batch in that precision may give other
    tokens than plain greedy. Seconds per new row count; cached per machine, thread count, model
    shape and row count."""
    from components.model import native as native_mod
    ops = native_mod.load() if native and device.type == "cpu" else None
    path = None if cache is None else cache / f"precisions-{_precision_key(args, device, ops is not None)}.json"
    known = json.loads(path.read_text()) if path is not None and path.is_file() else {}
    todo = [c for c in candidates if f"{c}@{rows}" not in known]
    qkv = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
    shapes = [(args.dim, qkv), (args.n_heads * args.head_dim, args.dim), (args.dim, 2 * args.hidden_dim),
              (args.hidden_dim, args.dim)]  # [in, out]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for mode in todo:
        inv = next((v["invariant"] for k, v in known.items() if k.startswith(f"{mode}@")), None)
        try:
            known[f"{mode}@{rows}"] = _precision_cost(mode, args, shapes, device, sync, rows, ops, inv)
        except RuntimeError:  # this device has no kernel for it (e.g. int4 on an old GPU): not a candidate
            known[f"{mode}@{rows}"] = {"ms": float("inf"), "invariant": False}
    if todo and path is not None:
        from pipeline.core import atomic_write
        atomic_write(path, json.dumps(known))
    out = {c: {**known[f"{c}@{rows}"], "rows": rows} for c in candidates if known[f"{c}@{rows}"]["ms"] != float("inf")}
    return out or {"float32": {"ms": 0.0, "invariant": False, "rows": rows}}


def _precision_cost(mode: str, args, shapes, device, sync, rows: int, ops, invariant: bool | None) -> dict:
    """ms of one step's products at `rows` rows in `mode`, and whether each product torch computes
    has an invariant kernel (float32: never probed, see `measure`; `invariant`: already known)."""
    from components.model.linear import Int4, quantize_q4
    total, probe = 0.0, invariant is None and mode != "float32" and device.type == "cpu"
    inv = (mode != "float32" and device.type == "cpu") if invariant is None else invariant  # unprobed: not vouched for
    for k, n in [*shapes, (args.dim, args.vocab_size)]:
        w = torch.randn(k, n, device=device) * 0.02
        head = n == args.vocab_size
        if mode == "q4" and not head:
            m = Int4(*quantize_q4(w.t().cpu()), device=device)
            fns, native_product = {"int4": m.product}, False
            dt = torch.bfloat16
        else:
            dt = torch.bfloat16 if mode == "q4" else getattr(torch, mode)
            wd, wt = w.to(dt), w.t().contiguous().to(dt)
            native_product = ops is not None and dt == torch.bfloat16 and n % 4 == 0  # as Dense.native_ok
            if native_product:  # the head's logits stay float32, a layer's outputs are rounded to bfloat16
                fns = {"native": lambda x, wt=wt, head=head: ops.bf16_mm(x, wt, not head)}
            else:
                fns = {kern: (lambda x, kern=kern, wd=wd, wt=wt: matmul(x, wd, wt, kern)) for kern in dense_kernels(dt)}
        x = torch.randn(rows, k, device=device).to(dt)
        ms = min(_time(lambda f=f: (f(x), sync()), reps=3) for f in fns.values()) * 1e3
        total += ms if head else ms * args.n_layers
        if probe and inv and not native_product:
            inv = any(min_invariant_rows(f, k, dt, device) > 0 for f in fns.values())
    return {"ms": round(total, 3), "invariant": inv}
