"""Suffix decoding (SuffixDecoding, Oliaro et al. 2024; vLLM's `method: suffix`): draft what followed
the newest tokens elsewhere, each continuation scored by how often it followed them,

    p(path) = count(context, then path) / (count(context) + prior)

its estimated acceptance probability (`prior`, a pseudo-count of "something else follows", keeps a
context seen once from claiming certainty). The context is the longest suffix of the text, between
`min_ngram` and `max_ngram` tokens, found elsewhere; the continuations of its occurrences form a
count trie. Two places are searched, each scored on its own, and a path found in both keeps the
larger estimate:

- the sequence's own prompt and output (prompt lookup, as components/proposer/ngram.py, indexed
  incrementally as tokens are committed);
- a `SuffixCache` of the prompts and outputs of finished requests: one per proposer, so shared by
  every sequence of a run or a server (one proposer serves them all), bounded in tokens (the oldest
  sequences go first) and locked (the server's engine thread looks up while requests finish).

No training, no extra weights, no model cost. Used alone (`proposer=suffix`) the tree is the best
`max_nodes` paths; in `proposer=hybrid` its scored paths are ranked with a model's drafts.
"""
from __future__ import annotations

import threading
from collections import deque

import torch

from components.proposer.hybrid import Scored, merge, ranked_tree
from pipeline.core import DecodeState, Proposer, Tree, UserError, positive_int


class _Index:
    """Sequences of tokens, every position indexed by the `key` tokens before it: key -> [(sequence
    id, position)], oldest first. A sequence may grow (`add` to it again); lookups find the longest
    suffix of a context that occurs and what followed each occurrence."""

    def __init__(self, key: int, max_ngram: int):
        self.key, self.max_ngram = key, max_ngram
        self.seqs: dict[int, list[int]] = {}
        self.index: dict[tuple[int, ...], deque[tuple[int, int]]] = {}
        self.size = 0  # tokens held

    def add(self, uid: int, tokens: list[int]) -> None:
        seq = self.seqs.setdefault(uid, [])
        start = len(seq)
        seq.extend(tokens)
        self.size += len(tokens)
        k = self.key
        for e in range(max(k, start), len(seq)):  # position e: what followed seq[e - k:e]
            self.index.setdefault(tuple(seq[e - k:e]), deque()).append((uid, e))

    def drop_oldest(self) -> None:
        """Forget the sequence added first: its positions are the oldest of every key it indexed."""
        uid = next(iter(self.seqs))
        seq, k = self.seqs.pop(uid), self.key
        self.size -= len(seq)
        for e in range(k, len(seq)):
            key = tuple(seq[e - k:e])
            hits = self.index[key]
            hits.popleft()
            if not hits:
                del self.index[key]

    def continuations(self, context: list[int], depth: int, max_matches: int) -> list[list[int]]:
        """What followed the longest suffix of `context` (at least `key`, at most `max_ngram` tokens)
        at its most recent `max_matches` occurrences, `depth` tokens at most each."""
        k = self.key
        if len(context) < k:
            return []
        hits = self.index.get(tuple(context[-k:]))
        if not hits:
            return []
        best, found = 0, []
        for uid, e in reversed(hits):  # newest first
            seq, n = self.seqs[uid], k
            while n < self.max_ngram and n < len(context) and n < e and seq[e - n - 1] == context[-n - 1]:
                n += 1
            if n > best:
                best, found = n, []
            if n == best and len(found) < max_matches:
                found.append(seq[e:e + depth])
        return found


class SuffixCache:
    """The prompts and outputs of recent requests, indexed for suffix lookups: at most `max_tokens`
    tokens (adding more drops the oldest sequences), safe to use from several threads at once."""

    def __init__(self, max_tokens: int = 100_000, min_ngram: int = 2, max_ngram: int = 8):
        self.max_tokens = positive_int(max_tokens, "proposer.cache_tokens")
        self._index = _Index(min_ngram, max_ngram)
        self._lock = threading.Lock()
        self._next = 0

    @property
    def size(self) -> int:
        """Tokens held."""
        return self._index.size

    def __len__(self) -> int:
        """Sequences held."""
        return len(self._index.seqs)

    def add(self, tokens: list[int]) -> None:
        """One finished sequence (its last max_tokens tokens when it is longer)."""
        tokens = list(tokens[-self.max_tokens:])
        if len(tokens) <= self._index.key:
            return
        with self._lock:
            self._next += 1
            self._index.add(self._next, tokens)
            while self._index.size > self.max_tokens:
                self._index.drop_oldest()

    def continuations(self, context: list[int], depth: int, max_matches: int) -> list[list[int]]:
        with self._lock:
            return self._index.continuations(context, depth, max_matches)

    def clear(self) -> None:
        with self._lock:
            self._index = _Index(self._index.key, self._index.max_ngram)


def score(continuations: list[list[int]], prior: float) -> Scored:
    """The count trie of continuations: every prefix with count / (occurrences + prior)."""
    counts: dict[tuple[int, ...], int] = {}
    for cont in continuations:
        for d in range(1, len(cont) + 1):
            path = tuple(cont[:d])
            counts[path] = counts.get(path, 0) + 1
    total = len(continuations) + prior
    return [(path, n / total) for path, n in counts.items()]


