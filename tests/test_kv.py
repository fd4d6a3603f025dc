"""The KV manager contract (`pipeline.core.KVManager`), run over every option of conf/kv: a new KV
manager is tested by adding its YAML. Each manager is checked against a naive per-sequence copy
(a list of slots per sequence) under scripted and random sequences of create / fork / step /
commit / discard / truncate / free; pools must never leak memory or go negative."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pipeline.cli
from pipeline.build import component
from pipeline.core import StepBatch, Tree, forward_rows

from helpers import compose_config

L, NKV, HS = 2, 2, 4
OPTIONS = pipeline.cli.groups()["kv"]
SMALL = {"paged": ["kv.block_size=4", "kv.num_blocks=2"]}  # small blocks and pool: every path is taken


def fake_backbone():
    args = SimpleNamespace(n_layers=L, n_kv_heads=NKV, head_dim=HS)
    return SimpleNamespace(model=SimpleNamespace(args=args, attn_dtype=torch.float32, device=torch.device("cpu")))


def make(option: str, backbone=None, extra=()):
    cfg = compose_config([f"kv={option}", *SMALL.get(option, []), *extra])
    return component(cfg.kv, backbone or fake_backbone())


class Reference:
    """The naive model: every sequence is a list of committed slots and a list of pending ones, each
    slot a (L, 2, NKV, HS) tensor."""

    def __init__(self):
        self.committed: dict[int, list[torch.Tensor]] = {}
        self.pending: dict[int, list[torch.Tensor]] = {}


def step(kv, ref: Reference, seqs: list[int], counts: list[int], gen: torch.Generator):
    """Write `counts[b]` new rows to each sequence through begin_step / update / end_step, checking
    what every layer's update returns against the reference."""
    toks = [torch.zeros(n, dtype=torch.long) for n in counts]
    batch = StepBatch.build(seqs, toks, [None] * len(seqs), [None] * len(seqs), [kv.used(s) for s in seqs])
    kvals = torch.randn(L, 2, sum(counts), NKV, HS, generator=gen)
    plan = kv.begin_step(batch)
    assert plan.seqs == seqs and plan.counts == counts and plan.span == batch.span
    for layer in range(L):
        K, V = kv.update(layer, kvals[layer, 0], kvals[layer, 1], plan)
        assert K.shape == V.shape == (len(seqs), NKV, batch.span, HS)
        for b, s in enumerate(seqs):
            o, n = batch.offsets[b], counts[b]
            old = ref.committed[s] + ref.pending[s]
            want = torch.stack([x[layer] for x in old] + list(kvals[layer, :, o:o + n].unbind(1)))  # (used + n, 2, NKV, HS)
            used = len(old) + n
            torch.testing.assert_close(K[b, :, :used], want[:, 0].transpose(0, 1), rtol=0, atol=0)
            torch.testing.assert_close(V[b, :, :used], want[:, 1].transpose(0, 1), rtol=0, atol=0)
    kv.end_step(plan)
    for b, s in enumerate(seqs):
        o = batch.offsets[b]
        ref.pending[s] += list(kvals[:, :, o:o + counts[b]].permute(2, 0, 1, 3, 4).unbind(0))


def check(kv, ref: Reference):
    assert sorted(kv.sequences) == sorted(ref.committed)
    for s in ref.committed:
        assert kv.length(s) == len(ref.committed[s]) and kv.pending(s) == len(ref.pending[s])
        for layer in range(L):
            k, v = kv.gather(s, layer)
            want = torch.stack([x[layer] for x in ref.committed[s]]) if ref.committed[s] else torch.zeros(0, 2, NKV, HS)
            torch.testing.assert_close(k, want[:, 0].transpose(0, 1), rtol=0, atol=0)
            torch.testing.assert_close(v, want[:, 1].transpose(0, 1), rtol=0, atol=0)
    if hasattr(kv, "ref"):  # a paged pool: reference counts are exactly the block tables' holdings
        held = [0] * len(kv.ref)
        for table in kv.tables.values():
            for b in table:
                held[b] += 1
        assert kv.ref == held
        assert min(kv.ref) >= 0
        assert sorted(kv._free) == [b for b, r in enumerate(kv.ref) if r == 0]


