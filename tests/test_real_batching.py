"""The lossless invariant on the real model, in every precision (w4a8 also under the AVX2 stand-in): on the first 12 of the 24 benchmark
prompts x 64 tokens in q4 (float32, bfloat16, tree_eagle and self_spec: the first 8), greedy at batch 8 and every tree preset (tree_medusa and tree_eagle
with the shipped drafts) give the tokens of plain greedy decoding (batch 1)
in the same precision, with kv=paged and kv=contiguous, with batch_size=8 and batch_size=1.

float32 runs every preset with both KV managers and both batch sizes; bfloat16 and q4, whose
products are batch-invariant (components/model/linear.py), run a cross-section. (The prompt counts
keep the suite within its time: `pytest -k real_batching` with PROMPTS raised checks all 24.)"""
from __future__ import annotations

import os

import pytest

from components.model.load import from_pretrained
from pipeline.bench import DEFAULT_INPUT
from pipeline.build import build_engine
from pipeline.requests import encode, load_requests

from helpers import compose_config

RUNS = [("float32", "greedy", "paged", 8), ("float32", "tree_ngram", "contiguous", 1),
        ("float32", "tree_ngram", "paged", 8), ("float32", "tree_medusa", "paged", 1),
        ("float32", "tree_medusa", "contiguous", 8), ("float32", "self_spec", "contiguous", 8),
        ("q4", "greedy", "paged", 8), ("q4", "tree_ngram", "contiguous", 1),
        ("q4", "tree_medusa", "paged", 8), ("q4", "self_spec", "contiguous", 1),
        ("bfloat16", "greedy", "contiguous", 8), ("bfloat16", "tree_medusa", "paged", 1),
        ("float32", "tree_eagle", "paged", 8), ("q4", "tree_eagle", "contiguous", 1),  # q4: the 4-bit draft
        ("w4a8", "greedy", "paged", 8), ("w4a8", "tree_eagle", "paged", 8), ("w4a8", "tree_medusa", "contiguous", 1),
        ("w4a8", "tree_ngram", "paged", 1),  # w4a8: the integer products, drafts too
        ("float32", "tree_hybrid", "paged", 8), ("w4a8", "tree_hybrid", "contiguous", 1)]  # EAGLE + suffix trees
PROMPTS = {"float32": 8, "q4": 12, "bfloat16": 8, "w4a8": 8}  # float32 runs the most cases, bfloat16 is the slowest per token
STAND_IN = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
FEWER = {"tree_eagle": 8, "self_spec": 8, "tree_hybrid": 4}  # prompts for the slowest runs (16-draft float32 trees, self-speculation, EAGLE + suffix)

_backbones: dict = {}
_reference: dict = {}


def backbone(dtype: str, real_backbone):
    if dtype == "float32":
        return real_backbone
    if dtype not in _backbones:
        _backbones[dtype] = from_pretrained(dtype=dtype)
    return _backbones[dtype]


@pytest.fixture(scope="module")
def bench_prompts(real_backbone):
    return [encode(real_backbone.tokenizer, r, True) for r in load_requests(str(DEFAULT_INPUT), None)]


def plain_greedy(bb, dtype: str, prompts) -> list[list[int]]:
    """Greedy on contiguous KV at batch 1 in this precision: the reference every run must equal."""
    if len(_reference.get(dtype, ())) != len(prompts):
        engine, _ = build_engine(compose_config(["decode=greedy", "max_new_tokens=64", f"model.dtype={dtype}"]), bb)
        _reference[dtype] = [g.token_ids for g in engine.run(prompts)]
    return _reference[dtype]


@pytest.mark.slow
@pytest.mark.parametrize("dtype,preset,kv,batch", RUNS)
def test_bench_prompts_equal_plain_greedy(real_backbone, bench_prompts, dtype, preset, kv, batch):
    assert len(bench_prompts) == 24
    limit = int(os.environ.get("REAL_BATCHING_PROMPTS", 24))  # fewer, where a stand-in process repeats a case
    n = min(FEWER.get(preset, PROMPTS[dtype]), limit)
    bb = backbone(dtype, real_backbone)
    assert bb.precision == dtype
    if dtype != "float32":
        assert bb.batch_invariant, "the kernel probe found no batch-invariant path on this machine"
    reference = plain_greedy(bb, dtype, bench_prompts[:min(PROMPTS[dtype], limit)])[:n]  # one reference per precision
    bench_prompts = bench_prompts[:n]
    forced = {"tree_medusa": ["proposer.nodes=null"],  # the installed tree, whatever pays here
              "tree_eagle": ["tree.width=4", "tree.depth=4", "tree.max_nodes=16", "proposer.nodes=null"],  # a 16-draft EAGLE-2 tree
              "tree_hybrid": ["proposer.nodes=null"],  # the merged ranking's best 12, whatever pays here
              }.get(preset, [])
    cfg = compose_config([f"decode={preset}", f"kv={kv}", f"batch_size={batch}", "max_new_tokens=64",
                          f"model.dtype={dtype}", *forced])
    engine, _ = build_engine(cfg, bb)
    gens = engine.run(bench_prompts)
    diverged = [i for i, (g, r) in enumerate(zip(gens, reference)) if g.token_ids != r]
    assert not diverged, f"{dtype} {preset} kv={kv} batch_size={batch} diverges from plain greedy on requests {diverged}"
    assert engine.kv.sequences == [] and engine.kv.stats()["bytes_in_use"] == 0
    if preset != "greedy":
        assert sum(g.steps for g in gens) < sum(len(g.token_ids) for g in gens), "no draft was ever accepted"


@pytest.mark.slow
def test_w4a8_under_the_avx2_stand_in():
    """The integer products' AVX2 path (what a Zen 3 runs) keeps the invariant too: greedy at batch 8
    and a 16-draft EAGLE tree equal batch-1 greedy, in a process that takes the stand-in's kernels."""
    import os
    import subprocess
    import sys
    from components.model import native
    if native.load() is None or native.load().w4a8_path() in ("avx2", "scalar"):
        pytest.skip("this process already runs the AVX2 kernels (or none)")
    here = os.path.dirname(__file__)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        os.path.join(here, "test_real_batching.py"), "-k", "w4a8-greedy or w4a8-tree_eagle"],
                       cwd=os.path.dirname(here), env={**os.environ, **STAND_IN, "REAL_BATCHING_PROMPTS": "4"},
                       capture_output=True, text=True)
    assert r.returncode == 0 and "2 passed" in r.stdout, (r.stdout + r.stderr)[-3000:]
