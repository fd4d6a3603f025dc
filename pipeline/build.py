"""Turning a composed config into live components. The core names no concrete component: every
object comes from a `_target_` in conf/. Components that need the live backbone are declared
`_partial_: true` and are called here with `backbone=`."""
from __future__ import annotations

import functools
import inspect
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from pipeline.cli import CONF_DIR, compose_config, groups, option_nodes

from pipeline.core import Runner, UserError, positive_int
from pipeline.core.guard import SpeculationGuard
from pipeline.io import hydra_config


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


def check_paths(cfg: DictConfig) -> None:
    """Files a run will read, checked before the model loads (a missing one costs nothing)."""
    model_path = OmegaConf.select(cfg, "model.path")
    if model_path and not Path(str(model_path)).expanduser().exists():
        raise UserError(f"model.path {model_path} does not exist: pass a .gguf file or a Hugging Face folder")
    for key, what in (("proposer.checkpoint", "head checkpoint"), ("proposer.tree_file", "tree file")):
        v = OmegaConf.select(cfg, key)
        if v not in (None, "auto") and not Path(str(v)).expanduser().is_file():
            raise UserError(f"{what} {key}={v} does not exist: fix the path (or drop the override)")


# a request's own constraint field -> (the conf/constraint option of its kind, the argument it fills)
REQUEST_CONSTRAINTS = {"json_schema": ("json_schema", "schema"), "regex": ("regex", "pattern"), "grammar": ("ebnf", "grammar")}


@dataclass
class ConstraintSpec:
    """A constraint as plain data: its component's class and keyword arguments. A request's regex,
    schema or grammar is one of those values as the client sent it: never put into a config node
    (nothing in it is interpolated or resolved) and, with `inline`, never read as a file path (paths
    come only from the configured `constraint=`)."""
    target: str  # the component class, as conf/constraint/<option>.yaml names it
    kwargs: dict  # its arguments but `backbone`, plain values

    @property
    def key(self) -> str:
        """Equal for specs that build equal grammars (a compile cache's key)."""
        return json.dumps([self.target, self.kwargs], sort_keys=True, default=str)

    def check(self, where: str = "constraint") -> list[str]:
        """An invalid regex, schema or grammar fails here, before the model loads, with the engine's
        message. Returns the engine's warnings (what it only approximates)."""
        try:
            return list(get_class(self.target).check(**self.kwargs) or [])
        except UserError as e:
            raise UserError(f"{where}: {e}" if where != "constraint" else str(e)) from None

    def build(self, backbone):
        """The compiled grammar (a `Grammar`)."""
        return get_class(self.target)(backbone=backbone, **self.kwargs)


def _plain(node: DictConfig) -> ConstraintSpec:
    """The spec of a constraint config node (the operator's: resolved as every config value is)."""
    kwargs = OmegaConf.to_container(node, resolve=True)
    return ConstraintSpec(kwargs.pop("_target_"), {k: v for k, v in kwargs.items() if not k.startswith("_")})


@functools.lru_cache(maxsize=None)
def _option(group: str) -> ConstraintSpec:
    """conf/constraint/<group>.yaml's defaults (read once)."""
    return _plain(OmegaConf.load(CONF_DIR / "constraint" / f"{group}.yaml"))


def constraint_spec(cfg: DictConfig, request: dict | None = None) -> ConstraintSpec | None:
    """The constraint of a request: the configured one (`constraint=`), or for a request that brings
    its own (`"json_schema"`, `"regex"`, `"grammar"`: a request line's, or a server request's) the
    option of that kind with the request's value, the configured node's options when it is of the
    same kind (and its add_to_prompt in any case; with none configured,
    `request_constraints_add_to_prompt`). The request's value is data, taken as text (`inline`)."""
    configured = cfg.get("constraint")
    base = None if configured is None else _plain(configured)
    if not request:
        return base
    if len(request) > 1:
        raise UserError(f"a request carries {' and '.join(request)}: give at most one constraint per request")
    (field, value), = request.items()
    group, key = REQUEST_CONSTRAINTS[field]
    option = _option(group)
    if base is not None and base.target == option.target:
        kwargs = dict(base.kwargs)
    else:
        kwargs = dict(option.kwargs)
        kwargs["add_to_prompt"] = cfg.get("request_constraints_add_to_prompt", False) if base is None \
            else base.kwargs.get("add_to_prompt", False)
    kwargs[key] = value
    if "inline" in inspect.signature(get_class(option.target)).parameters:
        kwargs["inline"] = True
    return ConstraintSpec(option.target, kwargs)


