"""Hybrid trees: sources' scored candidates merged into one trie (shared prefixes once, the larger
estimate), ranked by estimate, cut to max_nodes / p_min / the cost policy's best prefix; a
constraint's forced tokens drafted first; the sequence calls forwarded to every source; and
proposer=hybrid lossless against greedy on the tiny model, batched and constrained."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import pipeline.cli
from components.constraint.fsm import FSM
from components.proposer.hybrid import HybridProposer, forced_tokens, ranked_tree
from pipeline.build import component
from pipeline.core import DecodeState, Proposer
from pipeline.core.bits import words
from pipeline.errors import UserError

from helpers import TEXT_PROMPTS, compose_config, decoder_for

V = 49152  # the tiny model's vocabulary (its tokenizer's)


class Fake(Proposer):
    """A source with fixed candidates that records the calls it gets."""

    def __init__(self, found, sampled=False, prompt_states=False):
        self.found, self.sampled, self.prompt_states, self.calls = found, sampled, prompt_states, []

    def scored(self, states):
        return [list(self.found) for _ in states]

    def propose(self, states):
        return [None] * len(states)

    def start(self, seq, prompt_ids):
        self.calls.append(("start", seq))

    def observe(self, seq, tokens, hidden):
        self.calls.append(("observe", seq, tuple(tokens)))

    def release(self, seq):
        self.calls.append(("release", seq))


class FakeAhead(Fake):
    """A source that drafts after given tokens (as suffix decoding does)."""

    def scored(self, states, ahead=None):
        self.ahead = ahead
        return [[(tuple(a) + p, s) for p, s in self.found] for a in ahead]


def state(tokens=(1, 2, 3), budget=10, constraint=None, seq=0):
    return DecodeState(seq, list(tokens), None, SimpleNamespace(args=SimpleNamespace(vocab_size=V)), None, budget,
                       constraint=constraint)


EAGLE = [((10,), .6), ((10, 20), .54), ((11,), .3), ((10, 20, 30), .2)]
SUFFIX = [((10,), .5), ((10, 20), .5), ((10, 20, 30), .45), ((10, 20, 30, 40), .4), ((12,), .35)]


def hybrid(max_nodes=16, **kw):
    return HybridProposer(sources=["eagle", "suffix"], eagle=Fake(EAGLE), suffix=Fake(SUFFIX), max_nodes=max_nodes, **kw)


def test_sources_merge_into_one_trie_ranked_by_estimate():
    (tree,) = hybrid(max_nodes=6).propose([state()])
    # (10,) and (10, 20) from both sources are one node each: 6 drafts, not 9; parents first, by rank
    assert tree.tokens.tolist() == [3, 10, 12, 11, 20, 30, 40]
    assert tree.parents.tolist() == [-1, 0, 0, 0, 1, 4, 5]
    (tree,) = hybrid(max_nodes=4).propose([state()])  # .6 .54 .45 (suffix's, the larger) .4
    assert tree.tokens.tolist() == [3, 10, 20, 30, 40]
    (tree,) = hybrid(p_min=0.42).propose([state()])
    assert tree.tokens.tolist() == [3, 10, 20, 30]
    (tree,) = hybrid().propose([state(budget=3)])  # drafts no deeper than budget - 1
    assert tree.max_depth == 2 and tree.size == 5


def test_the_cost_policy_cuts_the_ranking():
    h = hybrid()
    h.costs = {0: 10.0, 1: 10.5, 2: 11.0, 4: 30.0, 16: 100.0}  # rows cheap up to 2 drafts, then dear
    (tree,) = h.propose([state()])
    assert tree.tokens.tolist() == [3, 10, 20]  # 2.14 / 11 beats 1.6 / 10.5 and 2.59 / 20.5
    h.costs = {0: 1.0, 1: 100.0, 16: 100.0}  # no draft pays: a plain step
    assert h.propose([state()]) == [None]
    assert h.describe()["tree"]["plain_step_share"] == 0.5


def test_a_node_whose_parent_was_cut_goes_too():
    assert ranked_tree(0, {(5,): .1, (5, 6): .9}, max_nodes=1, max_depth=4) is None
    assert ranked_tree(0, {(5,): .1, (5, 6): .9}, max_nodes=2, max_depth=4).tokens.tolist() == [0, 5, 6]


def test_sequence_calls_reach_every_source():
    h = hybrid()
    h.start(3, [1, 2])
    h.observe(3, [7], torch.zeros(1, 4))
    h.release(3)
    for src in h.sources.values():
        assert src.calls == [("start", 3), ("observe", 3, (7,)), ("release", 3)]
    assert not h.prompt_states and h.active and not h.sampled
    assert HybridProposer(sources=["eagle", "suffix"], eagle=Fake(EAGLE, prompt_states=True), suffix=Fake(SUFFIX)).prompt_states


def test_configs_that_cannot_be_lossless_or_do_not_exist_are_refused():
    with pytest.raises(UserError, match="samples its drafts"):
        HybridProposer(sources=["eagle"], eagle=Fake(EAGLE, sampled=True))
    with pytest.raises(UserError, match="distinct drafters"):
        HybridProposer(sources=["ngram"], eagle=Fake(EAGLE))
    with pytest.raises(UserError, match="distinct drafters"):
        HybridProposer(sources=["eagle", "eagle"], eagle=Fake(EAGLE))

    class Unscored(Proposer):
        def propose(self, states):
            return [None] * len(states)
    with pytest.raises(UserError, match="no scored candidates"):
        HybridProposer(sources=["eagle"], eagle=Unscored())


def chain_fsm(bb):
    """100 101 102, then 103 or 104, then 105 106 107 and the end: six of its seven tokens forced."""
    return FSM(bb, transitions={0: {100: 1}, 1: {101: 2}, 2: {102: 3}, 3: {103: 4, 104: 4}, 4: {105: 5},
                                5: {106: 6}, 6: {107: 7}}, start=0, accept=[7])


def test_forced_tokens_are_read_without_moving_the_state(tiny_backbone):
    c = chain_fsm(tiny_backbone).start()
    before = torch.zeros(words(V), dtype=torch.int32)
    c.fill(before)
    assert forced_tokens(c, V, 16) == [100, 101, 102] and forced_tokens(c, V, 2) == [100, 101]
    after = torch.zeros_like(before)
    c.fill(after)
    assert torch.equal(before, after)
    c.advance(100), c.advance(101), c.advance(102), c.advance(104)
    assert forced_tokens(c, V, 16) == [105, 106, 107]  # then only EOS: never drafted


def test_forced_tokens_come_first_and_sources_continue_or_agree(tiny_backbone):
    c = chain_fsm(tiny_backbone).start()
    model = Fake([((100,), .6), ((7,), .9), ((100, 101, 102, 5), .5)])
    after = FakeAhead([((103,), .7), ((104,), .25), ((104, 105), .2)])
    h = HybridProposer(sources=["eagle", "suffix"], eagle=model, suffix=after, max_nodes=16)
    (tree,) = h.propose([state(constraint=c)])
    assert after.ahead == [[100, 101, 102]]
    paths = {tuple(tree.tokens[tree.path_to(i)][1:].tolist()) for i in range(1, tree.size)}
    assert paths == {(100,), (100, 101), (100, 101, 102), (100, 101, 102, 5), (100, 101, 102, 103),
                     (100, 101, 102, 104), (100, 101, 102, 104, 105)}  # (7,) disagrees with the forced 100
    assert h.describe()["tree"]["mean_forced"] == 3


# --- on the tiny model -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def heads(tiny_backbone, tmp_path_factory) -> dict[str, str]:
    """Random EAGLE and Medusa drafts for the tiny backbone (none are shipped for it), saved as
    pipeline/train.py saves them."""
    bb, out = tiny_backbone, {}
    for kind in ("eagle", "medusa"):
        assert kind in pipeline.cli.groups()["heads"]
        cfg = compose_config(["model=tiny", f"heads={kind}"], config_name="train")
        h = component(cfg.heads, bb, token_counts=torch.ones(bb.model.args.vocab_size, dtype=torch.long))
        path = tmp_path_factory.mktemp(kind) / "heads.safetensors"
        h.save(path, {"vocab_size": bb.model.args.vocab_size, "fingerprint": bb.model.fingerprint(), "backbone": bb.name})
        out[kind] = str(path)
    return out


def hybrid_decoder(bb, heads, sources, *extra, variant=(), max_new_tokens=32):
    return decoder_for("tree_hybrid", bb, *variant, f"proposer.sources=[{','.join(sources)}]",
                       f"proposer.eagle.checkpoint={heads['eagle']}", f"proposer.medusa.checkpoint={heads['medusa']}",
                       *extra, max_new_tokens=max_new_tokens)


@pytest.mark.parametrize("sources", [("eagle", "suffix"), ("medusa", "suffix")])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("variant", ["tied", "untied"])
def test_hybrid_greedy_equals_plain_greedy(tiny_variants, heads, sources, batch, variant):
    """Tied, the tiny model repeats itself (suffix drafts accepted); untied, it walks at random
    (drafts rejected); either way the tokens are plain greedy's, and no draft cache leaks."""
    bb = tiny_variants[variant]
    extra = () if variant == "tied" else ("+model.tie_embeddings=false",)
    prompts = [bb.tokenizer.encode(t) for t in TEXT_PROMPTS]
    ref = decoder_for("greedy", bb, *extra, max_new_tokens=32).run(prompts)
    spec = hybrid_decoder(bb, heads, sources, "proposer.nodes=null", f"batch_size={batch}", variant=extra)
    got = spec.run(prompts)
    assert [g.token_ids for g in got] == [g.token_ids for g in ref]
    assert sum(g.steps for g in got) < sum(g.steps for g in ref) or variant == "untied"
    assert isinstance(spec.proposer, HybridProposer) and set(spec.proposer.sources) == set(sources)
    eagle = spec.proposer.sources.get("eagle")
    assert eagle is None or not eagle.kv.sequences
    assert not spec.proposer.sources["suffix"].seqs and len(spec.proposer.sources["suffix"].cache) == len(prompts)


