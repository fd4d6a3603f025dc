"""Turning a composed config into live components. The core names no concrete component: every
object comes from a `_target_` in conf/. Components that need the live backbone are declared
`_partial_: true` and are called here with `backbone=`."""
from __future__ import annotations

import functools
import inspect
import json
import sys
from pathlib import Path

from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from pipeline.core import BeamSearch, Engine, UserError


def component(node: DictConfig | None, backbone=None, **kwargs):
    if node is None:
        return None
    obj = instantiate(node, **kwargs)
    return obj(backbone=backbone) if isinstance(obj, functools.partial) else obj


def build_proposer(cfg: DictConfig, backbone):
    """The configured proposer, None without one. A proposer whose constructor takes `kv` keeps a
    draft cache of its own: it gets the run's `kv` group unapplied (`_partial_`), to make a manager
    of that kind shaped for its draft."""
    node = cfg.get("proposer")
    if node is None:
        return None
    takes_kv = "kv" in inspect.signature(get_class(node._target_)).parameters
    return component(node, backbone, **({"kv": instantiate(cfg.kv)} if takes_kv else {}))


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


# a request line's own constraint field -> (the conf/constraint file of its kind, the field it fills)
REQUEST_CONSTRAINTS = {"json_schema": ("json_schema", "schema"), "regex": ("regex", "pattern"), "grammar": ("ebnf", "grammar")}


def constraint_node(cfg: DictConfig, request: dict | None = None) -> DictConfig | None:
    """The config node of a constraint: the configured one (`constraint=`), or for a request line that
    brings its own (`"json_schema"`, `"regex"`, `"grammar"`) the node of that kind, with the
    configured node's options when it is of the same kind (and its add_to_prompt in any case)."""
    from pipeline.cli import CONF_DIR
    configured = cfg.get("constraint")
    configured = configured if configured and configured.get("_target_") else None
    if not request:
        return configured
    if len(request) > 1:
        raise UserError(f"a request line carries {' and '.join(request)}: give at most one constraint per request")
    (field, spec), = request.items()
    group, key = REQUEST_CONSTRAINTS[field]
    node = OmegaConf.load(CONF_DIR / "constraint" / f"{group}.yaml")
    if configured is not None and configured.get("_target_") == node.get("_target_"):
        node = configured.copy()
    elif cfg.get("constraint") and "add_to_prompt" in cfg.constraint:
        node.add_to_prompt = cfg.constraint.add_to_prompt
    node[key] = spec if isinstance(spec, str) else json.dumps(spec)
    return node


def check_constraint(node: DictConfig | None, where: str = "constraint") -> list[str]:
    """An invalid regex, schema or grammar fails here, before the model loads, with the engine's
    message. Returns the engine's warnings (what it only approximates)."""
    if node is None:
        return []
    cls = get_class(node._target_)
    kwargs = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if not k.startswith("_")}
    try:
        return list(cls.check(**kwargs) or [])
    except UserError as e:
        raise UserError(f"{where}: {e}" if where != "constraint" else str(e)) from None


def is_speculative(cfg: DictConfig) -> bool:
    return cfg.get("proposer") is not None and cfg.get("num_beams") is None


def needs_invariance(cfg: DictConfig) -> bool:
    """A speculative or batched run equals plain greedy at batch 1 only where every product gives a
    row the same bits whatever rows come with it: `model.dtype=auto` then picks among those."""
    return is_speculative(cfg) or OmegaConf.select(cfg, "batch_size", default=1) > 1


def step_rows(cfg: DictConfig) -> int:
    """The rows of a full step of this run: batch size x (1 + the tree's drafts), what
    `model.dtype=auto` weighs."""
    batch = OmegaConf.select(cfg, "batch_size", default=1)
    drafts = OmegaConf.select(cfg, "proposer.max_nodes", default=None) if is_speculative(cfg) else 0
    return max(1, int(batch)) * (1 + int(drafts or 0))


def build_engine(cfg: DictConfig, backbone=None, with_constraint: bool = True) -> tuple[Engine, object]:
    """Returns (engine, backbone). Pass `backbone` to reuse one already loaded (benchmarks).
    with_constraint=False leaves the configured constraint out (the caller passes each request's)."""
    mnt, batch = positive_int(cfg, "max_new_tokens"), positive_int(cfg, "batch_size")
    check_paths(cfg)
    if with_constraint:
        check_constraint(constraint_node(cfg))
    if backbone is None:
        backbone = component(cfg.model, invariant=needs_invariance(cfg), step_rows=step_rows(cfg))
    notice = backbone.lossless_notice(is_speculative(cfg), batch > 1)
    if notice:
        print(notice, file=sys.stderr)
    if cfg.get("num_beams") is not None:  # decode=beam: beam search on forked sequences
        if cfg.get("proposer") is not None:
            raise UserError("beam search does not take a proposer: drop proposer= (or use decode=greedy for speculation)")
        engine = BeamSearch(
            model=backbone.model, kv=component(cfg.kv, backbone), sampler=component(cfg.sampler, backbone),
            eos_ids=backbone.eos_ids, max_new_tokens=mnt, num_beams=cfg.num_beams,
            length_penalty=cfg.get("length_penalty", 1.0), early_stopping=cfg.get("early_stopping", False),
            num_return_sequences=cfg.get("num_return_sequences", 1), num_beam_groups=cfg.get("num_beam_groups", 1),
            diversity_penalty=cfg.get("diversity_penalty", 0.0), seed=int(cfg.seed), batch_size=batch,
            constraint=component(constraint_node(cfg), backbone) if with_constraint else None)
        return engine, backbone
    proposer = build_proposer(cfg, backbone)
    guard = None
    if proposer is not None and cfg.get("speculation_guard", True):
        from pipeline.core.guard import SpeculationGuard
        try:
            guard = SpeculationGuard(**dict(cfg.get("guard") or {}))
        except (TypeError, ValueError) as e:
            raise UserError(f"bad guard settings ({e}): guard takes warmup, probe, backoff, max_backoff, "
                            "decay, margin (pipeline/core/guard.py)") from None
    engine = Engine(
        model=backbone.model,
        kv=component(cfg.kv, backbone),
        sampler=component(cfg.sampler, backbone),
        eos_ids=backbone.eos_ids,
        max_new_tokens=mnt,
        proposer=proposer,
        verifier=component(cfg.get("verifier"), backbone),
        seed=int(cfg.seed),
        batch_size=batch,
        constraint=component(constraint_node(cfg), backbone) if with_constraint else None,
        guard=guard,
    )
    return engine, backbone
