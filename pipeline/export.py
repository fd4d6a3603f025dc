"""python -m pipeline.export <heads.safetensors> <out_dir> [--format medusa|vllm] [--model-path P]

Writes trained heads in the layouts engines load:
- medusa (FasterDecoding/Medusa): config.json {medusa_num_heads, medusa_num_layers, ...} and
  medusa_lm_head.safetensors with `{k}.{l}.linear.weight|bias` per ResBlock and `{k}.{L}.weight`
  for each head's [vocab, hidden] projection;
- vllm (its `medusa` model type): config.json {model_type: medusa, num_heads, num_hidden_layers,
  hidden_size, vocab_size} and model.safetensors with `blocks.{k}.layers.{l}.weight|bias` and
  `lm_heads.{k}.weight`.
Projections are written over the full vocabulary (the draft rows of a shared head are the
backbone's own rows, so the full backbone head is exact), in float16.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from components.heads.medusa import MedusaHeads
from components.model.load import from_pretrained
from pipeline.build import component
from pipeline.errors import UserError, one_line_errors


def full_vocab_projection(heads: MedusaHeads, backbone, k: int) -> torch.Tensor:
    w = backbone.model.lm_head.detach().t().float().clone()  # (V, dim)
    if heads.proj is not None:
        w[heads.vocab_ids] = heads.proj[k].detach()
    return w


def backbone_for(checkpoint: Path, model_path: str | None):
    """The backbone the heads were trained on, in float32 (the exported LM head rows are exact):
    `model_path` when given, else the `model` config the training run stored beside the heads
    (train_config.yaml: the tiny model, a local checkpoint), else the default model."""
    if model_path:
        return from_pretrained(model_path, dtype="float32")
    stored = checkpoint.parent / "train_config.yaml"
    if stored.is_file():
        model_cfg = OmegaConf.load(stored).get("model")
        if model_cfg is not None:
            if "dtype" in model_cfg:
                model_cfg.dtype = "float32"
            return component(model_cfg)
    return from_pretrained(dtype="float32")


def export(checkpoint: str, out_dir: str, fmt: str = "medusa", model_path: str | None = None, backbone=None) -> Path:
    if fmt not in ("medusa", "vllm"):
        raise UserError(f"--format must be medusa or vllm, got {fmt!r}")
    if backbone is None:
        backbone = backbone_for(Path(checkpoint), model_path)
    heads = MedusaHeads.load(checkpoint, backbone)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    K, L, a = heads.num_heads, heads.num_layers, backbone.model.args
    tensors = {}
    for k in range(K):
        for l in range(L):
            lin = heads.blocks[k][l].linear
            pre = f"{k}.{l}.linear." if fmt == "medusa" else f"blocks.{k}.layers.{l}."
            tensors[pre + "weight"] = lin.weight.detach().half().contiguous()
            tensors[pre + "bias"] = lin.bias.detach().half().contiguous()
        name = f"{k}.{L}.weight" if fmt == "medusa" else f"lm_heads.{k}.weight"
        tensors[name] = full_vocab_projection(heads, backbone, k).half().contiguous()
    if fmt == "medusa":
        config = {"medusa_num_heads": K, "medusa_num_layers": L, "hidden_size": a.dim, "vocab_size": a.vocab_size,
                  "base_model_name_or_path": heads.info.get("backbone", backbone.name)}
        save_file(tensors, out / "medusa_lm_head.safetensors")
    else:
        config = {"model_type": "medusa", "architectures": ["MedusaModel"], "num_heads": K, "num_hidden_layers": L,
                  "hidden_size": a.dim, "vocab_size": a.vocab_size, "truncated_vocab_size": a.vocab_size}
        save_file(tensors, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@one_line_errors
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("out_dir")
    p.add_argument("--format", default="medusa", choices=["medusa", "vllm"])
    p.add_argument("--model-path", default=None, help="the backbone (default: the one in the heads' train_config.yaml, else SmolLM2-135M-Instruct)")
    a = p.parse_args(argv)
    out = export(a.checkpoint, a.out_dir, a.format, a.model_path)
    print(f"exported {a.checkpoint} in {a.format} layout -> {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
