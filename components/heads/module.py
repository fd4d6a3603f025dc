"""The LightningModule that trains Medusa heads on a frozen backbone's hidden states."""
from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F

from components.heads.medusa import MedusaHeads


def head_weights(num_heads: int, decay: float = 0.8, weights: list[float] | None = None) -> list[float]:
    if weights is not None:
        if len(weights) != num_heads or any(w < 0 for w in weights):
            raise ValueError(f"`loss.weights` must list {num_heads} non-negative numbers, got {list(weights)}")
        return [float(w) for w in weights]
    if not 0 < decay <= 1:
        raise ValueError(f"`loss.decay` must be in (0, 1], got {decay}")
    return [decay ** k for k in range(1, num_heads + 1)]


class MedusaModule(L.LightningModule):
    """loss = sum_k w_k * CE(head_k(h_t), y_{t+1+k}), k = 1..K, over response positions only.

    Offset convention: see components/heads/medusa.py (backbone head -> t+1, head k -> t+1+k). A
    batch holds hidden states h_t (B, dim) and targets (B, K) whose column k-1 is y_{t+1+k} as a
    backbone token id, or -100 where the answer ends before it. Prompt tokens and padding never
    appear: the data holds response positions only. Targets outside the draft vocabulary count as
    misses in the accuracies and are left out of the loss (no head can produce them)."""

    def __init__(self, heads: MedusaHeads, optimizer, scheduler=None, decay: float = 0.8,
                 weights: list[float] | None = None):
        super().__init__()
        self.heads = heads
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.w = head_weights(heads.num_heads, decay, weights)
        vocab = int(heads.vocab_ids.max()) + 1
        lookup = torch.full((max(vocab, 1),), -100, dtype=torch.long)
        lookup[heads.vocab_ids] = torch.arange(heads.vocab_ids.numel())
        self.register_buffer("to_draft", lookup, persistent=False)

    def draft_targets(self, targets: torch.Tensor) -> torch.Tensor:
        inside = (targets >= 0) & (targets < self.to_draft.numel())
        return torch.where(inside, self.to_draft[targets.clamp(0, self.to_draft.numel() - 1)], -100)

    def step(self, batch, split: str):
        hidden, targets = batch
        logits = self.heads(hidden.float())  # (K, B, V')
        dt = self.draft_targets(targets)  # (B, K)
        loss = 0.0
        for k in range(self.heads.num_heads):
            valid = targets[:, k] >= 0
            ce = F.cross_entropy(logits[k], dt[:, k], ignore_index=-100)
            ce = torch.nan_to_num(ce)  # a batch with no in-vocabulary target
            loss = loss + self.w[k] * ce
            n = valid.sum().clamp(min=1)
            top5 = logits[k].topk(5, dim=-1).indices  # (B, 5)
            hit5 = (top5 == dt[:, k:k + 1]).any(-1) & valid & (dt[:, k] >= 0)
            hit1 = (top5[:, 0] == dt[:, k]) & valid & (dt[:, k] >= 0)
            self.log(f"{split}/head{k + 1}_loss", ce, on_step=split == "train", on_epoch=True, sync_dist=True)
            self.log(f"{split}/head{k + 1}_top1", hit1.sum() / n, on_epoch=True, on_step=False, sync_dist=True)
            self.log(f"{split}/head{k + 1}_top5", hit5.sum() / n, on_epoch=True, on_step=False, sync_dist=True)
        self.log(f"{split}/loss", loss, prog_bar=True, on_step=split == "train", on_epoch=True, sync_dist=True)
        return loss

    def training_step(self, batch, batch_idx):
        return self.step(batch, "train")

    def validation_step(self, batch, batch_idx):
        self.step(batch, "val")

    def configure_optimizers(self):
        opt = self.optimizer_factory(params=[p for p in self.parameters() if p.requires_grad])
        if self.scheduler_factory is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.scheduler_factory(optimizer=opt), "interval": "step"}}


def warmup_cosine(optimizer, total_steps: int, warmup_steps: int = 50, min_ratio: float = 0.05):
    """Linear warm-up, then cosine decay to min_ratio x lr at total_steps. A LambdaLR, so a resumed
    run with a larger total_steps simply follows the new schedule from where it stopped."""
    import math
    if not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"`scheduler.total_steps` must be a positive int, got {total_steps}")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        t = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
