"""Contiguous KV cache: one preallocated (B, nkv, S_max, hs) buffer pair per layer, updated in place."""
from __future__ import annotations

import torch

from components.kv.base import KVManager


class ContiguousKV(KVManager):
    def __init__(self, backbone=None, max_len: int = 2048, n_layers: int | None = None,
                 n_kv_heads: int | None = None, head_dim: int | None = None, dtype: torch.dtype | None = None):
        """Shapes come from `backbone` (its model args and dtype) unless given one by one."""
        if backbone is not None:
            a = backbone.model.args
            n_layers, n_kv_heads, head_dim = a.n_layers, a.n_kv_heads, a.head_dim
            dtype = backbone.model.dtype
        if not isinstance(max_len, int) or max_len <= 0:
            raise ValueError(f"`max_len` must be a positive int, got {max_len}")
        self.n_layers, self.n_kv, self.hs = n_layers, n_kv_heads, head_dim
        self.dtype = dtype or torch.float32
        self.capacity, self.batch = 0, 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.length = self.pending = 0
        self.default_len = max_len

    def allocate(self, batch: int = 1, max_len: int | None = None) -> None:
        need = max(max_len or 0, self.default_len)
        if batch != self.batch or need > self.capacity:  # buffers are reused across requests
            shape = (batch, self.n_kv, need, self.hs)
            self.k = [torch.zeros(shape, dtype=self.dtype) for _ in range(self.n_layers)]
            self.v = [torch.zeros(shape, dtype=self.dtype) for _ in range(self.n_layers)]
            self.capacity, self.batch = need, batch
        self.length = self.pending = 0

    def update(self, layer, k, v):
        s, t = self.used, k.shape[2]
        if s + t > self.capacity:
            raise RuntimeError(f"KV cache full: {s} + {t} slots > capacity {self.capacity}")
        self.k[layer][:, :, s:s + t] = k
        self.v[layer][:, :, s:s + t] = v
        return self.k[layer][:, :, :s + t], self.v[layer][:, :, :s + t]

    def advance(self, n):
        self.pending += n

    def commit(self, keep=None):
        if keep is None:
            self.length += self.pending
        else:
            idx = torch.as_tensor(keep, dtype=torch.long) + self.length
            n = idx.numel()
            if n and not bool((idx == torch.arange(self.length, self.length + n)).all()):
                for buf in (*self.k, *self.v):  # gather: index_select copies, so overlap is safe
                    buf[:, :, self.length:self.length + n] = buf.index_select(2, idx)
            self.length += n
        self.pending = 0

    def discard(self):
        self.pending = 0

    def truncate(self, n):
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} slots to {n}")
        self.length, self.pending = n, 0

    def fork(self):
        other = ContiguousKV(None, self.default_len, self.n_layers, self.n_kv, self.hs, self.dtype)
        other.k = [b.clone() for b in self.k]
        other.v = [b.clone() for b in self.v]
        other.capacity, other.batch, other.length = self.capacity, self.batch, self.length
        return other

    def free(self):
        self.k, self.v = [], []
        self.capacity = self.batch = self.length = self.pending = 0

    def keys_values(self, layer):
        return self.k[layer][:, :, :self.length], self.v[layer][:, :, :self.length]

    @property
    def slots_in_use(self):
        return self.used * self.batch
