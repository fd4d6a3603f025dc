"""Requests: from `input=` JSON Lines or a single `prompt=`, validated line by line before any model
loads, then tokenized with the chat template."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.core import UserError, encode_chat

CONSTRAINT_KEYS = ("json_schema", "regex", "grammar")
ROLES = ("system", "user", "assistant", "tool")


@dataclass
class Request:
    id: str
    prompt: str  # the user text, or the last message's content
    messages: list[dict] | None = None
    constraint: dict | None = None  # a per-request constraint line, if any


def _messages(msgs, where: str) -> list[dict]:
    shape = 'a non-empty list of {"role": "user", "content": "..."} objects'
    if not isinstance(msgs, list) or not msgs:
        raise UserError(f'{where}: "messages" must be {shape}')
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            missing = "an object" if not isinstance(m, dict) else " and ".join(
                f'"{k}"' for k in ("role", "content") if k not in m)
            raise UserError(f'{where}: message {j} needs {missing}; "messages" must be {shape}')
        if m["role"] not in ROLES:
            raise UserError(f'{where}: message {j} has role {m["role"]!r}; use one of {", ".join(ROLES)}')
        if not isinstance(m["content"], str):
            raise UserError(f'{where}: message {j} content must be a string, got {type(m["content"]).__name__}')
    return msgs


def _prompt(text, where: str) -> str:
    if not isinstance(text, str):
        raise UserError(f'{where}: "prompt" must be a string, got {type(text).__name__} {text!r}; quote it')
    if not text.strip():
        raise UserError(f'{where}: "prompt" is empty: give the text to continue')
    return text


def load_requests(input_path: str | None, prompt: str | None) -> list[Request]:
    if prompt is not None and input_path is not None:
        raise UserError("give either input=<file.jsonl> or prompt=\"...\", not both")
    if prompt is not None:
        return [Request("prompt", _prompt(str(prompt) if isinstance(prompt, (int, float)) else prompt, "prompt="))]
    if input_path is None:
        raise UserError('nothing to decode: pass input=<file.jsonl> or prompt="..."')
    path = Path(input_path).expanduser()
    if not path.is_file():
        raise UserError(f"input file {path} does not exist: pass input=<file.jsonl> with one "
                        '{"id": ..., "prompt": ...} per line')
    out, seen = [], {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where} is not valid JSON ({e.msg}): one JSON object per line")
        if not isinstance(row, dict) or ("prompt" not in row and "messages" not in row):
            raise UserError(f'{where} needs a "prompt" string or a "messages" list')
        if "prompt" in row and "messages" in row:
            raise UserError(f'{where} has both "prompt" and "messages": keep one')
        msgs = _messages(row["messages"], where) if "messages" in row else None
        text = _prompt(row["prompt"], where) if "prompt" in row else msgs[-1]["content"]
        rid = row.get("id", f"r{n - 1:03d}")
        if not isinstance(rid, (str, int)) or isinstance(rid, bool):
            raise UserError(f'{where}: "id" must be a string or an int, got {rid!r}')
        rid = str(rid)
        if rid in seen:
            raise UserError(f"{where}: id {rid!r} repeats line {seen[rid]}: ids must be unique (resuming is keyed by id)")
        seen[rid] = n
        cons = {k: row[k] for k in CONSTRAINT_KEYS if k in row} or None
        out.append(Request(rid, text, msgs, cons))
    if not out:
        raise UserError(f"input file {path} holds no requests: one JSON object per line, "
                        '{"id": ..., "prompt": ...}')
    return out


def encode(tokenizer, req: Request, chat: bool, system_prompt: str | None = None) -> list[int]:
    if not chat and req.messages is not None:
        raise UserError(f'request {req.id} has "messages", which need chat=true')
    ids = encode_chat(tokenizer, req.messages, req.prompt, chat, system_prompt)
    if not ids:
        raise UserError(f"request {req.id}: the prompt encodes to no tokens: give it some text")
    return ids
