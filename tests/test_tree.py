"""Tree speculation core: packed tree attention (seed 000's experiment), one packed tree forward
against every branch run alone (hypothesis), the toy greedy verification case, StaticTree."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from components.kv.contiguous import ContiguousKV
from components.model.llama import attention as our_attention
from components.model.load import tiny
from components.verifier.greedy import GreedyVerifier
from pipeline.core import StaticTree, StepBatch, Target, Tree, forward_rows

from helpers import compose_config

# ---------------------------------------------------------------------------------------------
# (a) the seed experiment: packed attention with an ancestry mask == per-branch reference
# ---------------------------------------------------------------------------------------------

SEED_TOKENS = [4, 9, 5, 7, 0, 6, 8, 1]
SEED_PARENTS = [-1, -1, 0, 0, 1, 2, 3, 4]  # two top-level candidates (4 and 9), no shared root
SEED_P = 2


def rotate_half(x):
    return torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)


def rope(x, positions, base=10_000.0):
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=x.dtype) / d)
    angles = positions.to(x.dtype)[..., None] * inv
    cos = torch.repeat_interleave(angles.cos(), 2, -1)
    sin = torch.repeat_interleave(angles.sin(), 2, -1)
    return x * cos + rotate_half(x) * sin


def ancestor_path(node, parents):
    path = []
    while node != -1:
        path.append(node)
        node = parents[node]
    return path[::-1]


def seed_tree_mask(parents, prefix_length):
    n = len(parents)
    mask = torch.zeros(n, prefix_length + n, dtype=torch.bool)
    mask[:, :prefix_length] = True
    for node in range(n):
        mask[node, prefix_length + torch.tensor(ancestor_path(node, parents))] = True
    return mask


def packed_attention(q, bk, bv, ck, cv, mask):
    k, v = torch.cat((bk, ck), -2), torch.cat((bv, cv), -2)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return torch.softmax(scores.masked_fill(~mask, -torch.inf), -1) @ v


def branch_reference(q, bk, bv, ck, cv, parents):
    out = []
    for node in range(len(parents)):
        path = torch.tensor(ancestor_path(node, parents))
        k = torch.cat((bk, ck.index_select(-2, path)), -2)
        v = torch.cat((bv, cv.index_select(-2, path)), -2)
        scores = q[..., node:node + 1, :] @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        out.append(torch.softmax(scores, -1) @ v)
    return torch.cat(out, -2)


def seed_as_our_tree() -> Tree:
    """Our convention has one root, node 0 = the newest token, whose keys/values are written by the
    same forward as the drafts (the previous step's bonus token). The seed's two top-level
    candidates hang off its committed prefix [10, 11] instead. So the seed's prefix of P = 2 is our
    committed prefix of P - 1 = 1 slot plus our root (token 11, position 1), and seed node i is our
    node i + 1: its mask row is ours without the root row, the root's column falling on the seed's
    last prefix column (always visible), and its position P + depth - 1 is ours (P - 1) + depth."""
    return Tree.from_parents([11] + SEED_TOKENS, [-1] + [p + 1 for p in SEED_PARENTS])


def step_view(tree: Tree, prefix_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What a target step shows the tree's nodes after `prefix_len` committed slots, packed as the
    engine packs it (StepBatch.build): (N, P + N) bool, the slots each node attends to, and (N,)
    its position ids."""
    step = StepBatch.build([0], [tree.tokens], [tree.depth], [tree.mask], [prefix_len])
    return step.bias[0, 0] == 0, step.positions


def test_visible_shows_a_row_only_the_held_slots_given():
    """StepBatch.build(visible=): per row, which of the slots its sequence holds it reads (EAGLE's
    draft shows each node its ancestors' tentative slots only); its own rows as the mask says."""
    vis = torch.tensor([[True, False, True], [True, True, False]])
    step = StepBatch.build([0], [torch.tensor([5, 6])], [torch.zeros(2, dtype=torch.long)],
                           [torch.eye(2, dtype=torch.bool)], [3], visible=[vis])
    assert (step.bias[0, 0] == 0).tolist() == [[True, False, True, True, False], [True, True, False, False, True]]
    assert step.positions.tolist() == [3, 3]


def test_seed_tree_mask_and_positions_match_our_tree():
    tree = seed_as_our_tree()
    ours = step_view(tree, SEED_P - 1)[0]  # (N + 1, P + N)
    seed = seed_tree_mask(SEED_PARENTS, SEED_P)  # (N, P + N)
    assert ours.shape == (len(SEED_PARENTS) + 1, SEED_P + len(SEED_PARENTS))
    assert torch.equal(ours[1:], seed)
    assert ours[1:].sum(-1).tolist() == [3, 3, 4, 4, 4, 5, 5, 5]
    assert step_view(tree, SEED_P - 1)[1][1:].tolist() == [2, 2, 3, 3, 3, 4, 4, 4]
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 2, 3, 3, 3]
    # packed index is never the position: siblings share one
    assert step_view(tree, SEED_P - 1)[1].tolist() != list(range(SEED_P - 1, SEED_P - 1 + tree.size))


