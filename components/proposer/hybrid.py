"""Hybrid trees: one tree per step from several drafters, ranked together by estimated acceptance.

Each source gives its candidates as scored paths, (the draft tokens from the root, the estimated
probability that the target accepts the whole path): EAGLE its cumulative draft probability, Medusa
the product of its heads' probabilities along the path, suffix decoding how often the path followed
the matched context (components/proposer/suffix.py). Under a constraint, the tokens the grammar
forces (its allowed set holds one token) come first, a chain of probability 1 drafted at no model
cost: the sources that can draft after given tokens (suffix) continue after it, and the other
sources' drafts that disagree with it are dropped (they could never be accepted).

The candidates merge into one trie: a path two sources propose is one node, estimated at the larger
of their estimates. Nodes are ranked by that estimate; a source's estimate of a path is a product of
probabilities along it, so a child never outranks its parent and a prefix of the ranking is a tree
(ties go to the shallower node). The tree is the best `max_nodes` of them, and with `nodes: auto`
the best prefix of those by predicted tokens per ms on this machine's measured step costs
(components/proposer/policy.py), none (a plain step) when no prefix pays.

Every source drafts deterministically (q one-hot), so the tree is lossless under greedy and exact
verification alike; a source that samples its drafts is refused.
"""
from __future__ import annotations

import functools
import inspect

import torch

from components.proposer.policy import best_prefix, chain_costs
from pipeline.core import DecodeState, Proposer, Tree, UserError, positive_int
from pipeline.core.bits import words

Scored = list[tuple[tuple[int, ...], float]]  # candidates: (draft tokens from the root, estimated acceptance)


def merge(*found: Scored) -> dict[tuple[int, ...], float]:
    """One trie of the candidates of several sources: each path once, at its largest estimate."""
    out: dict[tuple[int, ...], float] = {}
    for scored in found:
        for path, p in scored:
            if p > out.get(path, -1.0):
                out[path] = p
    return out


def ranked_tree(root: int, found: dict[tuple[int, ...], float], max_nodes: int, max_depth: int, p_min: float = 0.0,
                costs: dict[int, float] | None = None, min_gain: float = 1.0) -> Tree | None:
    """The best `max_nodes` candidates with an estimate of at least p_min (above 0) and no deeper than
    max_depth, ranked by estimate (ties: shallower first); with `costs`, the best prefix of them by
    predicted tokens per ms (policy.best_prefix). A node whose parent was cut goes too. None: nothing
    left (a plain step)."""
    ranked = sorted(((path, p) for path, p in found.items() if p > 0 and p >= p_min and len(path) <= max_depth),
                    key=lambda item: (-item[1], len(item[0])))[:max_nodes]
    if costs is not None:
        ranked = ranked[:best_prefix([p for _, p in ranked], costs, min_gain)]
    keep = {path for path, _ in ranked}
    paths = [path for path, _ in sorted(ranked, key=lambda item: len(item[0]))  # parents first, by rank
             if all(path[:d] in keep for d in range(1, len(path)))]
    return Tree.from_paths(root, paths) if paths else None


def forced_tokens(constraint, vocab_size: int, limit: int) -> list[int]:
    """The tokens a constraint forces from its current state, at most `limit`: while its allowed set
    holds exactly one token, that token (never EOS: the engine ends the request on it). Read on a
    fork, made only once a token is forced: the state itself never moves."""
    if constraint is None or limit < 1:
        return []
    bits = torch.zeros(words(vocab_size), dtype=torch.int32)
    c, out = constraint, []
    while len(out) < limit and not c.is_complete():
        c.fill(bits)
        nz = bits.nonzero().flatten()
        if nz.numel() != 1:
            break
        word = int(bits[nz[0]]) & 0xFFFFFFFF
        if word & (word - 1):  # more than one bit in the word
            break
        tok = 32 * int(nz[0]) + word.bit_length() - 1
        if c is constraint:
            c = constraint.fork()
        if not c.advance(tok):  # EOS (or a token the state refuses after all): the chain ends
            break
        out.append(tok)
    return out