def runner_class(cfg: DictConfig) -> type[Runner]:
    """The class of the run's runner (`runner=engine|beam`): what it is, before anything is built."""
    return get_class(OmegaConf.select(cfg, "runner._target_", default="pipeline.core.Engine"))


def is_speculative(cfg: DictConfig) -> bool:
    return cfg.get("proposer") is not None and runner_class(cfg).speculates


def is_plain(cfg: DictConfig) -> bool:
    """The run computes plain decoding (no proposer, a plain runner), whatever its preset is called:
    what sweeps and benchmarks take as a baseline."""
    return cfg.get("proposer") is None and runner_class(cfg).plain


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


def build_engine(cfg: DictConfig, backbone=None, with_constraint: bool = True) -> tuple[Runner, object]:
    """Returns (runner, backbone): the configured runner (`runner=`) with its components. Pass
    `backbone` to reuse one already loaded (benchmarks). with_constraint=False leaves the configured
    constraint out (the caller passes each request's)."""
    mnt, batch = positive_int(cfg.max_new_tokens, "max_new_tokens"), positive_int(cfg.batch_size, "batch_size")
    check_paths(cfg)
    configured = constraint_spec(cfg) if with_constraint else None
    if configured is not None:
        configured.check()
    cls = runner_class(cfg)
    if cfg.get("proposer") is not None and not cls.speculates:
        raise UserError(f"{cls.__name__} does not take a proposer: drop proposer= (or use decode=greedy for speculation)")
    if backbone is None:
        backbone = component(cfg.model, invariant=needs_invariance(cfg), step_rows=step_rows(cfg))
    notice = backbone.lossless_notice(is_speculative(cfg), batch > 1)
    if notice:
        print(notice, file=sys.stderr)
    kv = component(cfg.kv, backbone)
    if OmegaConf.select(cfg, "kv.prefix_cache") and not kv.stats()["prefix_cache"]:
        print(f"kv.prefix_cache is off: {backbone.precision} has no batch-invariant path here (a cached prefix could "
              "change the tokens), so every prompt is prefilled whole", file=sys.stderr)
    parts = dict(model=backbone.model, kv=kv, sampler=component(cfg.sampler, backbone),
                 eos_ids=backbone.eos_ids, max_new_tokens=mnt, seed=int(cfg.seed), batch_size=batch,
                 constraint=None if configured is None else configured.build(backbone))
    drafts = build_drafts(cfg, backbone)
    if drafts and not cls.speculates:
        raise UserError(f"{cls.__name__} takes no drafts: drop drafts= (or serve a speculative runner)")
    if cls.speculates:
        proposer = build_proposer(cfg, backbone)
        verifier = component(cfg.get("verifier"), backbone)
        if verifier is None and drafts:  # a plain preset serving drafts: the verifier of its sampler's kind
            verifier = component(option_nodes("verifier")["exact" if cfg.sampler.do_sample else "greedy"], backbone)
        parts.update(proposer=proposer, verifier=verifier,
                     guard=speculation_guard(cfg) if proposer is not None or drafts else None,
                     record_trees=bool(cfg.get("record_trees", False)), drafts=drafts)
        if (proposer is not None or drafts) and verifier is not None:
            parts.update(request_verifiers(verifier, backbone))
    return instantiate(cfg.runner)(**parts), backbone


