"""Our Transformer against transformers' LlamaForCausalLM on the same weights (fp32, 1e-3 max abs):
prefill, token-by-token decoding through ContiguousKV, and a block after a cache with an explicit
causal mask; on random small LlamaConfigs that exercise every architecture switch we claim to
support, on a Hugging Face folder loaded through `from_pretrained(path=...)`, and on the real model."""
from __future__ import annotations

import inspect
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from components.kv.contiguous import ContiguousKV
from components.model.llama import LlamaArgs
from components.model.load import build, convert_hf_state_dict, from_pretrained
from pipeline.core import forward_rows

ATOL = 1e-3
VOCAB = 101


def random_hf_llama(seed: int = 0, vocab_size: int = VOCAB, o_bias: bool = True, **overrides) -> LlamaForCausalLM:
    """A randomly initialised HF Llama. HF zeroes biases and sets norms to one at init, which would
    hide a loader that drops them, so every bias and norm weight is re-drawn here. `o_bias=False`
    keeps o_proj's bias at zero (q/k/v biases alone)."""
    kw = dict(vocab_size=vocab_size, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(LlamaConfig(**kw)).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                if o_bias or "o_proj" not in name:
                    p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
    return hf


def ours_from_hf(hf: LlamaForCausalLM):
    args = LlamaArgs.from_hf_config(hf.config)
    return build(args, convert_hf_state_dict(hf.state_dict(), args), "float32")


def make_kv(model, max_len=512):
    """A pool with one sequence; returns (kv, seq)."""
    a = model.args
    kv = ContiguousKV(None, max_len, a.n_layers, a.n_kv_heads, a.head_dim, model.dtype)
    return kv, kv.create()


@torch.no_grad()
def hf_logits(hf, tokens: torch.Tensor) -> torch.Tensor:
    return hf(input_ids=tokens).logits[0].float()  # (T, V)


@torch.no_grad()
def prefill_logits(model, tokens):
    T = tokens.shape[1]
    return model.logits(model(tokens, torch.arange(T)[None]))[0]  # (T, V)


@torch.no_grad()
def stepwise_logits(model, tokens):
    """Feed the tokens one at a time through a ContiguousKV, committing each."""
    kv, seq = make_kv(model)
    rows = []
    for i in range(tokens.shape[1]):
        h = forward_rows(model, kv, seq, tokens[0, i:i + 1])
        kv.commit(seq)
        rows.append(model.logits(h)[-1])
    assert kv.length(seq) == tokens.shape[1] and kv.pending(seq) == 0
    return torch.stack(rows)


@torch.no_grad()
def block_logits(model, tokens, split: int, explicit_mask: bool):
    """Prefill tokens[:split], commit, then the rest as one block after the cache."""
    kv, seq = make_kv(model)
    T = tokens.shape[1]
    h1 = forward_rows(model, kv, seq, tokens[0, :split])
    kv.commit(seq)
    n = T - split
    mask = torch.ones(n, n, dtype=torch.bool).tril_() if explicit_mask else None
    h2 = forward_rows(model, kv, seq, tokens[0, split:], torch.arange(n) if explicit_mask else None, mask)
    kv.commit(seq)
    return torch.cat((model.logits(h1), model.logits(h2)))


def assert_close(ours, ref, what):
    diff = (ours - ref).abs().max().item()
    assert diff < ATOL, f"{what}: max abs diff {diff:.3e} >= {ATOL}"


CONFIGS = {
    "gqa": dict(),
    "mha": dict(num_key_value_heads=4),
    "mqa_head_dim": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16),  # head_dim != dim / heads
    "qkv_bias": dict(attention_bias=True, o_bias=False),
    "attention_bias": dict(attention_bias=True),  # LlamaConfig's attention_bias also biases o_proj
    "tied": dict(tie_word_embeddings=True),
    "llama3_rope": dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "linear_rope": dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_random_llama_matches_transformers(name):
    kw = dict(CONFIGS[name])
    o_bias = kw.pop("o_bias", True)
    hf = random_hf_llama(seed=len(name), o_bias=o_bias, **kw)
    ours = ours_from_hf(hf)
    # the switches under test really reached our model
    assert ours.args.n_kv_heads == hf.config.num_key_value_heads
    assert ours.args.qkv_bias == bool(hf.config.attention_bias)
    assert ours.args.tie_embeddings == bool(hf.config.tie_word_embeddings)
    if "rope_scaling" in kw:  # the scaling must actually change the frequencies, or the case tests nothing
        d = ours.args.head_dim
        plain = 1.0 / ours.args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        assert not torch.allclose(ours.inv_freq.double(), plain)
    torch.testing.assert_close(ours.inv_freq, hf.model.rotary_emb.inv_freq.float(), rtol=1e-6, atol=0)

    g = torch.Generator().manual_seed(7)
    T = 40  # long enough for the transposed multi-row matmul path (12..256 rows) and position effects
    tokens = torch.randint(0, VOCAB, (1, T), generator=g)
    ref = hf_logits(hf, tokens)
    assert_close(prefill_logits(ours, tokens), ref, f"{name}: prefill")
    assert_close(stepwise_logits(ours, tokens), ref, f"{name}: one token at a time through ContiguousKV")
    assert_close(block_logits(ours, tokens, 13, explicit_mask=True), ref, f"{name}: block with explicit causal mask")
    assert_close(block_logits(ours, tokens, 29, explicit_mask=False), ref, f"{name}: block with the implicit mask")


def test_loader_refuses_or_keeps_every_weight():
    """A checkpoint tensor the converted model does not use must not vanish silently: every HF
    parameter of a Llama with attention_bias=True is either converted or refused."""
    hf = random_hf_llama(seed=3, attention_bias=True)
    args = LlamaArgs.from_hf_config(hf.config)
    try:
        ours = build(args, convert_hf_state_dict(hf.state_dict(), args), "float32")
    except (ValueError, KeyError, RuntimeError):
        return  # refusing the checkpoint is acceptable
    n_hf = sum(p.numel() for p in hf.parameters())
    n_ours = sum(p.numel() for n, p in ours.named_parameters() if n != "lm_head")  # lm_head: [in, out] copy
    n_ours += 0 if args.tie_embeddings else ours.lm_head.numel()
    assert n_ours == n_hf, f"converted model holds {n_ours} parameters, the HF checkpoint {n_hf}"


@pytest.mark.parametrize("tied", [False, True])
def test_hf_folder_loads_through_from_pretrained(tmp_path, tiny_backbone, tied):
    tok = tiny_backbone.tokenizer
    hf = random_hf_llama(seed=11, vocab_size=len(tok), tie_word_embeddings=tied,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    kwargs = {"safe_serialization": True} if "safe_serialization" in inspect.signature(hf.save_pretrained).parameters else {}
    hf.save_pretrained(tmp_path, **kwargs)
    tok.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["vocab_size"] == len(tok) and saved.get("tie_word_embeddings", False) == tied
    weights = {k: v for f in tmp_path.glob("*.safetensors") for k, v in load_file(f).items()}
    assert torch.equal(weights["model.embed_tokens.weight"], hf.model.embed_tokens.weight.detach())

    bb = from_pretrained(path=str(tmp_path), name="folder")
    assert bb.model.args.tie_embeddings == tied
    assert bb.tokenizer.encode("hello world") == tok.encode("hello world")
    assert tok.eos_token_id in bb.eos_ids
    tokens = torch.tensor([tok.encode("The quick brown fox jumps over the lazy dog, again and again.")])
    ref = hf_logits(hf, tokens)
    assert_close(prefill_logits(bb.model, tokens), ref, "HF folder: prefill")
    assert_close(stepwise_logits(bb.model, tokens), ref, "HF folder: stepwise")


def test_from_pretrained_max_seq_len_override(tmp_path, tiny_backbone):
    hf = random_hf_llama(seed=5, vocab_size=len(tiny_backbone.tokenizer))
    hf.save_pretrained(tmp_path)
    tiny_backbone.tokenizer.save_pretrained(tmp_path)
    assert from_pretrained(path=str(tmp_path)).model.args.max_seq_len == 512
    assert from_pretrained(path=str(tmp_path), max_seq_len=64).model.args.max_seq_len == 64


@pytest.mark.slow
def test_real_model_matches_transformers(real_backbone, real_hf):
    tok, model = real_backbone.tokenizer, real_backbone.model
    text = tok.apply_chat_template([{"role": "user", "content": "Name three colours of the rainbow."}],
                                   tokenize=False, add_generation_prompt=True)
    tokens = torch.tensor([tok.encode(text, add_special_tokens=False)])
    T = tokens.shape[1]
    assert T > 16
    ref = hf_logits(real_hf, tokens)
    assert_close(prefill_logits(model, tokens), ref, "real model: prefill")
    assert_close(block_logits(model, tokens, T - 6, explicit_mask=True), ref, "real model: block after cache")
    # the last 8 positions one at a time on top of a cached prefix
    kv, seq = make_kv(model)
    with torch.no_grad():
        forward_rows(model, kv, seq, tokens[0, :T - 8])
        kv.commit(seq)
        rows = []
        for i in range(T - 8, T):
            rows.append(model.logits(forward_rows(model, kv, seq, tokens[0, i:i + 1]))[-1])
            kv.commit(seq)
    assert_close(torch.stack(rows), ref[T - 8:], "real model: stepwise decode")
