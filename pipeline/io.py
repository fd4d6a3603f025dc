"""The run on disk: its directory, Hydra's runtime, and files written whole.

Files are written beside the target, then renamed over it, so a failed or interrupted run never
leaves half a file: the one helper every artifact writer uses. Torch-free (Hydra callbacks import
it in every app they start); `pipeline.core` re-exports the writers for the components."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

from hydra.core.hydra_config import HydraConfig

__all__ = ["append_jsonl", "atomic_write", "hydra_config", "run_dir", "write_json"]


def hydra_config() -> HydraConfig | None:
    """Hydra's runtime config (`.runtime`, `.overrides`, `.mode`, ...) inside a Hydra app, else None."""
    return HydraConfig.get() if HydraConfig.initialized() else None


def run_dir(cfg=None) -> Path:
    """The Hydra run directory when inside a Hydra app, else `cfg.output_dir`, else the cwd."""
    hc = hydra_config()
    if hc is not None:
        return Path(hc.runtime.output_dir)
    out = cfg.get("output_dir") if cfg is not None else None
    return Path(out) if out else Path.cwd()


def atomic_write(path: str | Path, data: str | bytes | Callable[[Path], None]) -> Path:
    """data: the text or bytes to write, or a function that writes the file (or builds the folder)
    at the path it is given (safetensors' save_file, a cache folder, ...). A folder replaces only a
    missing or empty one (OSError otherwise)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        if callable(data):
            data(tmp)
        elif isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)
        os.replace(tmp, path)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp)
        elif tmp.exists():
            tmp.unlink()
    return path


def write_json(path: str | Path, data) -> Path:
    return atomic_write(path, json.dumps(data, indent=2, ensure_ascii=False))


def append_jsonl(path: str | Path, row: dict) -> None:
    """One line, flushed and synced: a row appended is a row kept, whatever happens next."""
    with open(path, "a") as f:
        f.write(json.dumps(row, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
