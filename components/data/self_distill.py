"""Self-distillation data (group `data`): the backbone's own greedy answers to the project's prompt
set, with the backbone's last hidden state at every response position.

The hidden states come for free: the core engine decodes the prompt set in batches (continuous
batching) and reports, with every committed token, the target hidden state that chose it, which is
exactly what a Medusa head reads. A sample is
  tokens[i]  = y_{i+1}, the i-th response token (i = 0..n-1),
  hidden[i]  = h after consuming the prompt (i = 0) or y_i (i >= 1), the state that predicts y_{i+1}.
The answers are stored in parts with the config that made them (`config.json`, `manifest.json`:
answers and tokens so far) and reused by every run with that config, whatever its size.

The prompts are `data.prompts`' mix (components/data/prompts.py: the template pool, the backbone's
own Magpie-style user turns, JSONL files), in an order whose every prefix is the set of that size; a
prompt may be a multi-turn list of messages, encoded with the chat template like a single text.

For an EAGLE-3 draft (`fuse_layers`, another config key) hidden[i] is [the fused layers' states |
the last state], kept by the same forward (`Transformer.tap`). Shard jobs (`shard`, `num_shards`)
each make their cells of the parts grid (`todo`); a job without a shard reads them all.

With `context=True` (an EAGLE draft that reads the prompt, `data.context=true`) every part also gets
a `context-*` file: the prompt's pairs, ctx_hidden[p] = h at prompt position p and ctx_tokens[p] =
the prompt token after it (p = 0..P-2; position P-1's state is the answer's hidden[0]), computed by
one prefill per prompt through the same core (`build_context`), after the answers, from the same
prompt order; a prompt whose recomputed last state is not its answer's hidden[0] is an error.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from components.data.magpie import Magpie
from components.data.prompts import PromptMix, parse_sources, prompt_filter
from components.kv.contiguous import ContiguousKV
from components.kv.paged import PagedKV
from components.sampler.logits import Sampler
from pipeline.core import Engine, StepBatch, UserError, atomic_write, encode_chat, forward_step, positive_int


@dataclass
class DistillSet:
    tokens: torch.Tensor  # (total,) long: response tokens of all samples, concatenated
    hidden: torch.Tensor  # (total, dim) bf16: the hidden state that predicts each token
    offsets: torch.Tensor  # (samples + 1,) long: sample s spans [offsets[s], offsets[s + 1])
    context: "DistillSet | None" = None  # the prompts' pairs, same layout (data.context=true)

    @property
    def samples(self) -> int:
        return self.offsets.numel() - 1

    def split(self, val_fraction: float, seed: int = 0) -> tuple["DistillSet", "DistillSet"]:
        """Split by sample (never inside one answer), holding out about `val_fraction` of them.
        Whether sample i is held out depends on i and the seed alone, so the first n answers of a
        larger set hold out exactly the larger set's held-out answers among them (a set too small to
        hold out any by that rule holds out its first-ranked one)."""
        if self.samples < 2:
            return self, self.subset(torch.zeros(0, dtype=torch.long))
        idx = torch.arange(self.samples)
        u = ((idx * 2654435761 + seed * 0x9E3779B9 + 12345) % 2**32).double() / 2**32  # low-discrepancy in i
        val = u < val_fraction
        if not val.any():
            val[u.argmin()] = True
        return self.subset(idx[~val]), self.subset(idx[val])

    def subset(self, idx: torch.Tensor) -> "DistillSet":
        spans = [(int(self.offsets[i]), int(self.offsets[i + 1])) for i in idx]
        sel = torch.cat([torch.arange(a, b) for a, b in spans]) if spans else torch.zeros(0, dtype=torch.long)
        lengths = torch.tensor([b - a for a, b in spans], dtype=torch.long)
        return DistillSet(self.tokens[sel], self.hidden[sel], torch.cat((torch.zeros(1, dtype=torch.long), lengths.cumsum(0))),
                          None if self.context is None else self.context.subset(idx))


def generate_batch(backbone, prompts: list[list[int]], max_new_tokens: int,
                   batch_size: int | None = None, kv=None, taps: tuple[int, ...] = ()) -> list[tuple[list[int], torch.Tensor]]:
    """Greedy answers of the prompts with the hidden state before each token, decoded by the core
    engine `batch_size` at a time (default: all together) with continuous batching. With `taps`
    (EAGLE-3's fused layers) each state is [those layers' states | the last], from the same forward."""
    engine = Engine(backbone.model, kv or PagedKV(backbone), Sampler(do_sample=False), backbone.eos_ids,
                    max_new_tokens, batch_size=batch_size or len(prompts))
    hidden: list[list[torch.Tensor]] = [[] for _ in prompts]
    with tapping(backbone.model, taps):
        gens = engine.run(prompts, on_tokens=lambda i, ids, h: hidden[i].append(h.to(torch.bfloat16)))
    return [(g.token_ids, torch.cat(hs)) for g, hs in zip(gens, hidden)]


@contextmanager
def tapping(model, taps: tuple[int, ...]):
    """The model keeps the states of `taps` (llama.Transformer.tap) inside the block, as it did after."""
    before = model.taps
    model.tap(taps)
    try:
        yield
    finally:
        model.tap(before)


def data_dir(root: str | Path, config: dict) -> Path:
    key = hashlib.sha1(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
    return Path(root) / f"self_distill-{key}"


PART = re.compile(r"part-(\d{6})-(\d{6})\.safetensors")


def parts(out: Path) -> list[tuple[int, int, Path]]:
    """The saved parts of a set, as (first prompt, end prompt, path), sorted."""
    found = ((PART.fullmatch(p.name), p) for p in out.glob("part-*.safetensors"))
    return sorted((int(m[1]), int(m[2]), p) for m, p in found if m)


def todo(out: Path, n: int, chunk: int, shard: int | None = None, num_shards: int = 1) -> list[tuple[int, int]]:
    """The answer ranges of the first n that no part holds yet, one part each. One job cuts each
    missing run into `chunk`s from its start (a set grows from where it stops). Shard i of
    num_shards cuts on the grid of `chunk` cells from answer 0 and takes the cells k with
    k % num_shards == i: shard jobs write disjoint parts, and for a set made from scratch exactly
    the parts one job writes."""
    held = [False] * n + [True]  # a sentinel: every run ends
    for a, b, _ in parts(out):
        held[a:min(b, n)] = [True] * max(0, min(b, n) - a)
    cells = [(0, n)] if shard is None else [(k * chunk, min((k + 1) * chunk, n))
                                           for k in range(shard, -(-n // chunk), num_shards)]
    ranges = []
    for lo, hi in cells:
        i = lo
        while i < hi:
            if held[i]:
                i += 1
                continue
            j = i
            while j < hi and not held[j]:
                j += 1
            ranges += [(a, min(a + chunk, j)) for a in range(i, j, chunk)]
            i = j
    return ranges


def covered(out: Path) -> int:
    """How many prompts from the start of the order have saved answers (the contiguous prefix)."""
    end = 0
    for a, b, _ in parts(out):
        if a > end:
            break
        end = max(end, b)
    return end


def build_self_distill(backbone, max_samples: int = 2000, max_new_tokens: int = 192, batch_size: int = 16,
                       prompt_seed: int = 0, root: str = "outputs/data", chat: bool = True,
                       save_every: int = 8, context: bool = False, fuse_layers: list[int] | None = None,
                       shard: int | None = None, num_shards: int = 1, prompts=None,
                       magpie: dict | None = None) -> DistillSet:
    """The backbone's answers to the first `max_samples` training prompts, generated where missing.

    One directory holds every answer made with one generation config (model, precision, answer
    length, prompt order, filter, and the fused layers an EAGLE-3 draft reads when it asks for
    them); its size is not part of that config, so asking for more answers generates only the new
    ones and a smaller request reads a prefix. Answers are saved in parts of `save_every` x
    `batch_size` prompts, so an interrupted job resumes where it stopped. With `fuse_layers` each
    state is [those layers' states | the last one] ((len + 1) dim wide), from the same forward.
    `shard` (of `num_shards`) makes only that shard's parts (`make_self_distill`), then reads the
    set, which needs every shard's parts. `prompts`, `magpie`: where the prompts come from
    (data.prompts, data.magpie: `prompt_mix`)."""
    out, config = make_self_distill(backbone, max_samples, max_new_tokens, batch_size, prompt_seed, root, chat,
                                    save_every, fuse_layers, shard, num_shards, prompts, magpie)
    if covered(out) < max_samples and shard is not None:
        raise UserError(f"{out}: shard {shard} of {num_shards} is made, {covered(out)} of {max_samples} answers are: "
                        "run the other shards (data.shard=...) or one job without data.shard, then train; "
                        "data.only=true makes a shard job stop after its data")
    ds = _first(out, max_samples)
    if context:
        with open(out / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            build_context(backbone, out, config, max_samples, batch_size, prompt_mix(backbone, prompts, prompt_seed,
                                                                                        root, magpie))
        ds.context = _first(out, max_samples, "context")
    return ds


def make_self_distill(backbone, max_samples: int = 2000, max_new_tokens: int = 192, batch_size: int = 16,
                      prompt_seed: int = 0, root: str = "outputs/data", chat: bool = True, save_every: int = 8,
                      fuse_layers: list[int] | None = None, shard: int | None = None,
                      num_shards: int = 1, prompts=None, magpie: dict | None = None) -> tuple[Path, dict]:
    """Generate the missing parts of the first `max_samples` answers (only shard `shard`'s, of
    `num_shards`, when given: see `todo`); returns the set's directory and generation config."""
    for name, v in (("max_samples", max_samples), ("max_new_tokens", max_new_tokens), ("batch_size", batch_size),
                    ("save_every", save_every), ("num_shards", num_shards)):
        positive_int(v, f"data.{name}")
    if shard is not None and (isinstance(shard, bool) or not isinstance(shard, int) or not 0 <= shard < num_shards):
        raise UserError(f"data.shard must be an int in 0..{num_shards - 1} (data.num_shards={num_shards}), got {shard!r}")
    mix = prompt_mix(backbone, prompts, prompt_seed, root, magpie)
    config = {"model": backbone.name, "fingerprint": backbone.model.fingerprint(), "precision": backbone.precision,
              "max_new_tokens": max_new_tokens, "prompt_seed": prompt_seed, "chat": chat, "decoding": "greedy",
              "prompt_filter": prompt_filter()}
    if fuse_layers is not None:  # only then: the sets made before fusion keep their key
        config["fuse_layers"] = [int(i) for i in fuse_layers]
    if mix.describe() is not None:  # only then: the sets of the template pool alone keep their key
        config["prompts"] = mix.describe()
    out = data_dir(root, config)
    chunk, mine = batch_size * save_every, (shard, num_shards)
    if todo(out, max_samples, chunk, *mine):
        out.mkdir(parents=True, exist_ok=True)
        # one process per shard generates; others (DDP ranks) wait, then load. Shards write disjoint parts.
        with open(out / (".lock" if shard is None else f".lock-{shard}-of-{num_shards}"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            _generate(backbone, out, config, todo(out, max_samples, chunk, *mine), batch_size, mix)
    if covered(out):
        _note(out)
    return out, config


def prompt_mix(backbone, prompts=None, seed: int = 0, root: str | Path = "outputs/data",
               magpie: dict | None = None) -> PromptMix:
    """data.prompts (None: the template pool) as a PromptMix; its Magpie source, where it lists
    one, makes its rounds under `root` with the `magpie` knobs (data.magpie)."""
    sources = parse_sources(prompts)
    made = Magpie(backbone, root, **(magpie or {})) if any(s.kind == "magpie" for s in sources) else None
    return PromptMix(sources, seed, made)


def encode_prompt(tokenizer, prompt: str | list[dict], chat: bool = True) -> list[int]:
    """A training prompt's tokens: a text, or a conversation's messages, with the chat template."""
    if isinstance(prompt, str):
        return encode_chat(tokenizer, None, prompt, chat)
    if not chat:
        raise UserError("data.chat=false feeds prompts raw, but data.prompts gave a multi-turn conversation: "
                        "set data.chat=true or use single-turn prompts")
    return encode_chat(tokenizer, prompt, prompt[-1]["content"], chat)


def build_context(backbone, out: Path, config: dict, n: int, batch_size: int = 16,
                  mix: PromptMix | None = None) -> None:
    """The `context-*` file of every answer part that holds one of the first n answers and has none:
    the prompts prefilled `batch_size` at a time (one packed causal step, as the engine prefills),
    each prompt's pairs (h_p, prompt[p + 1]) for p < P - 1 saved; its last state must be the
    answer's hidden[0] (same model, precision and prompt), else the set is not this config's.
    `mix`: the set's prompts (None: the template pool, ordered by the config's prompt_seed)."""
    missing = [(a, b, p) for a, b, p in parts(out) if a < n and not _sibling(p, "context").is_file()]
    if not missing:
        return
    model, tok = backbone.model, backbone.tokenizer
    taps = tuple(config.get("fuse_layers", ()))
    prompts = (mix or PromptMix(parse_sources(None), config["prompt_seed"])).take(max(b for _, b, _ in missing))
    kv = ContiguousKV(backbone)
    bar = tqdm(total=sum(b - a for a, b, _ in missing), desc="prompt context", unit="prompt")
    for a, b, path in missing:
        with safe_open(path, "pt") as f:  # each answer's first state only, not the whole part
            offsets, rows = f.get_tensor("offsets"), f.get_slice("hidden")
            first = {i: rows[int(o):int(o) + 1][0].float() for i, o in enumerate(offsets[:-1]) if offsets[i + 1] > o}
        samples = []
        for start in range(a, b, batch_size):
            encoded = [encode_prompt(tok, p, config["chat"]) for p in prompts[start:min(start + batch_size, b)]]
            seqs = [kv.create() for _ in encoded]
            step = StepBatch.build(seqs, [torch.tensor(e) for e in encoded], [None] * len(seqs), [None] * len(seqs),
                                   [0] * len(seqs), model.attn_dtype)
            with torch.inference_mode(), tapping(model, taps):
                h = forward_step(model, kv, step)
                h = (h if not taps else torch.cat((model.tapped, h), dim=-1)).to(torch.bfloat16)  # as the answers
            for k, (e, q) in enumerate(zip(encoded, seqs)):
                kv.free(q)
                hk = h[step.offsets[k]:step.offsets[k + 1]]
                i = start - a + k
                want = first.get(i, hk[-1].float())
                if (hk[-1].float() - want).abs().max() > 0.05 * want.abs().max():
                    raise UserError(f"{out}: the prompt of answer {start + k} does not reproduce its first hidden "
                                    "state: the prompt order or the model changed; delete the set and regenerate it")
                samples.append((e[1:], hk[:-1].clone()))
        _save(_sibling(path, "context"), samples)
        bar.update(b - a)
    bar.close()


def _note(out: Path) -> None:
    """manifest.json: the answers saved so far (the contiguous prefix) and their tokens; rewritten
    when it no longer says so (a job interrupted after its last part)."""
    answers, path = covered(out), out / "manifest.json"
    if path.is_file() and json.loads(path.read_text()).get("answers") == answers:
        return
    tokens = sum(int(offsets[-1]) for _, _, offsets in _reading(out, answers))
    atomic_write(path, json.dumps({"answers": answers, "tokens": tokens}, indent=2))


def _generate(backbone, out: Path, config: dict, ranges: list[tuple[int, int]], batch_size: int,
              mix: PromptMix) -> None:
    """One part per answer range [start, end) of the mix's prompts."""
    if not ranges:
        return
    atomic_write(out / "config.json", json.dumps(config, indent=2))
    prompts = mix.take(max(end for _, end in ranges))
    tok = backbone.tokenizer
    taps = tuple(config.get("fuse_layers", ()))
    bar = tqdm(total=sum(end - start for start, end in ranges), desc="self-distill", unit="answer")
    for start, end in ranges:
        encoded = [encode_prompt(tok, p, config["chat"]) for p in prompts[start:end]]
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))  # similar lengths pad less
        answers = generate_batch(backbone, [encoded[i] for i in order], config["max_new_tokens"], batch_size, taps=taps)
        samples = [None] * len(encoded)
        for i, a in zip(order, answers):
            samples[i] = a  # saved in prompt order, so any prefix of the set is well defined
        _save(out / f"part-{start:06d}-{end:06d}.safetensors", samples)
        bar.update(end - start)
        bar.set_postfix(tokens=sum(len(t) for t, _ in samples))
    bar.close()


def _sibling(part: Path, kind: str) -> Path:
    """An answer part's file of another kind ("context"), or the part itself (kind="part")."""
    return part if kind == "part" else part.with_name(part.name.replace("part-", f"{kind}-", 1))


def _offsets(path: Path) -> torch.Tensor:
    with safe_open(path, "pt") as f:
        return f.get_tensor("offsets")


def _reading(out: Path, n: int, kind: str = "part") -> list[tuple[Path, int, torch.Tensor]]:
    """The parts that hold answers 0..n-1, each with how many of its answers to read and its
    offsets. Parts are contiguous (one generator at a time, under the lock, starts where the
    saved ones end); a gap, a short part or too few answers is an error, never a silent shortfall."""
    plan, end = [], 0
    for a, b, p in parts(out):
        if end >= n:
            break
        p = _sibling(p, kind)
        offsets = _offsets(p)
        if a != end or offsets.numel() - 1 != b - a:
            raise UserError(f"{out}: part {p.name} does not continue the answers before it (at {end}) or is "
                               "short: delete it and rerun to regenerate it")
        plan.append((p, min(b, n) - a, offsets))
        end = min(b, n)
    if end < n:
        raise UserError(f"{out}: {end} answers saved, {n} asked for: rerun to generate the rest")
    return plan


def _first(out: Path, n: int, kind: str = "part") -> DistillSet:
    """The first `n` answers (or their prompts' pairs: kind="context"), copied part by part into
    tensors allocated once."""
    plan = _reading(out, n, kind)
    lengths = torch.cat([offsets[:k + 1].diff() for _, k, offsets in plan])
    total = int(lengths.sum())
    with safe_open(plan[0][0], "pt") as f:
        row = f.get_slice("hidden")[:1]  # dim and dtype
    hidden = torch.empty(total, row.shape[-1], dtype=row.dtype)
    tokens = torch.empty(total, dtype=torch.long)
    at = 0
    for p, k, offsets in plan:
        m = int(offsets[k])
        with safe_open(p, "pt") as f:
            hidden[at:at + m] = f.get_slice("hidden")[:m]
            tokens[at:at + m] = f.get_slice("tokens")[:m]
        at += m
    return DistillSet(tokens, hidden, torch.cat((torch.zeros(1, dtype=torch.long), lengths.cumsum(0))))


def _pack(samples) -> DistillSet:
    lengths = torch.tensor([len(t) for t, _ in samples], dtype=torch.long)
    return DistillSet(torch.tensor([x for t, _ in samples for x in t], dtype=torch.long),
                      torch.cat([h for _, h in samples]), torch.cat((torch.zeros(1, dtype=torch.long), lengths.cumsum(0))))


def _write(path: Path, ds: DistillSet) -> None:
    atomic_write(path, lambda tmp: save_file({"tokens": ds.tokens, "hidden": ds.hidden.contiguous(),
                                              "offsets": ds.offsets}, tmp))


def _save(path: Path, samples) -> None:
    _write(path, _pack(samples))
