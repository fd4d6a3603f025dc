"""Writing run artifacts whole: a file is written beside its target, then renamed over it."""
from __future__ import annotations

import json
import os
from pathlib import Path


def write_json(path: str | Path, data) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False))
    os.replace(tmp, path)
    return path


def run_dir(cfg=None) -> Path:
    """The Hydra run directory when inside a Hydra app, else `cfg.output_dir`, else the cwd."""
    try:
        from hydra.core.hydra_config import HydraConfig
        return Path(HydraConfig.get().runtime.output_dir)
    except ValueError:
        out = cfg.get("output_dir") if cfg is not None else None
        return Path(out) if out else Path.cwd()
