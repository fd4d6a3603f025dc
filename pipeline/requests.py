"""Requests: from `input=` JSON Lines or a single `prompt=`, tokenized with the chat template."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import UserError

CONSTRAINT_KEYS = ("json_schema", "regex", "grammar")


@dataclass
class Request:
    id: str
    prompt: str  # the user text, or the last message's content
    messages: list[dict] | None = None
    constraint: dict | None = None  # a per-request constraint line, if any


def load_requests(input_path: str | None, prompt: str | None) -> list[Request]:
    if prompt is not None and input_path is not None:
        raise UserError("give either input=<file.jsonl> or prompt=\"...\", not both")
    if prompt is not None:
        return [Request("prompt", str(prompt))]
    if input_path is None:
        raise UserError('nothing to decode: pass input=<file.jsonl> or prompt="..."')
    path = Path(input_path).expanduser()
    if not path.is_file():
        raise UserError(f"input file {path} does not exist: pass input=<file.jsonl> with one "
                        '{"id": ..., "prompt": ...} per line')
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n} is not valid JSON ({e.msg}): one JSON object per line")
        if not isinstance(row, dict) or ("prompt" not in row and "messages" not in row):
            raise UserError(f'{path}:{n} needs a "prompt" string or a "messages" list')
        msgs = row.get("messages")
        if msgs is not None and (not isinstance(msgs, list) or not all(isinstance(m, dict) and "content" in m for m in msgs)):
            raise UserError(f'{path}:{n}: "messages" must be a list of {{"role", "content"}} objects')
        text = row["prompt"] if "prompt" in row else msgs[-1]["content"]
        cons = {k: row[k] for k in CONSTRAINT_KEYS if k in row} or None
        out.append(Request(str(row.get("id", f"r{n - 1:03d}")), str(text), msgs, cons))
    if not out:
        raise UserError(f"input file {path} holds no requests")
    return out


def encode(tokenizer, req: Request, chat: bool, system_prompt: str | None = None) -> list[int]:
    if not chat:
        if req.messages is not None:
            raise UserError(f'request {req.id} has "messages", which need chat=true')
        return tokenizer.encode(req.prompt, add_special_tokens=False)
    msgs = req.messages or [{"role": "user", "content": req.prompt}]
    if system_prompt and msgs[0].get("role") != "system":
        msgs = [{"role": "system", "content": system_prompt}] + msgs
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)
