"""EAGLE proposer: an EAGLE draft (components/heads/eagle.py) grows a dynamic tree per step (EAGLE-2).

The draft keeps its own KV cache, one sequence of a small KV pool (a manager of the run's `kv`
group, shaped for the one-layer draft) per decoding sequence, holding one slot per committed answer
position, and per prompt position too for a draft trained with prompt
context (`data.context=true`; its checkpoint says `context: prompt`). Each step, for every live
sequence at once (one packed draft forward per depth, `StepBatch` as in the target):

1. the committed pairs (f_t, y_{t+1}) not yet seen, with the target's true features (for an
   EAGLE-3 draft, the states of its fused layers, which the target's forward keeps for it:
   `Transformer.tap`, no extra forward), go into the draft cache; the last row's output is the
   predicted feature of the root, whose LM-head distribution gives the depth-1 candidates (top
   `width`);
2. depth by depth, the `width` nodes of the newest depth with the best cumulative draft
   log-probability are expanded: the draft reads (predicted feature of the parent, node token) as
   one new row per node, attending to the committed slots and to its ancestors' tentative slots
   (written at earlier depths: the step's `visible` slots), and proposes each one's top `width`
   children;
3. all candidates are re-ranked by cumulative log-probability and the best `max_nodes` form the
   tree (a child never scores above its parent, so the kept set is a tree); nodes below `p_min`
   are dropped. The draft's tentative slots are discarded.

With `nodes: auto` the size is chosen per step and per sequence, on this machine's measured cost of
a verification step with n drafts at batch 1 (components/proposer/policy.py, measured once and
cached): the best n by predicted tokens per ms, taking each draft's cumulative draft probability as
its chance of acceptance (EAGLE-2's observation: the draft's confidence is calibrated), 0 (a plain
step) when no n beats plain decoding; and a depth is drafted only while the expanded nodes'
probability mass could pay for their share of the draft forward (the median of the last 16 draft
forwards). The drafting already done is paid even when the step ends plain; the speculation guard
(pipeline/core/guard.py) pauses drafting while trees lose.

Beside a q4 backbone the draft is stored in 4 bits as well (EagleDraft.quantize_for_decoding): a
float32 draft depth costs ~40% of a q4 verification step on a 2-core CPU, a 4-bit one ~6%.

Verification is the target's (any verifier). Drafts are deterministic (top-k), so exact
speculative sampling treats them as one-hot q.
"""
from __future__ import annotations

import heapq
import math
import time
from pathlib import Path
from typing import Callable

import torch

from components.model.assemble import FOUR_BIT
from components.heads.eagle import EagleDraft
from components.proposer.policy import best_prefix, measured_costs
from pipeline.core import DecodeState, KVManager, Proposer, StepBatch, Tree, UserError, forward_step, positive_int

SHIPPED = Path(__file__).resolve().parent.parent / "heads" / "checkpoints"


def shipped_draft(backbone_name: str) -> Path:
    return SHIPPED / backbone_name / "eagle.safetensors"


class _Seq:
    def __init__(self, dseq: int):
        self.dseq = dseq
        self.feats: list[torch.Tensor] = []  # committed pairs not yet in the draft cache
        self.tokens: list[int] = []
        self.fresh = True  # the next observe is the prompt's: all its pairs for a prompt-context draft, else only the last


