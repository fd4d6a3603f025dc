"""ContiguousKV: the KV manager contract (components/kv/base.py), unit by unit, then the issue's
soak test: hundreds of random tree steps on the tiny model with no leaked slot and a committed cache
equal to plain decoding of the committed tokens."""
from __future__ import annotations

import random

import pytest
import torch

from components.kv.contiguous import ContiguousKV
from pipeline.tree import Tree

L, NKV, HS = 3, 2, 4


def make(max_len=64, batch=1):
    kv = ContiguousKV(None, max_len, L, NKV, HS, torch.float32)
    kv.allocate(batch, max_len)
    return kv


def write(kv, values: list[float], layers=None, batch=1):
    """One 'forward' of len(values) tokens: slot t of every layer/head gets keys = value,
    values = -value (layer-offset so layers are distinguishable)."""
    T = len(values)
    base = torch.tensor(values, dtype=torch.float32).view(1, 1, T, 1).expand(batch, NKV, T, HS)
    for layer in range(L) if layers is None else layers:
        kv.update(layer, base + 1000 * layer, -(base + 1000 * layer))
    kv.advance(T)


def committed(kv, layer=0) -> list[float]:
    k, v = kv.keys_values(layer)
    assert k.shape == (kv.batch, NKV, kv.length, HS) and v.shape == k.shape
    assert torch.equal(v, -k)
    assert bool((k == k[:, :1, :, :1]).all()), "heads/features of one slot must agree"
    return (k[0, 0, :, 0] - 1000 * layer).tolist()


def test_update_returns_cached_plus_new_and_advance_marks_pending():
    kv = make()
    write(kv, [1, 2])
    kv.commit()
    k, v = kv.update(0, torch.full((1, NKV, 3, HS), 7.0), torch.full((1, NKV, 3, HS), -7.0))
    assert k.shape == (1, NKV, 5, HS)  # used + T
    assert k[0, 0, :, 0].tolist() == [1, 2, 7, 7, 7]
    for layer in range(1, L):
        kv.update(layer, torch.zeros(1, NKV, 3, HS), torch.zeros(1, NKV, 3, HS))
    kv.advance(3)
    assert (kv.length, kv.pending, kv.used, kv.slots_in_use) == (2, 3, 5, 5)


def test_commit_all():
    kv = make()
    write(kv, [1, 2, 3])
    assert (kv.length, kv.pending) == (0, 3)
    kv.commit()
    assert (kv.length, kv.pending, kv.slots_in_use) == (3, 0, 3)
    write(kv, [4])
    kv.commit()
    for layer in range(L):
        assert committed(kv, layer) == [1, 2, 3, 4]


@pytest.mark.parametrize("keep", [[0, 2, 5], [1, 2, 3], [5], [0], [0, 1, 2, 3, 4, 5], [3, 4, 5]])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_commit_keep_gathers_in_order_and_releases_the_rest(keep, as_tensor):
    kv = make()
    write(kv, [10, 11])
    kv.commit()
    tentative = [20, 21, 22, 23, 24, 25]
    write(kv, tentative)
    kv.commit(torch.tensor(keep) if as_tensor else keep)
    assert kv.pending == 0
    assert kv.length == 2 + len(keep)
    assert kv.slots_in_use == kv.length
    for layer in range(L):
        assert committed(kv, layer) == [10, 11] + [tentative[i] for i in keep]
    # the released slots are really free: the next forward lands right after the kept ones
    write(kv, [99])
    kv.commit()
    assert committed(kv, 1) == [10, 11] + [tentative[i] for i in keep] + [99]


def test_commit_keep_nothing():
    kv = make()
    write(kv, [1])
    kv.commit()
    write(kv, [2, 3])
    kv.commit([])
    assert (kv.length, kv.pending, kv.slots_in_use) == (1, 0, 1)
    assert committed(kv) == [1]


def test_discard_releases_every_tentative_slot():
    kv = make()
    write(kv, [1, 2])
    kv.commit()
    write(kv, [3, 4, 5])
    kv.discard()
    assert (kv.length, kv.pending, kv.slots_in_use) == (2, 0, 2)
    write(kv, [6])
    kv.commit()
    assert committed(kv, 2) == [1, 2, 6]


def test_draft_on_a_subset_of_layers_then_discard():
    """A self-spec draft writes only some layers' tentative slots and must leave no trace."""
    kv = make()
    write(kv, [1, 2])
    kv.commit()
    write(kv, [50, 51], layers=[0])
    kv.discard()
    write(kv, [3])
    kv.commit()
    for layer in range(L):
        assert committed(kv, layer) == [1, 2, 3]


def test_truncate():
    kv = make()
    write(kv, [1, 2, 3, 4])
    kv.commit()
    write(kv, [5])
    kv.truncate(2)
    assert (kv.length, kv.pending, kv.slots_in_use) == (2, 0, 2)
    assert committed(kv) == [1, 2]
    kv.truncate(2)  # to its own length: a no-op
    kv.truncate(0)
    assert kv.length == 0 and kv.slots_in_use == 0
    write(kv, [7])
    kv.commit()
    assert committed(kv) == [7]


@pytest.mark.parametrize("n", [-1, 2, 10])
def test_truncate_errors(n):
    kv = make()
    write(kv, [1])
    kv.commit()
    write(kv, [2, 3])  # tentative slots do not count: only the committed prefix can be kept
    with pytest.raises(ValueError, match="truncate"):
        kv.truncate(n)


