"""The GGUF reader and the precision modes: our de-quantization equals gguf-py's bit for bit for every
tensor type, the 4-bit blocks map exactly onto torch's int4 format, the q/k row order is the one
transformers uses, the caches are keyed by content, and a head checkpoint loads in every precision."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from components.model import gguf as ours
from components.model.assemble import PRECISIONS
from components.model.linear import Int4, quantize_q4
from components.model.load import content_key, from_pretrained, smollm2_gguf, tiny
from pipeline.core import UserError

from helpers import TEXT_PROMPTS, compose_config, decoder_for


@pytest.fixture(scope="module")
def real_file():
    return ours.GGUFFile(smollm2_gguf())


def gguf_py(t: ours.RawTensor, kind: str) -> np.ndarray:
    from gguf import GGMLQuantizationType, dequantize
    return dequantize(t.data, GGMLQuantizationType[kind]).reshape(t.shape)


@pytest.mark.parametrize("name,kind", [("blk.3.attn_q.weight", "Q4_1"), ("blk.0.ffn_down.weight", "Q4_1"),
                                       ("token_embd.weight", "Q8_0"), ("blk.7.attn_norm.weight", "F32")])
def test_dequantize_equals_gguf_py_on_the_shipped_file(real_file, name, kind):
    t = real_file.tensors[name]
    assert t.kind == kind
    assert np.array_equal(ours.dequantize(t).numpy(), gguf_py(t, kind))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "F16", "BF16"])
def test_dequantize_equals_gguf_py_per_type(kind):
    """Every supported type on weights quantized by gguf-py itself (the shipped file has three)."""
    from gguf import GGMLQuantizationType, quantize
    w = (torch.randn(8, 96, generator=torch.Generator().manual_seed(1)) * 0.05).numpy()
    data = quantize(w, GGMLQuantizationType[kind])
    t = ours.RawTensor(kind, (8, 96), data)
    assert np.array_equal(ours.dequantize(t).numpy(), gguf_py(t, kind))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_q4_blocks_are_the_gguf_weights_exactly(kind):
    """codes, scale, zero with w = (q - 8) * scale + zero reproduce gguf-py's weights: exactly in
    float64 (scale = d, zero = m + 8d), and float32 differs from it only by float32 rounding."""
    from gguf import GGMLQuantizationType, quantize
    w = (torch.randn(16, 128, generator=torch.Generator().manual_seed(2)) * 0.05).numpy()
    t = ours.RawTensor(kind, (16, 128), quantize(w, GGMLQuantizationType[kind]))
    b = ours.q4_blocks(t)
    assert b.codes.dtype == torch.uint8 and int(b.codes.max()) <= 15
    ref = torch.from_numpy(gguf_py(t, kind)).double()
    q, sc, z = b.codes.double() - 8, b.scale.double().repeat_interleave(32, 1), b.zero.double().repeat_interleave(32, 1)
    # gguf-py computes d * q + m in float32: compare against it rounded the same way
    assert torch.allclose(q * sc + z, ref, rtol=0, atol=1e-6)
    assert torch.allclose(b.dequantize().double(), ref, rtol=0, atol=1e-6)


def test_int4_kernel_computes_the_blocks_with_bf16_scales(real_file):
    """The int4 kernel's weights, read back through the identity, are (q - 8) * bf16(d) + bf16(m + 8d):
    the only rounding of a Q4_1 block is its two scales to bfloat16 (and the product's output)."""
    t = real_file.tensors["blk.5.attn_output.weight"]
    b = ours.q4_blocks(t)
    m = Int4(b.codes, b.scale, b.zero)
    bf = lambda x: x.to(torch.bfloat16).float()  # noqa: E731
    expect = (b.codes.float() - 8) * bf(b.scale).repeat_interleave(32, 1) + bf(b.zero).repeat_interleave(32, 1)
    got = m.dense().t()  # (out, in), bf16 output of the kernel
    assert torch.equal(got, bf(expect))


def test_row_order_is_transformers_reverse_permute(real_file):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
    a = real_file.args()
    w = ours.dequantize(real_file.tensors["blk.2.attn_k.weight"])
    proc = LlamaTensorProcessor(config={"num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads})
    ref = proc.process(w.numpy(), "blk.2.attn_k.weight").weights
    assert np.array_equal(w[ours.row_order(w.shape[0], a.n_kv_heads)].numpy(), ref)


def test_quantize_q4_round_trips_within_half_a_step():
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    codes, scale, zero = quantize_q4(w)
    back = ours.Q4Blocks(codes, scale, zero).dequantize()
    step = scale.repeat_interleave(32, 1)
    assert bool(((back - w).abs() <= step / 2 + 1e-6).all())


def test_cache_is_keyed_by_content_and_holds_no_weights(tmp_path, monkeypatch):
    """The same file under another path shares the tokenizer cache; nothing of weight size is written."""
    monkeypatch.setenv("PIPELINE_CACHE", str(tmp_path / "cache"))
    src = smollm2_gguf()
    copy = tmp_path / "elsewhere" / src.name
    copy.parent.mkdir()
    shutil.copy(src, copy)
    a = from_pretrained(dtype="q4")
    b = from_pretrained(path=str(copy), dtype="q4")
    assert content_key(src) == content_key(copy)
    entries = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len([e for e in entries if e.endswith("-tokenizer")]) == 1, entries
    big = [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and p.stat().st_size > 20e6]
    assert not big, big
    assert a.model.fingerprint() == b.model.fingerprint()


def test_fingerprint_is_the_same_in_every_precision():
    from components.model import native
    dtypes = ("float32", "bfloat16", "q4") + (("w4a8",) if native.load() is not None else ())  # w4a8: native only
    prints = {p: tiny(dtype=p).model.fingerprint() for p in dtypes}
    assert len(set(prints.values())) == 1, prints


def test_bad_precision_is_one_line():
    with pytest.raises(UserError, match="model.dtype must be one of"):
        tiny(dtype="int3")
    assert PRECISIONS == ("auto", "float32", "bfloat16", "q4", "w4a8")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "q4", "w4a8"])
def test_shipped_heads_load_in_every_precision(dtype, tmp_path):
    """decode=tree_medusa with the shipped heads in a non-float32 precision (once refused as 'trained
    on another backbone')."""
    from pipeline.build import build_engine
    bb = from_pretrained(dtype=dtype)
    assert bb.precision == dtype
    engine, _ = build_engine(compose_config(["decode=tree_medusa", f"model.dtype={dtype}", "max_new_tokens=8"]), bb)
    prompt = bb.tokenizer.encode("The capital of France is", add_special_tokens=False)
    assert len(engine.run([prompt])[0].token_ids) == 8


@pytest.mark.parametrize("dtype", ["bfloat16", "q4"])
def test_tiny_modes_decode_losslessly_and_record_their_precision(dtype, tmp_path):
    """Every preset equals greedy in the same mode (tiny model, batch 1 and 3), and results.json
    says which precision ran."""
    from pipeline.decode import decode
    bb = tiny(dtype=dtype)
    assert bb.precision == dtype
    prompts = [bb.tokenizer.encode(t, add_special_tokens=False) for t in TEXT_PROMPTS[:3]]
    ref = [g.token_ids for g in decoder_for("greedy", bb, max_new_tokens=24).run(prompts)]
    for preset, extra in (("tree_ngram", ("proposer.min_ngram=1",)), ("self_spec", ()), ("greedy", ())):
        for batch in (1, 3):
            got = decoder_for(preset, bb, *extra, f"batch_size={batch}", max_new_tokens=24).run(prompts)
            assert [g.token_ids for g in got] == ref, (preset, batch)
    cfg = compose_config(["model=tiny", f"model.dtype={dtype}", "decode=greedy", "max_new_tokens=4", "chat=false",
                          "stream=false"], output_dir=tmp_path, prompt="hello")
    _, objs = decode(cfg)
    assert objs["results"]["summary"]["precision"] == dtype


def test_resume_refuses_items_of_another_precision(tmp_path):
    """A run directory's finished requests were decoded in one precision; resuming in another would
    mix them: a one-line error names both."""
    import json as _json
    from pipeline.decode import decode
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": "a", "prompt": "hello"}\n{"id": "b", "prompt": "there"}\n')
    args = ["model=tiny", "decode=greedy", "max_new_tokens=3", "chat=false", "stream=false", f"input={inp}"]
    decode(compose_config(args, output_dir=tmp_path / "run"))
    items = tmp_path / "run" / "items.jsonl"
    lines = [_json.loads(x) for x in items.read_text().splitlines()]
    assert all(x["precision"] == "float32" for x in lines)
    items.write_text("".join(_json.dumps({**x, "precision": "q4"}) + "\n" for x in lines[:1]))
    with pytest.raises(UserError, match="decoded in q4, this run computes in float32"):
        decode(compose_config(args, output_dir=tmp_path / "run"))


def test_int8_head_is_row_invariant_and_within_half_a_step():
    """The q4 mode's 8-bit LM head: each weight within half a step of its row's scale (the bfloat16
    scale the kernel multiplies by), and a row's bits never depend on the rows computed with it."""
    from components.model.tuner import min_invariant_rows
    from components.model.linear import Int8Rows
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(5))
    head = Int8Rows(w)
    step = head.scale.float()[None, :]  # (1, out): [in, out] layout
    assert bool(((head.dense() - w.t()).abs() <= step / 2 + 1e-6).all())
    assert min_invariant_rows(head, 64, torch.bfloat16) == 1
    x = torch.randn(5, 64).bfloat16()
    assert torch.allclose(head(x).float(), x.float() @ head.dense(), rtol=2e-2, atol=2e-2)


