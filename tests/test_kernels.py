"""The kernel plan's invariance probe (components/model/tuner.py) on kernels that behave as the
ones seen on real CPUs: invariant as they are (torch's int4), from 2 rows (oneDNN's bfloat16 on
AVX-512), only from 32 rows (oneDNN's bfloat16 on AMX), or never. The probe must find the padding
that makes a product invariant, the plan must take it, a tree then equals plain greedy, and where
nothing is invariant the run says so and `auto` does not pick that precision."""
from __future__ import annotations

import json

import pytest
import torch

import components.model.cost_model as cost_model
import components.model.kernels as kernels
import components.model.linear as linear
import components.model.llama as llama
import components.model.tuner as tuner
from components.model import load
from components.model.load import tiny
from pipeline.build import build_engine

from helpers import compose_config

PROMPTS = ["Once upon a time, in a land far away,", "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3",
           "The quick brown fox jumps over the lazy dog. The quick brown fox"]
REAL_MATMUL = kernels.matmul


def row_dependent(from_rows: int | None):
    """A product whose bits for a row depend on the row count below `from_rows` (None: at every
    count), as oneDNN's bfloat16 kernels do below their blocking size: the few-row path computes in
    float32 and rounds once with a per-count offset of a few ulps."""
    def product(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        n = x2.shape[0]
        exact = x2.double() @ w.double()  # float32's own BLAS is not invariant (its rounding to bfloat16 shows on AMX)
        if from_rows is not None and n >= from_rows:
            return exact.to(x2.dtype)
        return (exact * (1 + n * 2.0 ** -9)).to(x2.dtype)
    return product


def emulate(monkeypatch, xw_from: int | None, linear_from: int | None):
    """Every Dense product (layers and LM head) through `row_dependent` kernels: "xw" invariant from
    `xw_from` rows, "linear" from `linear_from` (None: never)."""
    prods = {"xw": row_dependent(xw_from), "linear": row_dependent(linear_from)}

    def matmul(x, w, wt, kernel, min_rows=1):
        if w.dtype == torch.float32:
            return REAL_MATMUL(x, w, wt, kernel, min_rows)
        x2 = x.reshape(-1, x.shape[-1])
        y = prods.get(kernel, prods["xw"])(kernels.at_least(x2, min_rows), w)[:x2.shape[0]]
        return y.view(*x.shape[:-1], y.shape[-1])

    for mod in (kernels, tuner, cost_model, linear, llama):
        monkeypatch.setattr(mod, "matmul", matmul)


def optimized_tiny(dtype: str = "bfloat16"):
    bb = tiny(dtype=dtype, native=False)  # torch's kernels: the ones the probe vouches for
    bb.model.optimize_for_decoding(cache=None)  # measured now, not read from a cache
    return bb


def run(bb, preset: str, batch: int, *extra: str) -> list[list[int]]:
    cfg = compose_config(["model=tiny", f"decode={preset}", "max_new_tokens=24", f"batch_size={batch}",
                          "model.dtype=bfloat16", *extra])
    engine, _ = build_engine(cfg, bb)
    prompts = [bb.tokenizer.encode(t, add_special_tokens=False) for t in PROMPTS]
    return [g.token_ids for g in engine.run(prompts)]


def test_probe_finds_the_fewest_rows_from_which_a_product_is_invariant():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(1)).bfloat16()
    for from_rows, expected in ((1, 1), (2, 2), (3, 4), (32, 32), (64, 64), (None, 0)):
        fn = lambda x, p=row_dependent(from_rows): p(x, w)
        assert tuner.min_invariant_rows(fn, 64, torch.bfloat16) == expected, from_rows
    x = torch.randn(5, 64).bfloat16()
    fn = row_dependent(32)
    assert not torch.equal(fn(x[:1], w), fn(x, w)[:1])  # the emulated kernel really is row-dependent


