"""The data that flows through one decode step: the packed step, the decode state a proposer sees,
what a verifier accepted, and what a finished request produced."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch


@dataclass
class Accepted:
    """What a verifier keeps of one tree (vLLM / SpecInfer naming)."""
    path: list[int]  # packed node indices, root first: the tentative slots to commit
    draft_tokens: list[int]  # the accepted draft tokens (the path without the root)
    bonus_token: int  # the target's own token after the last accepted node: the bonus token when
    # every draft on the path was accepted, the recovered (corrected) token after a rejection

    @property
    def accept_length(self) -> int:
        return len(self.draft_tokens)

    @property
    def tokens(self) -> list[int]:
        """Everything this step commits: accepted drafts, then the bonus / recovered token."""
        return self.draft_tokens + [self.bonus_token]


@dataclass
class DecodeState:
    """What a proposer sees of one live sequence when it drafts."""
    seq: int  # the sequence id in the KV pool
    tokens: list[int]  # prompt + every committed token, the root (newest, not yet cached) last
    hidden: torch.Tensor  # (dim,) the target's hidden state that chose the root
    model: object  # the backbone Transformer, for self-drafting proposers
    kv: object  # its KV manager; a draft may write tentative slots of `seq` and must discard them
    budget: int  # tokens this sequence may still commit, the bonus token included (max_new_tokens,
    # context end): a tree may hold budget nodes, its drafts reach depth budget - 1
    generator: torch.Generator | None = None  # the request's own, for sampled drafts
    constraint: object = None  # the request's Constraint state (None: unconstrained), to read: fork it
    # to look ahead (e.g. the tokens the grammar forces), never advance it


@dataclass
class Generation:
    """One finished request."""
    token_ids: list[int] = field(default_factory=list)  # generated tokens (EOS included when it ended on it)
    finish_reason: str = "length"  # eos | length | context | constraint_complete | abort (Runner.abort) | error
    accepted_lengths: list[int] = field(default_factory=list)  # tokens committed per target forward (prefill first)
    step_ms: list[float] = field(default_factory=list)  # wall time per step this request took part in
    step_draft_ms: list[float] = field(default_factory=list)  # ... of it drafting (the proposer's trees)
    step_verify_ms: list[float] = field(default_factory=list)  # ... of it the target: forward, masks, logits, processors
    step_nodes: list[int] = field(default_factory=list)  # its tree nodes per step (1 = plain step)
    tree_depths: list[int] = field(default_factory=list)  # its deepest draft per step (0 = plain step)
    wall_s: float = 0.0  # from admission (prefill) to the last token
    prefill_ms: float = 0.0
    constraint: str | None = None  # the kind of constraint the request followed, if any
    constraint_complete: bool | None = None  # the output is a whole sentence of its language
    pruned_drafts: int = 0  # drafts dropped before the forward because they leave the language
    mask_ms: list[float] = field(default_factory=list)  # constraint time per step (masks, walk, advances)
    beams: list | None = None  # beam search: [(token_ids, score)], best first
    kv_peak_bytes: int = 0  # beam search: the KV pool's peak while the request ran
    kv_copy_per_beam_bytes: int = 0  # ... and what a copy of the prefix per beam would have held
    # with Engine.record_trees: per tree step {"step": index into accepted_lengths, "tokens", "parents"
    # (the candidate tree, node 0 the root), "path": the accepted nodes from the root}
    trees: list = field(default_factory=list)
    # with Request.logprobs: per generated token (its log-probability, [(token, log-probability)] of the
    # k best), from the target distribution the step computed (log-softmax of the processed, masked scores)
    logprobs: list | None = None
    error: str | None = None  # finish_reason "error": what failed (the request's own work; it failed alone)
    fault: BaseException | None = field(default=None, repr=False, compare=False)  # ... and the exception

    @property
    def steps(self) -> int:
        return len(self.accepted_lengths)


@dataclass(frozen=True)
class KVPlan:
    """One step in a KV manager, as data: where each new row's key and value go and what each
    sequence reads back. `KVManager.begin_step` makes room and returns it; the step's batch carries
    it to every layer's `update`, and `end_step` turns its rows into tentative slots. The manager
    keeps nothing of the step between those calls; the index tensors are on the manager's device.

    `write` and `read` index the manager's own storage (components/kv): contiguous, (slab, position)
    per row, a slice of consecutive slabs or the (B,) slabs to gather; paged, (block, offset) per row,
    a slice of consecutive blocks or the (B, nb) block table."""
    seqs: list[int]  # (B,) the step's sequences, in its order
    counts: list[int]  # (B,) new rows per sequence
    span: int  # S: slots every sequence's attention reads (its own, padded to the longest)
    write: tuple  # (R,) index tensors, row by row; a lone sequence: (its slab, slice of positions)
    read: slice | torch.Tensor  # a slice: a view of the storage, no copy; a tensor: ids gathered
    in_place: tuple | None = None  # paged: ((R,) slot ids block * block_size + offset, (B, nb) block table), for
    # the fused layer that writes and reads the pool where it lies (None: the manager offers none)


@dataclass
class StepBatch:
    """One target forward over the new rows of several sequences, packed row after row.

    Sequence b owns rows [offsets[b], offsets[b + 1]) (a prompt block, a plain step's root, or a
    tree). Its rows are written after the `starts[b]` slots it already holds (committed + tentative)
    and attend to those of the slots that `visible[b]` shows (all by default) plus, among themselves,
    what `masks[b]` allows. Attention runs on a padded (B, T) layout: row r sits at flat index
    `row_index[r]` of (B * T). `plan` is the KV manager's plan for the step (`KVManager.begin_step`),
    set by whoever runs the forward (`pipeline.core.forward_step`)."""
    seqs: list[int]  # (B,) sequence ids
    tokens: torch.Tensor  # (R,) long
    positions: torch.Tensor  # (R,) long: position ids (start + depth in the tree / offset in the block)
    offsets: list[int]  # (B + 1,) row offsets
    starts: list[int]  # (B,) slots already held by each sequence
    bias: torch.Tensor | None  # (B, 1, T, S) additive attention bias (0 / -inf); None = attend to all
    row_index: torch.Tensor | None  # (R,) flat index into (B * T); None when B == 1
    causal: bool  # one sequence, empty cache, a causal block: the fused causal kernel applies
    width: int  # T: the most rows any sequence has
    span: int  # S: the most slots any sequence attends to (start + its rows)
    plan: KVPlan | None = None  # where the rows go in the KV manager; None until the step begins

    def to(self, device: torch.device) -> "StepBatch":
        """The batch with its tensors on `device` (itself when they are there already)."""
        if self.tokens.device == device:
            return self
        mv = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return replace(self, tokens=mv(self.tokens), positions=mv(self.positions), bias=mv(self.bias),
                       row_index=mv(self.row_index))

    @property
    def counts(self) -> list[int]:
        return [b - a for a, b in zip(self.offsets, self.offsets[1:])]

    @classmethod
    def build(cls, seqs: list[int], tokens: list[torch.Tensor], depths: list[torch.Tensor | None],
              masks: list[torch.Tensor | None], starts: list[int], dtype: torch.dtype = torch.float32,
              visible: list[torch.Tensor | None] | None = None) -> "StepBatch":
        """tokens[b]: (n_b,) the new rows of sequence b; depths[b]: (n_b,) their depth below the
        first row (None = 0, 1, 2, ...: a causal block); masks[b]: (n_b, n_b) bool ancestry among
        them (None = causal); visible[b]: (n_b, starts[b]) bool, which of the slots the sequence
        already holds each row may read (None = all of them: the usual case; a draft growing a tree
        over several forwards shows each row only its own ancestors' tentative slots)."""
        visible = [None] * len(seqs) if visible is None else visible
        counts = [t.shape[0] for t in tokens]
        B, T = len(seqs), max(counts)
        S = max(s + n for s, n in zip(starts, counts))
        offsets = [0]
        for n in counts:
            offsets.append(offsets[-1] + n)
        pos = [s + (torch.arange(n) if d is None else d) for s, n, d in zip(starts, counts, depths)]
        plain = B == 1 and masks[0] is None and visible[0] is None
        causal = plain and starts[0] == 0 and T > 1
        bias = None
        if not (plain and (T == 1 or causal)):
            allowed = torch.zeros(B, 1, T, S, dtype=torch.bool)
            for b, (s, n, m, vis) in enumerate(zip(starts, counts, masks, visible)):
                allowed[b, 0, :n, :s] = True if vis is None else vis  # the sequence's own cached slots
                allowed[b, 0, :n, s:s + n] = torch.ones(n, n, dtype=torch.bool).tril_() if m is None else m
                allowed[b, 0, n:, 0] = True  # padding rows: any finite row, their output is dropped
            bias = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
        row_index = None
        if B > 1:
            row_index = torch.cat([b * T + torch.arange(n) for b, n in enumerate(counts)])
        return cls(list(seqs), torch.cat(tokens), torch.cat(pos), offsets, list(starts), bias, row_index,
                   causal, T, S)
