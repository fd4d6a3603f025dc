"""A token-level finite-state machine written in the config: states, transitions on token strings,
accepting states. The seed's language A (B|C) EOS is

    start: 0
    accept: [2]
    transitions: {0: {A: 1}, 1: {B: 2, C: 2}}

Each transition names one token, by its text (it must be a single token of the tokenizer, e.g.
"Yes" or " no") or by its id (an int). EOS is allowed exactly in accepting states; an accepting state
with no transitions is complete (the request ends there, `constraint_complete`). Allowed sets are
packed once per state, so a mask is a copy.
"""
from __future__ import annotations

import torch

from pipeline.core import Constraint, Grammar, UserError
from pipeline.core.bits import pack


class FSM(Grammar):
    kind = "fsm"

    def __init__(self, backbone=None, transitions: dict | None = None, start=0, accept: list | None = None,
                 add_to_prompt: bool = False, vocab_size: int | None = None, eos_ids: list[int] | None = None,
                 tokenizer=None):
        """backbone: gives the tokenizer, vocabulary size and EOS ids (or pass them directly)."""
        self.check(transitions, start, accept)
        self.tokenizer = tokenizer if tokenizer is not None else getattr(backbone, "tokenizer", None)
        self.vocab_size = vocab_size or backbone.model.args.vocab_size
        self.eos_ids = list(eos_ids if eos_ids is not None else backbone.eos_ids)
        self.add_to_prompt = bool(add_to_prompt)
        self.start_state, self.accept = start, set(accept)
        states = list(dict.fromkeys([start, *transitions, *(t for out in transitions.values() for t in out.values()),
                                     *accept]))
        self.index = {s: i for i, s in enumerate(states)}
        self.states = states
        self.next: list[dict[int, int]] = [{} for _ in states]  # state -> token id -> next state
        for src, out in transitions.items():
            for label, dst in out.items():
                tok = self._token(label, src)
                if tok in self.next[self.index[src]]:
                    raise UserError(f"constraint.transitions: state {src!r} has two transitions on token {tok} "
                                    f"({label!r}): an FSM here is deterministic; merge them")
                self.next[self.index[src]][tok] = self.index[dst]
        allowed = torch.zeros(len(states), self.vocab_size, dtype=torch.bool)
        for i, s in enumerate(states):
            allowed[i, list(self.next[i])] = True
            if s in self.accept:
                allowed[i, self.eos_ids] = True
        self.bits = pack(allowed)  # (S, W)
        self.complete = [s in self.accept and not self.next[i] for i, s in enumerate(states)]

    @staticmethod
    def check(transitions=None, start=0, accept=None, **_) -> list[str]:
        """The machine's shape, before anything loads (no warnings to return)."""
        if not isinstance(transitions, dict) or not transitions:
            raise UserError("constraint=fsm needs transitions: constraint.transitions={state: {token: next_state}}")
        for src, out in transitions.items():
            if not isinstance(out, dict):
                raise UserError(f"constraint.transitions[{src!r}] must map token strings to next states, got {out!r}")
        if not isinstance(accept, (list, tuple)) or not accept:
            raise UserError(f"constraint.accept must list the accepting states, got {accept!r}")
        if start not in transitions and start not in accept:
            raise UserError(f"constraint.start {start!r} has no transitions and does not accept: nothing could be "
                            "generated; add its transitions")
        return []

    def _token(self, label, src) -> int:
        if isinstance(label, int) and not isinstance(label, bool):
            tok = label
        else:
            if self.tokenizer is None:
                raise UserError(f"FSM transition {label!r} names a token by text, but no tokenizer was given: "
                                "use token ids")
            ids = self.tokenizer.encode(str(label), add_special_tokens=False)
            if len(ids) != 1:
                raise UserError(f"FSM transition {label!r} from state {src!r} is {len(ids)} tokens {ids}, not one: "
                                "FSM transitions are single tokens; use constraint=regex for strings")
            tok = ids[0]
        if not 0 <= tok < self.vocab_size:
            raise UserError(f"FSM transition token {tok} from state {src!r} is outside the vocabulary "
                            f"(0..{self.vocab_size - 1})")
        return tok

    def start(self) -> Constraint:
        return FSMState(self, [self.index[self.start_state]], [])

    def text(self) -> str:
        return ""


class FSMState(Constraint):
    def __init__(self, fsm: FSM, path: list[int], tokens: list[int]):
        self.fsm, self.path, self.tokens = fsm, path, tokens  # states visited (start first), tokens taken

    def fill(self, bits: torch.Tensor) -> None:
        bits.copy_(self.fsm.bits[self.path[-1]])

    def advance(self, token: int) -> bool:
        nxt = self.fsm.next[self.path[-1]].get(token)
        if nxt is None:
            return False
        self.path.append(nxt)
        self.tokens.append(token)
        return True

    def rollback(self, n: int) -> None:
        if n:
            del self.path[-n:]
            del self.tokens[-n:]

    def fork(self) -> "FSMState":
        return FSMState(self.fsm, list(self.path), list(self.tokens))

    def is_complete(self) -> bool:
        return self.fsm.complete[self.path[-1]]

    def can_end(self) -> bool:
        return self.fsm.states[self.path[-1]] in self.fsm.accept

    def describe(self) -> str:
        tok = self.fsm.tokenizer
        text = tok.decode(self.tokens) if tok is not None else str(self.tokens)
        return f"FSM state {self.fsm.states[self.path[-1]]!r}, text so far {text[-200:]!r}"