def _seed_tensors():
    g = torch.Generator().manual_seed(233)
    b, h, p, n, d = 1, 2, SEED_P, len(SEED_PARENTS), 8
    positions = step_view(seed_as_our_tree(), SEED_P - 1)[1][1:]
    bkraw = torch.randn(b, h, p, d, generator=g, dtype=torch.float64)
    bv = torch.randn(b, h, p, d, generator=g, dtype=torch.float64)
    qraw, ckraw, cv = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for _ in range(3))
    return rope(qraw, positions), rope(bkraw, torch.arange(p)), bv, rope(ckraw, positions), cv


def test_packed_tree_attention_equals_branch_reference_and_causal_mask_leaks():
    q, bk, bv, ck, cv = _seed_tensors()
    mask = step_view(seed_as_our_tree(), SEED_P - 1)[0][1:]  # our mask, seed layout
    reference = branch_reference(q, bk, bv, ck, cv, SEED_PARENTS)
    packed = packed_attention(q, bk, bv, ck, cv, mask)
    torch.testing.assert_close(packed, reference, rtol=1e-12, atol=1e-12)

    n = len(SEED_PARENTS)
    wrong_mask = torch.cat((torch.ones(n, SEED_P, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()), -1)
    leak = (packed_attention(q, bk, bv, ck, cv, wrong_mask) - reference).abs().max()
    assert leak > 1e-3, f"a lower-triangular candidate mask should leak siblings, max diff {leak:.3e}"


def test_model_attention_kernel_with_tree_mask_equals_branch_reference():
    """The same experiment through components.model.llama.attention (the kernel used for trees),
    with the additive bias built exactly as Transformer.forward builds it. That kernel takes its
    softmax in float32 by design (the model runs in float32/bfloat16), hence 1e-6, not 1e-12."""
    q, bk, bv, ck, cv = _seed_tensors()
    mask = step_view(seed_as_our_tree(), SEED_P - 1)[0][None, None, 1:]  # (1, 1, N, P + N)
    bias = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
    out = our_attention(q, torch.cat((bk, ck), -2), torch.cat((bv, cv), -2), bias)
    torch.testing.assert_close(out, branch_reference(q, bk, bv, ck, cv, SEED_PARENTS), rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# (b) property: one packed tree forward == every branch alone, through the tiny backbone
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_fast():
    """The tiny backbone with the transposed weight copies used for multi-row forwards, as
    components.model.load.assemble prepares every loaded model (tiny() alone does not)."""
    return tiny().model.optimize_for_decoding()


@torch.inference_mode()
def branch_logits(model, seq: list[int]) -> torch.Tensor:
    """Last-position logits of a plain causal forward over `seq` (no cache)."""
    return model.logits(model(torch.tensor([seq]), torch.arange(len(seq))[None]))[0, -1]


@torch.inference_mode()
def tree_logits(model, prefix: list[int], tree: Tree) -> torch.Tensor:
    kv = ContiguousKV(None, 512, model.args.n_layers, model.args.n_kv_heads, model.args.head_dim, model.dtype)
    seq = kv.create()
    forward_rows(model, kv, seq, torch.tensor(prefix))
    kv.commit(seq)
    P = kv.length(seq)
    h = forward_rows(model, kv, seq, tree.tokens, tree.depth, tree.mask)  # (N, dim)
    assert kv.length(seq) == P and kv.pending(seq) == tree.size
    return model.logits(h)  # (N, V)


@st.composite
def trees(draw, max_nodes=14):
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = draw(st.lists(st.integers(0, 49151), min_size=n, max_size=n))
    prefix = draw(st.lists(st.integers(0, 49151), min_size=1, max_size=10))
    return prefix, Tree.from_parents(tokens, parents)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=trees())
def test_packed_tree_forward_equals_each_branch_alone(tiny_fast, case):
    prefix, tree = case
    logits = tree_logits(tiny_fast, prefix, tree)
    for node in range(tree.size):
        path = tree.tokens[tree.path_to(node)].tolist()
        ref = branch_logits(tiny_fast, prefix + path)
        diff = (logits[node] - ref).abs().max().item()
        assert diff < 1e-4, f"node {node} (path {tree.path_to(node)}): max abs diff {diff:.3e}"


@pytest.mark.parametrize("n_nodes", [20, 90])  # 90 > 64 rows: the SDPA-with-mask branch of Block.forward
def test_large_packed_tree_equals_branches(tiny_fast, n_nodes):
    g = torch.Generator().manual_seed(n_nodes)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n_nodes)]
    tokens = torch.randint(0, 49152, (n_nodes,), generator=g).tolist()
    prefix = torch.randint(0, 49152, (7,), generator=g).tolist()
    tree = Tree.from_parents(tokens, parents)
    logits = tree_logits(tiny_fast, prefix, tree)
    for node in range(0, n_nodes, 3):
        ref = branch_logits(tiny_fast, prefix + tree.tokens[tree.path_to(node)].tolist())
        assert (logits[node] - ref).abs().max().item() < 1e-4, f"node {node}"


