"""Which matmul kernel to use for how many rows, measured on this machine, not assumed.

A decode step multiplies a few rows (1 for a plain step of one sequence, up to ~100 for trees of a
batch) by every weight matrix. Which way of doing it (components/model/kernels.py) is fastest
depends on the CPU (AVX2 or AVX-512, the BLAS's small-M blocking) and the row count; which padding
makes it batch-invariant, too. Measured once per machine, model shape, dtype and thread count, on
the real shapes of the model, and cached beside the converted weights.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path

import torch

from components.model.kernels import BUCKETS, KERNELS, PRODUCTS, KernelPlan, dense_kernels, matmul, padded
from components.model.linear import Dense
from pipeline.core import atomic_write

def best_time(fn, reps: int = 2) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


DECODE_BUCKETS = (1, 2, 4, 8, 16)  # the row counts of decode steps and trees that a kernel choice weighs


def candidates(model) -> dict[str, dict[str, list]]:
    """product -> kernel -> [the product's function in every layer] (one for the head): what the
    plan chooses among. Dense matrices take `matmul` with a kernel name, 4-bit ones their one kernel;
    the q4 mode's 8-bit head is a candidate beside the bfloat16 head."""
    out: dict[str, dict[str, list]] = {}
    for name in PRODUCTS[:-1]:
        mats = [getattr(b, name) for b in model.layers]
        if getattr(mats[0], "activations", "") == "int8":
            continue  # w4a8: the native integer product, invariant by construction (nothing to choose)
        if all(isinstance(m, Dense) for m in mats):
            out[name] = {k: [lambda x, m=m, k=k: matmul(x, m.weight, m.weight_t, k) for m in mats]
                         for k in dense_kernels(model.dtype)}
        else:
            out[name] = {"int4": [lambda x, m=m: m.product(x) for m in mats]}
    w, wt = model.lm_head, (model.tok_embeddings.weight if model.args.tie_embeddings else model.lm_head_t)
    if model.activations == "int8" and wt.shape[0] % 16 == 0 and wt.shape[1] % 32 == 0:
        return out  # and its head: Q8_0 blocks times int8 rows (Int8Blocks)
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
    options_of = candidates(model)
    kernels = {p: {b: "native" for b in (*BUCKETS, 0)} for p in PRODUCTS if p not in options_of}
    min_rows = {p: 1 for p in kernels}  # the products the native integer kernels compute (w4a8)
    for product, options in options_of.items():
        k = in_features(model, product)
        xs = {b: torch.randn(b, k, dtype=dt) for b in BUCKETS}
        if dt == torch.float32:
            kernels[product] = {b: min(options, key=lambda n: best_time(lambda: [f(xs[b]) for f in options[n]]))
                                for b in BUCKETS}
            kernels[product][0] = kernels[product][BUCKETS[-1]]
            continue
        best, best_cost, best_rows = None, float("inf"), 0
        for name, fns in options.items():
            rows = min_invariant_rows(fns[0], k, dt)
            if rows == 0:
                continue
            cost = sum(best_time(lambda: [padded(f, rows)(xs[b]) for f in fns]) for b in DECODE_BUCKETS)
            if cost < best_cost:
                best, best_cost, best_rows = name, cost, rows
        if best is None:  # nothing invariant: the fastest kernel, and the product is reported lossy
            best = min(options, key=lambda n: sum(best_time(lambda: [f(xs[b]) for f in options[n]]) for b in DECODE_BUCKETS))
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
    """CPU model and features, torch version and threads, model shapes and precision, plan version,
    and whether the 8-bit head is a candidate (`model.head=int8`)."""
    a = model.args
    parts = [*machine_parts(model.device), f"{a.n_layers}x{a.dim}x{a.hidden_dim}x{a.vocab_size}",
             model.precision, str(a.tie_embeddings), "plan-v5", "int8" if model.head_q8 is not None else ""]
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]


def machine_parts(device: torch.device) -> list[str]:
    """What a measurement on this machine depends on: CPU model and features, the device (and its
    GPU), torch version, thread count, the CPU capability torch dispatches to, and the ISA caps
    oneDNN and MKL are given (`ONEDNN_MAX_CPU_ISA`, `MKL_ENABLE_INSTRUCTIONS`: another kernel path)."""
    cpu = ""
    if Path("/proc/cpuinfo").is_file():
        info = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
        cpu = "|".join(line for line in info.splitlines() if line.startswith(("model name", "flags")))
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    isa = [f"{k}={os.environ.get(k, '')}" for k in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")]
    return [cpu or platform.processor(), str(device), gpu, torch.__version__, str(torch.get_num_threads()),
            torch.backends.cpu.get_cpu_capability(), *isa]


def plan_for(model, cache: Path | None, kernels: str = "auto") -> KernelPlan:
    """The cached plan for this machine and model, measured on first use (`kernels="auto"`); a
    kernel name (one of `KERNELS`: `model.kernels=xw`, ...) forces that kernel everywhere."""
    if kernels != "auto" and kernels not in KERNELS:
        raise ValueError(f"`kernels` must be auto or one of {', '.join(KERNELS)}, got {kernels!r}")
    if model.device.type != "cpu":  # GPUs: the [out, in] layout, cuBLAS picks its own kernels
        return KernelPlan.single("linear")
    if kernels != "auto":
        return KernelPlan.single(kernels)
    path = None if cache is None else cache / f"kernels-{machine_key(model)}.json"
    if path is not None and path.is_file():
        return KernelPlan(**json.loads(path.read_text()))
    plan = measure(model)
    if path is not None:
        atomic_write(path, json.dumps(plan.to_json()))
    return plan


