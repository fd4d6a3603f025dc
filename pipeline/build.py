"""Turning a composed config into live components. The core names no concrete component: every
object comes from a `_target_` in conf/. Components that need the live backbone are declared
`_partial_: true` and are called here with `backbone=`."""
from __future__ import annotations

import functools
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from pipeline.core import Engine, UserError


def component(node: DictConfig | None, backbone=None, **kwargs):
    if node is None:
        return None
    obj = instantiate(node, **kwargs)
    return obj(backbone=backbone) if isinstance(obj, functools.partial) else obj


def model_key(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg.model, resolve=True)


def positive_int(cfg: DictConfig, key: str) -> int:
    v = OmegaConf.select(cfg, key)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise UserError(f"{key} must be a positive int, got {v!r}")
    return v


def check_paths(cfg: DictConfig) -> None:
    """Files a run will read, checked before the model loads (a missing one costs nothing)."""
    model_path = OmegaConf.select(cfg, "model.path")
    if model_path and not Path(str(model_path)).expanduser().exists():
        raise UserError(f"model.path {model_path} does not exist: pass a .gguf file or a Hugging Face folder")
    for key, what in (("proposer.checkpoint", "head checkpoint"), ("proposer.tree_file", "tree file")):
        v = OmegaConf.select(cfg, key)
        if v not in (None, "auto") and not Path(str(v)).expanduser().is_file():
            raise UserError(f"{what} {key}={v} does not exist: fix the path (or drop the override)")


def build_engine(cfg: DictConfig, backbone=None) -> tuple[Engine, object]:
    """Returns (engine, backbone). Pass `backbone` to reuse one already loaded (benchmarks)."""
    mnt, batch = positive_int(cfg, "max_new_tokens"), positive_int(cfg, "batch_size")
    check_paths(cfg)
    if backbone is None:
        backbone = component(cfg.model)
    engine = Engine(
        model=backbone.model,
        kv=component(cfg.kv, backbone),
        sampler=component(cfg.sampler, backbone),
        eos_ids=backbone.eos_ids,
        max_new_tokens=mnt,
        proposer=component(cfg.get("proposer"), backbone),
        verifier=component(cfg.get("verifier"), backbone),
        seed=int(cfg.seed),
        batch_size=batch,
    )
    return engine, backbone
