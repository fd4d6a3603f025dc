"""Medusa-2 (`heads=medusa2`): the backbone fine-tuned together with its Medusa heads.

Medusa-1 (heads=medusa) trains heads on a frozen backbone's stored hidden states. Medusa-2 trains
the backbone too, so that its hidden states carry more of the future the heads must draft, while a
self-distillation term keeps the backbone's own next-token distribution close to the original's:

  loss = backbone_weight x KL(p || q) + sum_k w_k CE(head_k(h_t), y_{t+1+k})

p is the original (frozen) backbone's next-token distribution at t, q the trained backbone's, h_t
the trained backbone's hidden state; the Medusa term is MedusaModule's loss (offset convention:
components/heads/medusa.py), whose gradient now reaches the backbone as well. For `warmup_steps`
steps only the heads train (the backbone frozen: fresh heads would otherwise pull it around), then
both, the backbone at its own, lower learning rate (`backbone_lr`).

The backbone trains in float32, de-quantized from whatever precision it was loaded in (as the
EAGLE draft copies a block): every block's matrices, norms and biases and the final norm
(`finetune: full`), or a low-rank delta beside each frozen matrix named in `lora.targets`
(`finetune: lora`, `LoRADense`). The token embedding and the LM head stay frozen: they are one tied
matrix in the default model, and the heads' shared projection reads the LM head's rows.
The data are the self-distillation answers (the original's own greedy answers), read as whole
conversations (prompt + answer) because the backbone now has to run on them; p is computed on the
fly by the frozen original (stored full-vocabulary logits would be 49,152 floats a token, ~200 KB,
against one extra forward without gradients).

The run writes <run>/backbone (a Hugging Face folder, float32, LoRA merged in, with the tokenizer:
`model.path=<run>/backbone` loads it bit for bit, whatever model trained it, the tiny one included)
and <run>/heads.safetensors fingerprinted for that backbone. `drift` measures how far a tuned
backbone strays from the original: greedy agreement and mean KL on held-out prompts.
"""
from __future__ import annotations

import math
import shutil
from dataclasses import replace
from pathlib import Path

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from components.data.prompts import training_prompts
from components.data.self_distill import DistillSet, generate_batch
from components.heads.medusa import MedusaHeads
from components.heads.module import MedusaModule
from components.model.linear import Dense
from components.model.llama import Block, Transformer
from components.model.load import Backbone, build, from_pretrained
from pipeline.core import atomic_write, encode_chat, positive_int
from omegaconf import OmegaConf
from pipeline.build import component
from pipeline.hf_peer import to_hf

FINETUNE = ("lora", "full")


class LoRADense(Dense):
    """x W + (alpha / rank) x A B: W [in, out] the frozen float32 matrix, A (in, rank) and B (rank, out)
    trained, B zero at start (the layer starts as W). `dense()` is the merged matrix."""

    def __init__(self, weight: torch.Tensor, rank: int, alpha: float):
        super().__init__(*weight.shape)
        positive_int(rank, "lora.rank")
        if not alpha > 0:
            raise ValueError(f"`lora.alpha` must be positive, got {alpha}")
        self.weight = nn.Parameter(weight.detach().float().clone(), requires_grad=False)  # (in, out)
        self.lora_a = nn.Parameter(torch.randn(self.in_features, rank) / math.sqrt(self.in_features))  # (in, r)
        self.lora_b = nn.Parameter(torch.zeros(rank, self.out_features))  # (r, out)
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor, kernel: str = "xw") -> torch.Tensor:
        return super().forward(x, kernel) + (x @ self.lora_a) @ self.lora_b * self.scale

    def dense(self) -> torch.Tensor:
        return (self.weight + self.scale * (self.lora_a @ self.lora_b)).detach()


def dense_weights(model: Transformer) -> dict[str, torch.Tensor]:
    """Every weight of `model` in our layout ([in, out], fused), float32 copies: a q4 model
    de-quantized as its kernel computes, a LoRA model merged."""
    out = {"tok_embeddings.weight": model.tok_embeddings.weight, "norm.weight": model.norm.weight,
           "lm_head": model.lm_head}
    for i, blk in enumerate(model.layers):
        p = f"layers.{i}."
        out.update({p + n + ".weight": getattr(blk, n).dense() for n in Block.MATRICES})
        out.update({p + "attn_norm.weight": blk.attn_norm.weight, p + "mlp_norm.weight": blk.mlp_norm.weight})
        if blk.bqkv is not None:
            out[p + "bqkv"] = blk.bqkv
        if blk.bo is not None:
            out[p + "bo"] = blk.bo
    return {k: v.detach().float().clone() for k, v in out.items()}


