"""Incremental detokenization: text is released only once its bytes form whole characters."""
from __future__ import annotations

import sys


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


class StreamPrinter:
    """Per-request streams on one terminal while requests decode in a batch: the oldest unfinished
    request prints live; the others are held (already decoded) and printed, whole, when their turn
    comes. Output therefore reads request after request, in input order, and never shows a draft."""

    def __init__(self, tokenizer, ids: list[str], show_ids: bool = True, out=None):
        self.streams = [TextStream(tokenizer) for _ in ids]
        self.held = ["" for _ in ids]
        self.finished = [False] * len(ids)
        self.ids, self.show_ids, self.out = ids, show_ids, out or sys.stdout
        self.current = -1
        self._advance()

    def _write(self, text: str) -> None:
        if text:
            print(text, end="", file=self.out, flush=True)

    def _advance(self) -> None:
        """Move to the next request; print what it already has."""
        while True:
            self.current += 1
            if self.current >= len(self.ids):
                return
            c = self.current
            if self.show_ids:
                self._write(f"{chr(10) if c else ''}[{self.ids[c]}] ")
            self._write(self.held[c])
            if not self.finished[c]:
                return
            self._write(self.streams[c].flush())

    def push(self, i: int, ids: list[int], hidden=None) -> None:
        text = self.streams[i].push(ids)
        if i == self.current:
            self._write(text)
        else:
            self.held[i] += text

    def finish(self, i: int) -> None:
        self.finished[i] = True
        if i == self.current:
            self._write(self.streams[i].flush())
            self._advance()
        else:
            self.held[i] += self.streams[i].flush()

    def close(self) -> None:
        self._write("\n")
