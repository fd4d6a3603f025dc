"""Self-distillation data (group `data`): the backbone's own greedy answers to the project's prompt
set, with the backbone's last hidden state at every response position.

The hidden states come for free: the core engine decodes the prompt set in batches (continuous
batching) and reports, with every committed token, the target hidden state that chose it, which is
exactly what a Medusa head reads. A sample is
  tokens[i]  = y_{i+1}, the i-th response token (i = 0..n-1),
  hidden[i]  = h after consuming the prompt (i = 0) or y_i (i >= 1), the state that predicts y_{i+1}.
The set is stored with the config that made it and reused when that config matches.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from components.data.prompts import FILTER, training_prompts
from pipeline.core import Engine, atomic_write, encode_chat


@dataclass
class DistillSet:
    tokens: torch.Tensor  # (total,) long: response tokens of all samples, concatenated
    hidden: torch.Tensor  # (total, dim) bf16: the hidden state that predicts each token
    offsets: torch.Tensor  # (samples + 1,) long: sample s spans [offsets[s], offsets[s + 1])

    @property
    def samples(self) -> int:
        return self.offsets.numel() - 1

    def split(self, val_fraction: float, seed: int = 0) -> tuple["DistillSet", "DistillSet"]:
        """Split by sample (never inside one answer)."""
        g = torch.Generator().manual_seed(seed)
        order = torch.randperm(self.samples, generator=g)
        n_val = max(1, int(round(self.samples * val_fraction))) if self.samples > 1 else 0
        return self.subset(order[n_val:].sort().values), self.subset(order[:n_val].sort().values)

    def subset(self, idx: torch.Tensor) -> "DistillSet":
        spans = [(int(self.offsets[i]), int(self.offsets[i + 1])) for i in idx]
        sel = torch.cat([torch.arange(a, b) for a, b in spans]) if spans else torch.zeros(0, dtype=torch.long)
        lengths = torch.tensor([b - a for a, b in spans], dtype=torch.long)
        return DistillSet(self.tokens[sel], self.hidden[sel], torch.cat((torch.zeros(1, dtype=torch.long), lengths.cumsum(0))))


def generate_batch(backbone, prompts: list[list[int]], max_new_tokens: int,
                   batch_size: int | None = None, kv=None) -> list[tuple[list[int], torch.Tensor]]:
    """Greedy answers of the prompts with the hidden state before each token, decoded by the core
    engine `batch_size` at a time (default: all together) with continuous batching."""
    from components.kv.paged import PagedKV
    from components.sampler.logits import Sampler
    engine = Engine(backbone.model, kv or PagedKV(backbone), Sampler(do_sample=False), backbone.eos_ids,
                    max_new_tokens, batch_size=batch_size or len(prompts))
    hidden: list[list[torch.Tensor]] = [[] for _ in prompts]
    gens = engine.run(prompts, on_tokens=lambda i, ids, h: hidden[i].append(h.to(torch.bfloat16)))
    return [(g.token_ids, torch.cat(hs)) for g, hs in zip(gens, hidden)]


def data_dir(root: str | Path, config: dict) -> Path:
    key = hashlib.sha1(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
    return Path(root) / f"self_distill-{key}"


def build_self_distill(backbone, max_samples: int = 2000, max_new_tokens: int = 192, batch_size: int = 16,
                       prompt_seed: int = 0, root: str = "outputs/data", chat: bool = True,
                       save_every: int = 8) -> DistillSet:
    """Generate (or load) the set. Partial progress is saved every `save_every` batches, so an
    interrupted job resumes where it stopped."""
    for name, v in (("max_samples", max_samples), ("max_new_tokens", max_new_tokens), ("batch_size", batch_size)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"`data.{name}` must be a positive int, got {v}")
    config = {"model": backbone.name, "fingerprint": backbone.model.fingerprint(), "precision": backbone.precision,
              "max_samples": max_samples,
              "max_new_tokens": max_new_tokens, "prompt_seed": prompt_seed, "chat": chat, "decoding": "greedy",
              "prompt_filter": FILTER}
    out = data_dir(root, config)
    final = out / "data.safetensors"
    if final.is_file():
        return _load(final)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:  # one process generates; others (DDP ranks) wait, then load
        fcntl.flock(lock, fcntl.LOCK_EX)
        if final.is_file():
            return _load(final)
        return _generate(backbone, out, final, config, batch_size, save_every)


def _generate(backbone, out: Path, final: Path, config: dict, batch_size: int, save_every: int) -> DistillSet:
    max_samples, max_new_tokens = config["max_samples"], config["max_new_tokens"]
    prompt_seed, chat = config["prompt_seed"], config["chat"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    prompts = training_prompts(max_samples, seed=prompt_seed)
    tok = backbone.tokenizer
    encoded = [encode_chat(tok, None, p, chat) for p in prompts]
    parts = sorted(out.glob("part-*.safetensors"))
    done = sum(int(load_file(p)["offsets"].numel() - 1) for p in parts)
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))  # similar lengths pad less
    bar = tqdm(total=len(encoded), initial=done, desc="self-distill", unit="answer")
    chunk = save_every * batch_size  # prompts per saved part, decoded batch_size at a time
    for start in range(done, len(order), chunk):
        batch = [encoded[i] for i in order[start:start + chunk]]
        samples = generate_batch(backbone, batch, max_new_tokens, batch_size)
        _save(out / f"part-{start:06d}.safetensors", samples)
        bar.update(len(batch))
        bar.set_postfix(tokens=sum(len(t) for t, _ in samples))
    bar.close()
    parts = sorted(out.glob("part-*.safetensors"))
    merged = _merge([_load(p) for p in parts])
    _write(final, merged)
    for p in parts:
        p.unlink()
    return merged


def _pack(samples) -> DistillSet:
    lengths = torch.tensor([len(t) for t, _ in samples], dtype=torch.long)
    return DistillSet(torch.tensor([x for t, _ in samples for x in t], dtype=torch.long),
                      torch.cat([h for _, h in samples]), torch.cat((torch.zeros(1, dtype=torch.long), lengths.cumsum(0))))


def _merge(sets: list[DistillSet]) -> DistillSet:
    lengths = torch.cat([s.offsets.diff() for s in sets])
    return DistillSet(torch.cat([s.tokens for s in sets]), torch.cat([s.hidden for s in sets]),
                      torch.cat((torch.zeros(1, dtype=torch.long), lengths.cumsum(0))))


def _write(path: Path, ds: DistillSet) -> None:
    atomic_write(path, lambda tmp: save_file({"tokens": ds.tokens, "hidden": ds.hidden.contiguous(),
                                              "offsets": ds.offsets}, tmp))


def _save(path: Path, samples) -> None:
    _write(path, _pack(samples))


def _load(path: Path) -> DistillSet:
    t = load_file(path)
    return DistillSet(t["tokens"], t["hidden"], t["offsets"])
