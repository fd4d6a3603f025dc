"""The paged KV's prefix cache (components/kv/paged.py): full blocks keyed by a chain hash of their
tokens, shared by reference, kept after their sequences end and evicted least recently used, never
leaking a block; and on the real model (q4, batch-invariant), every request's tokens with the cache
on equal those with it off: greedy and tree_eagle, shared and unshared prefixes, several requests
at once, beam search, a chat whose second turn extends the first, and the server's /metrics.

The unit tests write, at every slot, a value that is a function of the tokens up to it (`kv_of`),
as a batch-invariant model does: a cached block is right exactly when every sequence's gathered KV
equals `kv_of` of its own tokens."""
from __future__ import annotations

import random

import httpx
import pytest
import torch

from components.kv.paged import ROOT, PagedKV, chain_key
from components.model.load import from_pretrained
from pipeline.build import build_engine
from pipeline.core import Request, StepBatch, encode_chat

from helpers import compose_config
from serving import client, live_server, metric

L, NKV, HS, BS = 2, 1, 2, 4


def pool(num_blocks: int = 4) -> PagedKV:
    return PagedKV(block_size=BS, num_blocks=num_blocks, n_layers=L, n_kv_heads=NKV, head_dim=HS, prefix_cache=True)


def kv_of(prefix: list[int]) -> torch.Tensor:
    """What a batch-invariant model writes at the slot of prefix[-1]: (L, 2, NKV, HS), a function of
    the prefix alone."""
    return torch.randn(L, 2, NKV, HS, generator=torch.Generator().manual_seed(hash(tuple(prefix)) & 0xFFFFFFFF))


def write(kv: PagedKV, toks: dict, seq: int, rows: list[int], parents: list[int] | None = None) -> None:
    """One step of `rows` after the committed tokens toks[seq]: a chain, or a tree (parents[i] < i,
    -1 the root), each row's KV that of its sequence's tokens followed by its path in the tree."""
    parents = list(range(-1, len(rows) - 1)) if parents is None else parents
    paths: list[list[int]] = []
    for tok, p in zip(rows, parents):
        paths.append((paths[p] if p >= 0 else []) + [tok])
    vals = torch.stack([kv_of(toks[seq] + path) for path in paths], dim=2)  # (L, 2, n, NKV, HS)
    plan = kv.begin_step(StepBatch.build([seq], [torch.tensor(rows)], [None], [None], [kv.used(seq)]))
    for layer in range(L):
        kv.update(layer, vals[layer, 0], vals[layer, 1], plan)
    kv.end_step(plan)


def prefill(kv: PagedKV, toks: dict, prompt: list[int]) -> tuple[int, int]:
    """As the engine does: a sequence for the prompt, the uncached rest written and committed.
    Returns (seq, cached slots)."""
    seq = kv.create(prompt)
    cached = kv.length(seq)
    toks[seq] = prompt[:cached]
    write(kv, toks, seq, prompt[cached:])
    kv.commit(seq)
    toks[seq] = list(prompt)
    return seq, cached


def check(kv: PagedKV, toks: dict) -> None:
    """Every sequence holds kv_of its own tokens; reference counts are the tables' holdings; every
    block is free, idle (cached, held by none) or held, exactly one of them."""
    assert sorted(kv.sequences) == sorted(toks)
    for seq, t in toks.items():
        assert kv.length(seq) == len(t)
        want = torch.stack([kv_of(t[:i + 1]) for i in range(len(t))]) if t else torch.zeros(0, L, 2, NKV, HS)
        for layer in range(L):
            k, v = kv.gather(seq, layer)  # (NKV, n, HS)
            assert torch.equal(k, want[:, layer, 0].transpose(0, 1)) and torch.equal(v, want[:, layer, 1].transpose(0, 1))
    held = [0] * len(kv.ref)
    for table in kv.tables.values():
        for b in table:
            held[b] += 1
    assert kv.ref == held
    free, idle, used = set(kv._free), set(kv._idle), {b for b, r in enumerate(kv.ref) if r > 0}
    assert len(free) == len(kv._free) and not (free & idle or free & used or idle & used)
    assert free | idle | used == set(range(kv.pool.shape[2]))
    assert idle <= set(kv._key_of) and {b: k for k, b in kv.cached.items()} == kv._key_of


def finish(kv: PagedKV, toks: dict) -> None:
    """Free every sequence: nothing is held, every block free or idle in the cache."""
    for seq in list(toks):
        kv.free(seq)
        del toks[seq]
    check(kv, toks)
    assert kv.blocks_in_use == 0 and kv.stats()["bytes_in_use"] == 0 and not any(kv.ref)
    assert len(kv._free) + len(kv._idle) == kv.pool.shape[2]


