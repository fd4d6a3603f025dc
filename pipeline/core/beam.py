"""Beam search on forked sequences, with the semantics of transformers' `generate(num_beams=...)` (5.x).

Every live beam is a sequence of the KV pool. A step packs the newest token of every live beam of
every request into one target forward; per request, the processed log-probabilities (log-softmax,
then the logits processors, then the beam's constraint mask) plus each beam's running score rank
all num_beams x V continuations, and the top K = max(2, 1 + #EOS) x num_beams go on:

- the best num_beams that did not end (on EOS or at max_length) become the next running beams;
- those among the top num_beams that ended become finished hypotheses, scored sum(log p) /
  (generated length incl. EOS) ** length_penalty, merged with the finished ones so far (the best
  num_beams are kept);
- early_stopping: True stops once num_beams hypotheses are finished; False stops when the best
  running score, normalised at the current length, cannot beat the worst finished one; "never"
  normalises it at max_length when length_penalty > 0 (the canonical bound).

Reordering beams is a set of forks and frees, never a copy of a prefix: a parent kept by one child
hands it its sequence, one kept by several is forked (with `kv=paged`, forks share every full
block: the prompt is stored once), a parent no child keeps is freed. Constraint states fork with
their beams. The arithmetic (float32 tensors, torch.topk on the flattened candidates, the -1e9
sentinels) mirrors transformers' so that hypotheses and scores come out the same.

One module for both searches (plain and diverse, ~380 lines): they share the request state, the
hypothesis pool and the reordering of beams over the KV pool, and are read against transformers'.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pipeline.core.bits import words
from pipeline.errors import UserError, positive_int
from pipeline.core.runner import Request, Runner, forward_step
from pipeline.core.target import TargetStage
from pipeline.core.types import Generation, StepBatch

NEG = -1.0e9  # transformers' sentinel score
EARLY_STOPPING = (True, False, "never")


@dataclass
class _Beam:
    seq: int  # its sequence in the KV pool: every token but the newest is cached
    tokens: list[int]  # generated tokens; the newest is the root of the next forward
    constraint: object = None


@dataclass
class _Request:
    index: int
    prompt: list[int]
    max_length: int  # prompt + max_new_tokens (or the context end)
    grammar: object
    gen: Generation
    t0: float
    max_new_tokens: int
    beams: list[_Beam] = field(default_factory=list)
    running: torch.Tensor | None = None  # (num_beams,) float32 running scores
    fin_scores: torch.Tensor | None = None  # (num_beams,) float32, NEG where empty
    fin_tokens: list[list[int]] = field(default_factory=list)
    fin_done: torch.Tensor | None = None  # (num_beams,) bool
    unsatisfied: bool = True  # the early-stop heuristic still sees room for improvement
    cur_len: int = 0
    first: bool = True  # the next logits come from the prompt (one row for every beam)
    done: bool = False
    kv_peak: int = 0
    kv_copy: int = 0
    group_hyps: list = field(default_factory=list)  # diverse beam search: per group [(score, tokens)]
    group_worst: list = field(default_factory=list)
    group_done: list = field(default_factory=list)


class BeamSearch(Runner):
    """Decodes requests `batch_size` at a time by beam search, with `Generation.beams` holding each
    request's hypotheses, best first; on_tokens(i, best hypothesis, None) once request i is done
    (beams are not final before)."""

    def __init__(self, model, kv, sampler, eos_ids: list[int], max_new_tokens: int, num_beams: int = 4,
                 length_penalty: float = 1.0, early_stopping=False, num_return_sequences: int = 1,
                 num_beam_groups: int = 1, diversity_penalty: float = 0.0, seed: int = 0, batch_size: int = 1,
                 constraint=None):
        super().__init__(model, kv, sampler, eos_ids, max_new_tokens, seed, batch_size, constraint)
        for name, v in (("num_beams", num_beams), ("num_return_sequences", num_return_sequences),
                        ("num_beam_groups", num_beam_groups)):
            positive_int(v, name)
        if num_return_sequences > num_beams:
            raise UserError(f"num_return_sequences={num_return_sequences} exceeds num_beams={num_beams}: "
                            "beam search returns at most num_beams hypotheses")
        if early_stopping not in EARLY_STOPPING or (early_stopping == "never" and not isinstance(early_stopping, str)):
            raise UserError(f"early_stopping must be true, false or \"never\", got {early_stopping!r}")
        if not isinstance(length_penalty, (int, float)) or isinstance(length_penalty, bool):
            raise UserError(f"length_penalty must be a number, got {length_penalty!r}")
        if num_beams % num_beam_groups:
            raise UserError(f"num_beams={num_beams} must be divisible by num_beam_groups={num_beam_groups}")
        if num_beam_groups > 1 and not diversity_penalty:
            raise UserError("num_beam_groups > 1 needs diversity_penalty > 0 (without it the groups search alike)")
        if not sampler.greedy:
            raise UserError("beam search ranks continuations by log-probability: temperature, top-k and top-p "
                            "do not apply to it; use sampler=greedy (or decode=sample without beams)")
        warpers = [type(p).__name__ for p in sampler.processors if type(p).__name__ in ("Temperature", "TopK", "TopP")]
        if warpers:
            raise UserError(f"{', '.join(warpers)} do not apply to beam search: drop sampler.temperature / top_k / top_p")
        self.num_beams, self.length_penalty = num_beams, float(length_penalty)
        self.early_stopping, self.num_return_sequences = early_stopping, num_return_sequences
        self.num_beam_groups, self.diversity_penalty = num_beam_groups, float(diversity_penalty)
        # processors, then each beam's constraint mask; a beam that left its language has no allowed
        # token and scores -inf everywhere (it is never continued), which is not an error here
        self.target = TargetStage(sampler.processors, empty_rows="allowed")

    def _join(self, joining: list[tuple[int, Request]]) -> None:
        limit = self.model.args.max_seq_len
        self._prefill([_Request(h, list(r.prompt), min(len(r.prompt) + self._budget_of(r), limit), self._grammar(r),
                                Generation(), time.perf_counter(), self._budget_of(r)) for h, r in joining])

    # --- steps -------------------------------------------------------------------------------------
    def _prefill(self, joining: list[_Request]) -> None:
        for r in joining:
            seq = self.kv.create(r.prompt)  # holding the prompt's cached prefix, if any
            r.beams = [_Beam(seq, [], None if r.grammar is None else r.grammar.start())]
            r.cur_len = len(r.prompt)
            n = self.num_beams
            r.running = torch.zeros(n)
            r.running[1:] = NEG
            r.fin_scores, r.fin_done = torch.full((n,), NEG), torch.zeros(n, dtype=torch.bool)
            r.fin_tokens = [[] for _ in range(n)]
            self._live.append(r)
        cached = [self.kv.length(r.beams[0].seq) for r in joining]
        step = StepBatch.build([r.beams[0].seq for r in joining], [torch.tensor(r.prompt[c:]) for r, c in zip(joining, cached)],
                               [None] * len(joining), [None] * len(joining), cached, self.model.attn_dtype)
        h = forward_step(self.model, self.kv, step)
        last = [o - 1 for o in step.offsets[1:]]
        logits = self.model.logits(h[last])
        for b, r in enumerate(joining):
            self.kv.commit(r.beams[0].seq)
            r.gen.prefill_ms = (time.perf_counter() - r.t0) * 1e3
            self._advance(r, logits[b:b + 1])

    def _step(self, live: list[_Request]) -> None:
        t = time.perf_counter()
        beams = [(r, b) for r in live for b in r.beams]
        rank = {seq: k for k, seq in enumerate(self.kv.batch_order([b.seq for _, b in beams]))}
        beams.sort(key=lambda rb: rank[rb[1].seq])
        step = StepBatch.build([b.seq for _, b in beams], [torch.tensor(b.tokens[-1:]) for _, b in beams],
                               [None] * len(beams), [None] * len(beams), [self.kv.used(b.seq) for _, b in beams],
                               self.model.attn_dtype)
        h = forward_step(self.model, self.kv, step)
        logits = self.model.logits(h)
        row = {id(b): k for k, (_, b) in enumerate(beams)}
        for _, b in beams:
            self.kv.commit(b.seq)
        ms = (time.perf_counter() - t) * 1e3
        for r in live:
            r.gen.step_ms.append(ms)
            self._advance(r, logits[[row[id(b)] for b in r.beams]])

    def _advance(self, r: _Request, logits: torch.Tensor) -> None:
        """One beam-search step of request r from its beams' logits (n, V): transformers' ranking,
        then the new running beams take over the KV sequences (forks and frees)."""
        if self.num_beam_groups > 1:
            return self._advance_groups(r, logits)
        n, vocab = self.num_beams, logits.shape[-1]
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        log_probs = self.target(log_probs, input_ids=lambda: [r.prompt + b.tokens for b in r.beams],
                                allowed=self._allowed(r, vocab)).scores
        if r.first:  # every beam holds the prompt: the same row, scores [0, -1e9, ...]
            log_probs = log_probs.expand(n, vocab)
        cand = (log_probs + r.running[:, None]).reshape(-1)
        k = max(2, 1 + len(self.eos_ids)) * n
        top_scores, top_idx = torch.topk(cand, k)
        beam_of = [0] * k if r.first else (top_idx // vocab).tolist()  # first: one prompt row
        tok = (top_idx % vocab).tolist()
        hits = torch.tensor([t in self.eos_ids or r.cur_len + 1 >= r.max_length for t in tok])
        # the next running beams: the best n candidates that did not end
        ranked = top_scores + hits.to(torch.float32) * NEG
        nxt = torch.topk(ranked, n).indices.tolist()
        # finished hypotheses: those among the top n candidates that ended
        just = hits & (torch.arange(k) < n)
        fs = top_scores / ((r.cur_len + 1 - len(r.prompt)) ** self.length_penalty)
        full = bool(r.fin_done.all()) and self.early_stopping is True
        fs = fs + float(full) * NEG
        fs = fs + float(not r.unsatisfied) * NEG
        fs = fs + (~just).to(torch.float32) * NEG
        merged = torch.cat((r.fin_scores, fs))
        merged_tokens = r.fin_tokens + [r.beams[beam_of[j]].tokens + [tok[j]] for j in range(k)]
        merged_done = torch.cat((r.fin_done, just))
        sel = torch.topk(merged, n).indices.tolist()
        r.fin_scores, r.fin_done = merged[sel], merged_done[sel]
        r.fin_tokens = [merged_tokens[j] for j in sel]
        r.running = ranked[nxt]
        self._reorder(r, [beam_of[j] for j in nxt], [tok[j] for j in nxt])
        r.first = False
        r.cur_len += 1
        r.gen.accepted_lengths.append(1)
        hyp = (r.max_length - len(r.prompt)) if (self.early_stopping == "never" and self.length_penalty > 0) \
            else (r.cur_len - len(r.prompt))
        best = r.running[:1] / (hyp ** self.length_penalty)
        worst = torch.where(r.fin_done, r.fin_scores.min(), torch.tensor(NEG))
        r.unsatisfied = r.unsatisfied and bool((best > worst).any())
        r.done = not (r.unsatisfied and not (bool(r.fin_done.all()) and self.early_stopping is True)
                      and not bool(hits.all()))
        self._note_kv(r)

    def _advance_groups(self, r: _Request, logits: torch.Tensor) -> None:
        """Diverse beam search as transformers 4.x defines it (`_group_beam_search` with its
        BeamSearchScorer, removed from transformers 5's core): the beams form num_beam_groups groups
        searched one after the other within a step; a group's log-probabilities lose
        diversity_penalty x (how often each token was chosen at this step by the earlier groups,
        Hamming diversity); each group keeps its own finished hypotheses (a list of group-size best,
        scored sum(log p) / generated length ** length_penalty, EOS counted) and its own done flag;
        at max_length the running beams of unfinished groups join their lists; the best hypotheses
        over all groups are returned."""
        n, vocab, groups = self.num_beams, logits.shape[-1], self.num_beam_groups
        size = n // groups
        if r.first:
            r.running = torch.full((n,), NEG)
            r.running[::size] = 0.0
            r.group_hyps = [[] for _ in range(groups)]
            r.group_worst = [1e9] * groups
            r.group_done = [False] * groups
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        allowed = self._allowed(r, vocab)
        if r.first:
            log_probs = log_probs.expand(n, vocab)
            allowed = None if allowed is None else allowed.expand(n, -1)
        contexts = [r.prompt + b.tokens for b in r.beams] if not r.first else [r.prompt] * n
        cur_len = r.cur_len + 1  # the length the new scores are computed on (prompt + generated + 1)
        pad = min(self.eos_ids)
        k = max(2, 1 + len(self.eos_ids)) * size
        current = torch.zeros(n, dtype=torch.long)
        new_scores = torch.zeros(n)
        parents, tokens = [0] * n, [pad] * n
        for g in range(groups):
            rows = list(range(g * size, (g + 1) * size))
            lp = self.target(log_probs[rows], input_ids=lambda: [contexts[i] for i in rows],
                             allowed=None if allowed is None else allowed[rows]).scores
            if g > 0:
                freq = torch.bincount(current[:g * size], minlength=vocab).to(lp.dtype)
                lp = lp - self.diversity_penalty * freq
            cand = (lp + r.running[rows, None]).reshape(-1)
            top_scores, top = torch.topk(cand, k, largest=True, sorted=True)
            idx, tok = (top // vocab).tolist(), (top % vocab).tolist()
            if r.group_done[g]:  # transformers pads a finished group: score 0, the pad token, its first beam
                for j in rows:
                    parents[j], tokens[j], new_scores[j] = g * size, pad, 0.0
            else:
                self._group_select(r, g, size, cur_len, tok, top_scores, idx, (parents, tokens, new_scores))
            current[rows] = torch.tensor(tokens[g * size:(g + 1) * size])
        r.running = new_scores
        self._reorder(r, [p if not r.first else 0 for p in parents], tokens)
        r.first = False
        r.cur_len += 1
        r.gen.accepted_lengths.append(1)
        if all(r.group_done) or r.cur_len >= r.max_length:
            self._close_groups(r, size)
        self._note_kv(r)

    def _group_select(self, r: _Request, g: int, size: int, cur_len: int, tok: list[int], top_scores: torch.Tensor,
                      idx: list[int], out: tuple[list[int], list[int], torch.Tensor]) -> None:
        """Group g's next beams from its ranked candidates (transformers 4.x BeamSearchScorer.process):
        an EOS among the first `size` becomes a hypothesis, the others fill the group's beams in order;
        out = (parents, tokens, new_scores) over all beams, filled for this group's slots."""
        parents, tokens, new_scores = out
        slot = 0
        for rank, (t, sc, i) in enumerate(zip(tok, top_scores.tolist(), idx)):
            parent = 0 if r.first else g * size + i
            if t in self.eos_ids:
                if rank >= size:
                    continue
                self._add_hyp(r, g, r.beams[parent].tokens + [t], sc, cur_len - len(r.prompt), size)
            else:
                j = g * size + slot
                parents[j], tokens[j], new_scores[j] = parent, t, top_scores[rank]
                slot += 1
            if slot == size:
                break
        r.group_done[g] = r.group_done[g] or self._group_is_done(r, g, float(top_scores.max()), cur_len, size)

    def _close_groups(self, r: _Request, size: int) -> None:
        """The end of a diverse search: running beams of unfinished groups join their lists, and the
        best num_beams hypotheses over all groups are the request's."""
        for g in range(self.num_beam_groups):
            if not r.group_done[g]:
                for j in range(g * size, (g + 1) * size):
                    self._add_hyp(r, g, list(r.beams[j].tokens), float(r.running[j]), r.cur_len - len(r.prompt), size)
        hyps = [h for g in range(self.num_beam_groups) for h in r.group_hyps[g]]
        ranked = sorted(hyps, key=lambda h: h[0])  # stable, best popped last, as transformers does
        best = [ranked.pop() for _ in range(min(self.num_beams, len(ranked)))]
        r.fin_tokens = [t for _, t in best]
        r.fin_scores = torch.tensor([s for s, _ in best], dtype=torch.float32)
        r.fin_done = torch.ones(len(best), dtype=torch.bool)
        r.done = True

    def _note_kv(self, r: _Request) -> None:
        """The pool's bytes in use while r runs, and what a copy of the prefix per beam would hold."""
        r.kv_peak = max(r.kv_peak, self.kv.stats()["bytes_in_use"])
        r.kv_copy = max(r.kv_copy, self.num_beams * (r.cur_len - 1) * getattr(self.kv, "slot_bytes", 0))

    def _add_hyp(self, r: _Request, g: int, tokens: list[int], sum_logprobs: float, length: int, size: int) -> None:
        """transformers 4.x BeamHypotheses.add for group g (at most `size` kept)."""
        score = sum_logprobs / (length ** self.length_penalty)
        hyps = r.group_hyps[g]
        if len(hyps) < size or score > r.group_worst[g]:
            hyps.append((score, tokens))
            if len(hyps) > size:
                order = sorted((s, i) for i, (s, _) in enumerate(hyps))
                del hyps[order[0][1]]
                r.group_worst[g] = order[1][0]
            else:
                r.group_worst[g] = min(score, r.group_worst[g])

    def _group_is_done(self, r: _Request, g: int, best_sum_logprobs: float, cur_len: int, size: int) -> bool:
        """transformers 4.x BeamHypotheses.is_done for group g."""
        if len(r.group_hyps[g]) < size:
            return False
        if self.early_stopping is True:
            return True
        prompt = len(r.prompt)
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best = best_sum_logprobs / (r.max_length - prompt) ** self.length_penalty
        else:
            best = best_sum_logprobs / (cur_len - prompt) ** self.length_penalty
        return r.group_worst[g] >= best

    def _allowed(self, r: _Request, vocab: int) -> torch.Tensor | None:
        """Each beam's packed allowed set from its own constraint state (None: no beam is constrained)."""
        if all(b.constraint is None for b in r.beams):
            return None
        bits = torch.full((len(r.beams), words(vocab)), -1, dtype=torch.int32)
        for k, b in enumerate(r.beams):
            if b.constraint is not None:
                b.constraint.fill(bits[k])
        return bits

    def _reorder(self, r: _Request, parents: list[int], tokens: list[int]) -> None:
        """The new running beams: child j continues beam parents[j] with tokens[j]. A parent's first
        child takes its sequence (and constraint state); further children fork them; parents no
        child keeps are freed."""
        old = r.beams
        children: dict[int, list[int]] = {}
        for j, p in enumerate(parents):
            children.setdefault(p, []).append(j)
        new: list[_Beam | None] = [None] * len(parents)
        for p, js in children.items():  # forks first: they copy the parent's state as it is now
            for j in js[1:]:
                c = old[p].constraint
                new[j] = _Beam(self.kv.fork(old[p].seq), list(old[p].tokens), None if c is None else c.fork())
        for p, js in children.items():
            new[js[0]] = _Beam(old[p].seq, list(old[p].tokens), old[p].constraint)
        for p, b in enumerate(old):
            if p not in children:
                self.kv.free(b.seq)
        for b, t in zip(new, tokens):
            b.tokens.append(t)
            if b.constraint is not None and t not in self.eos_ids and not b.constraint.advance(t):
                b.constraint = _Dead()  # a continuation scored -inf (fewer legal ones than beams)
        r.beams = new

    def _release(self, r: _Request) -> None:
        for b in r.beams:
            if b.seq in self.kv.sequences:
                self.kv.free(b.seq)
        r.beams = []

    def _finish(self, r: _Request) -> Generation:
        gen = r.gen
        hyps = [(toks, float(s)) for toks, s, d in zip(r.fin_tokens, r.fin_scores.tolist(), r.fin_done.tolist()) if d]
        gen.beams = hyps[:self.num_return_sequences]
        best = gen.beams[0][0] if gen.beams else []
        gen.token_ids = list(best)
        gen.finish_reason = "eos" if best and best[-1] in self.eos_ids else (
            "context" if r.max_length < len(r.prompt) + r.max_new_tokens else "length")
        gen.wall_s = time.perf_counter() - r.t0
        gen.kv_peak_bytes, gen.kv_copy_per_beam_bytes = r.kv_peak, r.kv_copy
        if self.on_tokens is not None and best:
            self.on_tokens(r.index, best, None)
        return gen


class _Dead:
    """The state of a beam whose last token left its language: nothing is allowed after it."""

    def fill(self, bits: torch.Tensor) -> None:
        bits.zero_()

    def fork(self) -> "_Dead":
        return self

    def advance(self, token: int) -> bool:
        return False
