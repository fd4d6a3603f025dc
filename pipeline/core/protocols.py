"""The interface of every role. Components implement these; the core calls only these.

    proposer.propose(states) -> [Tree | None]        drafts per sequence (None = a plain step)
    kv.begin_step(batch) -> plan; model.step(batch with plan, kv) -> hidden (R, dim); kv.end_step(plan)
                                                      one target forward over every live sequence
    target(logits, ...) -> Target                     the processed target distribution, per row
    verifier.verify(tree, p, generator) -> Accepted  which drafts to keep, and the bonus token
    kv.commit(seq, path); proposer.observe(seq, tokens, hidden)
    constraint.fill(bits) / advance(token) / rollback(n) / fork()   per-sequence allowed sets
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol, runtime_checkable

import torch

from pipeline.core.runner import SamplingParams
from pipeline.core.target import Target
from pipeline.core.tree import Tree
from pipeline.core.types import Accepted, DecodeState, KVPlan, StepBatch


class Proposer(ABC):
    """Drafts candidate trees for the target to verify. One instance serves every live sequence of
    a run; per-sequence state is keyed by the sequence id."""

    # True when drafts are sampled from a distribution q that the tree carries (`Tree.q`); False
    # for deterministic drafts (argmax, top-k ranks, lookups), whose q is one-hot
    sampled: bool = False
    # True when `observe` must see the target's state at every prompt position (a draft cache of the
    # prompt): its requests' prompts are then prefilled whole, never taken from a prefix cache
    prompt_states: bool = False

    @property
    def active(self) -> bool:
        """False when the proposer will never draft (e.g. its policy chose plain decoding on this
        machine): the engine then runs plain steps without consulting it."""
        return True

    def start(self, seq: int, prompt_ids: list[int]) -> None:
        """A new sequence begins; `observe` follows with the prompt's hidden states."""

    @abstractmethod
    def propose(self, states: list[DecodeState]) -> list[Tree | None]:
        """For every drafting sequence of a step, in order: the tree to verify after
        `state.tokens[-1]` (the root), or None for a plain step. The engine prunes a tree to
        `state.budget` nodes and depth budget - 1; a proposer should not draft past them. Draft
        forwards of its own must discard their tentative slots."""

    def describe(self) -> dict:
        """What the run reports of it (results.json summary): "tree", the tree shape it drafts, and
        "policy", its sizing decision (components/proposer/policy.py), each where it has one."""
        return {}

    def observe(self, seq: int, tokens: list[int], hidden: torch.Tensor) -> None:
        """Committed tokens and the target's hidden states that chose them: hidden[j] (n, dim) is
        the state whose next-token head gave tokens[j]. After prefill: the prompt's tokens c+1..P-1
        and the first generated one, with the hidden state at every prompt position from c, where c
        is the prefix the KV manager had cached (0 for a proposer with `prompt_states`); after each
        step: the accepted drafts and the bonus token, with the states along the accepted path."""

    def release(self, seq: int) -> None:
        """The sequence finished (or failed): drop its state."""

    def reset(self) -> None:
        """Per-run state starts afresh (`Engine.reset`: each run, a server after its warm-up): what it
        learnt across requests (a cross-request cache) is forgotten, so one run's figures never ride
        on an earlier run's outputs."""


class Verifier(ABC):
    samples: bool = False  # True: may verify drafts under a sampling sampler (else greedy only)

    @abstractmethod
    def verify(self, tree: Tree, p: "Target", generator: torch.Generator | None = None) -> Accepted:
        """p: the processed target distribution at every node (row i = the target's next-token
        distribution after node i); the tree's `q` holds the draft's, when drafts were sampled."""


@runtime_checkable
class LogitsProcessor(Protocol):
    """transformers' one-method protocol. input_ids: the context each row continues (a list of R
    token lists; only built for processors with `needs_input_ids = True`, else None); scores (R, V).
    Returns new scores and never mutates its inputs."""

    def __call__(self, input_ids: list[list[int]] | None, scores: torch.Tensor) -> torch.Tensor: ...


class Sampler(ABC):
    """Chooses tokens from processed scores: greedy (argmax) or sampling."""
    processors: list  # LogitsProcessor, applied in order by the target stage: `shared`, then its own warpers
    shared: list  # the processors every request's rows go through (configured ones: a repetition penalty)
    params: "SamplingParams"  # its own knobs (temperature 0 when greedy)

    @abstractmethod
    def warpers(self, params: "SamplingParams") -> list:
        """The processors that follow `shared` for a request with its own knobs (none when greedy)."""

    @property
    @abstractmethod
    def greedy(self) -> bool: ...

    @abstractmethod
    def choose(self, p: "Target", generators: list[torch.Generator | None]) -> list[int]:
        """One token per row of p."""