def test_a_chain_key_names_the_block_and_everything_before_it():
    a = chain_key(ROOT, [1, 2, 3, 4])
    assert a == chain_key(ROOT, [1, 2, 3, 4]) and a != chain_key(ROOT, [1, 2, 3, 5])
    assert chain_key(a, [5, 6, 7, 8]) != chain_key(ROOT, [5, 6, 7, 8])  # the same tokens after another prefix


def test_a_prompt_takes_the_full_cached_blocks_of_an_earlier_one_and_computes_its_last_token():
    kv, toks = pool(), {}
    a, cached = prefill(kv, toks, list(range(10)))
    assert cached == 0 and kv.stats()["cached_blocks"] == 2  # two full blocks, the third partial
    kv.free(a)
    del toks[a]
    assert kv.blocks_in_use == 0 and kv.stats()["idle_cached_blocks"] == 2
    b, cached = prefill(kv, toks, list(range(9)) + [99])
    assert cached == 8
    _, cached = prefill(kv, toks, list(range(8)))
    assert cached == 4  # both blocks are cached, but the last token's logits are needed: its block is computed
    assert kv.ref[kv.tables[b][0]] == 2 and kv.stats()["shared_blocks"] == 1
    _, cached = prefill(kv, toks, [5] + list(range(1, 10)))
    assert cached == 0
    _, cached = prefill(kv, toks, [0, 1, 2, 9] + list(range(4, 10)))
    assert cached == 0  # block 1's tokens are cached, but after another block 0
    stats = kv.stats()
    assert stats["prefix_hit_tokens"] == 12 and stats["prefix_queried_tokens"] == 10 + 10 + 8 + 10 + 10
    assert stats["prefix_hit_rate"] == 12 / 48
    check(kv, toks)
    finish(kv, toks)


def test_answers_and_accepted_tree_paths_are_cached_for_the_next_turn():
    kv, toks = pool(), {}
    a, _ = prefill(kv, toks, [7, 8, 9, 10, 11, 12])
    for tok in (13, 14, 15):  # plain steps: one committed token each
        write(kv, toks, a, [tok])
        kv.commit(a)
        toks[a].append(tok)
    write(kv, toks, a, [16, 17, 18, 19, 20], [-1, 0, 0, 2, 3])  # a tree: 16 -> {17, 18 -> 19 -> 20}
    kv.commit(a, [0, 2, 3, 4])  # the path 16, 18, 19, 20
    toks[a] += [16, 18, 19, 20]
    check(kv, toks)
    assert kv.stats()["cached_blocks"] == 3  # 13 slots: three full blocks
    turn2 = toks[a] + [21, 22, 23]
    kv.free(a)
    del toks[a]
    _, cached = prefill(kv, toks, turn2)
    assert cached == 12
    check(kv, toks)
    finish(kv, toks)


def test_idle_blocks_are_evicted_least_recently_freed_first_a_chain_from_its_tail():
    kv, toks = pool(num_blocks=4), {}
    a0, a1 = chain_key(ROOT, [0, 1, 2, 3]), chain_key(chain_key(ROOT, [0, 1, 2, 3]), [4, 5, 6, 7])
    for prompt in ([0, 1, 2, 3, 4, 5, 6, 7], [100, 101, 102, 103, 104, 105, 106, 107]):
        seq, _ = prefill(kv, toks, prompt)
        kv.free(seq)
        del toks[seq]
    assert kv.stats()["idle_cached_blocks"] == 4 and kv._free == []
    prefill(kv, toks, [200, 201, 202])  # one block: the first chain's tail goes, taken back rather than grown
    assert a1 not in kv.cached and a0 in kv.cached and kv.stats()["evicted_blocks"] == 1 and kv.pool.shape[2] == 4
    _, cached = prefill(kv, toks, [100, 101, 102, 103, 104, 105, 106, 107, 108])
    assert cached == 8 and a0 not in kv.cached  # the second chain held again; its third block took a0
    check(kv, toks)
    kv.reset_prefix_cache()
    assert kv.stats()["cached_blocks"] == 0 and kv.stats()["prefix_hit_tokens"] == 0
    check(kv, toks)
    finish(kv, toks)


def test_a_truncated_sequence_never_writes_into_a_cached_block():
    kv, toks = pool(num_blocks=16), {}
    a, _ = prefill(kv, toks, list(range(8)))
    b, cached = prefill(kv, toks, list(range(8)) + [9])
    assert cached == 8 and kv.tables[a][:2] == kv.tables[b][:2]
    for seq, new in ((b, [60, 61]), (a, [50, 51])):  # b shares the cached block it writes into: copied first;
        kv.truncate(seq, 6)  # then a holds its own alone: it leaves the cache before a writes into it
        toks[seq] = toks[seq][:6]
        write(kv, toks, seq, new)
        kv.commit(seq)
        toks[seq] += new
        check(kv, toks)
    kv.free(b)
    del toks[b]
    for tail, hit in (([6, 7], 4), ([60, 61], 8), ([50, 51], 8)):  # 6, 7 were overwritten; b's copy and a's block are cached
        _, cached = prefill(kv, toks, list(range(6)) + tail + [9])
        assert cached == hit
    check(kv, toks)
    finish(kv, toks)


