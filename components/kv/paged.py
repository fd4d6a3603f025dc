"""Paged KV: fixed-size blocks in one pool, a block table per sequence, shared by reference.

pool: (n_layers, 2, n_blocks, block_size, nkv, hs); a block id addresses the same block in every
layer. A sequence's slot s lives in block table[s // block_size] at offset s % block_size.
- `fork` copies the block table and raises each block's reference count: a prompt read by four
  beams is stored once.
- Before a step writes into a block that another sequence also holds (a shared, partly filled last
  block), the block is copied first (copy-on-write); blocks are otherwise never copied.
- Blocks past a sequence's used slots go back to the free list at once (commit, discard, truncate,
  free); the free list hands out the lowest id first, so a lone sequence's blocks are usually
  consecutive and its attention reads a view of the pool instead of gathering its blocks.
"""
from __future__ import annotations

import heapq

import torch

from components.kv.base import SequencePool
from pipeline.core import KVPlan, positive_int


class PagedKV(SequencePool):
    def __init__(self, backbone=None, block_size: int = 16, num_blocks: int = 128, n_layers: int | None = None,
                 n_kv_heads: int | None = None, head_dim: int | None = None, dtype: torch.dtype | None = None,
                 device=None):
        """num_blocks: the pool's initial size; it doubles when a step needs more."""
        for name, v in (("block_size", block_size), ("num_blocks", num_blocks)):
            positive_int(v, f"kv.{name}")
        super().__init__(backbone, n_layers, n_kv_heads, head_dim, dtype, device)
        self.block_size = block_size
        self.pool = torch.zeros(self.n_layers, 2, num_blocks, block_size, self.n_kv, self.hs, dtype=self.dtype, device=self.device)
        self.ref = [0] * num_blocks  # sequences holding each block
        self._free = list(range(num_blocks))  # a heap
        self.tables: dict[int, list[int]] = {}
        self.peak_blocks = 0
        self.cow_copies = 0

    # --- blocks ----------------------------------------------------------------------------------
    def _alloc(self) -> int:
        if not self._free:
            n = self.pool.shape[2]
            grown = torch.zeros(self.n_layers, 2, 2 * n, self.block_size, self.n_kv, self.hs, dtype=self.dtype, device=self.device)
            grown[:, :, :n] = self.pool
            self.pool = grown
            self.ref += [0] * n
            self._free = list(range(n, 2 * n))
        b = heapq.heappop(self._free)
        self.ref[b] = 1
        return b

    def _decref(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] < 0:
            raise RuntimeError(f"block {b} released more often than it was held")
        if self.ref[b] == 0:
            heapq.heappush(self._free, b)

    @property
    def blocks_in_use(self) -> int:
        return self.pool.shape[2] - len(self._free)

    def _note_peak(self) -> None:
        self.peak_blocks = max(self.peak_blocks, self.blocks_in_use)
        super()._note_peak()

    def _release_tail(self, seq: int) -> None:
        table = self.tables[seq]
        keep = -(-self.used(seq) // self.block_size)
        while len(table) > keep:
            self._decref(table.pop())

    # --- sequences -------------------------------------------------------------------------------
    def create(self) -> int:
        seq = self._new_id()
        self.tables[seq] = []
        return seq

    def fork(self, seq: int) -> int:
        self._check(seq)
        new = self._new_id()
        n = self._len[seq]
        shared = self.tables[seq][:-(-n // self.block_size)]
        for b in shared:
            self.ref[b] += 1
        self.tables[new], self._len[new] = list(shared), n
        return new

    def free(self, seq: int) -> None:
        self._drop(seq)
        for b in self.tables.pop(seq):
            self._decref(b)

    # --- a step ----------------------------------------------------------------------------------
    def begin_step(self, step) -> KVPlan:
        bs = self.block_size
        wblk, woff, reads = [], [], []
        for seq, start, n in zip(step.seqs, step.starts, step.counts):
            table = self.tables[seq]
            while len(table) * bs < start + n:
                table.append(self._alloc())
            for i in range(start // bs, -(-(start + n) // bs)):  # blocks this step writes into
                b = table[i]
                if self.ref[b] > 1:  # shared with another sequence: copy on write
                    c = self._alloc()
                    self.pool[:, :, c] = self.pool[:, :, b]
                    self._decref(b)
                    table[i] = c
                    self.cow_copies += 1
            slots = torch.arange(start, start + n)
            t = torch.tensor(table)
            wblk.append(t[slots // bs])
            woff.append(slots % bs)
            reads.append(table)
        self._note_peak()
        nb = -(-step.span // bs)
        if len(reads) == 1 and reads[0][:nb] == list(range(reads[0][0], reads[0][0] + nb)):
            read = slice(reads[0][0], reads[0][0] + nb)  # consecutive blocks: a view of the pool
        else:
            read = self._dev(torch.tensor([r[:nb] + [r[0]] * (nb - len(r[:nb])) for r in reads]))  # (B, nb), padded
        return KVPlan(list(step.seqs), step.counts, step.span, (self._dev(torch.cat(wblk)), self._dev(torch.cat(woff))),
                      read)

    def update(self, layer, k, v, plan):
        kp, vp = self.pool[layer, 0], self.pool[layer, 1]  # (n_blocks, block_size, nkv, hs)
        wblk, woff = plan.write
        kp[wblk, woff] = k  # (R, nkv, hs)
        vp[wblk, woff] = v
        S, bs = plan.span, self.block_size
        shape = (len(plan.seqs), -(-S // bs) * bs, self.n_kv, self.hs)
        K, V = kp[plan.read].view(shape), vp[plan.read].view(shape)  # a view, or (B, nb, block, nkv, hs) gathered
        return K[:, :S].transpose(1, 2), V[:, :S].transpose(1, 2)  # (B, nkv, S, hs)

    def update_in_place(self, layer, k, v, plan):
        """`update` for an attention that reads the pool where it lies (the native `paged_attention`):
        writes the step's rows as `update` does and returns the layer's key and value pools and the
        step's block table, sequence b's slot s in block table[b, s // block_size] (past its own
        blocks, padded as `update` pads its gather). Nothing is gathered or copied."""
        kp, vp = self.pool[layer, 0], self.pool[layer, 1]  # (n_blocks, block_size, nkv, hs)
        wblk, woff = plan.write
        kp[wblk, woff] = k  # (R, nkv, hs)
        vp[wblk, woff] = v
        read = plan.read  # consecutive blocks as a slice (one sequence), else the (B, nb) table
        table = read if isinstance(read, torch.Tensor) else torch.arange(read.start, read.stop, device=kp.device)[None]
        return kp, vp, table  # (n_blocks, block_size, nkv, hs) x 2, (B, nb) int64

    def _move(self, seq, src, dst) -> None:
        bs, t = self.block_size, torch.tensor(self.tables[seq])
        # the blocks past the committed prefix were written this step: this sequence owns them
        self.pool[:, :, self._dev(t[dst // bs]), self._dev(dst % bs)] = \
            self.pool[:, :, self._dev(t[src // bs]), self._dev(src % bs)]

    def gather(self, seq, layer):
        n, bs = self._len[seq], self.block_size
        slots = torch.arange(n)
        t = torch.tensor(self.tables[seq], dtype=torch.long)
        blk, off = self._dev(t[slots // bs]), self._dev(slots % bs)
        k = self.pool[layer, 0, blk, off] if n else self.pool.new_zeros(0, self.n_kv, self.hs)
        v = self.pool[layer, 1, blk, off] if n else self.pool.new_zeros(0, self.n_kv, self.hs)
        return k.transpose(0, 1).clone(), v.transpose(0, 1).clone()  # (nkv, n, hs)

    def stats(self) -> dict:
        block_bytes = self.block_size * self.slot_bytes
        return {"sequences": len(self.tables), "tokens": sum(self._len.values()),
                "bytes_in_use": self.blocks_in_use * block_bytes, "peak_bytes": self.peak_bytes,
                "bytes_allocated": self.pool.numel() * self.dtype.itemsize,
                "blocks_in_use": self.blocks_in_use, "peak_blocks": self.peak_blocks,
                "shared_blocks": sum(r > 1 for r in self.ref), "free_blocks": len(self._free),
                "block_size": self.block_size, "cow_copies": self.cow_copies}
