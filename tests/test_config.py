"""Every option of every config group composes with its primary config and instantiates through
pipeline.build.component. Options are enumerated from pipeline.cli.groups(), so a new YAML file is
covered the moment it lands; a group used only by another entry point (train.yaml: heads, data,
trainer, logger) is composed with the primary config that lists it in its defaults."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf, open_dict

import pipeline.cli
from pipeline.build import build_engine, build_proposer, component
from pipeline.core import BeamSearch, Engine

from conftest import compose_config

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
    return cfg


def instantiate_option(group, option, cfg, backbone, heads_ckpt, tmp_path):
    if group == "decode":  # a global preset: it picks the components, the decoder assembles them
        assert cfg.name == option, f"conf/decode/{option}.yaml must set name: {option} (results.json's decode)"
        decoder, _ = build_engine(with_tiny_context(cfg, heads_ckpt), backbone)
        assert isinstance(decoder, BeamSearch if cfg.get("num_beams") is not None else Engine)
        if decoder.proposer is not None:  # a speculative preset must be runnable as configured
            assert decoder.verifier is not None and decoder.sampler.greedy
        return decoder
    if group == "model":
        bb = component(cfg.model)
        assert bb.model.args.vocab_size >= len(bb.tokenizer)
        assert bb.eos_ids, "a backbone must know its EOS token"
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
        assert obj.start() is not None
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
    if (group, option) == ("constraint", "none"):  # no component: every token may come next
        assert "_target_" not in cfg.constraint and build_engine(cfg, tiny_backbone)[0].constraint is None
        return
    if group != "decode":
        assert group in cfg, f"{group}={option} composed, but the config has no `{group}` node"
        if cfg[group] is not None and "_target_" not in cfg[group]:
            pytest.fail(f"conf/{group}/{option}.yaml has no _target_")
    obj = instantiate_option(group, option, cfg, tiny_backbone, tiny_heads_checkpoint, tmp_path)
    assert obj is not None


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