def run_ops(kv, ops: list[tuple[int, int, int]], seed: int):
    """Interpret (op, a, b) triples against the manager and the reference, checking after each."""
    ref, gen, rng = Reference(), torch.Generator().manual_seed(seed), random.Random(seed)
    for op, a, b in ops:
        live = list(ref.committed)
        if op == 0 or not live:  # create
            s = kv.create()
            ref.committed[s], ref.pending[s] = [], []
        elif op == 1:  # a step over up to three sequences
            seqs = rng.sample(live, min(len(live), 1 + a % 3))
            step(kv, ref, seqs, [1 + (b + i) % 5 for i in range(len(seqs))], gen)
        elif op == 2:  # commit: all, or a random ascending subset of the pending slots
            s = live[a % len(live)]
            p = len(ref.pending[s])
            if b % 2:
                kv.commit(s)
                ref.committed[s] += ref.pending[s]
            else:
                keep = sorted(rng.sample(range(p), rng.randint(0, p)))
                kv.commit(s, keep)
                ref.committed[s] += [ref.pending[s][i] for i in keep]
            ref.pending[s] = []
        elif op == 3:  # fork
            s = live[a % len(live)]
            new = kv.fork(s)
            ref.committed[new], ref.pending[new] = list(ref.committed[s]), []
        elif op == 4:  # discard
            s = live[a % len(live)]
            kv.discard(s)
            ref.pending[s] = []
        elif op == 5:  # truncate
            s = live[a % len(live)]
            n = b % (len(ref.committed[s]) + 1)
            kv.truncate(s, n)
            ref.committed[s], ref.pending[s] = ref.committed[s][:n], []
        else:  # free
            s = live[a % len(live)]
            kv.free(s)
            del ref.committed[s], ref.pending[s]
        check(kv, ref)
    for s in list(ref.committed):
        kv.free(s)
    assert kv.sequences == [] and kv.stats()["bytes_in_use"] == 0
    if hasattr(kv, "ref"):
        assert kv.blocks_in_use == 0 and all(r == 0 for r in kv.ref)


@pytest.mark.parametrize("option", OPTIONS)
def test_thousand_random_operations_leak_nothing(option):
    rng = random.Random(0)
    ops = [(rng.choice([0, 1, 1, 1, 2, 2, 3, 4, 5, 6]), rng.randrange(100), rng.randrange(100)) for _ in range(1000)]
    run_ops(make(option), ops, seed=0)


@pytest.mark.parametrize("option", OPTIONS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 99), st.integers(0, 99)), max_size=40),
       seed=st.integers(0, 2 ** 16))
def test_random_operations_match_a_naive_copy(option, ops, seed):
    run_ops(make(option), ops, seed)


@pytest.mark.parametrize("option", OPTIONS)
def test_commit_keep_gathers_in_order_and_releases_the_rest(option):
    kv, ref, gen = make(option), Reference(), torch.Generator().manual_seed(1)
    s = kv.create()
    ref.committed[s], ref.pending[s] = [], []
    step(kv, ref, [s], [3], gen)
    kv.commit(s)
    ref.committed[s] += ref.pending[s]
    ref.pending[s] = []
    step(kv, ref, [s], [6], gen)
    kv.commit(s, [0, 2, 5])
    ref.committed[s] += [ref.pending[s][i] for i in (0, 2, 5)]
    ref.pending[s] = []
    check(kv, ref)
    assert kv.length(s) == 6 and kv.pending(s) == 0


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("keep", [[1, 0], [0, 0], [-1], [7]])
def test_bad_keep_is_refused(option, keep):
    kv, ref = make(option), Reference()
    s = kv.create()
    ref.committed[s], ref.pending[s] = [], []
    step(kv, ref, [s], [3], torch.Generator())
    with pytest.raises(ValueError, match="keep"):
        kv.commit(s, keep)


@pytest.mark.parametrize("option", OPTIONS)
def test_truncate_beyond_length_and_dead_sequences_are_refused(option):
    kv = make(option)
    s = kv.create()
    with pytest.raises(ValueError, match="truncate"):
        kv.truncate(s, 1)
    kv.free(s)
    with pytest.raises(KeyError):
        kv.commit(s)