def test_fork_is_independent():
    kv = make()
    write(kv, [1, 2, 3])
    kv.commit()
    other = kv.fork()
    assert other.length == 3 and other.pending == 0 and other.slots_in_use == 3
    assert committed(other) == [1, 2, 3]
    write(other, [40, 41])
    other.commit([1])
    write(kv, [50])
    kv.commit()
    assert committed(kv) == [1, 2, 3, 50]
    assert committed(other) == [1, 2, 3, 41]
    kv.truncate(1)
    other.free()
    assert committed(kv) == [1]
    assert kv.slots_in_use == 1 and other.slots_in_use == 0


def test_free_and_reallocate():
    kv = make()
    write(kv, [1, 2])
    kv.commit()
    write(kv, [3])
    kv.free()
    assert kv.slots_in_use == 0 and kv.length == 0 and kv.pending == 0
    kv.allocate(1, 8)
    assert kv.slots_in_use == 0
    write(kv, [5])
    kv.commit()
    assert committed(kv) == [5]


def test_allocate_resets_a_reused_cache():
    kv = make()
    write(kv, [1, 2, 3])
    kv.commit()
    write(kv, [4])
    kv.allocate(1, 16)
    assert (kv.length, kv.pending, kv.slots_in_use) == (0, 0, 0)


def test_batch_slots_and_overflow():
    kv = make(max_len=8, batch=2)
    write(kv, [1, 2, 3], batch=2)
    assert kv.slots_in_use == 2 * 3
    kv.commit()
    assert kv.keys_values(0)[0].shape == (2, NKV, 3, HS)
    with pytest.raises(RuntimeError, match="full"):
        kv.update(0, torch.zeros(2, NKV, 6, HS), torch.zeros(2, NKV, 6, HS))


def test_from_backbone_shapes(tiny_backbone):
    a = tiny_backbone.model.args
    kv = ContiguousKV(tiny_backbone, max_len=32)
    kv.allocate(1, 40)
    assert len(kv.k) == a.n_layers and kv.k[0].shape == (1, a.n_kv_heads, 40, a.head_dim)
    assert kv.k[0].dtype == tiny_backbone.model.dtype
    with pytest.raises(ValueError, match="max_len"):
        ContiguousKV(tiny_backbone, max_len=0)


def random_tree(rng: random.Random, root: int, vocab: int, max_nodes: int) -> Tree:
    n = rng.randint(1, max_nodes)
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    tokens = [root] + [rng.randrange(vocab) for _ in range(1, n)]
    return Tree.from_parents(tokens, parents)


@torch.inference_mode()
def test_random_tree_steps_leak_nothing_and_match_plain_decoding(tiny_backbone):
    """300 steps, each writing a random tree of tentative tokens (root = the pending token, as the
    decoder does) and committing a random root path. Some steps first run a layer-subset draft that
    is discarded, some are plain one-token steps. After every step nothing tentative survives; at the
    end every layer's committed keys/values equal a fresh cache fed the committed tokens one by one."""
    model = tiny_backbone.model
    vocab = model.args.vocab_size
    rng = random.Random(1234)
    kv = ContiguousKV(tiny_backbone, max_len=4096)
    kv.allocate(1, 4096)
    prompt = [rng.randrange(vocab) for _ in range(5)]
    model(torch.tensor([prompt]), torch.arange(len(prompt))[None], kv)
    kv.commit()
    tokens = list(prompt)  # committed tokens: their keys/values are in the cache
    root = rng.randrange(vocab)  # pending: chosen, not yet in the cache
    for step in range(300):
        P = kv.length
        if rng.random() < 0.2:  # a draft pass over a subset of layers, thrown away
            model(torch.tensor([[root]]), torch.tensor([[P]]), kv, layers=[0])
            kv.discard()
            assert kv.used == P
        if rng.random() < 0.1:  # a plain step
            model(torch.tensor([[root]]), torch.tensor([[P]]), kv)
            kv.commit()
            tokens.append(root)
        else:
            tree = random_tree(rng, root, vocab, max_nodes=12)
            model(tree.tokens[None], tree.positions(P), kv, tree.attention_mask(P))
            assert kv.pending == tree.size
            path = tree.path_to(rng.randrange(tree.size))
            kv.commit(path)
            tokens += tree.tokens[path].tolist()
        root = rng.randrange(vocab)
        assert kv.pending == 0, f"step {step}: {kv.pending} tentative slots leaked"
        assert kv.slots_in_use == kv.length == len(tokens), f"step {step}"

    ref = ContiguousKV(tiny_backbone, max_len=4096)
    ref.allocate(1, 4096)
    for i, t in enumerate(tokens):
        model(torch.tensor([[t]]), torch.tensor([[i]]), ref)
        ref.commit()
    assert ref.length == kv.length
    for layer in range(model.args.n_layers):
        k, v = kv.keys_values(layer)
        rk, rv = ref.keys_values(layer)
        torch.testing.assert_close(k, rk, rtol=1e-5, atol=1e-5, msg=f"layer {layer} keys")
        torch.testing.assert_close(v, rv, rtol=1e-5, atol=1e-5, msg=f"layer {layer} values")