def float32_copy(model: Transformer, device=None) -> Transformer:
    """A plain float32 Transformer with `model`'s (dense, merged) weights, frozen, cache-free ready."""
    return build(replace(model.args), dense_weights(model), "float32", str(device or model.device), optimize=False)


def trainable_copy(model: Transformer, finetune: str = "lora", rank: int = 16, alpha: float = 32.0,
                   targets: list[str] | tuple[str, ...] = ("wqkv", "wo", "w13", "w2")) -> Transformer:
    """`float32_copy` of `model` with what `finetune` trains requiring gradients (see the module
    docstring); with lora, each block matrix in `targets` becomes a `LoRADense`."""
    if finetune not in FINETUNE:
        raise ValueError(f"`module.finetune` must be one of {', '.join(FINETUNE)}, got {finetune!r}")
    bad = sorted(set(targets) - set(Block.MATRICES))
    if finetune == "lora" and (bad or not targets):
        raise ValueError(f"`module.lora.targets` must name some of {', '.join(Block.MATRICES)}, got {list(targets)}")
    copy = float32_copy(model)
    for blk in copy.layers:
        if finetune == "full":
            blk.requires_grad_(True)
        else:
            for n in targets:
                setattr(blk, n, LoRADense(getattr(blk, n).weight, rank, alpha))
    if finetune == "full":
        copy.norm.requires_grad_(True)
    return copy.train()  # no dropout anywhere: the mode only tells Lightning the copy is meant to train


class Conversations(L.LightningDataModule):
    """The self-distillation answers (a DistillDataModule after setup) as whole conversations: item =
    (prompt + answer token ids, prompt length), the same train / held-out split by answer."""

    def __init__(self, data, tokenizer, num_heads: int):
        super().__init__()
        self.data, self.num_heads = data, num_heads
        n = data.train_set.samples + data.val_set.samples
        index = DistillSet(torch.arange(n), torch.zeros(n, 1), torch.arange(n + 1))  # token i = answer i
        train_idx, val_idx = (s.tokens.tolist() for s in index.split(data.val_fraction))  # the data's own rule
        prompts = training_prompts(n, seed=data.gen_kw["prompt_seed"])
        encode = lambda i: encode_chat(tokenizer, None, prompts[i], data.gen_kw["chat"])  # noqa: E731
        self.train_items = _items(data.train_set, [encode(i) for i in train_idx])
        self.val_items = _items(data.val_set, [encode(i) for i in val_idx])

    def collate(self, items):
        return conversation_batch(items, self.num_heads)

    def train_dataloader(self):
        return DataLoader(self.train_items, batch_size=self.data.answers_per_batch, shuffle=True, collate_fn=self.collate)

    def val_dataloader(self):
        return DataLoader(self.val_items, batch_size=self.data.answers_per_batch, collate_fn=self.collate)


def _items(ds: DistillSet, prompts: list[list[int]]) -> list[tuple[torch.Tensor, int]]:
    if len(prompts) != ds.samples:
        raise RuntimeError(f"{len(prompts)} prompts for {ds.samples} answers: the split rule changed")
    return [(torch.cat((torch.tensor(p), ds.tokens[int(ds.offsets[i]):int(ds.offsets[i + 1])])), len(p))
            for i, p in enumerate(prompts)]


