"""Every option of every config group composes with its primary config and instantiates through
pipeline.build.component. Options are enumerated from pipeline.cli.groups(), so a new YAML file is
covered the moment it lands; a group used only by another entry point (train.yaml: heads, data,
trainer, logger) is composed with the primary config that lists it in its defaults."""
from __future__ import annotations

import inspect
import typing
from pathlib import Path

import pytest
import torch
from hydra.utils import get_object
from omegaconf import OmegaConf, open_dict

import pipeline.cli
from pipeline.build import build_engine, build_proposer, component
from pipeline.core import BeamSearch, Constraint, Engine, Proposer, Verifier
from pipeline.core.bits import words
from pipeline.core.guard import SpeculationGuard

from helpers import compose_config

CONF = pipeline.cli.CONF_DIR
DECODING_GROUPS = {"decode", "model", "kv", "sampler", "proposer", "verifier"}


def primary_defaults() -> dict[str, set[str]]:
    """conf/<primary>.yaml -> the config groups its defaults list selects."""
    out = {}
    for f in sorted(CONF.glob("*.yaml")):
        groups = set()
        for entry in OmegaConf.load(f).get("defaults", []) or []:
            if isinstance(entry, str):
                if entry in out:  # `- config`: inherits that primary's groups
                    groups |= out[entry]
                continue
            for key in entry:
                key = str(key).removeprefix("override ").lstrip("/")
                if not key.startswith("hydra"):
                    groups.add(key.split("@")[0])
        out[f.stem] = groups
    return out


PRIMARIES = primary_defaults()


def primary_for(group: str) -> str:
    if group in PRIMARIES.get("config", set()) or group == "decode":
        return "config"
    users = [name for name, gs in PRIMARIES.items() if group in gs]
    assert users, f"config group {group!r} is used by no primary config in {CONF}"
    return "train" if "train" in users else users[0]


def options():
    return [(g, o) for g, opts in sorted(pipeline.cli.groups().items()) for o in opts]


def test_groups_cover_the_contract():
    groups = pipeline.cli.groups()
    for g in ("decode", "model", "kv", "sampler", "proposer", "verifier"):
        assert g in groups and groups[g], g
    for preset in ("greedy", "sample", "tree_ngram", "self_spec"):
        assert preset in groups["decode"]
    assert {"tiny", "smollm2_135m"} <= set(groups["model"])


@pytest.fixture(scope="module")
def tiny_heads_checkpoint(tiny_backbone, tmp_path_factory) -> dict[str, Path]:
    """Draft heads for the tiny backbone, one per `heads` option, built through the `heads` group (no
    heads are shipped for it): the extra context proposer=medusa|eagle and their presets need on
    model=tiny. Saved with the metadata pipeline/train.py writes."""
    out = {}
    bb = tiny_backbone
    for kind in pipeline.cli.groups().get("heads", []):
        cfg = compose_config(["model=tiny", f"heads={kind}"], config_name="train")
        heads = component(cfg.heads, bb, token_counts=torch.ones(bb.model.args.vocab_size, dtype=torch.long))
        path = tmp_path_factory.mktemp("heads") / "heads.safetensors"
        heads.save(path, {"vocab_size": bb.model.args.vocab_size, "fingerprint": bb.model.fingerprint(),
                          "backbone": bb.name})
        out[kind] = path
    return out


def with_tiny_context(cfg, heads_ckpt):
    """A proposer that loads a checkpoint shipped only for the real model gets the tiny one."""
    prop = cfg.get("proposer")
    if prop is not None and "checkpoint" in prop and prop.checkpoint is None and heads_ckpt:
        kind = "eagle" if "eagle" in prop._target_ else "medusa"
        with open_dict(cfg):
            cfg.proposer.checkpoint = str(heads_ckpt[kind])
    if prop is not None and "sources" in prop and heads_ckpt:  # proposer=hybrid: its model sources' drafts
        with open_dict(cfg):
            for kind in ("eagle", "medusa"):
                if prop[kind].checkpoint is None:
                    prop[kind].checkpoint = str(heads_ckpt[kind])
    return cfg


