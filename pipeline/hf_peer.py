"""Benchmark peers: the same weights run through transformers' `LlamaForCausalLM.generate`, the
decoder a user would otherwise pick. The HF model is rebuilt from our Backbone (no files are read
again) with the inverse of `convert_hf_state_dict`, in the same dtype.

A peer has the Engine's calling convention (`run(prompts, seeds) -> list[Generation]`, and
`generate(prompt_ids, on_tokens, seed)` for one), so the benchmark times it with the same loop and
reports the same fields. `batch_size` prompts go to one batched `generate` call, left-padded, in
input order. Forward hooks record what transformers does not return: one entry per target forward
(its input length and wall time), from which the committed tokens per forward follow.
"""
from __future__ import annotations

import inspect
import time

import torch

from components.model.llama import LlamaArgs
from pipeline.core import Generation, UserError, positive_int

# peer name -> its `generate` knobs unless the bench entry overrides them
PEERS: dict[str, dict] = {
    "hf_greedy": {},
    "hf_beam": {"num_beams": 4},
    "hf_prompt_lookup": {"prompt_lookup_num_tokens": 10},
}
# entry overrides with these keys go to `generate`, every other one to the composed decode config
GENERATE_KNOBS = ("num_beams", "length_penalty", "early_stopping", "prompt_lookup_num_tokens",
                  "max_matching_ngram_size")


def to_hf_state_dict(model) -> dict[str, torch.Tensor]:
    """Ours ([in, out], fused q|k|v and gate|up) -> Hugging Face Llama names and layout ([out, in]).
    The inverse of `components.model.load.convert_hf_state_dict`. Tensors are contiguous copies:
    a peer gets the layout a user loading the checkpoint would get, not our faster one."""
    a: LlamaArgs = model.args
    if model.precision in ("q4", "w4a8"):
        raise UserError("the transformers peer needs dense weights: load the backbone with model.dtype=float32 "
                        "or bfloat16")
    q_out, kv_out = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    ours = {n: t.detach() for n, t in model.named_parameters()}
    take = ours.pop  # every parameter must be taken once: a new one would otherwise be dropped silently
    sd = {"model.embed_tokens.weight": take("tok_embeddings.weight"), "model.norm.weight": take("norm.weight"),
          "lm_head.weight": take("lm_head").t()}
    for i in range(a.n_layers):
        o, p = f"layers.{i}.", f"model.layers.{i}."
        at, m = p + "self_attn.", p + "mlp."
        q, k, v = take(o + "wqkv.weight").t().split([q_out, kv_out, kv_out])  # each (out, dim)
        sd.update({at + "q_proj.weight": q, at + "k_proj.weight": k, at + "v_proj.weight": v,
                   at + "o_proj.weight": take(o + "wo.weight").t()})
        if a.qkv_bias:
            bq, bk, bv = take(o + "bqkv").split([q_out, kv_out, kv_out])
            sd.update({at + "q_proj.bias": bq, at + "k_proj.bias": bk, at + "v_proj.bias": bv})
        if a.o_bias:  # HF's attention_bias biases o_proj as well; a q/k/v-only bias model gets zeros
            sd[at + "o_proj.bias"] = take(o + "bo")
        elif a.qkv_bias:
            sd[at + "o_proj.bias"] = torch.zeros(a.dim, dtype=sd[at + "q_proj.weight"].dtype)
        gate, up = take(o + "w13.weight").t().split([a.hidden_dim, a.hidden_dim])  # each (hidden, dim)
        sd.update({m + "gate_proj.weight": gate, m + "up_proj.weight": up, m + "down_proj.weight": take(o + "w2.weight").t(),
                   p + "input_layernorm.weight": take(o + "attn_norm.weight"),
                   p + "post_attention_layernorm.weight": take(o + "mlp_norm.weight")})
    if ours:
        raise RuntimeError(f"to_hf_state_dict does not know the parameters {sorted(ours)}: extend it")
    return {k: t.clone(memory_format=torch.contiguous_format) for k, t in sd.items()}


def hf_config(args: LlamaArgs):
    """The LlamaConfig of our args (the inverse of `LlamaArgs.from_hf_config`)."""
    from transformers import LlamaConfig  # transformers is slow to import: loaded only when a peer is built
    if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters:  # transformers >= 5
        rope = {"rope_parameters": {**(args.rope_scaling or {"rope_type": "default"}), "rope_theta": args.rope_theta}}
    else:
        rope = {"rope_theta": args.rope_theta, "rope_scaling": args.rope_scaling}
    eos = args.eos_token_ids[0] if len(args.eos_token_ids) == 1 else list(args.eos_token_ids) or None
    return LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.hidden_dim,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
        head_dim=args.head_dim, rms_norm_eps=args.norm_eps, max_position_embeddings=args.max_seq_len,
        tie_word_embeddings=args.tie_embeddings, attention_bias=args.qkv_bias, bos_token_id=args.bos_token_id,
        eos_token_id=eos, pad_token_id=args.eos_token_ids[0] if args.eos_token_ids else None, **rope)


def to_hf(backbone):
    """A `LlamaForCausalLM` holding the backbone's weights, in the backbone's dtype, in eval mode."""
    from transformers import LlamaForCausalLM  # slow to import, see hf_config
    try:  # transformers >= 5
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers < 5
        from transformers.modeling_utils import no_init_weights
    model = backbone.model
    with no_init_weights():  # every weight is loaded next: skip the random init
        hf = LlamaForCausalLM(hf_config(model.args))
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"HF Llama does not fit our weights: missing {missing}, unexpected {unexpected}")
    if model.args.tie_embeddings:
        hf.tie_weights()
    return hf.to(device=model.device, dtype=model.dtype).eval().requires_grad_(False)


