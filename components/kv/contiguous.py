"""Contiguous KV: one preallocated slab per sequence, all in one buffer, updated in place.

buf: (n_layers, 2, slots, nkv, capacity, hs). A sequence owns one slot (a row of the buffer) for its
whole life; a step over sequences in consecutive slots attends to a view of the buffer, with no copy.
Slots are handed out lowest first, so a full batch occupies slots 0..B-1. The buffer grows (a copy)
when more sequences or more slots per sequence are needed.
"""
from __future__ import annotations

import torch

from components.kv.base import SequencePool
from pipeline.core import KVPlan, positive_int


class ContiguousKV(SequencePool):
    def __init__(self, backbone=None, max_len: int = 512, n_layers: int | None = None,
                 n_kv_heads: int | None = None, head_dim: int | None = None, dtype: torch.dtype | None = None,
                 device=None):
        """max_len: slots per sequence allocated up front (grown when a sequence needs more)."""
        positive_int(max_len, "kv.max_len")
        super().__init__(backbone, n_layers, n_kv_heads, head_dim, dtype, device)
        self.capacity = max_len
        self.buf = torch.zeros(self.n_layers, 2, 0, self.n_kv, max_len, self.hs, dtype=self.dtype, device=self.device)
        self._slot: dict[int, int] = {}
        self._free: list[int] = []  # free slots, ascending

    # --- sequences -------------------------------------------------------------------------------
    def _grow(self, slots: int, capacity: int) -> None:
        old = self.buf
        self.buf = torch.zeros(self.n_layers, 2, slots, self.n_kv, capacity, self.hs, dtype=self.dtype, device=self.device)
        self.buf[:, :, :old.shape[2], :, :old.shape[4]] = old
        self._free = sorted(self._free + list(range(old.shape[2], slots)))
        self.capacity = capacity

    def create(self, prompt: list[int] | None = None) -> int:  # no prefix cache: always empty
        if not self._free:
            self._grow(max(1, 2 * self.buf.shape[2]), self.capacity)
        seq = self._new_id()
        self._slot[seq] = self._free.pop(0)
        self._note_peak()
        return seq

    def fork(self, seq: int) -> int:
        self._check(seq)
        new = self.create()
        n = self._len[seq]
        self.buf[:, :, self._slot[new], :, :n] = self.buf[:, :, self._slot[seq], :, :n]
        self._len[new] = n
        return new

    def free(self, seq: int) -> None:
        self._drop(seq)
        self._free = sorted(self._free + [self._slot.pop(seq)])

    def batch_order(self, seqs):
        return sorted(seqs, key=self._slot.__getitem__)

    # --- a step ----------------------------------------------------------------------------------
    def begin_step(self, step) -> KVPlan:
        need = step.span
        if need > self.capacity:
            self._grow(self.buf.shape[2], max(need, 2 * self.capacity))
            self._note_peak()
        slots = [self._slot[s] for s in step.seqs]
        counts = step.counts
        if len(slots) == 1:  # one slab, its rows in order: slice writes and a view
            s0 = step.starts[0]
            return KVPlan(list(step.seqs), counts, step.span, (slots[0], slice(s0, s0 + counts[0])),
                          slice(slots[0], slots[0] + 1))
        wslot = torch.tensor(slots).repeat_interleave(torch.tensor(counts))  # (R,)
        wpos = torch.cat([s + torch.arange(n) for s, n in zip(step.starts, counts)])  # (R,)
        consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
        read = slice(slots[0], slots[0] + len(slots)) if consecutive else self._dev(torch.tensor(slots))
        return KVPlan(list(step.seqs), counts, step.span, (self._dev(wslot), self._dev(wpos)), read)

    def update(self, layer, k, v, plan):
        kb, vb = self.buf[layer, 0], self.buf[layer, 1]  # (slots, nkv, capacity, hs)
        slot, pos = plan.write
        if isinstance(pos, slice):  # a lone sequence: (nkv, R, hs) in its slab
            kb[slot, :, pos] = k.transpose(0, 1)
            vb[slot, :, pos] = v.transpose(0, 1)
        else:
            kb[slot, :, pos] = k  # (R, nkv, hs) scattered to (slab, position)
            vb[slot, :, pos] = v
        S = plan.span
        return kb[plan.read, :, :S], vb[plan.read, :, :S]  # (B, nkv, S, hs): views, or copies when gathered

    def _move(self, seq, src, dst) -> None:
        row = self.buf[:, :, self._slot[seq]]  # (n_layers, 2, nkv, capacity, hs)
        row[:, :, :, self._dev(dst)] = row.index_select(3, self._dev(src))  # index_select copies: overlap is safe

    def gather(self, seq, layer):
        n, s = self._len[seq], self._slot[seq]
        return self.buf[layer, 0, s, :, :n].clone(), self.buf[layer, 1, s, :, :n].clone()

    def stats(self) -> dict:
        live = len(self._slot)
        return {"sequences": live, "tokens": sum(self._len.values()),
                "bytes_in_use": live * self.capacity * self.slot_bytes,
                "bytes_allocated": self.buf.numel() * self.dtype.itemsize, "peak_bytes": self.peak_bytes,
                "capacity": self.capacity}
