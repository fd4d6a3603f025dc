"""Shared bookkeeping of the KV managers: sequence ids, lengths, shapes from the backbone. The
interface itself is `pipeline.core.KVManager`."""
from __future__ import annotations

import torch

from pipeline.core import KVManager, KVPlan


class SequencePool(KVManager):
    def __init__(self, backbone=None, n_layers: int | None = None, n_kv_heads: int | None = None,
                 head_dim: int | None = None, dtype: torch.dtype | None = None, device=None):
        """Shapes come from `backbone` (its model args, attention dtype and device) unless given one
        by one. Index tensors are built on the host and moved once per step (`_dev`)."""
        if backbone is not None:
            a = backbone.model.args
            n_layers, n_kv_heads, head_dim, dtype = a.n_layers, a.n_kv_heads, a.head_dim, backbone.model.attn_dtype
            device = backbone.model.device
        self.device = torch.device(device or "cpu")
        self.n_layers, self.n_kv, self.hs = n_layers, n_kv_heads, head_dim
        self.dtype = dtype or torch.float32
        self.slot_bytes = 2 * n_layers * n_kv_heads * head_dim * self.dtype.itemsize  # one token, all layers, K and V
        self._len: dict[int, int] = {}
        self._pend: dict[int, int] = {}
        self._next = 0
        self.peak_bytes = 0

    def _dev(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.device == self.device else t.to(self.device, non_blocking=True)

    def _new_id(self) -> int:
        seq, self._next = self._next, self._next + 1
        self._len[seq], self._pend[seq] = 0, 0
        return seq

    def _check(self, seq: int) -> None:
        if seq not in self._len:
            raise KeyError(f"sequence {seq} is not live in this KV pool")

    def _drop(self, seq: int) -> None:
        self._check(seq)
        del self._len[seq], self._pend[seq]

    def length(self, seq: int) -> int:
        return self._len[seq]

    def pending(self, seq: int) -> int:
        return self._pend[seq]

    @property
    def sequences(self) -> list[int]:
        return list(self._len)

    def end_step(self, plan: KVPlan) -> None:
        for seq, n in zip(plan.seqs, plan.counts):
            self._pend[seq] += n

    def commit(self, seq: int, keep=None) -> None:
        self._check(seq)
        L = self._len[seq]
        if keep is None:
            self._len[seq] += self._pend[seq]
        else:
            idx = self._kept(seq, keep)
            if idx is not None:
                self._move(seq, idx + L, torch.arange(L, L + idx.numel()))
            self._len[seq] = L + len(keep)
        self._pend[seq] = 0
        self._release_tail(seq)

    def _move(self, seq: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the slots src (tentative, ascending) of every layer to dst (from the committed end)."""
        raise NotImplementedError

    def _kept(self, seq: int, keep) -> torch.Tensor | None:
        """Validate `keep`; None when the kept slots are already in place (a prefix of the tentative ones)."""
        idx = torch.as_tensor(keep, dtype=torch.long).reshape(-1)
        n, p = idx.numel(), self._pend[seq]
        if n and (int(idx.min()) < 0 or int(idx.max()) >= p or not bool((idx[1:] > idx[:-1]).all())):
            raise ValueError(f"keep must be ascending tentative slot indices in [0, {p}), got {idx.tolist()}")
        return None if bool((idx == torch.arange(n)).all()) else idx

    def truncate(self, seq: int, n: int) -> None:
        self._check(seq)
        if not 0 <= n <= self._len[seq]:
            raise ValueError(f"cannot truncate a sequence of {self._len[seq]} slots to {n}")
        self._len[seq], self._pend[seq] = n, 0
        self._release_tail(seq)

    def discard(self, seq: int) -> None:
        self._check(seq)
        self._pend[seq] = 0
        self._release_tail(seq)

    def _release_tail(self, seq: int) -> None:
        """Memory past the sequence's used slots may go back (paged pools)."""

    def _note_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.stats()["bytes_in_use"])