class HFPeer:
    """`LlamaForCausalLM.generate` behind the Engine's interface. Tokens are the generated ones only,
    ending with the EOS token when it stopped there (HF's padding after EOS is dropped).

    Prompts run in groups of `batch_size`, in input order, one `generate` call per group: LEFT-padded
    with the pad id (the first EOS id), attention_mask 0 on the pads, as a user batching requests
    through transformers would. Every request of a group reports the group's wall time and prefill.
    Left padding changes the shapes of the matmuls, so in float a near-tie may resolve differently
    from the unpadded batch of one: that is the peer's behaviour, and the bench reports it as is."""

    def __init__(self, hf_model, eos_ids: list[int], max_new_tokens: int, seed: int = 0, batch_size: int = 1,
                 **generate_kwargs):
        from transformers import GenerationConfig  # slow to import, see hf_config
        positive_int(max_new_tokens, "max_new_tokens"), positive_int(batch_size, "batch_size")
        unknown = set(generate_kwargs) - set(GENERATE_KNOBS)
        if unknown:
            raise UserError(f"unknown peer knob(s) {sorted(unknown)}; known: {', '.join(GENERATE_KNOBS)}")
        self.prompt_lookup = generate_kwargs.get("prompt_lookup_num_tokens") is not None
        if self.prompt_lookup and batch_size > 1:
            raise UserError(f"transformers' prompt lookup decodes one request at a time, got batch_size={batch_size}: "
                            'give that entry batch_size=1, e.g. decodes=[greedy,"hf_prompt_lookup batch_size=1"]')
        self.model, self.eos_ids, self.seed, self.batch_size = hf_model, list(eos_ids), seed, batch_size
        self.pad_id = self.eos_ids[0]
        self.num_beams = int(generate_kwargs.get("num_beams", 1))
        self.generation_config = GenerationConfig(
            do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id, bos_token_id=hf_model.config.bos_token_id, **generate_kwargs)
        self._trace: list[list] = []  # per forward: [input length, start position, t0, ms]

    def _before(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        pos = kwargs.get("position_ids")  # (B, T): the first is the number of cached tokens (batch 1)
        self._trace.append([ids.shape[1], int(pos[0, 0]) if pos is not None else 0, time.perf_counter(), 0.0])

    def _after(self, module, args, output):
        self._trace[-1][3] = (time.perf_counter() - self._trace[-1][2]) * 1e3

    def generate(self, prompt_ids: list[int], on_tokens=None, seed: int | None = None) -> Generation:
        """One request on its own; on_tokens(ids) gets its tokens once it is done."""
        g = self.run([prompt_ids], [self.seed if seed is None else seed])[0]
        if on_tokens is not None and g.token_ids:
            on_tokens(g.token_ids)
        return g

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], seeds: list[int] | None = None, on_finish=None) -> list[Generation]:
        """Every prompt, `batch_size` per `generate` call. `seeds` is accepted for the Engine's
        interface; greedy, beam search and prompt lookup do not sample. on_finish(i, generation)
        as each group finishes."""
        for i, p in enumerate(prompts):
            if not p:
                raise UserError(f"request {i} has an empty prompt: give it some text")
        out: list[Generation] = []
        for g0 in range(0, len(prompts), self.batch_size):
            group = [list(p) for p in prompts[g0:g0 + self.batch_size]]
            out += self._group(group)
            if on_finish is not None:
                for i in range(g0, len(out)):
                    on_finish(i, out[i])
        return out

    def _group(self, group: list[list[int]]) -> list[Generation]:
        width = max(map(len, group))
        ids = torch.full((len(group), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for r, p in enumerate(group):  # left padding: every prompt ends at column width - 1
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        self._trace = []
        hooks = [self.model.register_forward_pre_hook(self._before, with_kwargs=True),
                 self.model.register_forward_hook(self._after)]  # peers may share one HF model
        try:
            t0 = time.perf_counter()
            dev = self.model.device
            out = self.model.generate(ids.to(dev), generation_config=self.generation_config,
                                      attention_mask=mask.to(dev)).cpu()
            wall = time.perf_counter() - t0
        finally:
            for h in hooks:
                h.remove()
        prefill = self._trace[0][3] if self._trace else 0.0
        gens = []
        for r, p in enumerate(group):
            toks = out[r, width:].tolist()
            stop = next((i for i, t in enumerate(toks) if t in self.eos_ids), None)
            toks = toks if stop is None else toks[:stop + 1]
            if self.prompt_lookup:  # batch 1: the forwards after the prefill are all this request's
                accepted, steps = self._accepted(len(p), len(toks)), self._trace[1:]
            else:  # one token per forward: the prefill, then one forward for each later token
                accepted, steps = [1] * len(toks), self._trace[1:len(toks)]
            gens.append(Generation(token_ids=toks, finish_reason="eos" if stop is not None else "length",
                                   accepted_lengths=accepted, step_ms=[ms for *_, ms in steps],
                                   step_nodes=[n for n, *_ in steps], tree_depths=[], wall_s=wall,
                                   prefill_ms=prefill))
        return gens

    def _accepted(self, prompt_len: int, new: int) -> list[int]:
        """Prompt lookup (batch 1): tokens committed per target forward. Each forward after the
        prefill starts at the newest committed token (its cache holds everything before it), so
        forward i committed the growth of the cache between forward i and i+1."""
        known = [c + 1 for _, c, *_ in self._trace[1:]] + [prompt_len + new]  # sequence length after each forward
        return [b - a for a, b in zip([prompt_len] + known[:-1], known)]
