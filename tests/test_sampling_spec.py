"""Speculation under sampling. On a small vocabulary with known target p and draft q, and through
the engine on model=tiny, the tokens committed by `verifier=exact` follow plain sampling's
distribution (total-variation distance over the first tokens), for deterministic and sampled
drafts, several temperatures and top-p; deliberately wrong verifiers fail the same test; with a
greedy sampler exact and typical verification equal greedy speculation."""
from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from components.sampler.logits import Sampler
from components.verifier.exact import ExactVerifier
from components.verifier.typical import TypicalVerifier
from pipeline.core import Target, Tree

from helpers import chi_square_p, decoder_for, rebuild, tiny_truth
from toy import GreedyAcceptance, NoRenormalisation, RepeatProposer

V = 4  # vocabulary of the synthetic target and draft


def table(ctx: tuple, salt: int) -> torch.Tensor:
    """Fixed random logits for a context (the synthetic target: salt 0, draft: salt 1)."""
    g = torch.Generator().manual_seed(hash((ctx, salt)) % (2 ** 31))
    return torch.randn(V, generator=g) * 1.5


class Synthetic:
    def __init__(self, temperature: float, top_p: float):
        self.sampler = Sampler(do_sample=True, temperature=temperature, top_p=top_p)

    def p(self, ctx) -> torch.Tensor:  # the processed target distribution after ctx
        return self.sampler.probs(table(tuple(ctx), 0)[None])[0]

    def q(self, ctx) -> torch.Tensor:  # the draft model
        return table(tuple(ctx), 1).softmax(-1)

    def truth(self, n: int) -> dict[tuple, float]:
        """Plain sampling's distribution of the first n tokens."""
        out = {}
        for seq in itertools.product(range(V), repeat=n):
            prob = 1.0
            for i, t in enumerate(seq):
                prob *= float(self.p(seq[:i])[t])
            out[seq] = prob
        return out


def draft_tree(model: Synthetic, ctx: list[int], sampled: bool, g: torch.Generator) -> Tree:
    """Root, two children, a grandchild under the first (duplicates kept as separate siblings)."""
    if sampled:  # iid draws from q, q carried by the tree
        a, b = torch.multinomial(model.q(ctx), 2, replacement=True, generator=g).tolist()
        c = int(torch.multinomial(model.q(ctx + [a]), 1, generator=g))
    else:  # deterministic: the draft's top-2, then its top-1
        a, b = model.q(ctx).topk(2).indices.tolist()
        c = int(model.q(ctx + [a]).argmax())
    tree = Tree.from_parents([ctx[-1] if ctx else 0, a, b, c], [-1, 0, 0, 1])
    if sampled:
        tree.q = torch.stack([model.q(ctx), model.q(ctx + [a]), model.q(ctx + [b]), model.q(ctx + [a, c])])
    return tree


def simulate(model: Synthetic, verifier, n_tokens: int, draws: int, sampled: bool, seed: int = 0) -> Counter:
    """Speculative decoding of `draws` sequences from an empty context, `n_tokens` each."""
    g, counts = torch.Generator().manual_seed(seed), Counter()
    contexts = {}
    for _ in range(draws):
        ctx: list[int] = []
        while len(ctx) < n_tokens:
            tree = draft_tree(model, ctx, sampled, g)
            nodes = [ctx + tree.tokens[tree.path_to(i)[1:]].tolist() for i in range(tree.size)]
            key = tuple(tuple(n) for n in nodes)
            if key not in contexts:
                contexts[key] = torch.stack([model.p(n) for n in nodes])
            probs = contexts[key]
            p = Target(probs.log())
            p._probs = probs
            acc = verifier.verify(tree, p, g)
            ctx += acc.tokens
        counts[tuple(ctx[:n_tokens])] += 1
    return counts


def tv(counts: Counter, truth: dict[tuple, float]) -> float:
    n = sum(counts.values())
    return 0.5 * sum(abs(counts.get(k, 0) / n - v) for k, v in truth.items())


DRAWS = 30_000


