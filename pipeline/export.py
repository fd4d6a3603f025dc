"""python -m pipeline.export <heads.safetensors> <out_dir> [--format medusa|vllm|eagle] [--model-path P]

Writes trained heads and drafts in the layouts engines load:
- medusa (FasterDecoding/Medusa): config.json {medusa_num_heads, medusa_num_layers, ...} and
  medusa_lm_head.safetensors with `{k}.{l}.linear.weight|bias` per ResBlock and `{k}.{L}.weight`
  for each head's [vocab, hidden] projection;
- vllm (its `medusa` model type): config.json {model_type: medusa, num_heads, num_hidden_layers,
  hidden_size, vocab_size} and model.safetensors with `blocks.{k}.layers.{l}.weight|bias` and
  `lm_heads.{k}.weight`.
Projections are written over the full vocabulary (the draft rows of a shared head are the
backbone's own rows, so the full backbone head is exact), in float16.
- eagle (an EAGLE draft, `heads=eagle`, for vLLM's speculative_config method eagle / eagle3):
  `export_eagle` below, with what maps exactly and what has no counterpart.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import save_file

from components.heads.checkpoint import load_state as checkpoint_load_state
from components.heads.eagle import FORMAT as EAGLE_FORMAT
from components.heads.eagle import EagleDraft, backbone_embedding
from components.heads.medusa import MedusaHeads, draft_lm_weight
from components.model.load import from_pretrained
from pipeline.build import component
from pipeline.errors import UserError, one_line_errors
from pipeline.hf_peer import hf_config


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
    if fmt not in ("medusa", "vllm", "eagle"):
        raise UserError(f"--format must be medusa, vllm (Medusa heads) or eagle (an EAGLE draft), got {fmt!r}")
    if backbone is None:
        backbone = backbone_for(Path(checkpoint), model_path)
    if fmt == "eagle":
        return export_eagle(checkpoint, out_dir, backbone)[0]
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

# --- EAGLE drafts in vLLM's layouts ---------------------------------------------------------------
# What vLLM 0.32 runs (vllm/model_executor/models/mistral_eagle.py, llama_eagle3.py), against ours
# (components/heads/eagle.py). Both hand the draft what ours reads: method eagle the target's last
# state after its final norm, method eagle3 the states entering blocks i ("eagle_aux_hidden_state_layer_ids",
# i = n_layers: the last block's output, before the norm), our taps. The files of the layout are
# vLLM's; llm_decode/extras.safetensors holds what it has no place for (read back by `read_eagle`).
EAGLE_EXPORT_VERSION = 3  # bump when the mapping changes: the vllm peer caches exports under it
EXTRAS = "llm_decode/extras.safetensors"  # a subfolder: vLLM loads every top-level *.safetensors
EAGLE1_LOST = (
    "draft vocabulary: vLLM's EAGLE drafts over the full vocabulary with the target's LM head, ours over "
    "{V} tokens",
)
EAGLE3_LOST = (
    "input projection: vLLM's EAGLE-3 layer reads concat(norm(embed), norm(feature)) into q/k/v and adds the "
    "feature alone to the residual, ours norm(fc(concat(feature, embed))) and adds fc's output; q/k/v are "
    "exported as W diag(attn_norm) [fc_embed | fc_feature] with unit norms, the per-token scale and the "
    "residual's fc are lost",
)
CONTEXT_LOST = ("context: the draft was trained on the answer's positions alone (data.context=false); "
                "vLLM's draft attends to the prompt's positions too")


def _hf_layer(draft, fold: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Our block -> HF names ([out, in]) under `self_attn.` / `mlp.`; `fold`: a vector (dim,) the
    q/k/v columns are scaled by (a norm weight vLLM applies nowhere)."""
    a, blk = draft.args, draft.block
    q_out, kv_out = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    wqkv = blk.wqkv.dense().float().t()  # (qkv_out, dim)
    if fold is not None:
        wqkv = wqkv * fold.float()[None]
    q, k, v = wqkv.split([q_out, kv_out, kv_out])
    gate, up = blk.w13.dense().float().t().split([a.hidden_dim, a.hidden_dim])
    out = {"self_attn.q_proj.weight": q, "self_attn.k_proj.weight": k, "self_attn.v_proj.weight": v,
           "self_attn.o_proj.weight": blk.wo.dense().float().t(), "mlp.gate_proj.weight": gate,
           "mlp.up_proj.weight": up, "mlp.down_proj.weight": blk.w2.dense().float().t(),
           "post_attention_layernorm.weight": blk.mlp_norm.weight.float()}
    if blk.bqkv is not None:
        out.update(zip(("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
                       blk.bqkv.float().split([q_out, kv_out, kv_out])))
    if blk.bo is not None:
        out["self_attn.o_proj.bias"] = blk.bo.float()
    return out


def _draft_config(args, **extra) -> dict:
    """The draft's HF config: the backbone's block shape, one layer, vLLM's keys in `extra`."""
    cfg = hf_config(replace(args, n_layers=1)).to_dict()
    cfg.update({"architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16", **extra})
    return cfg


def export_eagle(checkpoint: str, out_dir: str, backbone) -> tuple[Path, str, list[str]]:
    """An EAGLE draft -> a vLLM draft folder (config.json, model.safetensors in float32: vLLM casts
    to its dtype). An unfused draft as vLLM's EAGLE-1 EagleMistralForCausalLM (method eagle: a Llama
    block, exact), a fused one (heads.fuse_layers) in EAGLE-3's layout (method eagle3). Returns the folder,
    the method and one line per part that does not map exactly (also in config.json)."""
    draft = EagleDraft.load(checkpoint, backbone)
    out = Path(out_dir)
    (out / EXTRAS).parent.mkdir(parents=True, exist_ok=True)
    a, dim, V = draft.args, draft.dim, len(draft.vocab_ids)
    fc = draft.fc.weight.detach().float()
    fc_feat, fc_embed = fc[:, :dim], fc[:, dim:]  # ours: concat(feature, embed)
    attn_w = draft.block.attn_norm.weight.detach().float()
    extras = {"vocab_ids": draft.vocab_ids.long()}
    if not draft.fused:
        # vLLM's LlamaForCausalLMEagle drops layer 0's input norm and has no final norm: our draft in it
        # would draft differently. EagleMistralForCausalLM is ours exactly: fc(concat(embeds, hidden)),
        # a Mistral (= Llama) decoder layer with both norms, a final norm whose output is its feature
        # and the target LM head's input.
        method = "eagle"
        lost = [line.format(V=V) for line in EAGLE1_LOST if V < a.vocab_size]
        tensors = {"model.fc.weight": torch.cat((fc_embed, fc_feat), dim=1),  # vLLM: concat(embeds, hidden)
                   "model.norm.weight": draft.norm.weight.detach().float(),
                   "model.layers.0.input_layernorm.weight": attn_w,
                   **{f"model.layers.0.{k}": t for k, t in _hf_layer(draft, None).items()}}
        cfg = _draft_config(a, model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None)
    else:
        method = "eagle3"
        lost = list(EAGLE3_LOST)
        order = sorted(range(len(draft.fuse_layers)), key=lambda i: draft.fuse_layers[i])  # vLLM keeps layer order
        fuse = draft.fuse.weight.detach().float().view(dim, len(order), dim)[:, order].reshape(dim, -1)
        layer = _hf_layer(draft, attn_w)
        for name in ("q_proj", "k_proj", "v_proj"):  # over concat(embed, feature), 2 dim wide
            w = layer.pop(f"self_attn.{name}.weight")
            layer[f"self_attn.{name}.weight"] = torch.cat((w @ fc_embed, w @ fc_feat), dim=1)
        ids = sorted(draft.fuse_layers)
        tensors = {"fc.weight": fuse, "norm.weight": draft.norm.weight.detach().float(),
                   "lm_head.weight": draft.lm_weight.detach().float(),
                   "d2t": draft.vocab_ids.long() - torch.arange(V),  # vLLM: target id = draft id + d2t
                   "t2d": torch.zeros(a.vocab_size, dtype=torch.bool).index_fill_(0, draft.vocab_ids.long(), True),
                   "midlayer.input_layernorm.weight": torch.ones(dim), "midlayer.hidden_norm.weight": torch.ones(dim),
                   **{f"midlayer.{k}": t for k, t in layer.items()}}
        extras.update({"attn_norm.weight": attn_w, "fc.weight": fc, "block.wqkv.weight": draft.block.wqkv.dense().float()})
        cfg = _draft_config(a, draft_vocab_size=V, target_hidden_size=dim, norm_output=True,
                            eagle_aux_hidden_state_layer_ids=ids,
                            eagle_config={"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True})
    if draft.info.get("context") != "prompt":
        lost.append(CONTEXT_LOST)
    cfg["llm_decode"] = {"source": str(checkpoint), "method": method, "not_exact": lost}
    save_file({k: t.contiguous() for k, t in tensors.items()}, out / "model.safetensors")
    save_file({k: t.contiguous() for k, t in extras.items()}, out / EXTRAS,
              metadata={"info": json.dumps(draft.info), "method": method})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out, method, lost


def read_eagle(folder: str | Path, backbone) -> EagleDraft:
    """The EagleDraft an `export_eagle` folder holds, from vLLM's tensors wherever they keep ours,
    the extras for the rest (the draft vocabulary of an unfused draft; a fused draft's input
    projection, attention norm and q/k/v, which its EAGLE-3 layout folds together)."""
    folder = Path(folder)
    if not (folder / EXTRAS).is_file():
        raise UserError(f"{folder} is not an export of ours ({EXTRAS} is missing): export the draft with "
                        "`python -m pipeline.export <draft.safetensors> <dir> --format eagle`")
    with safe_open(str(folder / EXTRAS), "pt") as f:
        meta = f.metadata()
        extras = {k: f.get_tensor(k) for k in f.keys()}
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        vt = {k: f.get_tensor(k) for k in f.keys()}
    info, method = json.loads(meta["info"]), meta["method"]
    cfg = json.loads((folder / "config.json").read_text())
    args = backbone.model.args
    dim = args.dim
    fuse = None if method == "eagle" else tuple(info["fuse_layers"])
    vocab_ids = extras["vocab_ids"] if fuse is None else torch.arange(cfg["draft_vocab_size"]) + vt["d2t"]
    draft = EagleDraft(args, vocab_ids, draft_lm_weight(backbone, vocab_ids), backbone_embedding(backbone), fuse)
    pre = "model.layers.0." if fuse is None else "midlayer."
    state = {"block.mlp_norm.weight": vt[pre + "post_attention_layernorm.weight"],
             "block.wo.weight": vt[pre + "self_attn.o_proj.weight"].t(),
             "block.w13.weight": torch.cat((vt[pre + "mlp.gate_proj.weight"], vt[pre + "mlp.up_proj.weight"])).t(),
             "block.w2.weight": vt[pre + "mlp.down_proj.weight"].t(), "vocab_ids": vocab_ids}
    qkv = torch.cat([vt[pre + f"self_attn.{n}_proj.weight"] for n in "qkv"])  # (qkv_out, in)
    if fuse is None:
        fc = vt["model.fc.weight"]
        state["fc.weight"] = torch.cat((fc[:, dim:], fc[:, :dim]), dim=1)
        state["block.wqkv.weight"] = qkv.t()
        state["block.attn_norm.weight"], state["norm.weight"] = vt[pre + "input_layernorm.weight"], vt["model.norm.weight"]
    else:
        order = sorted(range(len(fuse)), key=lambda i: fuse[i])
        back = torch.empty_like(torch.tensor(order)).scatter_(0, torch.tensor(order), torch.arange(len(order)))
        state["fuse.weight"] = vt["fc.weight"].view(dim, len(fuse), dim)[:, back].reshape(dim, -1)
        state["fc.weight"], state["block.wqkv.weight"] = extras["fc.weight"], extras["block.wqkv.weight"]
        state["block.attn_norm.weight"], state["norm.weight"] = extras["attn_norm.weight"], vt["norm.weight"]
        if not torch.equal(vt["lm_head.weight"], draft.lm_weight):
            raise UserError(f"{folder}'s lm_head is not this backbone's rows for the draft vocabulary: "
                            "read it back with the backbone it was exported from")
    if pre + "self_attn.q_proj.bias" in vt:
        state["block.bqkv"] = torch.cat([vt[pre + f"self_attn.{n}_proj.bias"] for n in "qkv"])
    if pre + "self_attn.o_proj.bias" in vt:
        state["block.bo"] = vt[pre + "self_attn.o_proj.bias"]
    checkpoint_load_state(draft, {k: t.float() if t.is_floating_point() else t for k, t in state.items()},
                          folder, EAGLE_FORMAT)
    draft.info = info
    return draft.to(backbone.model.device).eval().requires_grad_(False)


@one_line_errors
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("out_dir")
    p.add_argument("--format", default="medusa", choices=["medusa", "vllm", "eagle"])
    p.add_argument("--model-path", default=None, help="the backbone (default: the one in the heads' train_config.yaml, else SmolLM2-135M-Instruct)")
    a = p.parse_args(argv)
    if a.format == "eagle":
        out, method, lost = export_eagle(a.checkpoint, a.out_dir, backbone_for(Path(a.checkpoint), a.model_path))
        print(f"exported {a.checkpoint} in vLLM's {method} layout -> {out} "
              f"(speculative_config method={method}, model={out})", file=sys.stderr)
        for line in lost:
            print(f"not exact: {line}", file=sys.stderr)
        return
    out = export(a.checkpoint, a.out_dir, a.format, a.model_path)
    print(f"exported {a.checkpoint} in {a.format} layout -> {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