# ---------------------------------------------------------------------------------------------
# (c) the seed's toy verifier case
# ---------------------------------------------------------------------------------------------

def test_toy_verifier_case(tiny_backbone):
    """Seed: base cache [10, 11], branches [4,5,6], [4,7,8], [9,0,1], target next path [4, 7, 3]:
    accepted [4, 7], committed cache [10, 11, 4, 7], 6 tentative nodes released.
    Ours: the cache holds the committed [10]; the root (node 0) is 11, the newest token, written in
    the same forward as the drafts. Committing acc.path = [root, "4", "4,7"] keeps 3 of the 9
    tentative slots (so committed = [10, 11, 4, 7] exactly as in the seed) and releases the other
    6 = the seed's 8 draft nodes minus the 2 accepted; the bonus 3 becomes the next root."""
    tree = Tree.from_paths(11, [[4, 5, 6], [4, 7, 8], [9, 0, 1]])
    assert tree.size == 9 and tree.tokens[0].item() == 11
    node = {(): 0}
    for i in range(1, tree.size):
        node[tuple(tree.tokens[tree.path_to(i)[1:]].tolist())] = i
    V = 16
    logits = torch.randn(tree.size, V)
    logits[:, 2] = 50.0  # elsewhere the target wants 2, which no draft proposes
    target_next = {(): 4, (4,): 7, (4, 7): 3}
    for path, tok in target_next.items():
        logits[node[path]] = torch.randn(V)
        logits[node[path], tok] = 50.0

    acc = GreedyVerifier().verify(tree, Target(logits))
    assert acc.draft_tokens == [4, 7] and acc.accept_length == 2
    assert acc.bonus_token == 3
    assert acc.path == [0, node[(4,)], node[(4, 7)]]
    assert tree.tokens[acc.path].tolist() == [11, 4, 7]

    model = tiny_backbone.model
    kv = ContiguousKV(tiny_backbone, max_len=64)
    seq = kv.create()
    with torch.inference_mode():
        forward_rows(model, kv, seq, torch.tensor([10]))
        kv.commit(seq)
        forward_rows(model, kv, seq, tree.tokens, tree.depth, tree.mask)
        assert kv.pending(seq) == tree.size
        kv.commit(seq, acc.path)
        released = tree.size - len(acc.path)
        assert released == 6
        assert kv.length(seq) == 4 and kv.pending(seq) == 0
        # the committed slots are exactly those of plain decoding of [10, 11, 4, 7]
        ref = ContiguousKV(tiny_backbone, max_len=64)
        rseq = ref.create()
        for t in [10, 11, 4, 7]:
            forward_rows(model, ref, rseq, torch.tensor([t]))
            ref.commit(rseq)
        for layer in range(model.args.n_layers):
            for a, b in zip(kv.gather(seq, layer), ref.gather(rseq, layer)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_verifier_rejects_everything_and_takes_the_deepest_path():
    tree = Tree.from_paths(1, [[2, 3], [4]])  # nodes: 1, 2, 3(under 2), 4
    V = 8
    none = torch.zeros(tree.size, V)
    none[:, 7] = 1.0  # the target always wants 7
    acc = GreedyVerifier().verify(tree, Target(none))
    assert acc.path == [0] and acc.draft_tokens == [] and acc.bonus_token == 7 and acc.accept_length == 0

    full = torch.zeros(tree.size, V)
    full[0, 2] = full[1, 3] = full[2, 5] = full[3, 6] = 1.0
    acc = GreedyVerifier().verify(tree, Target(full))
    assert acc.draft_tokens == [2, 3] and acc.bonus_token == 5

    # a child whose parent was rejected is never accepted, even if it matches
    orphan = torch.zeros(tree.size, V)
    orphan[0, 4] = orphan[1, 3] = orphan[3, 0] = 1.0
    acc = GreedyVerifier().verify(tree, Target(orphan))
    assert acc.draft_tokens == [4] and acc.bonus_token == 0


# ---------------------------------------------------------------------------------------------
# Tree and StaticTree structure
# ---------------------------------------------------------------------------------------------

def test_tree_from_paths_shares_prefixes():
    tree = Tree.from_paths(11, [[4, 5, 6], [4, 7, 8], [9, 0, 1], [4, 5]])
    assert tree.size == 9
    assert all(tree.parents[i] < i for i in range(1, tree.size))
    for i in range(tree.size):
        path = tree.path_to(i)
        assert path[0] == 0 and path[-1] == i
        assert tree.depth[i].item() == len(path) - 1
        assert tree.mask[i].nonzero().flatten().tolist() == sorted(path)


@pytest.mark.parametrize("parents", [[], [0], [-1, 1], [-1, 0, 3, 1], [-1, -1]])
def test_tree_rejects_bad_parent_lists(parents):
    with pytest.raises(ValueError):
        Tree.from_parents(list(range(len(parents))), parents)


def test_static_tree_from_choices():
    st_ = StaticTree.from_choices([[1, 0], [0], [0, 1], [1], [0, 0], [0, 0, 0], [0]])  # unordered, duplicate
    assert st_.choices == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert st_.parents == (-1, 0, 0, 1, 1, 2, 3)
    assert st_.head.tolist() == [0, 0, 1, 1, 1, 2]
    assert st_.rank.tolist() == [0, 1, 0, 1, 0, 0]
    assert st_.depth == 3 and st_.max_rank == 2
    topk = torch.tensor([[100, 101], [200, 201], [300, 301]])  # (depth, k): candidates per depth
    tree = st_.fill(7, topk)
    assert tree.tokens.tolist() == [7, 100, 101, 200, 201, 200, 300]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2, 3]
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    ref = Tree.from_parents(tree.tokens.tolist(), tree.parents.tolist())
    assert torch.equal(tree.mask, ref.mask) and torch.equal(step_view(tree, 5)[0], step_view(ref, 5)[0])


