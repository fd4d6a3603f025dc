"""Writing files whole: written beside the target, then renamed over it, so a failed or interrupted
run never leaves half a file. The one helper every artifact writer uses."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable


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