def conversation_batch(items, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> tokens (B, T) right-padded with 0, targets (B, T, K + 1): at a position t that predicts an
    answer token, column 0 is y_{t+1} (the backbone's own head) and column k is y_{t+1+k} (head k),
    -100 past the answer's end, at prompt positions and in the padding."""
    T = max(ids.numel() for ids, _ in items)
    tokens = torch.zeros(len(items), T, dtype=torch.long)
    targets = torch.full((len(items), T, num_heads + 1), -100, dtype=torch.long)
    for b, (ids, P) in enumerate(items):
        answer = ids[P:]  # y_1..y_n, predicted from positions P-1 .. P+n-2
        tokens[b, :ids.numel()] = ids
        for k in range(min(num_heads + 1, answer.numel())):
            targets[b, P - 1:P - 1 + answer.numel() - k, k] = answer[k:]
    return tokens, targets


class Medusa2Module(MedusaModule):
    """The joint loss of the module docstring on conversation batches (`conversation_batch`). Logged
    beside MedusaModule's head metrics: backbone_kl (mean KL(p || q) a token), backbone_top1 (the
    trained backbone's argmax equals the original's greedy token, teacher-forced) and, in the final
    validation (trainer.validate), `drift` on `drift_prompts` held-out prompts: greedy_match and
    greedy_prefix. `_partial_` in its YAML: train.py gives it the live backbone and the data."""

    def __init__(self, heads: MedusaHeads, optimizer, scheduler=None, decay: float = 0.8,
                 weights: list[float] | None = None, *, backbone: Backbone, data, finetune: str = "lora",
                 lora: dict | None = None, warmup_steps: int = 100, backbone_lr: float = 3e-4,
                 backbone_weight: float = 1.0, drift_prompts: int = 16, drift_tokens: int = 64):
        super().__init__(heads, optimizer, scheduler, decay, weights)
        if warmup_steps < 0 or backbone_lr <= 0 or backbone_weight < 0 or drift_prompts < 0:
            raise ValueError("`module.warmup_steps`, `module.drift_prompts` and `module.backbone_weight` must be >= 0 "
                             f"and `module.backbone_lr` > 0, got {warmup_steps}, {drift_prompts}, {backbone_weight}, "
                             f"{backbone_lr}")
        positive_int(drift_tokens, "module.drift_tokens")
        self.finetune, self.lora = finetune, dict(lora or {})
        self.backbone_model = trainable_copy(backbone.model, finetune, **(self.lora if finetune == "lora" else {}))
        self._original = [float32_copy(backbone.model)]  # a list, not a submodule: never in a checkpoint
        self.base = backbone  # the tokenizer, EOS ids, name and fingerprint of the original
        self.warmup_steps, self.backbone_lr, self.backbone_weight = int(warmup_steps), float(backbone_lr), float(backbone_weight)
        self.drift_prompts, self.drift_tokens = int(drift_prompts), int(drift_tokens)
        self.fit_data = Conversations(data, backbone.tokenizer, heads.num_heads)

    @property
    def original(self) -> Transformer:
        """The frozen original, on this module's device."""
        if self._original[0].device != self.device:
            self._original[0] = self._original[0].to(self.device)
        return self._original[0]

    @property
    def joint(self) -> bool:
        """Past the heads' warm-up: the backbone trains too."""
        return self.global_step >= self.warmup_steps

    def param_groups(self) -> list[dict]:
        bb = [p for p in self.backbone_model.parameters() if p.requires_grad]
        return [{"params": [p for p in self.heads.parameters() if p.requires_grad]},
                {"params": bb, "lr": self.backbone_lr}]

    def loss(self, batch, split: str) -> torch.Tensor:
        tokens, targets = batch  # (B, T), (B, T, K + 1)
        rows = targets[..., 0] >= 0  # (B, T): positions that predict an answer token
        positions = torch.arange(tokens.shape[1], device=tokens.device)[None].expand_as(tokens)
        train_backbone = split == "train" and self.joint
        with torch.set_grad_enabled(train_backbone and torch.is_grad_enabled()):
            h = self.backbone_model(tokens, positions)[rows]  # (N, dim)
        y = targets[rows]  # (N, K + 1)
        loss = super().loss((h, y[:, 1:]), split)  # the weighted head losses; through h, the backbone's too
        if split == "train" and not train_backbone:
            return loss  # warm-up: the backbone is frozen, its KL to itself is 0
        with torch.no_grad():
            log_p = self.original.logits(self.original(tokens, positions)[rows]).log_softmax(-1)  # (N, V) original
        log_q = self.backbone_model.logits(h).log_softmax(-1)  # (N, V) trained
        kl = F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")  # KL(p || q) a token
        self.metric(split, "backbone_kl", kl, per_step=True)
        self.metric(split, "backbone_top1", (log_q.argmax(-1) == y[:, 0]).float().mean())
        return loss + self.backbone_weight * kl

    def on_validation_epoch_end(self) -> None:
        if self.trainer.state.fn != "validate" or not self.drift_prompts:
            return  # greedy decoding twice is too dear for every validation during fit
        prompts = [ids[:P].tolist() for ids, P in self.fit_data.val_items[:self.drift_prompts]]
        tok = self.base.tokenizer
        out = drift(Backbone(self.original, tok, "original"), Backbone(self.backbone_model, tok, "tuned"), prompts,
                    self.drift_tokens)
        for k in ("greedy_match", "greedy_prefix"):
            self.log(f"val/{k}", out[k], on_epoch=True, sync_dist=True)

    def write_backbone(self, folder: Path) -> dict:
        """Write the trained backbone (LoRA merged, float32) as a Hugging Face folder with the
        tokenizer, replacing an earlier run's. Returns what the heads' header records of it: the
        fingerprint of the folder as `model.path=` loads it, and the original's."""
        merged = Backbone(float32_copy(self.backbone_model, "cpu"), self.base.tokenizer, self.base.name)

        def write(tmp: Path) -> None:
            to_hf(merged).save_pretrained(tmp)
            self.base.tokenizer.save_pretrained(tmp)
        folder = Path(folder)
        if folder.is_dir():
            shutil.rmtree(folder)  # a resumed run's: atomic_write fills only a missing folder
        atomic_write(folder, write)
        reloaded = from_pretrained(str(folder), dtype="float32", native=False)
        return {"fingerprint": reloaded.model.fingerprint(), "backbone_path": str(folder),
                "base_backbone": self.base.name, "base_fingerprint": self.base.model.fingerprint(),
                "finetune": self.finetune, **({"lora": self.lora} if self.finetune == "lora" else {})}


@torch.inference_mode()
def drift(original: Backbone, tuned: Backbone, prompts: list[list[int]], max_new_tokens: int = 64) -> dict:
    """How far `tuned` strays from `original` on `prompts` (token ids): greedy_match, the fraction of
    greedy answers that are identical; greedy_prefix, the mean fraction of the original's answer
    reproduced before the first divergence; kl, the mean KL(original || tuned) a token over the
    original's answers (teacher-forced). Both are decoded by the core engine, batched, each in its
    own precision (load both in the same one to measure the fine-tuning alone)."""
    ref, got = ([ids for ids, _ in generate_batch(bb, prompts, max_new_tokens)] for bb in (original, tuned))
    prefix, kl_sum, kl_n = [], 0.0, 0
    for p, a, b in zip(prompts, ref, got):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(same / max(len(a), 1))
        log_p, log_q = (answer_logprobs(bb.model, p, a) for bb in (original, tuned))
        kl_sum += float(F.kl_div(log_q, log_p, log_target=True, reduction="sum"))
        kl_n += log_p.shape[0]
    return {"greedy_match": sum(a == b for a, b in zip(ref, got)) / max(len(ref), 1),
            "greedy_prefix": sum(prefix) / max(len(prefix), 1), "kl": kl_sum / max(kl_n, 1),
            "prompts": len(prompts), "max_new_tokens": max_new_tokens}


def answer_logprobs(model: Transformer, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """(len(answer), V) float32 log-probabilities of the model at the positions that chose each
    answer token, cache-free."""
    seq = torch.tensor([prompt + answer], device=model.device)  # (1, T)
    h = model(seq, torch.arange(seq.shape[1], device=seq.device)[None])[0, len(prompt) - 1:-1]  # (n, dim)
    return model.logits(h).float().log_softmax(-1)


def drift_of_run(run: str | Path, prompts: int = 32, max_new_tokens: int = 64) -> dict:
    """`drift` of a heads=medusa2 run's written backbone against the original it started from (the
    run's own model config, de-quantized to float32 as training did), both in float32, on the
    `prompts` training prompts after the run's data.max_samples (never trained on)."""
    run = Path(run)
    cfg = OmegaConf.load(run / "train_config.yaml")
    base = component(cfg.model)
    original = Backbone(float32_copy(base.model), base.tokenizer, base.name)
    tuned = from_pretrained(str(run / "backbone"), dtype="float32", native=False)
    n = int(cfg.data.max_samples)
    texts = training_prompts(n + positive_int(prompts, "prompts"), seed=int(cfg.data.prompt_seed))[n:]
    ids = [encode_chat(base.tokenizer, None, t, bool(cfg.data.chat)) for t in texts]
    return drift(original, tuned, ids, max_new_tokens)


if __name__ == "__main__":  # python -m components.heads.medusa2 <run dir> [prompts] [max_new_tokens]
    import json
    import sys
    if not 2 <= len(sys.argv) <= 4:
        sys.exit("usage: python -m components.heads.medusa2 <heads=medusa2 run dir> [prompts=32] [max_new_tokens=64]")
    print(json.dumps(drift_of_run(sys.argv[1], *map(int, sys.argv[2:])), indent=2))