def test_plan_pads_to_32_rows_where_only_that_is_invariant_and_trees_stay_lossless(monkeypatch):
    """The AMX case: "xw" invariant only from 32 rows, "linear" never. The plan pads every bfloat16
    product to 32 rows with "xw", and trees and batches then equal plain greedy at batch 1."""
    emulate(monkeypatch, xw_from=32, linear_from=None)
    bb = optimized_tiny()
    plan = bb.model.layers[0].plan
    assert plan.min_rows == {p: 32 for p in kernels.PRODUCTS}
    assert all(set(plan.kernels[p].values()) == {"xw"} for p in kernels.PRODUCTS)
    assert bb.batch_invariant and bb.lossless_notice(True, True) is None
    assert all(getattr(b, n).min_rows == 32 for b in bb.model.layers for n in b.MATRICES)
    ref = run(bb, "greedy", 1)
    assert run(bb, "greedy", 3) == ref
    assert run(bb, "tree_ngram", 3, "proposer.min_ngram=1") == ref
    assert run(bb, "self_spec", 1) == ref


def test_plan_takes_the_kernel_invariant_without_padding_when_one_is(monkeypatch):
    emulate(monkeypatch, xw_from=None, linear_from=1)
    plan = optimized_tiny().model.layers[0].plan
    assert plan.min_rows == {p: 1 for p in kernels.PRODUCTS}
    assert all(set(plan.kernels[p].values()) == {"linear"} for p in kernels.PRODUCTS)


def test_no_invariant_path_is_said_in_one_line_and_in_results(monkeypatch, capsys, tmp_path):
    emulate(monkeypatch, xw_from=None, linear_from=None)
    bb = optimized_tiny()
    plan = bb.model.layers[0].plan
    assert plan.min_rows == {p: 0 for p in kernels.PRODUCTS} and not plan.invariant()
    assert not bb.batch_invariant and bb.describe()["not_invariant"] == list(kernels.PRODUCTS)
    assert bb.lossless_notice(False, False) is None  # plain greedy at batch 1 is its own reference
    from pipeline.decode import decode
    cfg = compose_config(["model=tiny", "model.dtype=bfloat16", "decode=tree_ngram", "max_new_tokens=8",
                          "prompt=Once upon a time"], output_dir=tmp_path)
    capsys.readouterr()
    decode(cfg, bb)
    err = [line for line in capsys.readouterr().err.splitlines() if "batch-invariant" in line]
    assert len(err) == 1 and "bfloat16" in err[0] and "model.dtype=float32" in err[0]
    summary = json.loads((tmp_path / "results.json").read_text())["summary"]
    assert summary["lossless_notice"] == err[0] and summary["batch_invariant"] is False


def test_auto_skips_a_precision_without_an_invariant_path_for_speculative_runs(monkeypatch):
    costs = {"float32": {"ms": 9.0, "invariant": False}, "bfloat16": {"ms": 3.0, "invariant": False},
             "q4": {"ms": 5.0, "invariant": True}}
    monkeypatch.setattr(cost_model, "precision_costs", lambda *a, **k: {c: costs[c] for c in a[1]})
    args = llama.LlamaArgs()
    assert load.resolve_precision("auto", list(costs), args, torch.device("cpu"))[0] == "bfloat16"
    assert load.resolve_precision("auto", list(costs), args, torch.device("cpu"), invariant=True)[0] == "q4"
    assert load.resolve_precision("auto", ["float32", "bfloat16"], args, torch.device("cpu"), invariant=True)[0] == "float32"
    assert load.resolve_precision("bfloat16", list(costs), args, torch.device("cpu"), invariant=True)[0] == "bfloat16"


def test_auto_weighs_the_rows_of_the_run(monkeypatch):
    """`auto` is told the rows of the run's steps (batch size x tree rows) and picks by the cost
    of a step that size: here q4 wins one row and bfloat16 a 24-sequence batch."""
    from pipeline.build import step_rows
    seen = []

    def costs(args, candidates, device, cache, rows=1, native=True):
        seen.append(rows)
        ms = {"float32": 9.0 * rows, "bfloat16": 3.0 + 0.1 * rows, "q4": 1.0 + 0.5 * rows}
        return {c: {"ms": ms[c], "invariant": True, "rows": rows} for c in candidates}
    monkeypatch.setattr(cost_model, "precision_costs", costs)
    args, cpu = llama.LlamaArgs(), torch.device("cpu")
    assert load.resolve_precision("auto", ["float32", "bfloat16", "q4"], args, cpu, step_rows=1)[0] == "q4"
    assert load.resolve_precision("auto", ["float32", "bfloat16", "q4"], args, cpu, step_rows=24)[0] == "bfloat16"
    assert seen == [1, 24]
    assert step_rows(compose_config(["decode=greedy", "batch_size=24"])) == 24
    assert step_rows(compose_config(["decode=tree_eagle", "batch_size=2", "tree.max_nodes=8"])) == 18
    assert step_rows(compose_config(["decode=beam"])) == 1


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("dtype", ["bfloat16", "q4"])
def test_precision_probe_on_model_shapes(dtype, native):
    """The real probe on random matrices of a small model's shapes: each product of this machine's
    kernels has an invariant path (what every CPU seen so far gives, padding included), and a step
    of more rows costs more."""
    args = llama.LlamaArgs(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128)
    one = cost_model.precision_costs(args, [dtype], torch.device("cpu"), None, rows=1, native=native)[dtype]
    many = cost_model.precision_costs(args, [dtype], torch.device("cpu"), None, rows=256, native=native)[dtype]
    assert one["invariant"] is True and many["invariant"] is True
    assert 0 < one["ms"] < many["ms"] and one["rows"] == 1 and many["rows"] == 256