class Constraint(ABC):
    """One sequence's automaton state (an FSM, a regex / JSON-schema / grammar matcher): which tokens
    may come next. The target stage masks every row with its sequence's (or tree node's) allowed set;
    the engine advances the state with each committed token and rolls back what a draft walk tried.
    Allowed sets travel packed, as in XGrammar and vLLM: (ceil(V / 32),) int32, bit v % 32 of word
    v // 32 set when token v is allowed. EOS tokens are allowed exactly where the language may end
    and are never passed to `advance` (the engine ends the request on them)."""

    @abstractmethod
    def fill(self, bits: torch.Tensor) -> None:
        """Write the allowed set of the current state into bits (W,) int32 (never mutates state)."""

    @abstractmethod
    def advance(self, token: int) -> bool:
        """Move past `token`; False (state unchanged) when the token is not allowed here."""

    @abstractmethod
    def rollback(self, n: int) -> None:
        """Undo the last n advances (rejected drafts)."""

    @abstractmethod
    def fork(self) -> "Constraint":
        """An independent copy of the state (a beam that splits, a draft walk)."""

    @abstractmethod
    def is_complete(self) -> bool:
        """Nothing but EOS may follow: the output is a whole sentence of the language and ends here."""

    @abstractmethod
    def can_end(self) -> bool:
        """EOS is allowed now: the output so far is a whole sentence (it might still go on)."""

    def describe(self) -> str:
        """The state and the text so far, for the empty-allowed-set error."""
        return "the current state"

    def close(self, bits: torch.Tensor) -> None:
        """Shrink the allowed set bits (W,) of the current state, in place, to the tokens that bring
        the output closest to a complete sentence (used in the last tokens of the budget, the
        closing margin). The default leaves the set as it is: a language without a notion of
        closing has no margin."""


class Grammar(ABC):
    """A compiled constraint (the `constraint` config group): makes one `Constraint` state per
    sequence. `kind` names it in results; `text` is what `add_to_prompt` shows the model."""
    kind: str = "constraint"
    add_to_prompt: bool = False
    close_margin: int = 0  # the last tokens of max_new_tokens in which rows shrink to `Constraint.close`

    @abstractmethod
    def start(self) -> Constraint:
        """The state at the beginning of the generated text."""

    def text(self) -> str:
        return ""


class KVManager(ABC):
    """A pool of per-sequence key/value caches, addressed by sequence id.

    A sequence holds `length(seq)` committed slots followed by `pending(seq)` tentative ones. A step
    writes each sequence's new rows after the slots it holds: `begin_step` makes room and returns
    the step's plan (`KVPlan`, plain data), every layer's `update` writes through it, and
    `end_step(plan)` makes the rows tentative; the manager holds no state of a step in between
    (`pipeline.core.forward_step` runs the three). Then the engine decides:
    `commit(seq)` keeps them all (plain decoding), `commit(seq, keep)` gathers the chosen ones, in
    order, right after the committed prefix and releases the rest (tree verification),
    `discard(seq)` releases them (a draft pass), `truncate(seq, n)` rolls the committed prefix back.
    """

    @abstractmethod
    def create(self, prompt: list[int] | None = None) -> int:
        """A new sequence, empty; or, given the prompt it is made for, holding as committed slots
        the KV of that prompt's longest prefix this manager has cached (`length(seq)`, always
        fewer than len(prompt)): the caller prefills the rest. A manager without a prefix cache
        starts it empty."""

    @abstractmethod
    def fork(self, seq: int) -> int:
        """A new sequence with the same committed prefix as `seq` (sharing its memory where the
        manager can); the two evolve independently afterwards."""

    @abstractmethod
    def free(self, seq: int) -> None:
        """Give the sequence's memory back; its id is dead."""

    @abstractmethod
    def length(self, seq: int) -> int: ...

    @abstractmethod
    def pending(self, seq: int) -> int: ...

    def used(self, seq: int) -> int:
        return self.length(seq) + self.pending(seq)

    @property
    @abstractmethod
    def sequences(self) -> list[int]:
        """Live sequence ids."""

    def batch_order(self, seqs: list[int]) -> list[int]:
        """The order in which a step should list these sequences for the cheapest attention."""
        return list(seqs)

    @abstractmethod
    def begin_step(self, step: StepBatch) -> KVPlan:
        """Make room for every sequence's new rows (grow, allocate, copy-on-write) and say where
        they go and what each sequence reads."""

    @abstractmethod
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: KVPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: (R, nkv, hs) of the step's packed rows. Writes them where `plan` says and returns
        what each sequence attends to, padded: (B, nkv, S, hs) each, slots past a sequence's own
        masked by the step."""

    @abstractmethod
    def end_step(self, plan: KVPlan) -> None:
        """The step's rows become tentative slots."""

    @abstractmethod
    def commit(self, seq: int, keep: list[int] | None = None) -> None:
        """Keep the tentative slots `keep` (indices from the first tentative slot, ascending), or
        all of them (None); release the rest."""

    @abstractmethod
    def discard(self, seq: int) -> None:
        """Release every tentative slot of `seq`."""

    @abstractmethod
    def truncate(self, seq: int, n: int) -> None:
        """Roll the committed prefix back to its first n slots (tentative slots go too)."""

    @abstractmethod
    def gather(self, seq: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The committed keys and values of one sequence and layer, (nkv, length, hs) each, as a
        copy (for tests and debugging, not the hot path)."""

    @abstractmethod
    def stats(self) -> dict:
        """Memory accounting: bytes in use, peak, and the manager's own counters."""

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (and the cache's counters); live sequences keep their slots."""

