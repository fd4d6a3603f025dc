"""From weights to a model: our Transformer assembled from float32 weights (our names and layout)
and 4-bit matrices in one precision, as every loader (components/model/load.py) and the cost model's
one-layer probe (components/model/cost_model.py) build it."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from components.model.linear import Int4, quantize_q4
from components.model.llama import Block, LlamaArgs, Transformer, fingerprint_of, rope_inv_freq
from pipeline.core import UserError


def cache_dir() -> Path:
    return Path(os.environ.get("PIPELINE_CACHE", Path.home() / ".cache" / "llm-decode"))


PRECISIONS = ("auto", "float32", "bfloat16", "q4", "w4a8")
FOUR_BIT = ("q4", "w4a8")  # 4-bit layer matrices: times bfloat16 activations (q4) or int8 ones (w4a8, native only)
Q4 = dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # "layers.{i}.{matrix}" -> codes, scale, zero


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise UserError(f"model.dtype must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def resolve_device(device: str | None) -> torch.device:
    name = device or "cpu"
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise UserError(f"model.device {name!r} is not a device: use cpu, cuda, cuda:N or auto") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"model.device={name} but torch sees no GPU: use model.device=cpu (or auto)")
    return dev


def _materialize(model: torch.nn.Module, device: torch.device):
    """Give every parameter / buffer still on the meta device real (uninitialised) storage."""
    for mod in model.modules():
        for name, t in list(mod._parameters.items()):
            if t is not None and t.is_meta:
                mod._parameters[name] = torch.nn.Parameter(torch.empty_like(t, device=device), requires_grad=False)
        for name, t in list(mod._buffers.items()):
            if t is not None and t.is_meta:
                mod._buffers[name] = torch.empty_like(t, device=device)


def assemble(args: LlamaArgs, weights: dict[str, torch.Tensor], q4: Q4, precision: str, device: torch.device,
             wqkv0: torch.Tensor, optimize: bool = True, head: str = "dtype", kernels: str = "auto",
             head_blocks: tuple[torch.Tensor, torch.Tensor] | None = None) -> Transformer:
    """Our Transformer from float32 `weights` (our names and layout) and 4-bit matrices `q4`, in
    `precision` (float32 / bfloat16 / q4 / w4a8) on `device`. Its fingerprint is taken from the float32
    weights as loaded (wqkv0: layer 0's q/k/v [in, out]), so heads trained in one precision load in
    every other. head, kernels: what `optimize_for_decoding` is given. head_blocks: the LM head's Q8_0
    codes and d as a file ships them (w4a8 multiplies those; else the head is quantized to Q8_0)."""
    with torch.device("meta"):
        model = Transformer(args)
    activations = "int8" if precision == "w4a8" else "bfloat16"
    model.activations = activations
    model.head_blocks = head_blocks if precision == "w4a8" else None
    for name, (codes, scale, zero) in q4.items():
        layer, mat = name.split(".")[1:]
        setattr(model.layers[int(layer)], mat, Int4(codes, scale, zero, device=device, activations=activations))
    _materialize(model, device)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = {m for m in missing if m.rsplit(".", 1)[0] not in q4}  # the Int4 modules came built
    if missing or unexpected:
        raise RuntimeError(f"weights do not fit the model: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    model.source_fingerprint = fingerprint_of(args, wqkv0, weights["tok_embeddings.weight"])
    dtype = torch.float32 if precision == "float32" else torch.bfloat16
    model = model.to(dtype).eval().requires_grad_(False)
    model.inv_freq = rope_inv_freq(args).float().to(device)  # RoPE frequencies stay float32 in every mode
    return model.optimize_for_decoding(cache_dir(), head, kernels) if optimize else model


def quantize_matrices(weights: dict[str, torch.Tensor], args: LlamaArgs) -> Q4:
    """Move every layer matrix of `weights` ([in, out] float) into 4-bit groups (min/max per group of
    32, as ggml's Q4_1 quantizes): `q4` for checkpoints that ship float weights."""
    return {f"layers.{i}.{n}": quantize_q4(weights.pop(f"layers.{i}.{n}.weight").t())
            for i in range(args.n_layers) for n in Block.MATRICES}


def build(args: LlamaArgs, weights: dict[str, torch.Tensor], precision: str = "float32", device: str = "cpu",
          optimize: bool = True, head: str = "dtype", kernels: str = "auto") -> Transformer:
    """A Transformer from float32 weights in our layout (`convert_hf_state_dict`), in `precision`."""
    weights = dict(weights)
    wqkv0 = weights["layers.0.wqkv.weight"]
    q4 = quantize_matrices(weights, args) if check_precision(precision) in FOUR_BIT else {}
    return assemble(args, weights, q4, "float32" if precision == "auto" else precision, resolve_device(device),
                    wqkv0, optimize, head, kernels)