class EagleProposer(Proposer):
    sampled = False

    def __init__(self, backbone, kv: Callable[..., KVManager], checkpoint: str | None = None, width: int = 6,
                 depth: int = 5, max_nodes: int = 24, p_min: float = 0.0, nodes: str | None = None,
                 min_gain: float = 1.0, batch_size: int = 1):
        """kv: makes the draft's KV pool from its shapes (n_layers, n_kv_heads, head_dim, dtype,
        device): the run's `kv` group, partially applied (pipeline/build.py passes it). batch_size:
        the run's (its steps have batch_size trees: nodes=auto weighs drafts at that size)."""
        if not callable(kv):
            raise TypeError(f"`kv` must make a KV manager (the run's kv group, partially applied), got {kv!r}")
        for name, v in (("width", width), ("depth", depth), ("max_nodes", max_nodes), ("batch_size", batch_size)):
            positive_int(v, f"proposer.{name} (tree.{name})")
        if not isinstance(min_gain, (int, float)) or isinstance(min_gain, bool) or min_gain < 1:
            raise UserError(f"proposer.min_gain must be a number >= 1 (a tree must be predicted at least as fast "
                            f"as a plain step), got {min_gain!r}")
        if nodes not in (None, "auto"):
            raise UserError(f"proposer.nodes must be auto (sized per step on measured costs) or null (always "
                            f"max_nodes), got {nodes!r}")
        if not isinstance(p_min, (int, float)) or isinstance(p_min, bool) or not 0 <= p_min < 1:
            raise UserError(f"proposer.p_min must be a probability in [0, 1), got {p_min}")
        path = Path(checkpoint) if checkpoint else shipped_draft(backbone.name)
        if checkpoint is None and not path.is_file():
            raise UserError(f"no EAGLE draft is shipped for model {backbone.name!r}: train one with "
                            "`python -m pipeline.train heads=eagle` and pass proposer.checkpoint=<run dir>/heads.safetensors")
        self.draft = EagleDraft.load(path, backbone)
        self.context = self.draft.info.get("context") == "prompt"  # the prompt's pairs go into its cache
        if self.draft.fused:  # EAGLE-3: the target's forward keeps the fused layers' states, handed to observe
            model = backbone.model
            if model.taps and model.taps != self.draft.fuse_layers:
                raise UserError(f"draft {path} fuses layers {list(self.draft.fuse_layers)}, and the backbone already keeps "
                                f"layers {list(model.taps)} for another draft: decode with drafts that fuse the same layers")
            model.tap(self.draft.fuse_layers)
        if backbone.model.precision in FOUR_BIT:  # a float32 draft depth costs ~40% of a q4 step here, an int4 one ~6%
            self.draft.quantize_for_decoding(backbone.model.native if backbone.model.precision == "w4a8" else None)
        self.checkpoint_path = path
        self.width, self.depth, self.max_nodes, self.p_min = width, depth, max_nodes, float(p_min)
        a = self.draft.args
        self.kv = kv(n_layers=1, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim,
                     dtype=torch.float32 if self.draft.native is None else torch.bfloat16,
                     device=backbone.model.device)
        self.seqs: dict[int, _Seq] = {}
        self.backbone, self.auto, self.min_gain, self.batch_size = backbone, nodes == "auto", float(min_gain), batch_size
        self.costs: dict[int, float] | None = None  # ms of a verification step by drafts (nodes=auto)
        self.draft_ms: list[float] = []  # the last draft forwards' wall times (nodes=auto)
        self.sized = {"steps": 0, "drafts": 0, "plain": 0}
        if self.auto:
            self._measure()

    @property
    def prompt_states(self) -> bool:
        """A draft trained with prompt context caches every prompt pair: its prompts are prefilled whole."""
        return self.context

    def describe(self) -> dict:
        """Its "tree": the tree it grows, and under nodes=auto how it sized them in this run."""
        spec = {"dynamic": True, "width": self.width, "depth": self.depth, "max_nodes": self.max_nodes,
                "p_min": self.p_min, "checkpoint": str(self.checkpoint_path),
                "draft_storage": self.draft.storage, "draft_context": "prompt" if self.context else "answer",
                "draft_fuse_layers": None if not self.draft.fused else list(self.draft.fuse_layers)}
        if self.auto:
            steps = max(1, self.sized["steps"])
            spec.update(nodes="auto", min_gain=self.min_gain, step_ms_by_drafts=self.costs, sized_for_batch=self.batch_size,
                        mean_drafts=self.sized["drafts"] / steps, plain_step_share=self.sized["plain"] / steps)
        return {"tree": spec}

    def _timed(self, t0: float) -> None:
        """nodes=auto: keep the last 16 draft forwards' times (their median gates deeper drafting)."""
        if self.auto:
            self.draft_ms = [*self.draft_ms[-15:], (time.perf_counter() - t0) * 1e3]

    def _measure(self) -> None:
        """nodes=auto: this machine's cost of a verification step with n drafts (a chain: the cost is
        the rows'), measured once per machine, precision and max_nodes, then cached."""
        chain = [(0,) * k for k in range(1, self.max_nodes + 1)]
        self.costs = measured_costs(self.backbone, chain, 0.0, f"eagle-chain{self.max_nodes}", self.batch_size)

    # --- sequences -------------------------------------------------------------------------------
    def start(self, seq: int, prompt_ids: list[int]) -> None:
        self.release(seq)
        self.seqs[seq] = _Seq(self.kv.create())

    def observe(self, seq: int, tokens: list[int], hidden: torch.Tensor) -> None:
        s = self.seqs.get(seq)
        if s is None or not tokens:
            return
        if s.fresh:  # prefill: every prompt pair for a draft trained with them, else only the first answer pair
            if not self.context:
                tokens, hidden = tokens[-1:], hidden[-1:]
            s.fresh = False
        s.feats.append(hidden[:len(tokens)].float())
        s.tokens += list(tokens)

    def release(self, seq: int) -> None:
        s = self.seqs.pop(seq, None)
        if s is not None:
            self.kv.free(s.dseq)

    # --- drafting ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, states: list[DecodeState]) -> list[Tree | None]:
        out = []
        floor = math.log(self.p_min) if self.p_min > 0 else -math.inf
        for st, t in zip(states, self._grow(states)):  # the best max_nodes candidates by cumulative log-probability
            tree = None if t is None else t.tree(st.tokens[-1], self.max_nodes, floor, self.costs if self.auto else None,
                                                 self.min_gain)
            if self.auto and t is not None and t.depth >= 1:  # a step that could have had a tree
                n = 0 if tree is None else len(tree.tokens) - 1
                self.sized["steps"] += 1
                self.sized["drafts"] += n
                self.sized["plain"] += n == 0
            out.append(tree)
        return out

    @torch.inference_mode()
    def scored(self, states: list[DecodeState]) -> list[list[tuple[tuple[int, ...], float]]]:
        """Every candidate the draft grew for each sequence, as (draft tokens from the root, cumulative
        draft probability), for a proposer that ranks them with other sources' (proposer=hybrid)."""
        floor = math.log(self.p_min) if self.p_min > 0 else -math.inf
        return [[] if t is None else t.scored(floor) for t in self._grow(states)]

    def _grow(self, states: list[DecodeState]) -> list["_Growing | None"]:
        """Each sequence's candidates this step (None where the draft has not seen it yet)."""
        live = [(st, self.seqs[st.seq]) for st in states if st.seq in self.seqs and self.seqs[st.seq].tokens]
        out: dict[int, _Growing | None] = {st.seq: None for st in states}
        if not live:
            return [None] * len(states)
        roots, logp = self._catch_up(live)  # (B, dim), (B, V')
        # per sequence: nodes as (token, parent node, depth, cumulative log p, feature of the parent)
        trees = []
        for b, (st, s) in enumerate(live):
            depth = min(self.depth, self.max_nodes, st.budget - 1)  # max_nodes drafts reach no deeper
            trees.append(_Growing(depth))
            if depth >= 1:
                trees[-1].add_children(0, logp[b], self.width, self.draft.vocab_ids, roots[b])
        committed = {s.dseq: self.kv.length(s.dseq) for _, s in live}
        for d in range(2, self.depth + 1):
            if not self._expand(live, trees, d, committed):
                break
        for _, s in live:
            self.kv.discard(s.dseq)
        for (st, _), t in zip(live, trees):
            out[st.seq] = t
        return [out[st.seq] for st in states]

    def _catch_up(self, live: list) -> tuple[torch.Tensor, torch.Tensor]:
        """The committed (token, feature) pairs of every sequence into the draft cache, in one draft
        forward; its last row per sequence predicts the root's feature. Returns those features (B, dim)
        and the draft's log-probabilities after them (B, V'), on the host."""
        kv, draft = self.kv, self.draft
        batch = StepBatch.build([s.dseq for _, s in live], [torch.tensor(s.tokens) for _, s in live],
                                [None] * len(live), [None] * len(live), [kv.used(s.dseq) for _, s in live])
        t0 = time.perf_counter()
        f = forward_step(draft, kv, batch, torch.cat([torch.cat(s.feats) for _, s in live]))
        roots = f[[o - 1 for o in batch.offsets[1:]]]  # (B, dim)
        for _, s in live:
            kv.commit(s.dseq)
            s.feats, s.tokens = [], []
        logp = torch.log_softmax(draft.logits(roots), dim=-1).cpu()  # (B, V'); on the host: synchronised
        self._timed(t0)
        return roots, logp

    def _expand(self, live: list, trees: list, d: int, committed: dict[int, int]) -> bool:
        """Depth d: expand the best `width` nodes of depth d - 1, all sequences in one draft forward.
        Only the new rows run; each sees the committed slots and the tentative slots its ancestors
        were written to at earlier depths (`visible`), never a cousin's. False when nothing grew."""
        kv, draft = self.kv, self.draft
        grow = [(b, t) for b, t in enumerate(trees) if t.depth >= d and t.frontier(d - 1)]
        picks = [heapq.nlargest(self.width, t.frontier(d - 1), key=lambda n: t.score[n]) for _, t in grow]
        if self.auto and self.draft_ms and grow:  # grow only where the new nodes' mass pays its share of the forward
            share = sorted(self.draft_ms)[len(self.draft_ms) // 2] / len(grow)
            worth = [sum(math.exp(t.score[n]) for n in pick) * self.costs[0] > share for (_, t), pick in zip(grow, picks)]
            grow, picks = [g for g, w in zip(grow, worth) if w], [p for p, w in zip(picks, worth) if w]
        if not grow:
            return False
        t0 = time.perf_counter()
        seqs = [live[b][1].dseq for b, _ in grow]
        starts = [kv.used(q) for q in seqs]
        visible = []
        for (_, t), pick, q, st in zip(grow, picks, seqs, starts):
            base, vis = committed[q], None
            if st > base:  # the committed slots, and of the tentative ones each row's ancestors'
                vis = torch.zeros(len(pick), st, dtype=torch.bool)
                vis[:, :base] = True
                for i, n in enumerate(pick):
                    for a in t.ancestors(n):
                        vis[i, base + t.slot[a]] = True
            visible.append(vis)
            for i, n in enumerate(pick):
                t.slot[n] = st - base + i
        batch = StepBatch.build(
            seqs, [torch.tensor([t.token[n] for n in pick]) for (_, t), pick in zip(grow, picks)],
            [torch.full((len(pick),), committed[q] + d - 2 - st) for q, st, pick in zip(seqs, starts, picks)],
            [torch.eye(len(pick), dtype=torch.bool) for pick in picks], starts, visible=visible)
        f = forward_step(draft, kv, batch, torch.stack([t.parent_feat[n] for (_, t), pick in zip(grow, picks) for n in pick]))
        lp = torch.log_softmax(draft.logits(f), dim=-1).cpu()
        self._timed(t0)
        r = 0
        for (_, t), pick in zip(grow, picks):
            for n in pick:
                t.add_children(n, lp[r], self.width, draft.vocab_ids, f[r])
                r += 1
        return True


class _Growing:
    """A draft tree being grown: node 0 is the root."""

    def __init__(self, depth: int):
        self.depth = depth
        self.token, self.parent, self.depth_of, self.score = [-1], [-1], [0], [0.0]
        self.parent_feat: list[torch.Tensor | None] = [None]  # the predicted feature a node's row reads
        self.by_depth: dict[int, list[int]] = {}
        self.slot: dict[int, int] = {}  # an expanded node's tentative slot in the draft cache (after the committed ones)

    def frontier(self, d: int) -> list[int]:
        return self.by_depth.get(d, [])

    def add_children(self, parent: int, logp: torch.Tensor, k: int, vocab_ids: torch.Tensor, feat: torch.Tensor):
        top = logp.topk(k)
        d = self.depth_of[parent] + 1
        for v, i in zip(top.values.tolist(), top.indices.tolist()):
            n = len(self.token)
            self.token.append(int(vocab_ids[i]))
            self.parent.append(parent)
            self.depth_of.append(d)
            self.score.append(self.score[parent] + v)
            self.parent_feat.append(feat)
            self.by_depth.setdefault(d, []).append(n)

    def tree(self, root: int, max_nodes: int, floor: float, costs: dict[int, float] | None = None,
             min_gain: float = 1.0) -> Tree | None:
        """The best `max_nodes` candidates at or above `floor` (log-probability); with `costs`, the best
        prefix of them by predicted tokens per ms (policy.best_prefix)."""
        cands = [n for n in range(1, len(self.token)) if self.score[n] >= floor]
        ranked = sorted(cands, key=lambda n: (-self.score[n], self.depth_of[n], n))[:max_nodes]
        if costs is not None:
            ranked = ranked[:best_prefix([math.exp(self.score[n]) for n in ranked], costs, min_gain)]
        keep = set(ranked)
        keep = {n for n in keep if all(a in keep for a in self.ancestors(n))}
        if not keep:
            return None
        order = sorted(keep, key=lambda n: (self.depth_of[n], n))
        index = {0: 0, **{n: i + 1 for i, n in enumerate(order)}}
        return Tree.from_parents([root] + [self.token[n] for n in order], [-1] + [index[self.parent[n]] for n in order])

    def scored(self, floor: float) -> list[tuple[tuple[int, ...], float]]:
        """Every candidate at or above `floor` as (its tokens from the root, its cumulative probability)."""
        out = []
        for n in range(1, len(self.token)):
            if self.score[n] >= floor:
                path = [self.token[n]] + [self.token[a] for a in self.ancestors(n)]
                out.append((tuple(path[::-1]), math.exp(self.score[n])))
        return out

    def ancestors(self, n: int):
        """n's ancestors below the root, nearest first."""
        a = self.parent[n]
        while a > 0:
            yield a
            a = self.parent[a]