def test_tiny_q4_with_the_int8_head_decodes_losslessly():
    """Where the machine picks the 8-bit head (components/model/tuner.py), every step uses it: trees
    and batches still equal greedy in the same mode."""
    from components.model.kernels import BUCKETS
    from components.model.linear import Int8Rows
    bb = tiny(dtype="q4")
    m = bb.model
    m.head_q8 = Int8Rows(m.lm_head.detach().t())
    plan = m.layers[0].plan
    saved = dict(plan.kernels.get("head", {}))
    try:
        plan.kernels["head"] = {b: "int8" for b in (*BUCKETS, 0)}
        prompts = [bb.tokenizer.encode(t, add_special_tokens=False) for t in TEXT_PROMPTS[:3]]
        h = m.norm(m.tok_embeddings(torch.tensor([prompts[0][:4]])))[0]
        assert torch.equal(m.logits(h), m.head_q8(h).float())  # the 8-bit head is what runs
        ref = [g.token_ids for g in decoder_for("greedy", bb, max_new_tokens=24).run(prompts)]
        for preset, extra in (("tree_ngram", ("proposer.min_ngram=1",)), ("self_spec", ())):
            for batch in (1, 3):
                got = decoder_for(preset, bb, *extra, f"batch_size={batch}", max_new_tokens=24).run(prompts)
                assert [g.token_ids for g in got] == ref, (preset, batch)
    finally:
        plan.kernels["head"] = saved
        m.head_q8 = None
