"""LightningDataModule over the self-distillation set: (hidden state, K future targets) pairs for
Medusa heads, or whole answers (hidden states and tokens, padded per batch) for an EAGLE draft
(`sequences: true`, set by heads=eagle; an EAGLE-3 draft's states carry its fused layers too)."""
from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from components.data.prompts import parse_sources
from components.data.self_distill import DistillSet, build_self_distill, covered, make_self_distill, prompt_mix
from components.heads.eagle import resolve_fuse_layers
from pipeline.core import atomic_write, positive_int


def head_targets(ds: DistillSet, num_heads: int) -> torch.Tensor:
    """(total, K): column k-1 holds y_{t+1+k} = tokens[i + k] within the same answer, else -100."""
    n = ds.tokens.numel()
    out = torch.full((n, num_heads), -100, dtype=torch.long)
    sample_end = torch.repeat_interleave(ds.offsets[1:], ds.offsets.diff())  # (total,) end of each answer
    idx = torch.arange(n)
    for k in range(1, num_heads + 1):
        ok = idx + k < sample_end
        out[ok, k - 1] = ds.tokens[idx[ok] + k]
    return out


class Answers(Dataset):
    """One item per answer: (hidden (n, dim), tokens (n,), c) where the first c pairs are its prompt's
    (a set with context: the draft attends to them, no loss is taken on them; else c = 0); `pad`
    batches them to the longest."""

    def __init__(self, ds: DistillSet):
        self.ds = ds

    def __len__(self) -> int:
        return self.ds.samples

    def __getitem__(self, i: int):
        a, b = int(self.ds.offsets[i]), int(self.ds.offsets[i + 1])
        ctx = self.ds.context
        if ctx is None:
            return self.ds.hidden[a:b], self.ds.tokens[a:b], 0
        c, d = int(ctx.offsets[i]), int(ctx.offsets[i + 1])
        return (torch.cat((ctx.hidden[c:d], self.ds.hidden[a:b])), torch.cat((ctx.tokens[c:d], self.ds.tokens[a:b])), d - c)

    @staticmethod
    def pad(items):
        """-> hidden (B, T, dim), tokens (B, T) with -100 past each answer's end, and the context
        lengths (B,) when any item has context."""
        T = max(t.numel() for _, t, _ in items)
        hidden = torch.zeros(len(items), T, items[0][0].shape[-1], dtype=items[0][0].dtype)
        tokens = torch.full((len(items), T), -100, dtype=torch.long)
        for b, (h, t, _) in enumerate(items):
            hidden[b, :t.numel()], tokens[b, :t.numel()] = h, t
        ctx = torch.tensor([c for _, _, c in items], dtype=torch.long)
        return (hidden, tokens, ctx) if bool(ctx.any()) else (hidden, tokens)


