"""Incremental detokenization: text is released only once its bytes form whole characters."""
from __future__ import annotations


class TextStream:
    """Feed committed token ids; get back the new printable text. A character whose bytes span
    several tokens (CJK, emoji) is held until it is complete, never printed as U+FFFD."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tok, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # tokens before this are already printed and closed
        self.read_offset = 0

    def _decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        if text.endswith("\ufffd") or len(text) <= len(prefix):
            return ""  # an incomplete multi-byte character: wait for the next token
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix):]

    def flush(self) -> str:
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix):]