def test_hybrid_sized_by_measured_costs_is_lossless(tiny_backbone, heads):
    bb = tiny_backbone
    prompts = [bb.tokenizer.encode(t) for t in TEXT_PROMPTS]
    ref = decoder_for("greedy", bb, max_new_tokens=24).run(prompts)
    spec = hybrid_decoder(bb, heads, ("eagle", "suffix"), "batch_size=2", max_new_tokens=24)
    assert [g.token_ids for g in spec.run(prompts)] == [g.token_ids for g in ref]
    tree = spec.describe()["tree"]
    assert tree["nodes"] == "auto" and set(tree["step_ms_by_drafts"]) >= {0, 12}


@pytest.mark.parametrize("batch", [1, 2])
def test_constrained_hybrid_drafts_forced_tokens_and_equals_constrained_greedy(tiny_backbone, heads, batch):
    from components.constraint.grammar import Regex
    bb = tiny_backbone
    prompts = [bb.tokenizer.encode(t) for t in TEXT_PROMPTS[:2]] * 2
    grammars = [chain_fsm(bb), Regex(bb, pattern="[0-9]{3}-(yes|no) [a-z]+"), chain_fsm(bb),
                Regex(bb, pattern="(ab)+c")]
    ref = decoder_for("greedy", bb, f"batch_size={batch}", max_new_tokens=16).run(prompts, grammars=grammars)
    spec = hybrid_decoder(bb, heads, ("eagle", "suffix"), "proposer.nodes=null", f"batch_size={batch}", max_new_tokens=16)
    got = spec.run(prompts, grammars=grammars)
    assert [g.token_ids for g in got] == [g.token_ids for g in ref]
    assert got[0].token_ids[:3] == [100, 101, 102] and got[0].finish_reason == "constraint_complete"
    assert got[0].steps < ref[0].steps  # the forced chains went in two steps, not six
    assert spec.proposer.sized["forced"] >= 6