@pytest.mark.parametrize("seed", range(3))
def test_random_operations_keep_every_sequence_equal_to_its_tokens_and_leak_nothing(seed):
    rng = random.Random(seed)
    kv, toks = pool(num_blocks=2), {}
    hits = evicted = 0
    stems = [[rng.randrange(5) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    for _ in range(400):
        op = rng.choice("pppcssttdfkxxxxxr" if toks else "p")
        seq = rng.choice(list(toks)) if toks else None
        if op == "p":  # a prompt: part of a stem, and some tokens of its own
            hits += prefill(kv, toks, rng.choice(stems)[:rng.randrange(1, 14)] + [rng.randrange(5) for _ in range(rng.randrange(1, 6))])[1]
        elif op == "c":  # a sequence made without a prompt: no lookup, no tokens kept, nothing registered
            new, rows = kv.create(), [rng.randrange(5) for _ in range(rng.randrange(1, 7))]
            toks[new] = []
            write(kv, toks, new, rows)
            kv.commit(new)
            toks[new] = rows
        elif op in "st":  # a plain step, or a tree whose accepted path is committed
            n = rng.randrange(1, 6)
            rows = [rng.randrange(5) for _ in range(n)]
            parents = None if op == "s" else [-1] + [rng.randrange(i) for i in range(1, n)]
            write(kv, toks, seq, rows, parents)
            if parents is None:
                kv.commit(seq)
                toks[seq] += rows
            else:
                node, path = rng.randrange(n), []
                while node >= 0:
                    path.append(node)
                    node = parents[node]
                kv.commit(seq, sorted(path))
                toks[seq] += [rows[i] for i in sorted(path)]
        elif op == "d":  # a draft pass: tentative slots discarded
            write(kv, toks, seq, [rng.randrange(5) for _ in range(rng.randrange(1, 4))])
            kv.discard(seq)
        elif op == "f":
            new = kv.fork(seq)
            toks[new] = list(toks[seq])
        elif op == "k":
            n = rng.randrange(len(toks[seq]) + 1)
            kv.truncate(seq, n)
            toks[seq] = toks[seq][:n]
        elif op == "x":
            kv.free(seq)
            del toks[seq]
        else:
            evicted += kv.evictions
            kv.reset_prefix_cache()
        check(kv, toks)
    assert hits > 0 and evicted + kv.evictions > 0
    finish(kv, toks)


def test_the_cache_is_off_where_the_backbone_is_not_batch_invariant(tiny_backbone):
    assert not tiny_backbone.batch_invariant  # float32: a row's bits depend on the rows beside it
    kv = PagedKV(tiny_backbone, prefix_cache=True)
    assert not kv.stats()["prefix_cache"]
    seq = kv.create([1] * 40)
    assert kv.length(seq) == 0


# --------------------------------------------------------------------------------------------------
# the real model
# --------------------------------------------------------------------------------------------------

SYSTEM = ("You are a patient tutor. Explain every idea in plain words, give one short example, and "
          "end with a question that checks the reader understood. Keep answers brief.")
QUESTIONS = ["What is a prime number?", "Why is the sky blue?", "What does a compiler do?", "Name a fast animal."]


@pytest.fixture(scope="module")
def q4():
    """The real model in q4, batch-invariant on the native kernels: the prefix cache is on."""
    bb = from_pretrained(dtype="q4")
    assert bb.batch_invariant, "no batch-invariant path on this machine: the prefix cache stays off"
    return bb


def engine(bb, preset: str, cache: bool, *overrides: str, batch: int = 4, max_new_tokens: int = 16):
    cfg = compose_config([f"decode={preset}", "kv=paged", f"kv.prefix_cache={str(cache).lower()}",
                          f"batch_size={batch}", f"max_new_tokens={max_new_tokens}", "model.dtype=q4", *overrides])
    return build_engine(cfg, bb)[0]


def serve(runner, prompts: list[list[int]]) -> list:
    """The first request prefilled alone, then the others added while it decodes (continuous
    batching: more than a batch, so some join later). The Generations, in order."""
    out = {}
    handles = [runner.add(Request(list(prompts[0]), 0))]
    out.update(runner.step())
    handles += [runner.add(Request(list(p), i)) for i, p in enumerate(prompts[1:], 1)]
    while runner.has_work:
        out.update(runner.step())
    assert runner.kv.sequences == [] and runner.kv.stats()["blocks_in_use"] == 0
    return [out[h] for h in handles]


@pytest.fixture(scope="module")
def prompts(q4):
    """Shared system prompt x 4 questions, one of them twice, and one prompt with none of it."""
    tok = q4.tokenizer
    shared = [encode_chat(tok, None, q, system_prompt=SYSTEM) for q in QUESTIONS]
    return shared[:2] + [shared[0]] + shared[2:] + [encode_chat(tok, None, "Say hello in French.")]


@pytest.mark.slow
@pytest.mark.parametrize("preset,overrides", [
    ("greedy", ()),
    ("tree_eagle", ("tree.width=2", "tree.depth=3", "tree.max_nodes=6", "proposer.nodes=null")),
])
def test_requests_give_the_same_tokens_with_the_prefix_cache(q4, prompts, preset, overrides):
    off = serve(engine(q4, preset, False, *overrides), prompts)
    on_engine = engine(q4, preset, True, *overrides)
    on = serve(on_engine, prompts)
    assert [g.token_ids for g in on] == [g.token_ids for g in off]
    stats = on_engine.kv.stats()
    shared = len(encode_chat(q4.tokenizer, None, "", system_prompt=SYSTEM)) // 16 * 16 - 16
    assert stats["prefix_hit_tokens"] >= 4 * shared and stats["prefix_queried_tokens"] == sum(map(len, prompts))
    if preset != "greedy":
        assert sum(g.steps for g in on) < sum(len(g.token_ids) for g in on), "no draft was ever accepted"


@pytest.mark.slow
def test_an_eagle_draft_that_caches_the_prompt_prefills_it_whole(q4, prompts):
    runner = engine(q4, "tree_eagle", True, "proposer.nodes=null")
    runner.proposer.context = True  # as a draft trained with prompt context (`context: prompt`)
    on = serve(runner, prompts[:3])
    assert runner.kv.stats()["prefix_queried_tokens"] == 0
    assert [g.token_ids for g in on] == [g.token_ids for g in serve(engine(q4, "greedy", False), prompts[:3])]


@pytest.mark.slow
def test_beam_search_gives_the_same_beams_with_the_prefix_cache(q4, prompts):
    runs = {}
    for cache in (False, True):
        runner = engine(q4, "beam", cache, "num_beams=2", "num_return_sequences=2", batch=2, max_new_tokens=8)
        runs[cache] = [g.beams for g in serve(runner, prompts[:3])]
    assert runs[True] == runs[False]
    assert runner.kv.stats()["prefix_hit_tokens"] > 0


@pytest.mark.slow
def test_a_second_chat_turn_prefills_only_what_the_first_did_not_hold(q4):
    tok = q4.tokenizer
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[1]}]
    first = encode_chat(tok, chat, "")
    runners = {cache: engine(q4, "greedy", cache, batch=1, max_new_tokens=24) for cache in (False, True)}
    answers = {cache: serve(r, [first])[0].token_ids for cache, r in runners.items()}
    assert answers[True] == answers[False]
    chat += [{"role": "assistant", "content": tok.decode(answers[True], skip_special_tokens=True)},
             {"role": "user", "content": "Give me one more example."}]
    second = encode_chat(tok, chat, "")
    assert second[:len(first)] == first
    before = runners[True].kv.stats()["prefix_hit_tokens"]
    turn2 = {cache: serve(r, [second])[0].token_ids for cache, r in runners.items()}
    assert turn2[True] == turn2[False]
    hit = runners[True].kv.stats()["prefix_hit_tokens"] - before
    assert hit > len(first) // 16 * 16  # the first turn's prompt and part of its answer