class _Seq:
    def __init__(self, min_ngram: int, max_ngram: int, prompt: list[int]):
        self.own = _Index(min_ngram, max_ngram)
        self.own.add(0, list(prompt))
        self.prompt_len = len(prompt)
        self.fresh = True  # the next observe is the prefill's: only its last token (the first generated) is new


class SuffixProposer(Proposer):
    def __init__(self, max_ngram: int = 8, min_ngram: int = 2, depth: int = 16, max_nodes: int = 16,
                 max_matches: int = 32, prior: float = 1.0, p_min: float = 0.0, cache_tokens: int = 100_000,
                 cache_prompts: bool = True):
        """max_ngram / min_ngram: the longest and shortest context matched; depth: tokens per
        continuation; max_matches: occurrences counted per lookup (the newest); prior: the
        pseudo-count of other continuations; p_min: paths estimated below it are not drafted;
        cache_tokens: the cross-request cache's bound in tokens (0: no cache, only the sequence's own
        text); cache_prompts: finished requests' prompts go into the cache with their outputs."""
        for name, v in (("max_ngram", max_ngram), ("min_ngram", min_ngram), ("depth", depth),
                        ("max_nodes", max_nodes), ("max_matches", max_matches)):
            positive_int(v, f"proposer.{name}")
        if min_ngram > max_ngram:
            raise UserError(f"proposer.min_ngram ({min_ngram}) must be <= proposer.max_ngram ({max_ngram})")
        if not isinstance(prior, (int, float)) or isinstance(prior, bool) or prior < 0:
            raise UserError(f"proposer.prior must be a count >= 0, got {prior!r}")
        if not isinstance(p_min, (int, float)) or isinstance(p_min, bool) or not 0 <= p_min < 1:
            raise UserError(f"proposer.p_min must be a probability in [0, 1), got {p_min}")
        if not isinstance(cache_tokens, int) or isinstance(cache_tokens, bool) or cache_tokens < 0:
            raise UserError(f"proposer.cache_tokens must be an int >= 0 (0: no cross-request cache), got {cache_tokens!r}")
        self.max_ngram, self.min_ngram, self.depth, self.max_nodes = max_ngram, min_ngram, depth, max_nodes
        self.max_matches, self.prior, self.p_min, self.cache_prompts = max_matches, float(prior), float(p_min), bool(cache_prompts)
        self.cache = SuffixCache(cache_tokens, min_ngram, max_ngram) if cache_tokens else None
        self.seqs: dict[int, _Seq] = {}

    def describe(self) -> dict:
        return {"tree": {"suffix": True, "depth": self.depth, "max_nodes": self.max_nodes, "min_ngram": self.min_ngram,
                         "max_ngram": self.max_ngram, "max_matches": self.max_matches, "prior": self.prior,
                         "p_min": self.p_min, "cache_tokens": 0 if self.cache is None else self.cache.max_tokens,
                         "cached_tokens": 0 if self.cache is None else self.cache.size}}

    def start(self, seq: int, prompt_ids: list[int]) -> None:
        self.seqs[seq] = _Seq(self.min_ngram, self.max_ngram, prompt_ids)

    def observe(self, seq: int, tokens: list[int], hidden: torch.Tensor) -> None:
        s = self.seqs.get(seq)
        if s is None or not tokens:
            return
        if s.fresh:  # prefill: the prompt's tokens (known from start) and the first generated one
            tokens, s.fresh = tokens[-1:], False
        s.own.add(0, list(tokens))

    def release(self, seq: int) -> None:
        """The sequence's text goes into the cross-request cache."""
        s = self.seqs.pop(seq, None)
        if s is not None and self.cache is not None:
            text = s.own.seqs[0]
            self.cache.add(text if self.cache_prompts else text[max(0, s.prompt_len - self.max_ngram):])

    def reset(self) -> None:
        """A new run: the cross-request cache starts empty (a bench's rounds never draft from the last)."""
        if self.cache is not None:
            self.cache.clear()

    def scored(self, states: list[DecodeState], ahead: list[list[int]] | None = None) -> list[Scored]:
        """Every sequence's candidates, (draft tokens from the root, estimated acceptance). ahead[i]:
        tokens drafted before them (a constraint's forced ones): the lookups continue after those,
        and every path starts with them."""
        out = []
        for i, st in enumerate(states):
            pre = [] if ahead is None else list(ahead[i])
            depth = min(self.depth, st.budget - 1 - len(pre))
            s = self.seqs.get(st.seq)
            if depth < 1 or s is None:
                out.append([])
                continue
            context = (st.tokens[-self.max_ngram:] + pre)[-self.max_ngram:]
            found = [score(s.own.continuations(context, depth, self.max_matches), self.prior)]
            if self.cache is not None:
                found.append(score(self.cache.continuations(context, depth, self.max_matches), self.prior))
            out.append([(tuple(pre) + path, p) for path, p in merge(*found).items()])
        return out

    def propose(self, states: list[DecodeState]) -> list[Tree | None]:
        return [ranked_tree(st.tokens[-1], merge(sc), self.max_nodes, st.budget - 1, self.p_min)
                for st, sc in zip(states, self.scored(states))]