def test_forced_kernels_are_not_vouched_for(monkeypatch):
    """LLM_DECODE_KERNELS (and GPUs) give a plan nothing probed: a speculative run is told."""
    monkeypatch.setenv("LLM_DECODE_KERNELS", "xw")
    bb = optimized_tiny("q4")
    assert not bb.model.layers[0].plan.probed and not bb.batch_invariant
    assert bb.describe()["not_invariant"] == list(kernels.PRODUCTS)
    assert "no batch-invariant kernel" in bb.lossless_notice(True, False)


@pytest.mark.parametrize("kernel", kernels.KERNELS)
def test_model_kernels_key_forces_one_kernel_unprobed(kernel):
    """`model.kernels=<kernel>` (what LLM_DECODE_KERNELS overrides): that kernel everywhere, nothing
    probed, and a speculative run is told."""
    bb = tiny(dtype="q4", native=False)
    bb.model.optimize_for_decoding(cache=None, kernels=kernel)
    plan = bb.model.layers[0].plan
    assert not plan.probed and not bb.batch_invariant
    assert all(set(plan.kernels[p].values()) == {kernel} for p in kernels.PRODUCTS)
    assert "no batch-invariant kernel" in bb.lossless_notice(True, False)


def test_model_head_and_kernels_keys_default_to_measuring_and_the_environment_overrides(monkeypatch):
    cfg = compose_config(["decode=greedy"])
    assert (cfg.model.head, cfg.model.kernels) == ("dtype", "auto")
    assert llama.decoding_choices(cfg.model.head, cfg.model.kernels) == ("dtype", "auto")
    monkeypatch.setenv("LLM_DECODE_HEAD", "int8")
    monkeypatch.setenv("LLM_DECODE_KERNELS", "xw")
    assert llama.decoding_choices("dtype", "linear") == ("int8", "xw")
    monkeypatch.setenv("LLM_DECODE_KERNELS", "fast")
    with pytest.raises(ValueError, match="LLM_DECODE_KERNELS"):
        llama.decoding_choices()


@pytest.mark.parametrize("head, kernel", [("int4", "auto"), ("dtype", "fast")])
def test_a_bad_head_or_kernels_value_fails_before_the_weights_load(head, kernel):
    with pytest.raises(ValueError, match="model.head" if head == "int4" else "model.kernels"):
        load.from_pretrained(path="/nonexistent/model.gguf", head=head, kernels=kernel)


@pytest.mark.parametrize("how", ["config", "env"])
def test_the_8bit_head_is_a_candidate_only_when_asked(monkeypatch, how):
    """`model.head=int8` (or LLM_DECODE_HEAD=int8) puts the q4 mode's 8-bit head among the plan's
    candidates; by default it is not measured (and holds no memory)."""
    seen, real = [], tuner.measure
    monkeypatch.setattr(tuner, "measure", lambda model: seen.append("int8" in tuner.candidates(model)["head"]) or real(model))
    tiny(dtype="q4", native=False).model.optimize_for_decoding(cache=None)
    if how == "env":
        monkeypatch.setenv("LLM_DECODE_HEAD", "int8")
    tiny(dtype="q4", native=False).model.optimize_for_decoding(cache=None, **({"head": "int8"} if how == "config" else {}))
    assert seen == [False, True]
