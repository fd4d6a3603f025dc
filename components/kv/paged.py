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
- Prefix cache (`prefix_cache`, vLLM's automatic prefix caching): a sequence created for a prompt,
  `create(prompt)`, keeps the token of every slot it holds; each of its blocks, once full and
  committed, is registered under a chain key, key_i = H(key_{i-1}, tokens of block i), which names
  the block's tokens and everything before them. `create(prompt)` takes a reference to each block
  of the longest registered chain the prompt begins with (never its last token, whose logits the
  caller needs) and starts the sequence with those slots committed: the caller prefills the rest.
  A registered block that no sequence holds any more stays cached (idle); idle blocks are taken
  back least recently freed first, only when the free list is empty, before the pool grows. A
  sequence's KV depends on its tokens alone only where the backbone is batch-invariant (a row's
  bits do not depend on the rows computed with it), so the cache is on only there.
"""
from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict

import torch

from components.kv.base import SequencePool
from pipeline.core import KVPlan, positive_int


ROOT = b""  # the chain key before a sequence's first block


def chain_key(parent: bytes, tokens: list[int]) -> bytes:
    """The key of a full block: its tokens after the block keyed `parent` (ROOT for the first)."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class PagedKV(SequencePool):
    def __init__(self, backbone=None, block_size: int = 16, num_blocks: int = 128, n_layers: int | None = None,
                 n_kv_heads: int | None = None, head_dim: int | None = None, dtype: torch.dtype | None = None,
                 device=None, prefix_cache: bool = False):
        """num_blocks: the pool's initial size; it doubles when a step needs more. prefix_cache:
        keep full blocks of prompts and answers for later prompts that begin with them; on only
        where `backbone` is batch-invariant (`Backbone.batch_invariant`; a pool given its shapes
        alone takes the caller's word)."""
        for name, v in (("block_size", block_size), ("num_blocks", num_blocks)):
            positive_int(v, f"kv.{name}")
        if not isinstance(prefix_cache, bool):
            raise ValueError(f"`kv.prefix_cache` must be true or false, got {prefix_cache!r}")
        super().__init__(backbone, n_layers, n_kv_heads, head_dim, dtype, device)
        self.block_size = block_size
        self.pool = torch.zeros(self.n_layers, 2, num_blocks, block_size, self.n_kv, self.hs, dtype=self.dtype, device=self.device)
        self.ref = [0] * num_blocks  # sequences holding each block
        self._free = list(range(num_blocks))  # a heap
        self.tables: dict[int, list[int]] = {}
        self.peak_blocks = 0
        self.cow_copies = 0
        self.prefix_cache = prefix_cache and getattr(backbone, "batch_invariant", True)
        self.cached: dict[bytes, int] = {}  # chain key -> its registered block
        self._key_of: dict[int, bytes] = {}  # registered block -> its chain key
        self._idle: OrderedDict[int, None] = OrderedDict()  # registered blocks no sequence holds, least recently freed first
        self._tok: dict[int, list[int]] = {}  # a prompt's sequence: the token of every slot it holds
        self._keys: dict[int, list[bytes]] = {}  # ... and the chain keys of its full committed blocks
        self.prefix_queries = self.prefix_hits = self.evictions = 0  # prompt tokens looked up, found; blocks evicted

    # --- blocks ----------------------------------------------------------------------------------
    def _alloc(self) -> int:
        if not self._free and self._idle:  # the least recently freed cached block goes
            b, _ = self._idle.popitem(last=False)
            del self.cached[self._key_of.pop(b)]
            self.evictions += 1
            self.ref[b] = 1
            return b
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
            if b in self._key_of:
                self._idle[b] = None
            else:
                heapq.heappush(self._free, b)

    def _hold(self, b: int) -> None:
        """One more reference to a registered block (taken back from the idle ones if none held it)."""
        if self.ref[b] == 0:
            del self._idle[b]
        self.ref[b] += 1

    @property
    def blocks_in_use(self) -> int:
        """Blocks some sequence holds (idle cached blocks are not in use: the pool takes them back)."""
        return self.pool.shape[2] - len(self._free) - len(self._idle)

    def _note_peak(self) -> None:
        self.peak_blocks = max(self.peak_blocks, self.blocks_in_use)
        super()._note_peak()

    def _release_tail(self, seq: int) -> None:
        table, bs = self.tables[seq], self.block_size
        keep = -(-self.used(seq) // bs)
        while len(table) > keep:
            self._decref(table.pop())
        full = self._len[seq] // bs
        for b in table[full:]:  # after a truncate: a registered block this sequence alone will write into
            if self.ref[b] == 1 and b in self._key_of:
                del self.cached[self._key_of.pop(b)]
        if seq in self._tok:
            del self._tok[seq][self.used(seq):], self._keys[seq][full:]

    # --- the prefix cache ------------------------------------------------------------------------
    def _match(self, seq: int, prompt: list[int]) -> None:
        """Start `seq` with the longest chain of registered blocks `prompt` begins with, its last
        token excluded (the caller computes at least that one)."""
        bs, table, keys = self.block_size, self.tables[seq], self._keys[seq]
        for i in range((len(prompt) - 1) // bs):
            key = chain_key(keys[-1] if keys else ROOT, prompt[i * bs:(i + 1) * bs])
            b = self.cached.get(key)
            if b is None:
                break
            self._hold(b)
            table.append(b)
            keys.append(key)
        n = len(table) * bs
        self._tok[seq] += prompt[:n]
        self._len[seq] = n
        self.prefix_queries += len(prompt)
        self.prefix_hits += n
        self._note_peak()

    def _register(self, seq: int) -> None:
        """Register the full committed blocks of a prompt's sequence not registered yet (a block
        whose key another block holds already stays a plain block)."""
        keys, tok, table, bs = self._keys[seq], self._tok[seq], self.tables[seq], self.block_size
        for i in range(len(keys), self._len[seq] // bs):
            key = chain_key(keys[-1] if keys else ROOT, tok[i * bs:(i + 1) * bs])
            keys.append(key)
            if key not in self.cached:
                self.cached[key], self._key_of[table[i]] = table[i], key

    def _note_tokens(self, step) -> None:
        """The tokens of a step's rows, for the sequences that keep theirs (slot start + i: row i)."""
        mine = [b for b, seq in enumerate(step.seqs) if seq in self._tok]
        if mine:
            rows = step.tokens.tolist()
            for b in mine:
                tok = self._tok[step.seqs[b]]
                del tok[step.starts[b]:]
                tok += rows[step.offsets[b]:step.offsets[b + 1]]

    def reset_prefix_cache(self) -> None:
        """Forget every registered block (idle ones go back to the free list) and the counters."""
        for b in self._idle:
            heapq.heappush(self._free, b)
        self._idle.clear()
        self.cached.clear()
        self._key_of.clear()
        self.prefix_queries = self.prefix_hits = self.evictions = 0

    # --- sequences -------------------------------------------------------------------------------
    def create(self, prompt: list[int] | None = None) -> int:
        seq = self._new_id()
        self.tables[seq] = []
        if prompt is not None and self.prefix_cache:
            self._tok[seq], self._keys[seq] = [], []
            self._match(seq, list(prompt))
        return seq

    def fork(self, seq: int) -> int:
        self._check(seq)
        new = self._new_id()
        n = self._len[seq]
        shared = self.tables[seq][:-(-n // self.block_size)]
        for b in shared:
            self.ref[b] += 1
        self.tables[new], self._len[new] = list(shared), n
        if seq in self._tok:
            self._tok[new], self._keys[new] = self._tok[seq][:n], list(self._keys[seq])
        return new

    def free(self, seq: int) -> None:
        self._drop(seq)
        self._tok.pop(seq, None)
        self._keys.pop(seq, None)
        for b in reversed(self.tables.pop(seq)):  # the tail first: a chain's last blocks are evicted before its first
            self._decref(b)

    def commit(self, seq: int, keep=None) -> None:
        super().commit(seq, keep)
        if seq in self._tok:
            self._register(seq)

    # --- a step ----------------------------------------------------------------------------------
    def begin_step(self, step) -> KVPlan:
        bs = self.block_size
        self._note_tokens(step)
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
        wblk, woff = self._dev(torch.cat(wblk)), self._dev(torch.cat(woff))
        table = read if isinstance(read, torch.Tensor) else self._dev(torch.arange(read.start, read.stop))[None]
        return KVPlan(list(step.seqs), step.counts, step.span, (wblk, woff), read, (wblk * bs + woff, table))

    def update(self, layer, k, v, plan):
        kp, vp = self.pool[layer, 0], self.pool[layer, 1]  # (n_blocks, block_size, nkv, hs)
        wblk, woff = plan.write
        kp[wblk, woff] = k  # (R, nkv, hs)
        vp[wblk, woff] = v
        S, bs = plan.span, self.block_size
        shape = (len(plan.seqs), -(-S // bs) * bs, self.n_kv, self.hs)
        K, V = kp[plan.read].view(shape), vp[plan.read].view(shape)  # a view, or (B, nb, block, nkv, hs) gathered
        return K[:, :S].transpose(1, 2), V[:, :S].transpose(1, 2)  # (B, nkv, S, hs)

    def pools(self, layer):
        """The layer's key and value pools, (n_blocks, block_size, nkv, hs) each: what the fused native
        layer (`Block.native_forward`) writes the step's rows into, at the plan's `in_place` slots, and
        reads where they lie."""
        return self.pool[layer, 0], self.pool[layer, 1]

    def update_in_place(self, layer, k, v, plan):
        """`update` for an attention that reads the pool where it lies (the native `paged_attention`):
        writes the step's rows as `update` does and returns the layer's key and value pools and the
        step's block table, sequence b's slot s in block table[b, s // block_size] (past its own
        blocks, padded as `update` pads its gather). Nothing is gathered or copied."""
        kp, vp = self.pool[layer, 0], self.pool[layer, 1]  # (n_blocks, block_size, nkv, hs)
        wblk, woff = plan.write
        kp[wblk, woff] = k  # (R, nkv, hs)
        vp[wblk, woff] = v
        if plan.in_place is not None:  # the table begin_step made once for the step
            return kp, vp, plan.in_place[1]
        read = plan.read  # consecutive blocks as a slice (one sequence), else the (B, nb) table
        table = read if isinstance(read, torch.Tensor) else torch.arange(read.start, read.stop, device=kp.device)[None]
        return kp, vp, table  # (n_blocks, block_size, nkv, hs) x 2, (B, nb) int64

    def _move(self, seq, src, dst) -> None:
        if seq in self._tok:  # src >= dst, both ascending: in order, nothing is read after it is overwritten
            tok = self._tok[seq]
            for a, b in zip(src.tolist(), dst.tolist()):
                tok[b] = tok[a]
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
                "block_size": self.block_size, "cow_copies": self.cow_copies,
                "prefix_cache": self.prefix_cache, "cached_blocks": len(self.cached), "idle_cached_blocks": len(self._idle),
                "evicted_blocks": self.evictions, "prefix_queried_tokens": self.prefix_queries,
                "prefix_hit_tokens": self.prefix_hits,
                "prefix_hit_rate": self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0}
