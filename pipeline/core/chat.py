"""Prompt text -> token ids, with the model's chat template."""
from __future__ import annotations


def encode_chat(tokenizer, messages: list[dict] | None, text: str, chat: bool = True,
                system_prompt: str | None = None) -> list[int]:
    """`messages` (chat format) or a single user `text`; chat=False feeds `text` raw."""
    if not chat:
        return tokenizer.encode(text, add_special_tokens=False)
    msgs = messages or [{"role": "user", "content": text}]
    if system_prompt and msgs[0].get("role") != "system":
        msgs = [{"role": "system", "content": system_prompt}] + msgs
    rendered = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False)
