"""The KV manager interface every decoder uses.

A sequence's cache has `length` committed slots followed by `pending` tentative ones. A forward
of T tokens writes its keys/values into the next T tentative slots (`update`, called per layer, then
`advance(T)` once). The decoder then decides what those slots become:

- `commit()` keeps all of them (plain decoding);
- `commit(keep)` gathers the chosen tentative slots, in order, into contiguous positions right after
  the committed prefix and releases every other one (tree verification);
- `discard()` releases all tentative slots (a draft pass whose keys the verifier recomputes);
- `truncate(n)` rolls the committed prefix back to n slots.

`fork()` gives an independent copy of the sequence (beam search), `free()` gives its memory back.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class KVManager(ABC):
    length: int  # committed slots
    pending: int  # tentative slots after them

    @property
    def used(self) -> int:
        return self.length + self.pending

    @abstractmethod
    def allocate(self, batch: int, max_len: int) -> None:
        """Start a new (batch of) sequence(s) able to hold `max_len` slots; the cache is empty."""

    @abstractmethod
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: (B, nkv, T, hs) for the T new tokens of this forward. Writes them after the used slots
        and returns all keys/values to attend to: (B, nkv, used + T, hs)."""

    @abstractmethod
    def advance(self, n: int) -> None:
        """Called once after a forward: its n written slots become tentative."""

    @abstractmethod
    def commit(self, keep: list[int] | torch.Tensor | None = None) -> None:
        """Keep the tentative slots `keep` (indices relative to the first tentative slot, ascending) or
        all of them (None); release the rest."""

    @abstractmethod
    def discard(self) -> None:
        """Release every tentative slot."""

    @abstractmethod
    def truncate(self, n: int) -> None:
        """Roll the committed prefix back to its first n slots (drops tentative slots too)."""

    @abstractmethod
    def fork(self) -> "KVManager":
        """An independent copy of this sequence's cache."""

    @abstractmethod
    def free(self) -> None:
        """Release the sequence's memory."""

    @abstractmethod
    def keys_values(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The committed keys/values of one layer: (B, nkv, length, hs). For tests and inspection."""

    @property
    @abstractmethod
    def slots_in_use(self) -> int:
        """Slots holding data that some sequence still owns (leak checks): committed + tentative."""
