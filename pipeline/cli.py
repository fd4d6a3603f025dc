"""Shared entry-point plumbing: config-group names are checked before Hydra composes, so an
unknown component gets one line that lists the known ones."""
from __future__ import annotations

import contextlib
import difflib
import functools
import re
from pathlib import Path

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipeline.errors import die

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def groups() -> dict[str, list[str]]:
    """The registry: every config group of conf/ with its options."""
    return {d.name: sorted(p.stem for p in d.glob("*.yaml"))
            for d in CONF_DIR.iterdir() if d.is_dir() and d.name != "hydra"}


@functools.lru_cache(maxsize=None)
def option_nodes(group: str) -> dict[str, DictConfig]:
    """Each option of a group as its YAML holds it (before composition), by option name."""
    return {name: OmegaConf.create(yaml.safe_load((CONF_DIR / group / f"{name}.yaml").read_text()) or {})
            for name in groups().get(group, [])}


FREE_TEXT_KEYS = ("prompt", "system_prompt", "constraint.pattern", "constraint.grammar", "constraint.schema")
# values users type as prose, commas, brackets and all


def quote_free_text(argv: list[str]) -> list[str]:
    """`prompt=Hi, who are you?` reaches us unquoted (the shell ate the quotes) and Hydra's override
    grammar rejects it ("Ambiguous value"). A free-text value that Hydra would not read as the one
    string typed is quoted for it, as typed: backslashes before a quote or at the end doubled,
    quotes escaped, `${` kept literal. A value already quoted for Hydra is left alone."""
    parser, out = OverridesParser.create(), []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if eq and key.lstrip("+~") in FREE_TEXT_KEYS:
            try:
                parsed = parser.parse_override(arg).value()
            except Exception:  # Hydra's grammar errors: quote it
                parsed = None
            if not isinstance(parsed, str) or "${" in value:
                text = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, value)
                arg = f"{key}='" + text.replace("'", "\\'").replace("${", "\\${") + "'"
        out.append(arg)
    return out


@contextlib.contextmanager
def composing():
    """`hydra.compose` needs an initialized GlobalHydra: the running app's own (it searches the same
    conf/) inside an entry point, or a temporary one when called from Python."""
    if GlobalHydra.instance().is_initialized():
        yield
    else:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            yield


def compose_config(overrides: list[str], config_name: str = "config") -> DictConfig:
    with composing():
        return compose(config_name=config_name, overrides=list(overrides))


# knobs that became something else: what to type now
MOVED = {"speculation_guard": "the guard is the `guard` group now: ~guard always drafts, guard.<knob>=... tunes it"}


def check_overrides(argv: list[str], config_name: str) -> None:
    """Fail with one line, before Hydra runs, on an unknown component or a knob that does not exist."""
    check_group_overrides(argv)
    if any(a in ("-m", "--multirun") or a.startswith("-") for a in argv):
        return  # sweeps and Hydra's own flags: left to Hydra
    overrides = [a for a in argv if "=" in a and not a.lstrip("+~").startswith("hydra")]
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            compose(config_name=config_name, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        msg = str(e).split("\n")[0].rstrip(".")
        bad = next((o.split("=", 1)[0].lstrip("+~") for o in overrides if f"'{o.split('=', 1)[0]}'" in msg), None)
        hint = ""
        if bad in MOVED:
            hint = f"; {MOVED[bad]}"
        elif bad is not None:
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                base = compose(config_name=config_name)
            parent, _, leaf = bad.rpartition(".")
            node = OmegaConf.select(base, parent) if parent else base
            known = list(node.keys()) if isinstance(node, DictConfig) else []
            close = difflib.get_close_matches(leaf, known, n=1)
            hint = f"; did you mean {parent + '.' if parent else ''}{close[0]}?" if close else \
                f"; known keys here: {', '.join(map(str, known))}" if known else ""
        die(f"bad override: {msg}{hint}")


def check_group_overrides(argv: list[str]) -> None:
    known = groups()
    for arg in argv:
        if "=" not in arg or arg.startswith("hydra"):
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        if key not in known:
            continue
        for v in value.split(","):
            v = v.strip()
            if v == "null":  # Hydra takes no null for a group on the command line
                die(f"{key}=null: drop the {key} group with ~{key} (a group that is null by default needs nothing)")
            if v not in known[key]:
                off = f"; ~{key} for none" if v.lower() in ("none", "false", "off") else ""
                die(f"unknown {key} {v!r}; known {key} options: {', '.join(known[key])}{off}")