@pytest.mark.parametrize("option", OPTIONS)
def test_random_tree_steps_through_the_model_match_plain_decoding(option, tiny_backbone):
    """300 tree steps with random trees and random accepted paths: after each commit the cache holds
    exactly the keys plain decoding of the accepted tokens would have written."""
    model, rng = tiny_backbone.model, random.Random(0)
    kv = make(option, tiny_backbone)
    seq = kv.create()
    tokens = [rng.randrange(1000) for _ in range(5)]
    with torch.inference_mode():
        forward_rows(model, kv, seq, torch.tensor(tokens[:-1]))
        kv.commit(seq)
        for _ in range(300):
            n = rng.randint(1, 6)
            parents = [-1] + [rng.randrange(i) for i in range(1, n)]
            tree = Tree.from_parents([tokens[-1]] + [rng.randrange(1000) for _ in range(n - 1)], parents)
            forward_rows(model, kv, seq, tree.tokens, tree.depth, tree.mask)
            assert kv.pending(seq) == n
            path = tree.path_to(rng.randrange(n))
            kv.commit(seq, path)
            tokens += tree.tokens[path[1:]].tolist() + [rng.randrange(1000)]
            assert kv.pending(seq) == 0 and kv.length(seq) == len(tokens) - 1
        plain = make(option, tiny_backbone)
        ref_seq = plain.create()
        forward_rows(model, plain, ref_seq, torch.tensor(tokens[:-1]))
        plain.commit(ref_seq)
        for layer in range(model.args.n_layers):
            for a, b in zip(kv.gather(seq, layer), plain.gather(ref_seq, layer)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    kv.free(seq)
    assert kv.stats()["bytes_in_use"] == 0


def test_paged_forks_share_the_prompt():
    """Four sequences forked from one 500-token prompt, each then decoding 20 tokens of its own,
    hold less than 1.3x the bytes of one sequence; the shared partly filled block is copied on write."""
    bb = SimpleNamespace(model=SimpleNamespace(args=SimpleNamespace(n_layers=30, n_kv_heads=3, head_dim=64),
                                               attn_dtype=torch.float32, device=torch.device("cpu")))
    kv = make("paged", bb, ["kv.block_size=16", "kv.num_blocks=64"])
    root = kv.create()
    batch = StepBatch.build([root], [torch.zeros(500, dtype=torch.long)], [None], [None], [0])
    kv.end_step(kv.begin_step(batch))  # the slots exist; their values do not matter here
    kv.commit(root)
    one = kv.stats()["bytes_in_use"]
    forks = [kv.fork(root) for _ in range(3)]
    for _ in range(20):
        for s in [root, *forks]:
            batch = StepBatch.build([s], [torch.zeros(1, dtype=torch.long)], [None], [None], [kv.used(s)])
            kv.end_step(kv.begin_step(batch))
            kv.commit(s)
    stats = kv.stats()
    single = -(-520 // 16) * 16 * kv.slot_bytes  # one sequence of 520 tokens, alone
    assert stats["bytes_in_use"] <= 1.3 * single, stats
    assert stats["cow_copies"] == 3 and stats["shared_blocks"] == 31
    assert one == 32 * 16 * kv.slot_bytes
    for s in [root, *forks]:
        kv.free(s)
    assert kv.stats()["blocks_in_use"] == 0


def test_contiguous_batch_in_consecutive_slots_is_a_view():
    kv = make("contiguous")
    seqs = [kv.create() for _ in range(3)]
    assert kv.batch_order(list(reversed(seqs))) == seqs
    batch = StepBatch.build(seqs, [torch.zeros(2, dtype=torch.long)] * 3, [None] * 3, [None] * 3, [0, 0, 0])
    plan = kv.begin_step(batch)
    K, _ = kv.update(0, torch.zeros(6, NKV, HS), torch.zeros(6, NKV, HS), plan)
    assert K.data_ptr() == kv.buf[0, 0].data_ptr()  # no copy
    kv.end_step(plan)


@pytest.mark.parametrize("option", OPTIONS)
def test_a_plan_is_all_a_step_needs(option):
    """`update` and `end_step` read nothing but their arguments: two steps begun before either ends
    (disjoint sequences, as a draft pass next to a target step) write and read what each would alone,
    the second's begin_step growing the pool under the first's plan."""
    kv, ref, gen = make(option), Reference(), torch.Generator().manual_seed(0)
    a, b = kv.create(), kv.create()
    for s in (a, b):
        ref.committed[s], ref.pending[s] = [], []
    step(kv, ref, [a], [2], gen)
    kv.commit(a)
    ref.committed[a], ref.pending[a] = ref.pending[a], []
    pa = kv.begin_step(StepBatch.build([a], [torch.zeros(3, dtype=torch.long)], [None], [None], [2]))
    pb = kv.begin_step(StepBatch.build([b], [torch.zeros(9, dtype=torch.long)], [None], [None], [0]))
    new = {a: torch.randn(L, 3, NKV, HS, generator=gen), b: torch.randn(L, 9, NKV, HS, generator=gen)}
    for layer in range(L):
        Kb, _ = kv.update(layer, new[b][layer], new[b][layer], pb)
        Ka, _ = kv.update(layer, new[a][layer], new[a][layer], pa)
        want = torch.cat((torch.stack([x[layer, 0] for x in ref.committed[a]]), new[a][layer]))  # (5, NKV, HS)
        torch.testing.assert_close(Ka[0, :, :5], want.transpose(0, 1), rtol=0, atol=0)
        torch.testing.assert_close(Kb[0, :, :9], new[b][layer].transpose(0, 1), rtol=0, atol=0)
    kv.end_step(pb)
    kv.end_step(pa)
    assert (kv.pending(a), kv.pending(b)) == (3, 9)
    for s in (a, b):
        kv.commit(s)
        ref.committed[s] += [torch.stack((x, x), 1) for x in new[s].unbind(1)]  # (L, 2, NKV, HS) per slot
    check(kv, ref)
