"""The step loop over many sequences: propose -> one target forward -> target -> verify -> commit.

Every live sequence's root (a plain step) or tree is packed into one target forward (`StepBatch`:
block-diagonal attention, each row positioned within its own sequence). The target-distribution
stage processes every row once; plain rows are sampled, trees are verified, and each sequence
commits its own accepted path. Requests join and leave between steps (`pipeline.core.runner`):
continuous batching.

The root of a sequence is its newest token, already chosen and streamed, whose keys/values are not
cached yet; a step with no draft is exactly a plain decode step, and every step commits
accept_length + 1 tokens per target forward. Constrained requests are handled by one object,
`StepConstraints` (pipeline/core/masks.py): prune the drafts, start the masks, wait for them, advance.

A request may bring its own sampling knobs (`Request.sampling`). Its rows go through the sampler's
shared processors with every other row, then through its own temperature / top-k / top-p (one row
group per distinct knobs, `pipeline.core.target.RowGroup`); temperature 0 is greedy. Its trees are
verified by the verifier of its kind: `greedy_verifier` for a greedy request, `sampling_verifier`
for a sampled one (the build passes the configured verifier as the one of its kind and
`verifier=greedy` / `verifier=exact` as the other). Every proposer here drafts deterministically
(q one-hot, `Tree.q` None), which exact verification takes for any p, and a sampled proposer carries
its q: drafts stay valid whatever knobs the request has. A request whose kind has no verifier runs
plain steps. Requests with the sampler's own knobs (`sampling` None or equal to them) take the
path every request took before: one pass of all processors over all rows, the configured verifier.

One module (~340 lines): the step loop and what it does per sequence (propose, commit, emit) read
together, as Medusa's decode loop does; admission is runner.py's, constraints masks.py's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pipeline.errors import UserError
from pipeline.core.faults import blame, isolate
from pipeline.core.masks import StepConstraints
from pipeline.core.runner import Request, Runner, SamplingParams, forward_step
from pipeline.core.target import RowGroup, TargetStage
from pipeline.core.tree import Tree
from pipeline.core.types import DecodeState, Generation, StepBatch


PREFILL_ROWS = 2048  # padded prompt rows (requests x longest prompt) per admission forward


def forward_rows(model, kv, seq: int, tokens: torch.Tensor, depths: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None, layers: list[int] | None = None) -> torch.Tensor:
    """One sequence's forward: tokens (n,) after the slots it holds (a prompt block when depths and
    mask are None, else a tree). Returns hidden (n, dim); the rows become tentative slots."""
    step = StepBatch.build([seq], [tokens], [depths], [mask], [kv.used(seq)], model.attn_dtype)
    return forward_step(model, kv, step, layers)


@dataclass
class _Live:
    index: int  # the request's handle
    seq: int  # its sequence id in the KV pool
    prompt_len: int
    tokens: list[int]  # prompt + committed tokens; the last is the root
    hidden: torch.Tensor | None  # (dim,) the target state that chose the root
    gen: Generation
    generator: torch.Generator
    t0: float
    max_new_tokens: int
    grammar: object = None  # its Grammar, when the request is constrained
    constraint: object = None  # ... and that grammar's Constraint state
    sampling: SamplingParams | None = None  # its own knobs; None: the sampler's
    warpers: list | None = None  # ... and their processors (after the sampler's shared ones)
    proposer: object = None  # the proposer of its trees (the runner's, or the named draft it asked for); None: plain
    logprobs: int | None = None  # Request.logprobs
    done: bool = False
    mask_s: float = 0.0  # constraint time (masks, tree walk, advances) in the current step
    error: BaseException | None = None  # its own work failed: it ends with finish_reason "error"


class Engine(Runner):
    """Decodes requests `batch_size` at a time with one model, KV pool, sampler and, optionally, a
    proposer + verifier. Tokens do not depend on the batch size (where the model's products are
    batch-invariant, see the README) and sampling is seeded per request."""
    speculates = True
    plain = True
    per_request = True
    rewinds = True

    def __init__(self, model, kv, sampler, eos_ids: list[int], max_new_tokens: int, proposer=None,
                 verifier=None, seed: int = 0, batch_size: int = 1, constraint=None, guard=None,
                 record_trees: bool = False, greedy_verifier=None, sampling_verifier=None, drafts: dict | None = None):
        """verifier: verifies the trees of requests with the sampler's own knobs. greedy_verifier,
        sampling_verifier: the trees of requests with knobs of their own, greedy and sampled; each
        defaults to `verifier` where it is of that kind, else none (those requests run plain steps).
        drafts: named proposers a request may ask for (`Request.draft`) instead of `proposer`; every
        sequence's rows, whichever draft made its tree, go through one target forward."""
        super().__init__(model, kv, sampler, eos_ids, max_new_tokens, seed, batch_size, constraint)
        self.drafts = dict(drafts or {})
        if (proposer is not None or self.drafts) and verifier is None:
            raise UserError("a proposer needs a verifier: add verifier=greedy")
        if proposer is not None and not sampler.greedy and not verifier.samples:
            raise UserError(f"verifier {type(verifier).__name__} is lossless only for sampler=greedy: to sample "
                            "with speculation use verifier=exact (or verifier=typical), or drop the proposer")
        if sampling_verifier is not None and not sampling_verifier.samples:
            raise UserError(f"sampling_verifier {type(sampling_verifier).__name__} cannot verify sampled requests: "
                            "give one that samples (verifier=exact)")
        if verifier is not None:
            if greedy_verifier is None and not verifier.samples:
                greedy_verifier = verifier
            if sampling_verifier is None and verifier.samples:
                sampling_verifier = verifier
        self.greedy_verifier, self.sampling_verifier = greedy_verifier, sampling_verifier
        self.idle_proposer = None  # a proposer that will never draft (kept for what it reports)
        if proposer is not None and not proposer.active:
            self.idle_proposer, proposer = proposer, None  # e.g. no tree pays here: plain steps, no overhead
        self.proposer, self.verifier = proposer, verifier
        self.guard = guard  # a SpeculationGuard: pauses drafting while it does not pay (None: always draft)
        self.record_trees = record_trees  # keep every verified tree in Generation.trees (pipeline.report draws them)
        self.target = TargetStage(sampler.shared, greedy=sampler.greedy, warpers=sampler.processors[len(sampler.shared):])
        self.masks = StepConstraints(model.args.vocab_size, self.eos_ids)

    def reset(self) -> None:
        """The speculation guard's measurements start afresh, the proposers' cross-request state
        (`Proposer.reset`), and the prefix cache (`Runner.reset`)."""
        super().reset()
        if self.guard is not None:
            self.guard.reset()
        for p in {id(p): p for p in (self.proposer, self.idle_proposer, *self.drafts.values()) if p is not None}.values():
            p.reset()

    @property
    def drafting(self) -> bool:
        return self.proposer is not None or any(p.active for p in self.drafts.values())

    @property
    def drafter(self):
        return self.proposer or self.idle_proposer

    def describe(self) -> dict:
        out = super().describe()
        drafter = {} if self.drafter is None else self.drafter.describe()
        if drafter.get("tree") is not None:
            out["tree"] = drafter["tree"]
        if self.guard is not None and self.drafting:
            out["guard"] = self.guard.describe()
        if self.drafts:
            out["drafts"] = {name: p.describe() for name, p in self.drafts.items()}
        return out

    def add(self, request: Request) -> int:
        if request.draft is not None and request.draft not in self.drafts:
            raise UserError(f"no draft {request.draft!r} here: this engine has {sorted(self.drafts) or 'none'}")
        return super().add(request)

    def peek(self, handle: int) -> Generation | None:
        """What a live request has made so far (its Generation, to read, not to change); None when
        it is not live."""
        return next((s.gen for s in self._live if s.index == handle), None)

    def _proposer_of(self, r: Request):
        """The proposer of a request's trees: its named draft, else the runner's (None: plain steps)."""
        p = self.proposer if r.draft is None else self.drafts[r.draft]
        return p if p is not None and p.active else None

    # --- requests join and leave ----------------------------------------------------------------
    def _join(self, joining: list[tuple[int, Request]]) -> None:
        """Prefill the joining requests, packed into forwards of at most PREFILL_ROWS padded prompt
        rows (a longer prompt goes alone), and choose each one's first token. A request whose own
        work fails in its prefill fails alone (`pipeline.core.faults`)."""
        group: list[tuple[int, Request]] = []
        for item in joining:
            if item[1].sibling_of is not None and any(h == item[1].sibling_of for h, _ in group):
                group.append(item)  # forks its sibling's prompt: no rows of its own
                continue
            if group and (len(group) + 1) * max(len(item[1].prompt), *(len(r.prompt) for _, r in group)) > PREFILL_ROWS:
                self._prefill_alone(group)
                group = []
            group.append(item)
        self._prefill_alone(group)

    def _prefill_alone(self, group: list[tuple[int, Request]]) -> None:
        for (handle, _), cause, _ in isolate(group, self._prefill, self._unjoin, lambda item: item[0]):
            self._fail_joining(handle, cause)

    def _unjoin(self, group: list[tuple[int, Request]]) -> None:
        """Undo a prefill that raised before it committed: the group's live states go, with their memory."""
        handles = {h for h, _ in group}
        for s in [s for s in self._live if s.index in handles]:
            self._live.remove(s)
            self._release(s)

    def _prefill(self, group: list[tuple[int, Request]]) -> None:
        """One forward over the prompts of a group of joining requests. A request whose sibling
        (`Request.sibling_of`, n > 1) is prefilled in this forward forks its prompt KV and takes its
        first token from the sibling's row of the target, with its own generator. Every first token
        is chosen before any is committed (a failure before then can be undone: `_unjoin`)."""
        t0 = time.perf_counter()
        joined, fed, row = [], [], {}  # every joining request; those whose prompt the forward reads; request -> its row
        for handle, r in group:
            with blame(handle):  # its constraint, its knobs' warpers, its seed
                grammar, sampling = self._grammar(r), self._knobs(r.sampling)
                state = None if grammar is None else grammar.start()
                warpers = None if sampling is None else self.sampler.warpers(sampling)
                generator = torch.Generator().manual_seed(r.seed)
            sibling = next((f for f in fed if f.index == r.sibling_of), None)
            proposer = self._proposer_of(r)
            prompt = None if proposer is not None and proposer.prompt_states else r.prompt  # None: no cached prefix
            s = _Live(handle, None if sibling is not None else self.kv.create(prompt), len(r.prompt), list(r.prompt),
                      None, Generation(logprobs=None if r.logprobs is None else []), generator, t0, self._budget_of(r),
                      grammar, state, sampling, warpers, proposer, r.logprobs)
            s.gen.constraint = None if grammar is None else grammar.kind
            self._live.append(s)
            joined.append(s)
            if sibling is None:
                row[handle] = len(fed)
                fed.append(s)
            else:
                row[handle] = row[sibling.index]
        cached = [self.kv.length(s.seq) for s in fed]  # a prompt's prefix the KV manager had: not computed again
        step = StepBatch.build([s.seq for s in fed], [torch.tensor(s.tokens[c:]) for s, c in zip(fed, cached)],
                               [None] * len(fed), [None] * len(fed), cached, self.model.attn_dtype)
        masks = self.masks.start(fed, [None] * len(fed), [1] * len(fed))
        h, f = self._forward(step)  # (R, dim): every uncached prompt position of every prefilled request; f what observers read
        last = [o - 1 for o in step.offsets[1:]]
        allowed = masks()
        p = self.target(self.model.logits(h[last]), input_ids=lambda: [s.tokens for s in fed], allowed=allowed,
                        where=self.masks.where(fed, [1] * len(fed)), groups=_groups(fed, [1] * len(fed)))
        firsts = []
        for s in joined:  # every first token chosen before anything commits
            b = row[s.index]
            with blame(s.index):
                first = self.sampler.choose(p.rows(b, b + 1), [s.generator])[0]
                firsts.append((first, None if s.logprobs is None else _logprobs(p.rows(b, b + 1), [0], [first], s.logprobs)))
        self.masks.charge(fed, allowed, self.target.mask_s)
        ms = (time.perf_counter() - t0) * 1e3
        for s, (first, lps) in zip(joined, firsts):
            b = row[s.index]
            _alone(s, lambda: self._start(s, fed[b], first, lps, f[step.offsets[b]:step.offsets[b + 1]], h[last[b]],
                                          f[last[b]:last[b] + 1], ms))

    def _start(self, s: _Live, source: _Live, first: int, lps: list | None, feats: torch.Tensor,
               hidden: torch.Tensor, out: torch.Tensor, ms: float) -> None:
        """Commit a prefilled request's prompt (or fork its sibling's, `source`) and its first token."""
        if s.seq is None:
            s.seq = self.kv.fork(source.seq)  # its sibling's prompt KV, committed just before
        else:
            self.kv.commit(s.seq)
        if s.proposer is not None:
            s.proposer.start(s.seq, s.tokens)
            s.proposer.observe(s.seq, (s.tokens[1:] + [first])[-len(feats):], feats)  # the positions prefilled
        s.hidden = hidden
        s.gen.prefill_ms = ms
        self._emit(s, [first], out, lps)
        self.masks.note(s)

    def _release(self, s: _Live) -> None:
        if s.seq is None:  # a fork that never got its KV (its step failed first)
            return
        if s.seq in self.kv.sequences:
            self.kv.free(s.seq)
        if s.proposer is not None:
            s.proposer.release(s.seq)

    def _finish(self, s: _Live) -> Generation:
        s.gen.wall_s = time.perf_counter() - s.t0
        return s.gen

    # --- one step over every live sequence -------------------------------------------------------
    def _step(self, live: list[_Live]) -> None:
        t = time.perf_counter()
        rank = {seq: r for r, seq in enumerate(self.kv.batch_order([s.seq for s in live]))}
        live = sorted(live, key=lambda s: rank[s.seq])
        trees, node_bits = self._propose(live)
        t_draft = time.perf_counter()
        step = StepBatch.build([s.seq for s in live], [tr.tokens for tr in trees],
                               [None if tr.size == 1 else tr.depth for tr in trees],
                               [None if tr.size == 1 else tr.mask for tr in trees],
                               [self.kv.used(s.seq) for s in live], self.model.attn_dtype)
        sizes = [tr.size for tr in trees]
        masks = self.masks.start(live, node_bits, sizes)
        h, f = self._forward(step)  # (R, dim), and what observers read
        allowed = masks()
        p = self.target(self.model.logits(h), input_ids=lambda: _contexts(live, trees), allowed=allowed,
                        where=self.masks.where(live, sizes), groups=_groups(live, sizes))
        t_verify = time.perf_counter()
        decided = []
        for s, tree, o in zip(live, trees, step.offsets):  # every request's tokens before anything commits
            with blame(s.index):
                decided.append(self._decide(s, tree, p.rows(o, o + tree.size)))
        self.masks.charge(live, allowed, self.target.mask_s)
        committed = [(s, tree, new, lps, _alone(s, lambda: self._commit(s, tree, path, new, h[o:o + tree.size],
                                                                        f[o:o + tree.size])))
                     for s, tree, o, (path, new, lps) in zip(live, trees, step.offsets, decided)]
        committed = [c for c in committed if not c[0].done]  # a commit that failed failed its request alone
        ms = (time.perf_counter() - t) * 1e3
        if self.guard is not None and any(s.proposer is not None for s in live):
            self.guard.record(any(tr.size > 1 for tr in trees), sum(len(new) for _, _, new, _, _ in committed), ms)
        draft_ms, verify_ms = (t_draft - t) * 1e3, (t_verify - t_draft) * 1e3
        for s, tree, new, lps, feats in committed:
            s.gen.step_ms.append(ms)
            s.gen.step_draft_ms.append(draft_ms)
            s.gen.step_verify_ms.append(verify_ms)
            s.gen.step_nodes.append(tree.size)
            s.gen.tree_depths.append(tree.max_depth)
            _alone(s, lambda: (self._emit(s, new, feats, lps), self.masks.note(s)))

    def _snapshot(self, live: list[_Live]) -> list:
        """What a step changes before it commits: each generator's state and the pruned-draft count."""
        return [(s.generator.get_state(), s.gen.pruned_drafts) for s in live]

    def _rewind(self, live: list[_Live], snapshot: list) -> None:
        """Undo a step over `live` that raised before committing: the forward's tentative KV slots go,
        the generators draw again from where they were (the redone step gives the same tokens)."""
        for s, (state, pruned) in zip(live, snapshot):
            s.generator.set_state(state)
            s.gen.pruned_drafts, s.mask_s = pruned, 0.0
            if s.seq in self.kv.sequences:
                self.kv.discard(s.seq)

    def _forward(self, step: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's hidden states (R, dim) and what `observe` / `on_tokens` read: the same, or
        where a proposer asked the model to keep layers (`model.taps`, EAGLE-3's fusion) those
        layers' states before them, (R, (len(taps) + 1) dim), from this same forward."""
        h = forward_step(self.model, self.kv, step)
        if not getattr(self.model, "taps", ()):
            return h, h
        return h, torch.cat((self.model.tapped, h), dim=-1)

    def _budget(self, s: _Live) -> int:
        """Tokens this sequence may still commit: up to its max_new_tokens and the context end."""
        n = len(s.gen.token_ids)
        return min(s.max_new_tokens - n, self.model.args.max_seq_len - s.prompt_len - n)

    def _propose(self, live: list[_Live]) -> tuple[list[Tree], list]:
        """Each sequence's tree for this step (a lone root where nothing is drafted), pruned to its
        budget and its language, and the nodes' packed allowed sets where a walk computed them."""
        speculate = any(s.proposer is not None for s in live) and (self.guard is None or self.guard.speculate())
        drafted = [s for s in live if speculate and s.proposer is not None and self._budget(s) > 1
                   and self._verifier(s) is not None]
        proposals = {}
        for proposer in dict.fromkeys(s.proposer for s in drafted):  # each draft over its sequences, in order
            mine = [s for s in drafted if s.proposer is proposer]
            proposals.update(zip((s.seq for s in mine), proposer.propose(
                [DecodeState(s.seq, s.tokens, s.hidden, self.model, self.kv, self._budget(s), s.generator,
                             s.constraint)
                 for s in mine])))
        for s in drafted:
            self._check_proposal(s, proposals[s.seq])
        trees, node_bits = [], []
        for s in live:
            tree, bits = proposals.get(s.seq), None
            if tree is None:
                tree = Tree.root(s.tokens[-1])
            else:  # never more nodes than tokens left, never a draft past max_new_tokens or the context
                budget = self._budget(s)
                tree = tree.prune(budget - 1, min(budget, self.model.args.max_seq_len - self.kv.used(s.seq)))
                tree, bits = self.masks.prune(s, tree)  # drafts that leave the language go now
            trees.append(tree)
            node_bits.append(bits)
        return trees, node_bits

    def _check_proposal(self, s: _Live, tree: Tree | None) -> None:
        if s.proposer.sampled and tree is not None and tree.q is None:
            raise RuntimeError(f"{type(s.proposer).__name__} samples its drafts but gave no q: "
                               "exact verification needs the draft distribution of every node")
        if self.kv.pending(s.seq):
            raise RuntimeError(f"{type(s.proposer).__name__} left {self.kv.pending(s.seq)} tentative KV slots "
                               "of a sequence: a drafting proposer must discard its own slots")

    def _knobs(self, params: SamplingParams | None) -> SamplingParams | None:
        """A request's own knobs, None where they are the sampler's (its rows take the common path)."""
        if params is None or params == self.sampler.params or (params.greedy and self.sampler.greedy):
            return None
        return params

    def _verifier(self, s: _Live):
        """The verifier of s's trees (None: s runs plain steps)."""
        if s.sampling is None:
            return self.verifier
        return self.greedy_verifier if s.sampling.greedy else self.sampling_verifier

    def _decide(self, s: _Live, tree: Tree, p) -> tuple[list[int], list[int], list | None]:
        """s's tokens from its rows of the target p: its tree verified (a lone root sampled). Returns
        the accepted path (node indices), the committed tokens, and their log-probabilities where the
        request asked (token k is drawn from row path[k]). Changes nothing but s's generator."""
        if tree.size == 1:
            path, new = [0], self.sampler.choose(p, [s.generator])
        else:
            acc = self._verifier(s).verify(tree, p, s.generator)
            path, new = acc.path, acc.tokens
        return path, new, None if s.logprobs is None else _logprobs(p, path, new, s.logprobs)

    def _commit(self, s: _Live, tree: Tree, path: list[int], new: list[int], h: torch.Tensor,
                f: torch.Tensor) -> torch.Tensor:
        """Keep the accepted path's KV slots of s's tree (hidden h (n, dim) and what observers read,
        f: `_forward`), tell the proposer, and return f along the path."""
        if tree.size == 1:
            self.kv.commit(s.seq)
        else:
            self.kv.commit(s.seq, path)
            if self.record_trees:
                s.gen.trees.append({"step": len(s.gen.accepted_lengths), "tokens": tree.tokens.tolist(),
                                    "parents": tree.parents.tolist(), "path": [int(i) for i in path]})
        rows = torch.tensor(path, device=h.device) if len(path) > 1 else slice(0, 1)  # the path's rows
        feats = f[rows]  # (n, dim) along the path, or (n, (taps + 1) dim)
        if s.proposer is not None:
            s.proposer.observe(s.seq, new, feats)
        s.hidden = h[path[-1]]
        return feats

    def _emit(self, s: _Live, new: list[int], hidden: torch.Tensor, lps: list | None = None) -> None:
        """Append committed tokens (and their log-probabilities, lps), stopping exactly where plain
        decoding would: at the first EOS, where the constraint is complete, at max_new_tokens or at
        the context end, even inside an accepted path."""
        gen, out, forced = s.gen, [], None
        limit = self.model.args.max_seq_len
        c = s.constraint
        for tok in new:
            out.append(tok)
            n = len(gen.token_ids) + len(out)
            if tok in self.eos_ids:
                gen.finish_reason, s.done = "eos", True
            elif c is not None and self.masks.advance(s, tok):
                gen.finish_reason, s.done = "constraint_complete", True
                if n < s.max_new_tokens and s.prompt_len + n < limit:  # the one token it allows
                    forced = self.masks.end_token(c)
                    out.append(forced)
            elif n >= s.max_new_tokens:
                gen.finish_reason, s.done = "length", True
            elif s.prompt_len + n >= limit:
                gen.finish_reason, s.done = "context", True
            if s.done:
                break
        if s.done and c is not None:
            gen.constraint_complete = gen.finish_reason in ("eos", "constraint_complete") or c.can_end()
        gen.token_ids += out
        if lps is not None:  # the forced end token is the only one its row allows: log-probability 0
            gen.logprobs += lps[:len(out) - (forced is not None)] + ([] if forced is None else [(0.0, [(forced, 0.0)])])
        gen.accepted_lengths.append(len(out))
        s.tokens += new
        if self.on_tokens is not None and out:
            self.on_tokens(s.index, out, hidden[:len(out)])


def _logprobs(p, rows: list[int], tokens: list[int], k: int) -> list[tuple[float, list]]:
    """Token i's log-probability under row rows[i] of the target p (log-softmax of its processed,
    masked scores), and that row's k best tokens with theirs (tokens it does not allow left out)."""
    lp = torch.log_softmax(p.scores[torch.tensor(rows)], dim=-1)  # (n, V)
    chosen = lp.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    if not k:
        return [(c, []) for c in chosen]
    top = lp.topk(k, dim=-1)
    return [(c, [(t, v) for t, v in zip(ids, vals) if v > float("-inf")])
            for c, ids, vals in zip(chosen, top.indices.tolist(), top.values.tolist())]


def _alone(s: _Live, fn):
    """fn() for s after its tokens are decided: a failure there is s's alone (it ends with the error;
    the other requests' commits go on). Returns fn's result (None when it failed)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - one request's failure never fails another
        s.done, s.error = True, e
        return None


def _groups(live: list[_Live], sizes: list[int]) -> list[RowGroup] | None:
    """The rows of the requests with knobs of their own, one group per distinct knobs (None when
    every request has the sampler's: the common path)."""
    if all(s.sampling is None for s in live):
        return None
    groups: dict[SamplingParams, RowGroup] = {}
    o = 0
    for s, n in zip(live, sizes):
        if s.sampling is not None:
            g = groups.setdefault(s.sampling, RowGroup([], s.warpers, s.sampling.greedy))
            g.rows.extend(range(o, o + n))
            g.owners.append(s.index)
        o += n
    return list(groups.values())


def _contexts(live: list[_Live], trees: list[Tree]) -> list[list[int]]:
    """The token context each row of a step continues: the committed tokens, then the drafts on
    the path from the root to the row's node."""
    out = []
    for s, tree in zip(live, trees):
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        ctx = [s.tokens]
        for i in range(1, len(tokens)):
            ctx.append(ctx[parents[i]] + [tokens[i]])
        out += ctx
    return out