@pytest.mark.parametrize("choices", [[], [[]], [[0], [-1]], [[0, 0]], [[0], [1, 0]], [[0], [0, 0, 0]]])
def test_static_tree_invalid_choices_raise(choices):
    with pytest.raises(ValueError, match="tree.choices"):
        StaticTree.from_choices(choices)


def test_static_tree_from_shape():
    full = StaticTree.from_shape(2, 2)
    assert set(full.choices) == {(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)}
    assert full.parents == (-1, 0, 0, 1, 1, 2, 2)
    pruned = StaticTree.from_shape(2, 2, max_nodes=3)  # breadth-first in rank: (0), (0,0), (1)
    assert set(pruned.choices) == {(0,), (0, 0), (1,)}
    assert pruned.parents == (-1, 0, 0, 1)
    chain = StaticTree.from_shape(1, 4)
    assert chain.parents == (-1, 0, 1, 2, 3) and chain.depth == 4
    for w in (1, 2, 3):
        for d in (1, 2, 3):
            total = sum(w ** i for i in range(1, d + 1))
            for m in (1, 2, 5, 100):
                t = StaticTree.from_shape(w, d, max_nodes=m)
                assert len(t.parents) - 1 == min(m, total)
                assert all(0 <= p < i for i, p in enumerate(t.parents) if i)


@pytest.mark.parametrize("width,depth", [(0, 2), (2, 0), (-1, 1), (2.5, 1), (1, "2")])
def test_static_tree_from_shape_invalid(width, depth):
    with pytest.raises(ValueError, match=r"tree\.(width|depth)"):
        StaticTree.from_shape(width, depth)


def test_tree_costs_are_measured_at_the_runs_batch_size(tiny_backbone):
    """nodes=auto sizes trees on the cost of a step of batch_size trees: the proposers get the run's
    batch size from the config, and a batched step with drafts costs at least the batched plain one."""
    from components.proposer.policy import step_costs
    for preset in ("tree_eagle", "tree_medusa"):
        assert compose_config([f"decode={preset}", "batch_size=4"]).proposer.batch_size == 4
    assert compose_config(["decode=tree_eagle"]).proposer.batch_size == 1
    order = [(0,) * k for k in range(1, 5)]
    costs = step_costs(tiny_backbone.model, order, 0.5, prefix=8, repeats=1, batch=3)
    assert sorted(costs) == [0, 1, 2, 3, 4] and all(v > 0 for v in costs.values())
    assert costs[4] - 1.5 >= 0.8 * costs[0]  # 3 x 5 rows cost about what 3 x 1 do, plus 3 proposals of 0.5 ms