@pytest.mark.parametrize("sampled", [False, True], ids=["deterministic", "sampled"])
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (1.5, 0.8)])
def test_exact_verifier_keeps_the_distribution(temperature, top_p, sampled):
    model = Synthetic(temperature, top_p)
    counts = simulate(model, ExactVerifier(), 3, DRAWS, sampled)
    first = Counter()
    for k, n in counts.items():
        first[k[:1]] += n
    assert tv(first, model.truth(1)) < 0.02
    assert tv(counts, model.truth(3)) < 0.03  # 64 outcomes: the sampling noise alone is about 0.02
    assert chi_square_p(counts, model.truth(3)) > 1e-3


@pytest.mark.parametrize("wrong", [NoRenormalisation, GreedyAcceptance])
def test_wrong_verifiers_fail_the_same_test(wrong):
    model = Synthetic(1.0, 1.0)
    counts = simulate(model, wrong(), 3, DRAWS, sampled=False)
    assert tv(counts, model.truth(3)) > 0.05 and chi_square_p(counts, model.truth(3)) < 1e-6


def test_typical_acceptance_is_measured_not_exact():
    """Typical acceptance drifts from plain sampling (its distance is reported, not bounded): on a
    4-token vocabulary every draft is 'typical', so the draft's choice is always kept."""
    model = Synthetic(1.0, 1.0)
    counts = simulate(model, TypicalVerifier(), 3, DRAWS, sampled=False)
    assert tv(counts, model.truth(3)) > 0.05


@pytest.mark.parametrize("verifier", ["exact", "typical"])
@pytest.mark.parametrize("preset", ["tree_ngram", "self_spec"])
def test_with_a_greedy_sampler_they_equal_greedy_speculation(tiny_backbone, preset, verifier):
    bb = tiny_backbone
    prompts = [bb.tokenizer.encode(t, add_special_tokens=False) for t in
               ["The cat sat on the mat. The cat sat on the mat.", "one two three one two three", "hello"]]
    extra = ("proposer.min_ngram=1",) if preset == "tree_ngram" else ()
    greedy = decoder_for(preset, bb, *extra, "batch_size=2", max_new_tokens=30)
    ours = decoder_for(preset, bb, *extra, f"verifier={verifier}", "batch_size=2", max_new_tokens=30)
    a, b = greedy.run(prompts), ours.run(prompts)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.accepted_lengths for g in a] == [g.accepted_lengths for g in b]


@pytest.mark.parametrize("knobs", [("sampler.temperature=1.3", "sampler.top_k=2"),
                                   ("sampler.temperature=2.0", "sampler.top_k=3", "sampler.top_p=0.98")])
def test_exact_speculative_sampling_through_the_engine(tiny_backbone, knobs):
    """4,000 requests of one prompt, batch 64, drafts verified by `verifier=exact`: the first three
    tokens follow plain sampling (chi-square p > 0.001 against the exact distribution); the same run
    through a wrong verifier fails. Seeded: batch 1 and batch 64 give the same tokens."""
    bb = tiny_backbone
    prompt = bb.tokenizer.encode("a b a b a b a b a", add_special_tokens=False)
    eng = rebuild(decoder_for("tree_ngram", bb, "sampler=sample", *knobs, "verifier=exact", "batch_size=64",
                              max_new_tokens=3), proposer=RepeatProposer())
    truth = tiny_truth(bb, prompt, eng.sampler, 3)
    gens = eng.run([prompt] * 4000)
    counts = Counter(tuple(g.token_ids[:3]) for g in gens)
    accepted = sum(len(g.token_ids) - g.steps for g in gens)
    assert 200 < accepted < 4000, "the drafts should be accepted sometimes, not always"
    assert chi_square_p(counts, truth) > 1e-3, (counts, truth)
    wrong = rebuild(eng, verifier=GreedyAcceptance())
    counts = Counter(tuple(g.token_ids[:3]) for g in wrong.run([prompt] * 2000))
    assert chi_square_p(counts, truth) < 1e-6
    one = rebuild(eng, batch_size=1).run([prompt] * 30, seeds=list(range(30)))
    many = eng.run([prompt] * 30, seeds=list(range(30)))
    assert [g.token_ids for g in one] == [g.token_ids for g in many]
