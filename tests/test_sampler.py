"""Logits processors and the Sampler: validation that names the knob, top-k / top-p semantics
(against transformers' warpers as an independent oracle), seeding, greedy, and a statistical test
that draws follow the processed distribution (which a deliberately broken sampler fails)."""
from __future__ import annotations

import pytest
import torch

from components.sampler.logits import Sampler, Temperature, TopK, TopP


@pytest.mark.parametrize("kwargs,knob", [
    (dict(temperature=0), "sampler.temperature"),
    (dict(temperature=0.0), "sampler.temperature"),
    (dict(temperature=-0.5), "sampler.temperature"),
    (dict(temperature="hot"), "sampler.temperature"),
    (dict(top_k=-1), "sampler.top_k"),
    (dict(top_k=2.5), "sampler.top_k"),
    (dict(top_k="3"), "sampler.top_k"),
    (dict(top_p=0), "sampler.top_p"),
    (dict(top_p=0.0), "sampler.top_p"),
    (dict(top_p=1.5), "sampler.top_p"),
    (dict(top_p=-0.2), "sampler.top_p"),
])
def test_invalid_knobs_raise_value_error_naming_the_knob(kwargs, knob):
    with pytest.raises(ValueError, match=knob.replace(".", r"\.")):
        Sampler(do_sample=True, **kwargs)


def test_neutral_values_are_accepted_and_add_no_processor():
    s = Sampler(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    scores = torch.randn(3, 11)
    torch.testing.assert_close(s.probs(scores), scores.softmax(-1))


def test_processors_do_not_mutate_their_input():
    scores = torch.randn(4, 30)
    before = scores.clone()
    for proc in (Temperature(0.5), TopK(5), TopP(0.6)):
        proc(None, scores)
        assert torch.equal(scores, before), type(proc).__name__


@pytest.mark.parametrize("k", [1, 2, 7, 30, 100])
def test_top_k_keeps_exactly_the_k_best(k):
    g = torch.Generator().manual_seed(k)
    scores = torch.randn(6, 30, generator=g)  # distinct values almost surely
    out = TopK(k)(None, scores)
    kept = torch.isfinite(out)
    assert (kept.sum(-1) == min(k, 30)).all()
    best = scores.topk(min(k, 30), dim=-1).indices
    assert kept.gather(-1, best).all()
    torch.testing.assert_close(out[kept], scores[kept])  # survivors unchanged


def smallest_nucleus(probs: torch.Tensor, p: float) -> set[int]:
    """Reference: the fewest most-probable tokens whose total probability reaches p."""
    order = probs.argsort(descending=True).tolist()
    total, keep = 0.0, set()
    for i in order:
        keep.add(i)
        total += float(probs[i])
        if total >= p:
            break
    return keep


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 0.77, 0.9, 0.99])
def test_top_p_keeps_the_smallest_set_reaching_p(p):
    g = torch.Generator().manual_seed(int(p * 1000))
    checked = 0
    for _ in range(20):
        scores = torch.randn(40, generator=g, dtype=torch.float64) * 2
        probs = scores.softmax(-1)
        cum = probs.sort(descending=True).values.cumsum(-1)
        if (cum - p).abs().min() < 1e-6:
            continue  # too close to the boundary to be a fair float test
        out = TopP(p)(None, scores[None].float())[0]
        kept = set(torch.isfinite(out).nonzero().flatten().tolist())
        assert kept == smallest_nucleus(probs, p)
        checked += 1
    assert checked >= 15


def test_top_p_hand_case_and_never_empty():
    probs = torch.tensor([0.05, 0.5, 0.3, 0.15])
    scores = probs.log()[None]
    kept = lambda p: set(torch.isfinite(TopP(p)(None, scores)[0]).nonzero().flatten().tolist())
    assert kept(0.45) == {1}
    assert kept(0.7) == {1, 2}
    assert kept(0.9) == {1, 2, 3}
    assert kept(0.99) == {0, 1, 2, 3}
    assert kept(1e-9) == {1}  # the top token always survives


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (0.7, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.8), (0.6, 10, 0.9), (1.7, 3, 0.5)])
def test_probs_match_transformers_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import (
        LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
    hf = LogitsProcessorList()
    if temperature != 1.0:
        hf.append(TemperatureLogitsWarper(temperature))
    if top_k:
        hf.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        hf.append(TopPLogitsWarper(top_p))
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(8, 64, generator=g) * 3
    ref = hf(torch.zeros(8, 1, dtype=torch.long), scores.clone()).softmax(-1)
    ours = Sampler(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p).probs(scores)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_greedy_is_argmax():
    s = Sampler(do_sample=False)
    assert s.greedy
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        scores = torch.randn(7, 100, generator=g)
        assert torch.equal(s(scores, torch.Generator().manual_seed(1)), scores.argmax(-1))
    assert not Sampler(do_sample=True).greedy


def test_seeded_sampling_is_reproducible():
    s = Sampler(do_sample=True, temperature=0.9, top_k=50, top_p=0.95)
    scores = torch.randn(64, 200, generator=torch.Generator().manual_seed(5))
    a = s(scores, torch.Generator().manual_seed(42))
    b = s(scores, torch.Generator().manual_seed(42))
    c = s(scores, torch.Generator().manual_seed(43))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert a.shape == (64,) and a.dtype == torch.long


LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])


def target_distribution(temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Computed by hand from the definitions, not through the Sampler."""
    z = (LOGITS / temperature).double()
    p = z.softmax(-1)
    order = p.argsort(descending=True).tolist()
    keep = set(order[:top_k]) if top_k else set(order)
    p = torch.tensor([float(p[i]) if i in keep else 0.0 for i in range(len(p))], dtype=torch.float64)
    p = p / p.sum()
    if top_p < 1.0:
        keep = smallest_nucleus(p, top_p)
        p = torch.tensor([float(p[i]) if i in keep else 0.0 for i in range(len(p))], dtype=torch.float64)
        p = p / p.sum()
    return p


def empirical(sampler, n=20000, seed=0) -> torch.Tensor:
    draws = sampler(LOGITS.expand(n, -1).clone(), torch.Generator().manual_seed(seed))
    return torch.bincount(draws, minlength=len(LOGITS)).double() / n


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 3, 1.0), (1.3, 0, 0.8), (1.0, 0, 1.0), (2.0, 4, 0.9)])
def test_sampling_follows_the_processed_distribution(temperature, top_k, top_p):
    target = target_distribution(temperature, top_k, top_p)
    freq = empirical(Sampler(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p))
    assert total_variation(freq, target) < 0.02, (freq.tolist(), target.tolist())
    assert (freq[target == 0] == 0).all(), "a filtered-out token was drawn"


def test_statistical_test_catches_a_broken_sampler():
    """The same check must fail for a sampler that forgets the temperature or the top-k filter."""
    target = target_distribution(0.7, 3, 1.0)
    forgot_temperature = Sampler(do_sample=True, temperature=1.0, top_k=3)
    forgot_top_k = Sampler(do_sample=True, temperature=0.7, top_k=0)
    assert total_variation(empirical(forgot_temperature), target) > 0.02
    assert total_variation(empirical(forgot_top_k), target) > 0.02
