"""Run directories; files are written whole by `pipeline.core.io` (re-exported here)."""
from __future__ import annotations

from pathlib import Path

from pipeline.core.io import append_jsonl, atomic_write, write_json

__all__ = ["append_jsonl", "atomic_write", "run_dir", "write_json"]

def run_dir(cfg=None) -> Path:
    """The Hydra run directory when inside a Hydra app, else `cfg.output_dir`, else the cwd."""
    try:
        from hydra.core.hydra_config import HydraConfig
        return Path(HydraConfig.get().runtime.output_dir)
    except ValueError:
        out = cfg.get("output_dir") if cfg is not None else None
        return Path(out) if out else Path.cwd()
