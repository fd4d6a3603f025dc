"""Draft-head checkpoints (Medusa heads, Hydra heads and EAGLE drafts alike): one safetensors file,
never pickle, whose metadata holds a JSON header under the kind's key (`"medusa"`, `"hydra"` or
`"eagle"`: format, hidden size, vocabulary size, backbone fingerprint, the head's own shape); `kind`
reads which it is without loading it. The frozen backbone rows a head reads (its LM head) are never
stored; everything else is loaded strictly."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from pipeline.core import UserError, atomic_write


@dataclass(frozen=True)
class Format:
    """What tells one kind of checkpoint from another, and what its errors say."""
    name: str  # the header's "format"
    key: str  # the metadata key holding the header
    kind: str  # "head" | "draft": how errors name it
    title: str  # "a Medusa head": what a file of another format is not
    train: str  # the command that writes one
    fix: str  # what to do with a damaged one
    frozen: str  # the state-dict entry not stored (the backbone's own LM head rows)


def save(module: nn.Module, path: str | Path, fmt: Format, info: dict, dtype: torch.dtype | None = None) -> Path:
    """Write module's state (floating tensors cast to dtype when given) with header {format, **info}."""
    tensors = {k: (v.detach().to(dtype) if dtype is not None and v.is_floating_point() else v.detach()).contiguous()
               for k, v in module.state_dict().items() if k != fmt.frozen}
    header = json.dumps({"format": fmt.name, **info})
    return atomic_write(Path(path), lambda tmp: save_file(tensors, tmp, metadata={fmt.key: header}))


def kind(path: str | Path) -> str | None:
    """Which kind of draft a checkpoint holds: the metadata key of its header ("medusa", "hydra",
    "eagle"), read without its tensors; None when it is not a readable checkpoint (`read` says why)."""
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
    except Exception:  # missing, not safetensors, damaged: the loader's error names the cause
        return None
    return next((k for k, v in meta.items() if v.startswith("{") and '"format"' in v), None)


def read(path: str | Path, fmt: Format, backbone, others: dict[str, str] | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """The header and tensors of a checkpoint of format `fmt` that fits `backbone` (UserError
    otherwise); `others`: metadata key -> what a file of that other kind is, named in the error."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{fmt.kind} checkpoint {path} does not exist: train one with `{fmt.train}` "
                        "or pass proposer.checkpoint=<heads.safetensors>")
    if path.suffix != ".safetensors":
        raise UserError(f"{fmt.kind} checkpoint {path} must be a .safetensors file (pickled checkpoints are refused)")
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            info = json.loads(meta.get(fmt.key, "{}"))
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types on a damaged file
        raise UserError(f"{fmt.kind} checkpoint {path} is not a readable safetensors file ({e}): {fmt.fix}") from None
    if info.get("format") != fmt.name:
        what = next((v for k, v in (others or {}).items() if k in meta), f"format {info.get('format')!r}")
        raise UserError(f"{path} is not {fmt.title} checkpoint of this project: it is {what}")
    check_fits(path, info, backbone, fmt.kind)
    if "vocab_ids" not in tensors:
        raise UserError(f"{fmt.kind} checkpoint {path} has no vocab_ids tensor: {fmt.fix}")
    return info, tensors


def load_state(module: nn.Module, tensors: dict[str, torch.Tensor], path: str | Path, fmt: Format) -> None:
    """Load tensors into module: every stored entry but the frozen one present, nothing else."""
    missing, unexpected = module.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if k != fmt.frozen]  # the backbone's own head, not stored
    if missing or unexpected:
        raise UserError(f"{fmt.kind} checkpoint {path} does not match its own header: missing tensors "
                        f"{missing or 'none'}, unexpected {unexpected or 'none'}; {fmt.fix}")


def check_fits(path: Path, info: dict, backbone, kind: str) -> None:
    """A checkpoint's header against the backbone it is loaded onto: hidden size, vocabulary and
    fingerprint (`kind` names it in the error)."""
    args = backbone.model.args
    if info["dim"] != args.dim or info.get("vocab_size") != args.vocab_size:
        raise UserError(f"{kind} checkpoint {path} was trained for hidden size {info['dim']} / vocab "
                        f"{info.get('vocab_size')}, but the backbone has {args.dim} / {args.vocab_size}: "
                        f"use {kind}s trained on this backbone")
    if info.get("fingerprint") not in (None, backbone.model.fingerprint()):
        raise UserError(f"{kind} checkpoint {path} was trained on another backbone "
                        f"({info.get('fingerprint')} != {backbone.model.fingerprint()}): retrain for this model")
