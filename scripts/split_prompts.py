"""Split a prompt file into a training part and a held-out slice of the same distribution.

    python scripts/split_prompts.py <prompts.jsonl> <train.jsonl> <held_out.jsonl> [held=200]

The held-out slice is the last `held` single-turn prompts of the file (the newest, for a recorded
file), written with ids (`<stem>-<k>`) so `python -m pipeline.bench input=<held_out.jsonl>` reads it;
every other line goes to the training part unchanged (`data.prompts=<train.jsonl>`). A draft adapted
on the training part is then measured on prompts it never saw, from the same source: how
`make heads` keeps a slice of the Magpie prompts apart, and how a user checks a draft adapted to their
recorded traffic (`python -m pipeline.serve record_prompts=<file>`).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def split(lines: list[str], held: int) -> tuple[list[str], list[dict]]:
    """(the training lines, the held-out prompts as {"id", "prompt"} without ids yet)."""
    rows = [json.loads(line) for line in lines]
    picked = [i for i in range(len(rows) - 1, -1, -1) if isinstance(rows[i].get("prompt"), str)][:held]
    keep = set(picked)
    return [line for i, line in enumerate(lines) if i not in keep], [{"prompt": rows[i]["prompt"]} for i in sorted(picked)]


def main(argv: list[str]) -> int:
    if len(argv) not in (3, 4):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    src, train, held_out = map(Path, argv[:3])
    held = int(argv[3].split("=")[-1]) if len(argv) == 4 else 200
    if not src.is_file():
        print(f"no prompt file {src}: make one with python -m pipeline.train data.only=prompts (prompts.jsonl in its run "
              "directory) or python -m pipeline.serve record_prompts=<file>", file=sys.stderr)
        return 2
    lines = [line if line.endswith("\n") else line + "\n" for line in src.read_text().splitlines(keepends=True) if line.strip()]
    kept, out = split(lines, held)
    if len(out) < held or not kept:
        print(f"{src}: {len(lines)} prompts cannot give a training part and {held} held-out single-turn prompts", file=sys.stderr)
        return 2
    train.parent.mkdir(parents=True, exist_ok=True)
    held_out.parent.mkdir(parents=True, exist_ok=True)
    train.write_text("".join(kept))
    held_out.write_text("".join(json.dumps({"id": f"{held_out.stem}-{k}", **r}) + "\n" for k, r in enumerate(out)))
    print(f"{src}: {len(kept)} prompts -> {train}, {len(out)} held out -> {held_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
