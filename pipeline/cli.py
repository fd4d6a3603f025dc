"""Shared entry-point plumbing: config-group names are checked before Hydra composes, so an
unknown component gets one line that lists the known ones."""
from __future__ import annotations

import sys
from pathlib import Path

from pipeline.errors import _die

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def groups() -> dict[str, list[str]]:
    return {d.name: sorted(p.stem for p in d.glob("*.yaml"))
            for d in CONF_DIR.iterdir() if d.is_dir() and d.name != "hydra"}


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
            if v not in known[key] and v != "null":
                _die(f"unknown {key} {v!r}; known {key} options: {', '.join(known[key])}")
