"""Suffix decoding: the cross-request cache is bounded in tokens (oldest out first), consistent under
concurrent adds and lookups, matches the longest context and scores continuations by frequency; the
proposer is lossless against greedy on the tiny model and drafts a repeated request from the cache."""
from __future__ import annotations

import random
import threading

import pytest

from components.proposer.suffix import SuffixCache, SuffixProposer, score
from pipeline.errors import UserError

from helpers import TEXT_PROMPTS, decoder_for


def entries(cache: SuffixCache) -> int:
    """Positions in the index (each token after the first `min_ngram` of a sequence has one)."""
    return sum(len(hits) for hits in cache._index.index.values())


def test_cache_stays_within_its_bound_and_forgets_the_oldest():
    cache = SuffixCache(max_tokens=500, min_ngram=2, max_ngram=4)
    rng = random.Random(0)
    for i in range(400):  # 20,000 tokens through a 500-token cache
        cache.add([i, i + 1] + [rng.randrange(50) for _ in range(48)])
        assert cache.size <= 500
    assert cache.size == sum(len(s) for s in cache._index.seqs.values()) and len(cache) == 10
    assert entries(cache) == sum(len(s) - 2 for s in cache._index.seqs.values())
    assert cache.continuations([0, 1], 3, 8) == []  # the first sequence is long gone
    assert cache.continuations([399, 400], 3, 8)  # the newest is there
    cache.add(list(range(10_000)))  # longer than the bound: its last 500 tokens
    assert cache.size == 500 and len(cache) == 1 and cache.continuations([9_000, 9_001], 2, 8) == []
    assert cache.continuations([9_600, 9_601], 2, 8) == [[9_602, 9_603]]


def test_cache_is_safe_under_concurrent_adds_and_lookups():
    cache = SuffixCache(max_tokens=2_000, min_ngram=2, max_ngram=6)
    errors = []

    def work(seed: int):
        rng = random.Random(seed)
        try:
            for _ in range(300):
                cache.add([rng.randrange(30) for _ in range(rng.randrange(3, 60))])
                for cont in cache.continuations([rng.randrange(30) for _ in range(6)], 5, 16):
                    assert 1 <= len(cont) <= 5
        except Exception as e:  # noqa: BLE001 - reported below, from the main thread
            errors.append(e)
    threads = [threading.Thread(target=work, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert cache.size <= 2_000 and cache.size == sum(len(s) for s in cache._index.seqs.values())
    assert entries(cache) == sum(len(s) - 2 for s in cache._index.seqs.values())


def test_longest_context_wins_and_continuations_are_scored_by_frequency():
    cache = SuffixCache(max_tokens=1_000, min_ngram=2, max_ngram=4)
    cache.add([1, 2, 3, 4, 5])
    cache.add([9, 2, 3, 7, 8])
    cache.add([0, 2, 3, 7, 6])
    assert cache.continuations([1, 2, 3], 2, 8) == [[4, 5]]  # three tokens match only the first
    assert cache.continuations([5, 2, 3], 2, 8) == [[7, 6], [7, 8], [4, 5]]  # two match all three, newest first
    assert cache.continuations([5, 2, 3], 2, 2) == [[7, 6], [7, 8]]  # max_matches: the newest
    scored = dict(score([[7, 6], [7, 8], [4, 5]], prior=1.0))
    assert scored[(7,)] == pytest.approx(2 / 4) and scored[(7, 6)] == pytest.approx(1 / 4)
    assert scored[(4, 5)] == pytest.approx(1 / 4) and len(scored) == 5


def test_the_sequence_own_text_is_matched_and_the_cache_fills_on_release():
    p = SuffixProposer(min_ngram=2, max_ngram=4, depth=3, max_nodes=8, prior=0.0)
    p.start(0, [5, 6, 7, 8, 5, 6])
    p.observe(0, [6, 7, 8, 5, 6, 9], None)  # after prefill: only the first generated token (9) is new
    assert p.seqs[0].own.seqs[0] == [5, 6, 7, 8, 5, 6, 9]
    p.observe(0, [5, 6], None)

    class State:
        seq, tokens, budget = 0, [5, 6, 7, 8, 5, 6, 9, 5, 6], 10
    (scored,) = p.scored([State])
    assert dict(scored)[(7, 8, 5)] == pytest.approx(0.5) and dict(scored)[(9,)] == pytest.approx(0.5)
    (tree,) = p.propose([State])
    assert tree.tokens.tolist()[0] == 6 and tree.size == 7  # 7 8 5 and 9 5 6 under the root
    (ahead,) = p.scored([State], ahead=[[7]])  # after a forced 7: what followed 6 7
    assert dict(ahead)[(7, 8, 5, 6)] == pytest.approx(1.0)
    p.release(0)
    assert p.seqs == {} and p.cache.size == 9


def test_bad_knobs_are_refused():
    with pytest.raises(UserError, match="min_ngram"):
        SuffixProposer(min_ngram=5, max_ngram=3)
    with pytest.raises(UserError, match="cache_tokens"):
        SuffixProposer(cache_tokens=-1)


@pytest.mark.parametrize("batch", [1, 3])
def test_suffix_is_lossless_and_drafts_a_repeated_request_from_the_cache(tiny_variants, batch):
    """Untied, the tiny model's output is a random walk: its own text offers little, but the same
    requests again find their whole outputs in the cross-request cache."""
    bb = tiny_variants["untied"]
    prompts = [bb.tokenizer.encode(t) for t in TEXT_PROMPTS]
    ref = decoder_for("greedy", bb, "+model.tie_embeddings=false", max_new_tokens=32).run(prompts)
    spec = decoder_for("greedy", bb, "+model.tie_embeddings=false", "proposer=suffix", "verifier=greedy",
                       f"batch_size={batch}", max_new_tokens=32)
    gens = spec.run(prompts + prompts)  # the copies join once the first ones finished (batch <= 3)
    first, again = gens[:len(prompts)], gens[len(prompts):]
    assert [g.token_ids for g in first] == [g.token_ids for g in ref] == [g.token_ids for g in again]
    assert len(spec.proposer.cache) == 2 * len(prompts) and not spec.proposer.seqs
    assert sum(g.steps for g in again) < sum(g.steps for g in first) / 2
    fresh = spec.run(prompts)  # a new run forgets the last one's outputs (Engine.reset): a bench's rounds stay honest
    assert [g.token_ids for g in fresh] == [g.token_ids for g in ref]
    assert sum(g.steps for g in fresh) == sum(g.steps for g in first)