@pytest.mark.slow
def test_the_server_reports_its_hit_rate(q4):
    system = SYSTEM + " " + " ".join(f"Rule {i}: be clear about step {i}." for i in range(30))
    with live_server("model=smollm2_135m", "model.dtype=q4", "decode=greedy", "batch_size=2", backbone=q4) as (_, url):
        c = client(url)
        usage = [c.chat.completions.create(model="smollm2_135m", max_tokens=4, temperature=0,
                                           messages=[{"role": "system", "content": system},
                                                     {"role": "user", "content": q}]).usage
                 for q in QUESTIONS[:2]]
        queries, hits = metric(url, "pipeline_prefix_cache_queries_total"), metric(url, "pipeline_prefix_cache_hits_total")
        assert queries == sum(u.prompt_tokens for u in usage)
        shared = len(encode_chat(q4.tokenizer, None, "", system_prompt=system)) // 16 * 16 - 16
        assert shared > 250 and hits >= shared  # the second request's system prompt, but its last block or so
        assert metric(url, "pipeline_prefix_cache_hit_rate") == pytest.approx(hits / queries)
        assert metric(url, "pipeline_kv_cached_blocks") > 0 and metric(url, "pipeline_kv_blocks_in_use") == 0
        assert "pipeline_prefix_cache_hit_rate" in httpx.get(f"{url}/metrics").text