def build_drafts(cfg: DictConfig, backbone) -> dict:
    """The named drafts of `drafts=[<preset>, ...]` (a server's: a request picks one by its model,
    `<model>:<name>`): each preset's proposer, as `decode=<preset>` configures it for this run's
    batch size and KV group, named by its proposer option (by the preset where two share one)."""
    presets = list(cfg.get("drafts") or [])
    if len(set(presets)) < len(presets):
        raise UserError(f"drafts: a preset is listed twice in {presets}")
    composed = {}
    for preset in presets:
        if preset not in groups()["decode"]:
            raise UserError(f"drafts: no preset {preset!r}; the presets: {', '.join(groups()['decode'])}")
        composed[preset] = compose_config([f"decode={preset}", f"batch_size={cfg.batch_size}"])
        if composed[preset].get("proposer") is None:
            raise UserError(f"drafts: {preset} has no proposer (a draft is a speculative preset: tree_eagle, "
                            "tree_medusa, tree_ngram, self_spec, ...)")
    choice = {p: component_choice("proposer", d.proposer) for p, d in composed.items()}
    out = {}
    for preset, d in composed.items():
        name = choice[preset] if list(choice.values()).count(choice[preset]) == 1 else preset
        node = OmegaConf.create({"proposer": OmegaConf.to_container(d.proposer, resolve=True),
                                 "kv": OmegaConf.to_container(cfg.kv, resolve=True)})
        check_paths(node)
        out[name] = build_proposer(node, backbone)
    return out


def request_verifiers(verifier, backbone) -> dict:
    """The verifiers of requests whose own knobs are of the other kind than the preset's: the
    configured verifier verifies its kind (greedy, or sampled where it `samples`), conf/verifier's
    `greedy` and `exact` options the other."""
    nodes = option_nodes("verifier")
    if verifier.samples:
        return {"greedy_verifier": component(nodes["greedy"], backbone), "sampling_verifier": verifier}
    return {"greedy_verifier": verifier, "sampling_verifier": component(nodes["exact"], backbone)}


def speculation_guard(cfg: DictConfig) -> SpeculationGuard | None:
    """The `guard` group's SpeculationGuard (None: `~guard`, always draft)."""
    if cfg.get("guard") is None:
        return None
    try:
        return component(cfg.guard)
    except InstantiationException as e:
        raise UserError(f"bad guard settings ({e.__cause__ or e}): guard takes warmup, probe, backoff, "
                        "max_backoff, decay, margin (conf/guard/default.yaml)") from None


def preset_name(cfg: DictConfig) -> str:
    """The preset's name if the run uses the preset's components, else the preset followed by the
    components that differ (`greedy proposer=ngram verifier=greedy`): a run whose proposer,
    verifier or sampler was picked by hand is never reported, or taken by a sweep, as a preset it
    is not."""
    name = cfg.get("name") or "custom"
    if name not in groups()["decode"]:
        return "custom"
    ref = compose_config([f"decode={name}"])
    differ = [f"{g}={component_choice(g, cfg.get(g))}" for g in ("proposer", "verifier", "sampler")
              if _pick(ref.get(g)) != _pick(cfg.get(g))]
    return " ".join([name, *differ])


def _pick(node):
    """What makes a component this component: its class (and, for samplers, whether it samples)."""
    if node is None:
        return None
    return OmegaConf.select(node, "_target_"), OmegaConf.select(node, "do_sample")


def component_choice(group: str, node) -> str:
    """The config-group option a component node came from (the running Hydra app's choice, else
    the conf/<group>/ file with the same class), for naming runs."""
    if node is None:
        return "null"
    hc = hydra_config()
    choice = None if hc is None else hc.runtime.choices.get(group)
    if choice:
        return str(choice)
    for name, option in option_nodes(group).items():
        if _pick(option) == _pick(node):
            return name
    return str(OmegaConf.select(node, "_target_")).rsplit(".", 1)[-1]
