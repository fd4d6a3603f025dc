"""Turning a composed config into live components. The core names no concrete component: every
object comes from a `_target_` in conf/. Components that need the live backbone are declared
`_partial_: true` and are called here with `backbone=`."""
from __future__ import annotations

import functools

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from pipeline.decoder import Decoder
from pipeline.errors import UserError


def component(node: DictConfig | None, backbone=None, **kwargs):
    if node is None:
        return None
    obj = instantiate(node, **kwargs)
    return obj(backbone=backbone) if isinstance(obj, functools.partial) else obj


def model_key(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg.model, resolve=True)


def build_decoder(cfg: DictConfig, backbone=None) -> tuple[Decoder, object]:
    """Returns (decoder, backbone). Pass `backbone` to reuse one already loaded (benchmarks)."""
    if backbone is None:
        backbone = component(cfg.model)
    mnt = cfg.max_new_tokens
    if not isinstance(mnt, int) or isinstance(mnt, bool) or mnt <= 0:
        raise UserError(f"max_new_tokens must be a positive int, got {mnt}")
    decoder = Decoder(
        model=backbone.model,
        kv=component(cfg.kv, backbone),
        sampler=component(cfg.sampler, backbone),
        eos_ids=backbone.eos_ids,
        max_new_tokens=mnt,
        proposer=component(cfg.get("proposer"), backbone),
        verifier=component(cfg.get("verifier"), backbone),
        seed=int(cfg.seed),
    )
    return decoder, backbone