class HybridProposer(Proposer):
    sampled = False

    def __init__(self, backbone=None, kv=None, sources=("eagle", "suffix"), eagle=None, medusa=None, suffix=None,
                 max_nodes: int = 16, p_min: float = 0.0, nodes: str | None = None, min_gain: float = 1.0,
                 batch_size: int = 1, forced: int = 16):
        """sources: the names of the drafters to rank together, each given as its own option (eagle,
        medusa, suffix: a proposer, or a partial that takes the live backbone and, where it keeps a
        draft cache, the run's kv group). max_nodes: drafts per step at most; p_min: candidates whose
        estimate is below it are dropped; nodes: auto = per step, the best prefix of the ranking by
        predicted tokens per ms on this machine's step costs (measured with `backbone`), null = the
        best max_nodes; forced: under a constraint, how many forced tokens to draft at most (0: none)."""
        options = {"eagle": eagle, "medusa": medusa, "suffix": suffix}
        names = None if isinstance(sources, str) else [str(n) for n in sources]  # a list (Hydra's ListConfig)
        if not names or len(set(names)) != len(names) or any(n not in options or options[n] is None for n in names):
            known = sorted(n for n, o in options.items() if o is not None)
            raise UserError(f"proposer.sources must list distinct drafters among {known}, got {sources!r}")
        for name, v in (("max_nodes", max_nodes), ("batch_size", batch_size)):
            positive_int(v, f"proposer.{name}")
        if not isinstance(forced, int) or isinstance(forced, bool) or forced < 0:
            raise UserError(f"proposer.forced must be an int >= 0 (forced tokens drafted per step), got {forced!r}")
        if not isinstance(p_min, (int, float)) or isinstance(p_min, bool) or not 0 <= p_min < 1:
            raise UserError(f"proposer.p_min must be a probability in [0, 1), got {p_min}")
        if nodes not in (None, "auto"):
            raise UserError(f"proposer.nodes must be auto (sized per step on measured costs) or null (always "
                            f"max_nodes), got {nodes!r}")
        if not isinstance(min_gain, (int, float)) or isinstance(min_gain, bool) or min_gain < 1:
            raise UserError(f"proposer.min_gain must be a number >= 1, got {min_gain!r}")
        self.sources: dict[str, Proposer] = {}
        for name in names:
            src = options[name]
            if isinstance(src, functools.partial):
                takes_kv = "kv" in inspect.signature(src.func).parameters
                src = src(backbone=backbone, **({"kv": kv} if takes_kv else {}))
            if not isinstance(src, Proposer) or not callable(getattr(src, "scored", None)):
                raise UserError(f"hybrid source {name!r} ({type(src).__name__}) gives no scored candidates: "
                                f"the hybrid ranks {sorted(options)}")
            if src.sampled:
                raise UserError(f"hybrid source {name!r} samples its drafts: a hybrid tree is verified as deterministic "
                                "drafts (one-hot q), which would not be lossless; use a deterministic source")
            self.sources[name] = src
        self.ahead = {name: "ahead" in inspect.signature(src.scored).parameters for name, src in self.sources.items()}
        self.max_nodes, self.p_min, self.min_gain, self.forced = max_nodes, float(p_min), float(min_gain), forced
        self.costs = chain_costs(backbone, max_nodes, batch_size) if nodes == "auto" else None
        self.sized = {"steps": 0, "drafts": 0, "plain": 0, "forced": 0}

    @property
    def active(self) -> bool:
        return any(src.active for src in self.sources.values())

    @property
    def prompt_states(self) -> bool:
        return any(src.prompt_states for src in self.sources.values())

    def describe(self) -> dict:
        """Its "tree": each source's own, and how the merged trees were sized in this run."""
        steps = max(1, self.sized["steps"])
        return {"tree": {"hybrid": True, "sources": {n: s.describe().get("tree") for n, s in self.sources.items()},
                         "max_nodes": self.max_nodes, "p_min": self.p_min, "forced": self.forced,
                         "nodes": "auto" if self.costs is not None else None, "min_gain": self.min_gain,
                         "step_ms_by_drafts": self.costs, "mean_drafts": self.sized["drafts"] / steps,
                         "plain_step_share": self.sized["plain"] / steps,
                         "mean_forced": self.sized["forced"] / steps}}

    def start(self, seq: int, prompt_ids: list[int]) -> None:
        for src in self.sources.values():
            src.start(seq, prompt_ids)

    def observe(self, seq: int, tokens: list[int], hidden: torch.Tensor) -> None:
        for src in self.sources.values():
            src.observe(seq, tokens, hidden)

    def release(self, seq: int) -> None:
        for src in self.sources.values():
            src.release(seq)

    def reset(self) -> None:
        for source in self.sources.values():
            source.reset()

    def propose(self, states: list[DecodeState]) -> list[Tree | None]:
        forced = [forced_tokens(st.constraint, st.model.args.vocab_size, min(self.forced, st.budget - 1))
                  if st.constraint is not None else [] for st in states]
        found: list[list[Scored]] = [[[(tuple(f[:d]), 1.0) for d in range(1, len(f) + 1)]] for f in forced]
        for name, src in self.sources.items():
            if not src.active:
                continue
            if self.ahead[name]:  # drafts after the forced tokens
                scored = src.scored(states, forced)
            else:  # drafts from the root: only those that agree with the forced tokens can be accepted
                scored = [[(path, p) for path, p in sc if path[:len(f)] == tuple(f[:len(path)])]
                          for sc, f in zip(src.scored(states), forced)]
            for mine, sc in zip(found, scored):
                mine.append(sc)
        out = []
        for st, f, mine in zip(states, forced, found):
            tree = ranked_tree(st.tokens[-1], merge(*mine), self.max_nodes, st.budget - 1, self.p_min, self.costs,
                               self.min_gain)
            n = 0 if tree is None else tree.size - 1
            self.sized["steps"] += 1
            self.sized["drafts"] += n
            self.sized["plain"] += n == 0
            self.sized["forced"] += len(f)
            out.append(tree)
        return out