def instantiate_option(group, option, cfg, backbone, heads_ckpt, tmp_path):
    if group == "decode":  # a global preset: it picks the components, the decoder assembles them
        assert cfg.name == option, f"conf/decode/{option}.yaml must set name: {option} (results.json's decode)"
        decoder, _ = build_engine(with_tiny_context(cfg, heads_ckpt), backbone)
        assert type(decoder) is (BeamSearch if option == "beam" else Engine)
        if decoder.drafter is not None:  # a speculative preset must be runnable as configured
            assert isinstance(decoder.drafter, Proposer) and isinstance(decoder.verifier, Verifier)
            assert decoder.sampler.greedy
        return decoder
    if group == "runner":  # the runner under the default preset's components
        runner, _ = build_engine(with_tiny_context(cfg, heads_ckpt), backbone)
        assert type(runner) is {"engine": Engine, "beam": BeamSearch}[option]
        assert runner.run([[1, 2, 3]], max_new_tokens=2)[0].token_ids
        return runner
    if group == "model":
        bb = component(cfg.model)
        assert bb.model.args.vocab_size >= len(bb.tokenizer)
        assert bb.eos_ids, "a backbone must know its EOS token"
        assert all(0 <= t < bb.model.args.vocab_size for t in bb.eos_ids), bb.eos_ids
        return bb
    if group == "proposer":
        return build_proposer(with_tiny_context(cfg, heads_ckpt), backbone)
    # train-time groups: each needs what pipeline/train.py passes alongside the backbone
    if group == "heads":
        return component(cfg.heads, backbone, token_counts=torch.ones(backbone.model.args.vocab_size, dtype=torch.long))
    if group == "data":
        return component(cfg.data, backbone, num_heads=int(cfg.heads.num_heads), root=str(tmp_path / "data"))
    if group == "trainer":
        return component(cfg.trainer, logger=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    if group == "logger":
        return component(cfg.logger, save_dir=str(tmp_path))
    if group == "constraint":  # the options that need their language named get an example
        example = {"regex": ("pattern", "[a-z]+"), "json_schema": ("schema", '{"type": "object"}'),
                   "ebnf": ("grammar", 'root ::= "a" | "b"')}
        if option in example:
            cfg.constraint[example[option][0]] = example[option][1]
        obj = component(cfg.constraint, backbone)
        state, bits = obj.start(), torch.zeros(words(backbone.model.args.vocab_size), dtype=torch.int32)
        assert isinstance(state, Constraint)
        state.fill(bits)
        assert bits.any(), f"constraint={option} allows no token at the start"
        return obj
    return component(cfg[group], backbone)


@pytest.mark.parametrize("group,option", [
    pytest.param(g, o, marks=pytest.mark.slow) if (g, o) == ("model", "smollm2_135m") else (g, o)
    for g, o in options()])
def test_every_option_composes_and_instantiates(group, option, tiny_backbone, tiny_heads_checkpoint, tmp_path):
    primary = primary_for(group)
    overrides = [f"{group}={option}"]
    if group != "model" and "model" in PRIMARIES.get(primary, ()):
        overrides.append("model=tiny")
    if group == "sweep":  # a ready-made sweep: the sweeper's class and what it sweeps
        from hydra import compose, initialize_config_dir
        with initialize_config_dir(config_dir=str(pipeline.cli.CONF_DIR), version_base="1.3"):
            full = compose(config_name=primary, overrides=overrides, return_hydra_config=True)
        assert full.hydra.sweeper._target_.startswith("hydra_plugins.decode_sweepers.sweepers.")
        assert full.hydra.sweeper.params and full.name != "greedy"  # it picks a speculative preset
        return
    cfg = compose_config(overrides, config_name=primary)
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    if group != "decode":
        assert group in cfg, f"{group}={option} composed, but the config has no `{group}` node"
        if cfg[group] is not None and "_target_" not in cfg[group]:
            pytest.fail(f"conf/{group}/{option}.yaml has no _target_")
    obj = instantiate_option(group, option, cfg, tiny_backbone, tiny_heads_checkpoint, tmp_path)
    made = made_by(cfg["runner" if group == "decode" else group]._target_)
    assert isinstance(obj, made), f"{group}={option} gave a {type(obj).__name__}, not a {made.__name__}"


def made_by(target: str) -> type:
    """What a `_target_` makes: the class it names, or what the function it names returns."""
    obj = get_object(target)
    return obj if inspect.isclass(obj) else typing.get_type_hints(obj)["return"]


def test_absent_components_are_null(tiny_backbone):
    """No constraint is `constraint: null` (every token may come next); `~guard` drops the guard."""
    cfg = compose_config(["model=tiny"])
    assert cfg.get("constraint") is None and "none" not in pipeline.cli.groups()["constraint"]
    assert build_engine(cfg, tiny_backbone)[0].constraint is None
    full = compose_config(["model=tiny", "decode=tree_ngram", "guard=default"])
    assert full.guard._target_ == "pipeline.core.guard.SpeculationGuard"
    guard = build_engine(full, tiny_backbone)[0].guard
    assert isinstance(guard, SpeculationGuard) and (guard.probe, guard.decay) == (full.guard.probe, full.guard.decay)
    assert build_engine(compose_config(["model=tiny", "decode=tree_ngram", "~guard"]), tiny_backbone)[0].guard is None
    # a preset's own guard option gives way to ~guard on the command line
    assert compose_config(["model=tiny", "decode=tree_eagle", "~guard"]).get("guard") is None
    steady = compose_config(["model=tiny", "decode=tree_eagle", "guard=steady"]).guard
    assert (steady.probe, steady.decay, steady.warmup) == (12, 0.9, 2)  # the default's other knobs kept


@pytest.mark.parametrize("argv,words", [
    (["constraint=none"], ["unknown constraint 'none'", "json_schema", "~constraint"]),
    (["guard=off"], ["unknown guard 'off'", "default", "~guard"]),
    (["guard=null"], ["guard=null", "~guard"]),
    (["speculation_guard=false"], ["speculation_guard", "~guard"]),
])
def test_old_off_switches_name_the_deletion(argv, words, capsys):
    """`constraint=none`, `guard=null` (which Hydra refuses for a group) and `speculation_guard=false`
    fail with one line naming what turns the component off now."""
    with pytest.raises(SystemExit) as e:
        pipeline.cli.check_overrides(["model=tiny", *argv], "config")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    for w in words:
        assert w in err, (w, err)


def test_null_proposer_means_plain_decoding(tiny_backbone):
    cfg = compose_config(["model=tiny"])
    assert cfg.get("proposer") is None and cfg.get("verifier") is None
    decoder, _ = build_engine(cfg, tiny_backbone)
    assert decoder.proposer is None and decoder.sampler.greedy


def test_component_overrides_compose_with_presets(tiny_backbone):
    """Any group override composes with any preset, and tree knobs reach the proposer."""
    cfg = compose_config(["model=tiny", "decode=tree_ngram", "tree.width=3", "tree.depth=5", "tree.max_nodes=7",
                          "kv=contiguous", "kv.max_len=256", "batch_size=4"])
    decoder, _ = build_engine(cfg, tiny_backbone)
    p = decoder.proposer
    assert (p.width, p.depth, p.max_nodes) == (3, 5, 7)
    assert decoder.kv.capacity == 256 and decoder.batch_size == 4
    cfg = compose_config(["model=tiny", "decode=self_spec", "tree.depth=2", "proposer.layers=[1]"])
    decoder, _ = build_engine(cfg, tiny_backbone)
    assert decoder.proposer.depth == 2 and decoder.proposer.layers == [1]


def test_tiny_config_matches_the_tiny_fixture(tiny_backbone):
    """conf/model/tiny.yaml builds the same weights as components.model.load.tiny() (the fixture
    the other tests compare against)."""
    bb = component(compose_config(["model=tiny"]).model)
    for (n, a), (_, b) in zip(bb.model.state_dict().items(), tiny_backbone.model.state_dict().items()):
        assert torch.equal(a, b), n


def test_self_spec_layers_default_to_every_second_block_of_the_backbone(tiny_backbone):
    """`proposer.layers: null` follows the live backbone's depth; slices and lists still pick blocks."""
    from components.proposer.self_spec import parse_layers
    n = tiny_backbone.model.args.n_layers
    cfg = compose_config(["model=tiny", "decode=self_spec"])
    assert cfg.proposer.layers is None
    assert build_engine(cfg, tiny_backbone)[0].proposer.layers == list(range(0, n, 2))
    assert parse_layers(None, 30) == list(range(0, 30, 2)) == parse_layers("0:30:2", 30)
    assert parse_layers("0:3", 30) == [0, 1, 2] and parse_layers([5, 1], 30) == [1, 5]
    with pytest.raises(ValueError, match="proposer.layers"):
        parse_layers("40:50", 30)


def test_request_constraints_add_to_prompt_with_no_constraint_configured():
    """With constraint=null a request line's own constraint takes its add_to_prompt from
    `request_constraints_add_to_prompt`; a configured constraint of another kind lends its own."""
    from pipeline.build import constraint_spec
    request = {"regex": "[a-z]+"}
    assert constraint_spec(compose_config(["model=tiny"]), request).kwargs["add_to_prompt"] is False
    spec = constraint_spec(compose_config(["model=tiny", "request_constraints_add_to_prompt=true"]), request)
    assert spec.kwargs["add_to_prompt"] is True and spec.kwargs["pattern"] == "[a-z]+"
    spec = constraint_spec(compose_config(["model=tiny", "constraint=json_schema", "constraint.add_to_prompt=true"]), request)
    assert spec.kwargs["add_to_prompt"] is True and spec.target.endswith("Regex")
