"""The cost model of `model.dtype=auto`: what one decode step's products cost in each precision on
this machine, and whether each has a batch-invariant kernel here, measured on random matrices of the
model's shapes (components/model/load.py `resolve_precision` picks by it)."""
from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import torch

from components.kv.contiguous import ContiguousKV
from components.model import native as native_mod
from components.model.assemble import FOUR_BIT, build
from components.model.kernels import dense_kernels, matmul
from components.model.linear import (Dense, Int4, native_bf16_layout, native_w4a8_layout, native_w8a8_layout, quantize_q4,
                                     quantize_q8)
from components.model.llama import Transformer
from components.model.tuner import best_time, machine_parts, min_invariant_rows
from pipeline.core import StepBatch, atomic_write, forward_step

ROUNDS = 3  # measurements of each candidate, interleaved (`precision_costs`)


def _precision_key(args, device: torch.device, native: bool) -> str:
    """Machine, model shape, and the native build measured (its key digests the kernels' source and
    flags: new kernels are measured again, never judged by an old build's times)."""
    parts = [*machine_parts(device), f"{args.n_layers}x{args.dim}x{args.hidden_dim}x{args.n_heads}x{args.n_kv_heads}",
             str(args.vocab_size), f"native={native_mod.key() if native else False}", "precision-v9"]
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]


@torch.inference_mode()
def precision_costs(args, candidates: list[str], device: torch.device, cache: Path | None, rows: int = 1,
                    native: bool = True) -> dict[str, dict]:
    """Per precision: `ms`, one step of `rows` rows (the run's batch size times its tree's rows): its
    products (one layer's four matrices scaled to all layers, plus the LM head, on random matrices of
    the model's shapes with the kernels the model will run: the native ones where built and
    `native`) and the rest of its layers' work (`glue_ms` a layer: `_glue_ms`), what `precision=auto`
    picks by; and `invariant`, whether every product torch
    computes has a batch-invariant path here (`min_invariant_rows`; the native products are
    invariant by construction), without which a tree or a batch in that precision may give other
    tokens than plain greedy. Seconds per new row count; cached per machine, thread count, model
    shape and row count."""
    ops = native_mod.load() if native and device.type == "cpu" else None
    path = None if cache is None else cache / f"precisions-{_precision_key(args, device, ops is not None)}.json"
    known = json.loads(path.read_text()) if path is not None and path.is_file() else {}
    todo = [c for c in candidates if f"{c}@{rows}" not in known]
    qkv = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
    shapes = [(args.dim, qkv), (args.n_heads * args.head_dim, args.dim), (args.dim, 2 * args.hidden_dim),
              (args.hidden_dim, args.dim)]  # [in, out]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    # Rounds over the candidates in turn, each keeping its least: a shared 2-core machine's neighbours
    # add tens of percent to any one sample, for seconds at a time, more than the candidates differ.
    for _ in range(ROUNDS):
        for mode in todo:
            if known.get(f"{mode}@{rows}", {}).get("ms") == float("inf"):
                continue
            inv = next((v["invariant"] for k, v in known.items() if k.startswith(f"{mode}@")), None)
            try:
                cost = _precision_cost(mode, args, shapes, device, sync, rows, ops, inv)
                cost["glue_ms"] = round(_glue_ms(mode, args, device, sync, rows, ops is not None), 3)
                cost["ms"] = round(cost["ms"] + args.n_layers * cost["glue_ms"], 3)
            except RuntimeError:  # this device has no kernel for it (e.g. int4 on an old GPU): not a candidate
                cost = {"ms": float("inf"), "invariant": False}
            if f"{mode}@{rows}" not in known or cost["ms"] < known[f"{mode}@{rows}"]["ms"]:
                known[f"{mode}@{rows}"] = cost
    if todo and path is not None:
        atomic_write(path, json.dumps(known))
    out = {c: {**known[f"{c}@{rows}"], "rows": rows} for c in candidates if known[f"{c}@{rows}"]["ms"] != float("inf")}
    return out or {"float32": {"ms": 0.0, "invariant": False, "rows": rows}}