class DistillDataModule(L.LightningDataModule):
    def __init__(self, backbone, num_heads: int, max_samples: int = 1600, max_new_tokens: int = 160,
                 gen_batch_size: int = 48, batch_size: int = 256, val_fraction: float = 0.05,
                 prompt_seed: int = 0, root: str = "outputs/data", chat: bool = True, num_workers: int = 0,
                 sequences: bool = False, answers_per_batch: int = 16, context: bool = False,
                 fuse_layers: list[int] | str | None = None, save_every: int = 8, shard: int | None = None,
                 num_shards: int = 1, only: bool | str = False, prompts=None, magpie: dict | None = None):
        """fuse_layers: the layers an EAGLE-3 draft fuses (heads.fuse_layers), stored with each state.
        shard / num_shards: this job makes only that shard's parts of the set (self_distill.todo);
        only: make the data and stop (shard jobs; `make`), the training then reads every shard's parts;
        only="prompts": make the prompts alone (data.prompts' Magpie rounds) and stop.
        prompts, magpie: where the prompts come from (data.prompts, its Magpie knobs data.magpie)."""
        super().__init__()
        if not 0 < val_fraction < 1:
            raise ValueError(f"`data.val_fraction` must be in (0, 1), got {val_fraction}")
        positive_int(batch_size, "data.batch_size")
        self.backbone, self.num_heads = backbone, num_heads
        fuse = resolve_fuse_layers(fuse_layers, backbone.model.args.n_layers)
        if fuse is not None and not sequences:
            raise ValueError("`data.fuse_layers` is for EAGLE-3 drafts (heads=eagle heads.fuse_layers=...): Medusa heads read one state")
        parse_sources(prompts)  # a bad data.prompts fails here, before any generation
        if only not in (True, False, "prompts"):
            raise ValueError(f"`data.only` must be true, false or prompts, got {only!r}")
        magpie = dict(magpie or {})
        self.make_kw = dict(max_samples=max_samples, max_new_tokens=max_new_tokens, batch_size=gen_batch_size,
                            prompt_seed=prompt_seed, root=root, chat=chat, save_every=save_every, fuse_layers=fuse,
                            shard=shard, num_shards=num_shards, prompts=prompts, magpie=magpie)
        self.gen_kw = dict(self.make_kw, context=bool(context))
        self.only = only
        if context and not sequences:
            raise ValueError("`data.context=true` is for EAGLE drafts (heads=eagle): Medusa heads read one state")
        self.batch_size, self.val_fraction, self.num_workers = batch_size, val_fraction, num_workers
        self.sequences, self.answers_per_batch = bool(sequences), int(answers_per_batch)
        self.train_set = self.val_set = None

    def build(self) -> DistillSet:
        return build_self_distill(self.backbone, **self.gen_kw)

    def make(self, out_dir: Path | None = None) -> dict:
        """Data only (`data.only=true`): this job's parts (its shard's, or all), no reading. Returns
        where the set is and how much of it exists. `data.only=prompts`: the first max_samples
        prompts only (the Magpie rounds they need), and how many are multi-turn; with `out_dir`
        they are also written there as prompts.jsonl (a prompt file: to read, to split, to feed
        data.prompts or the bench's input)."""
        kw = self.make_kw
        if self.only == "prompts":
            mix = prompt_mix(self.backbone, kw["prompts"], kw["prompt_seed"], kw["root"], kw["magpie"])
            made = mix.take(kw["max_samples"])
            written = None
            if out_dir is not None:
                written = Path(out_dir) / "prompts.jsonl"
                atomic_write(written, "".join(json.dumps({"messages": p} if isinstance(p, list) else {"prompt": p}) + "\n"
                                              for p in made))
            return {"prompts": len(made), "multi_turn": sum(isinstance(p, list) for p in made),
                    "magpie_dir": None if mix.magpie is None else str(mix.magpie.dir),
                    "prompts_file": None if written is None else str(written)}
        out, _ = make_self_distill(self.backbone, **kw)
        return {"data_dir": str(out), "answers": covered(out), "asked": self.make_kw["max_samples"],
                "shard": self.make_kw["shard"], "num_shards": self.make_kw["num_shards"]}

    def prepare_data(self):  # rank 0 generates; the others wait and load in setup
        self.make() if self.only else self.build()

    def setup(self, stage=None):
        train, val = self.build().split(self.val_fraction)
        self.train_set, self.val_set = train, val
        if self.sequences:
            self.train_ds, self.val_ds = Answers(train), Answers(val)
        else:
            self.train_ds = TensorDataset(train.hidden, head_targets(train, self.num_heads))
            self.val_ds = TensorDataset(val.hidden, head_targets(val, self.num_heads))

    def train_dataloader(self):
        if self.sequences:
            return DataLoader(self.train_ds, batch_size=self.answers_per_batch, shuffle=True,
                              num_workers=self.num_workers, collate_fn=Answers.pad)
        return DataLoader(self.train_ds, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self):
        if self.sequences:
            return DataLoader(self.val_ds, batch_size=64, num_workers=self.num_workers, collate_fn=Answers.pad)
        return DataLoader(self.val_ds, batch_size=1024, num_workers=self.num_workers)

    def token_counts(self) -> torch.Tensor:
        """(V,) how often each token occurs in the training answers."""
        return torch.bincount(self.train_set.tokens, minlength=self.backbone.model.args.vocab_size)