def _precision_cost(mode: str, args, shapes, device, sync, rows: int, ops, invariant: bool | None) -> dict:
    """ms of one step's products at `rows` rows in `mode`, and whether each product torch computes
    has an invariant kernel (float32: never probed, see `tuner.measure`; `invariant`: already known)."""
    total, probe = 0.0, invariant is None and mode != "float32" and device.type == "cpu"
    inv = (mode != "float32" and device.type == "cpu") if invariant is None else invariant  # unprobed: not vouched for
    for k, n in [*shapes, (args.dim, args.vocab_size)]:
        w = torch.randn(k, n, device=device) * 0.02
        head = n == args.vocab_size
        # A step reads each layer's own weights once, from memory: time every layer's copy in turn, as
        # the step does (one matrix alone would sit in the cache, and favour the precision with more bytes).
        copies = 1 if head else args.n_layers
        if mode == "w4a8":  # the integer products: layers' Q4_1 and the head's Q8_0 blocks times int8 rows
            if ops is None or not hasattr(ops, "q4i8_mm"):
                raise RuntimeError("w4a8 needs the native kernels")
            wt = w.t().contiguous()
            if head:
                layouts = [native_w8a8_layout(*quantize_q8(wt))]
                fns = {"native": lambda x, ls=layouts: [ops.q8i8_mm(x, c, d) for c, d in ls]}
            else:
                codes, scale, zero = quantize_q4(wt)
                layouts = [tuple(t.clone() for t in native_w4a8_layout(codes, scale, zero)) for _ in range(copies)]
                fns = {"native": lambda x, ls=layouts: [ops.q4i8_mm(x, c, d) for c, d in ls]}
            native_product, dt = True, torch.bfloat16
        elif mode == "q4" and not head:
            m = Int4(*quantize_q4(w.t().cpu()), device=device)
            native_product = m.use_native(ops)  # as Transformer.use_native
            if native_product:
                ws = [(m.q4_codes.clone(), m.q4_sz.clone()) for _ in range(copies)]
                fns = {"int4": lambda x, ws=ws: [ops.q4_mm(x, c, z) for c, z in ws]}
            else:
                ms_ = [m] + [copy.deepcopy(m) for _ in range(copies - 1)]  # torch's kernel: m.native is None
                fns = {"int4": lambda x, ms_=ms_: [mi.product(x) for mi in ms_]}
            dt = torch.bfloat16
        else:
            dt = torch.bfloat16 if mode in FOUR_BIT else getattr(torch, mode)
            ws = [(w.to(dt), w.t().contiguous().to(dt)) for _ in range(copies)]
            native_product = ops is not None and dt == torch.bfloat16 and n % 4 == 0  # as Dense.native_ok
            if native_product:  # in the layout it reads; the head's logits stay float32, a layer's outputs are rounded to bfloat16
                wps = [native_bf16_layout(wt) for _, wt in ws]
                fns = {"native": lambda x, wps=wps, head=head: [ops.bf16_mm(x, wp, not head) for wp in wps]}
            else:
                fns = {kern: (lambda x, kern=kern, ws=ws: [matmul(x, wd, wt, kern) for wd, wt in ws])
                       for kern in dense_kernels(dt)}
        x = torch.randn(rows, k, device=device).to(dt)
        ms = min(best_time(lambda f=f: (f(x), sync()), reps=3) for f in fns.values()) * 1e3
        total += ms
        if probe and inv and not native_product:
            inv = any(min_invariant_rows(lambda x, f=f: f(x)[0], k, dt, device) > 0 for f in fns.values())
    return {"ms": round(total, 3), "invariant": inv}



@torch.inference_mode()
def _glue_ms(mode: str, args, device: torch.device, sync, rows: int, native: bool, context: int = 64) -> float:
    """ms of one layer's work besides its four products at `rows` rows (a chain of them after
    `context` cached tokens): norms, RoPE, the cache write, attention, residuals, SwiGLU and the
    Python between them. It differs by precision more than the products do where bfloat16 and q4
    run the fused native kernels and float32 torch's ops (an AVX2 CPU: products 15 ms float32 against
    21 ms q4 at 4 rows, whole steps 27 against 19 ms). Measured on a one-layer model of the model's
    shapes with random weights, built as the loader builds it: its step through the layer less the
    step through none, less the layer's products timed the same (hot) way."""
    small = copy.copy(args)
    small.n_layers, small.vocab_size = 1, 256  # the head is timed apart (`_precision_cost`)
    g = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        names = {k: v.shape for k, v in Transformer(small).state_dict().items()}
    weights = {k: (1.0 + 0.1 * torch.randn(s, generator=g)) if k.endswith("norm.weight") else torch.randn(s, generator=g) * 0.05
               for k, s in names.items() if k != "inv_freq"}
    model = build(small, weights, mode, str(device), optimize=False)
    for m in model.layers[0].matrices():
        m.make_transposed()  # as optimize_for_decoding: the [out, in] copies the native product reads
    model.use_native(native)
    kv = ContiguousKV(None, context + rows + 8, 1, small.n_kv_heads, small.head_dim, model.attn_dtype, device=device)
    seq = kv.create()
    forward_step(model, kv, StepBatch.build([seq], [torch.randint(0, 256, (context,))], [None], [None], [0], model.attn_dtype))
    kv.commit(seq)
    tok = torch.randint(0, 256, (rows,))
    mask = torch.ones(rows, rows, dtype=torch.bool).tril_() if rows > 1 else None
    depth = torch.arange(rows) if rows > 1 else None

    def step(layers):
        forward_step(model, kv, StepBatch.build([seq], [tok], [depth], [mask], [kv.length(seq)], model.attn_dtype), layers)
        kv.discard(seq)
        sync()

    blk, x = model.layers[0], torch.randn(rows, small.dim, device=device).to(model.dtype)

    def product(m, x):  # as the step computes it: the native kernel where it takes this matrix
        if isinstance(m, Dense) and m.native_ok and model.native is not None:
            return model.native.bf16_mm(x, m.packed(m.weight_t), True)
        return m(x)

    def products():
        qkv = product(blk.wqkv, x)
        product(blk.wo, qkv[:, :small.n_heads * small.head_dim].contiguous())
        gu = product(blk.w13, x)
        product(blk.w2, gu[:, :small.hidden_dim].contiguous())
        sync()
    layer = best_time(lambda: step(None), reps=5) - best_time(lambda: step([]), reps=5)
    return max(0.0, layer - best_time(products, reps=5)) * 1e3
