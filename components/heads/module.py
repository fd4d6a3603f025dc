"""The LightningModules that train draft heads on a frozen backbone's hidden states: one base
(`HeadModule`: optimizer, schedule, steps, logging) and each head's loss: Medusa heads (k-shifted
weighted cross-entropy; Hydra heads the same, teacher-forced on the path) and an EAGLE draft
(feature regression + cross-entropy)."""
from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F

from components.heads.medusa import MedusaHeads
from pipeline.core import UserError, positive_int


def head_weights(num_heads: int, decay: float = 0.8, weights: list[float] | None = None) -> list[float]:
    if weights is not None:
        if len(weights) != num_heads or any(w < 0 for w in weights):
            raise ValueError(f"`loss.weights` must list {num_heads} non-negative numbers, got {list(weights)}")
        return [float(w) for w in weights]
    if not 0 < decay <= 1:
        raise ValueError(f"`loss.decay` must be in (0, 1], got {decay}")
    return [decay ** k for k in range(1, num_heads + 1)]


class HeadModule(L.LightningModule):
    """What training any draft head shares: the heads, their optimizer and schedule, the map from
    backbone token ids to draft-vocabulary ids, and Lightning's steps. A subclass defines
    `loss(batch, split)`: the batch's loss, logging its own terms through `metric`."""

    def __init__(self, heads, optimizer, scheduler=None):
        super().__init__()
        self.heads = heads
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        vocab = int(heads.vocab_ids.max()) + 1
        lookup = torch.full((max(vocab, 1),), -100, dtype=torch.long)
        lookup[heads.vocab_ids] = torch.arange(heads.vocab_ids.numel())
        self.register_buffer("to_draft", lookup, persistent=False)

    def draft_targets(self, targets: torch.Tensor) -> torch.Tensor:
        """Backbone token ids -> draft-vocabulary ids, -100 for padding and tokens outside it (same shape)."""
        inside = (targets >= 0) & (targets < self.to_draft.numel())
        return torch.where(inside, self.to_draft[targets.clamp(0, self.to_draft.numel() - 1)], -100)

    def loss(self, batch, split: str) -> torch.Tensor:
        raise NotImplementedError

    def metric(self, split: str, name: str, value, per_step: bool = False) -> None:
        """Log `split/name`, averaged over the epoch (and also per training step with per_step)."""
        self.log(f"{split}/{name}", value, on_step=per_step and split == "train", on_epoch=True, sync_dist=True)

    def _step(self, batch, split: str) -> torch.Tensor:
        loss = self.loss(batch, split)
        self.log(f"{split}/loss", loss, prog_bar=True, on_step=split == "train", on_epoch=True, sync_dist=True)
        return loss

    def training_step(self, batch, batch_idx):
        return self._step(batch, "train")

    def validation_step(self, batch, batch_idx):
        self._step(batch, "val")

    def param_groups(self) -> list:
        """What the optimizer trains: every parameter that requires a gradient (a subclass may return
        torch param-group dicts, each with its own learning rate)."""
        return [p for p in self.parameters() if p.requires_grad]

    def configure_optimizers(self):
        opt = self.optimizer_factory(params=self.param_groups())
        if self.scheduler_factory is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.scheduler_factory(optimizer=opt), "interval": "step"}}


class MedusaModule(HeadModule):
    """loss = sum_k w_k * CE(head_k(h_t), y_{t+1+k}), k = 1..K, over response positions only.

    Offset convention: see components/heads/medusa.py (backbone head -> t+1, head k -> t+1+k). A
    batch holds hidden states h_t (B, dim) and targets (B, K) whose column k-1 is y_{t+1+k} as a
    backbone token id, or -100 where the answer ends before it. Prompt tokens and padding never
    appear: the data holds response positions only. Targets outside the draft vocabulary count as
    misses in the accuracies and are left out of the loss (no head can produce them)."""

    def __init__(self, heads: MedusaHeads, optimizer, scheduler=None, decay: float = 0.8,
                 weights: list[float] | None = None):
        super().__init__(heads, optimizer, scheduler)
        self.w = head_weights(heads.num_heads, decay, weights)

    def loss(self, batch, split: str) -> torch.Tensor:
        hidden, targets = batch
        return self.scored(self.heads(hidden.float()), targets, split)  # logits (K, B, V')

    def scored(self, logits: torch.Tensor, targets: torch.Tensor, split: str) -> torch.Tensor:
        """The weighted loss of logits (K, B, V') against targets (B, K), logging each head's loss,
        top-1 and top-5."""
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
            self.metric(split, f"head{k + 1}_loss", ce, per_step=True)
            self.metric(split, f"head{k + 1}_top1", hit1.sum() / n)
            self.metric(split, f"head{k + 1}_top5", hit5.sum() / n)
        return loss


class HydraModule(MedusaModule):
    """Hydra heads (components/heads/hydra.py) trained as Medusa heads are, the same weighted loss and
    metrics (comparable head for head), teacher-forced: head k reads the true y_{t+1} .. y_{t+k}.

    A batch holds whole answers (data.sequences=true): hidden (B, T, dim) with hidden[:, i] the state
    that predicts tokens[:, i] (y_{t+1}), tokens (B, T), -100 past an answer's end, and with prompt
    context the number of prompt pairs in front of each answer (B,), which are never scored. Every
    answer position is one training row: h_t, the path tokens[:, i .. i+K-1], targets
    tokens[:, i+1 .. i+K] (y_{t+2} .. y_{t+1+K}, -100 past the end)."""

    def loss(self, batch, split: str) -> torch.Tensor:
        hidden, tokens = batch[0], batch[1]
        K = self.heads.num_heads
        window = F.pad(tokens, (0, K), value=-100).unfold(1, K + 1, 1)  # (B, T, K + 1): y_{t+1} .. y_{t+1+K}
        rows = tokens >= 0  # (B, T)
        if len(batch) > 2:  # prompt pairs in front: read by nothing here, scored never
            rows &= torch.arange(tokens.shape[1], device=tokens.device)[None] >= batch[2][:, None]
        window = window[rows]  # (N, K + 1)
        logits = self.heads(hidden[rows].float(), window[:, :K].clamp(min=0))  # (K, N, V'); -100 only after an end
        return self.scored(logits, window[:, 1:], split)


def warmup_cosine(optimizer, total_steps: int, warmup_steps: int = 50, min_ratio: float = 0.05):
    """Linear warm-up, then cosine decay to min_ratio x lr at total_steps. A LambdaLR, so a resumed
    run with a larger total_steps simply follows the new schedule from where it stopped. 0 steps
    (trainer.max_steps=0): no training, the job validates the draft it starts from (heads.init)."""
    if not isinstance(total_steps, int) or isinstance(total_steps, bool) or total_steps < 0:
        raise UserError(f"scheduler.total_steps must be an int >= 0, got {total_steps!r}")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        t = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class EagleModule(HeadModule):
    """The EAGLE draft's loss on whole answers. At position t the draft reads (f_t, y_{t+1}) and
    predicts f_{t+1}; per depth, loss = smooth-L1(f_hat_{t+1}, f_{t+1}) + ce_weight x CE over the draft
    vocabulary of y_{t+2} from f_hat_{t+1}. unroll = 1 is EAGLE-1 (teacher-forced); unroll = D > 1 is
    EAGLE-3's training-time test: depths 1..D of every chain at once (EagleDraft.unrolled, the draft
    reading its own predictions as when drafting), depth j weighted unroll_decay^(j-1), the sum
    normalised. A batch holds hidden (B, T, dim) with hidden[:, i] the state that predicts tokens[:, i],
    and tokens (B, T), -100 past an answer's end, and with prompt context (data.context=true) the
    number of prompt pairs in front of each answer (B,). Input features get uniform noise of `noise` x their
    RMS. Logged: the loss terms; head1_top1 / head1_top5 of y_{t+2} from the predicted feature (the
    depth-1 acceptance a greedy draft would see); on validation, depth{j}_top1 for j <= eval_depth
    (the draft on its own features, true tokens before) and `chain`: the mean accepted length of a
    greedy chain eval_depth deep (1 + the leading run of hits: the target's own token counts).
    An EAGLE-3 draft (heads.fuse_layers) reads [fused layers' states | last state] per position and
    regresses on the last one's part; feature_weight scales the smooth-L1 term (None: 1, and 0 for
    a fused draft, as EAGLE-3 trains on the tokens alone)."""

    def __init__(self, heads, optimizer, scheduler=None, ce_weight: float = 0.1, noise: float = 0.1,
                 unroll: int = 1, unroll_decay: float = 0.8, eval_depth: int = 5, feature_weight: float | None = None):
        super().__init__(heads, optimizer, scheduler)
        if ce_weight < 0 or noise < 0:
            raise ValueError(f"`module.ce_weight` and `module.noise` must be >= 0, got {ce_weight}, {noise}")
        positive_int(unroll, "module.unroll"), positive_int(eval_depth, "module.eval_depth")
        if not 0 < unroll_decay <= 1:
            raise ValueError(f"`module.unroll_decay` must be in (0, 1], got {unroll_decay}")
        self.ce_weight, self.noise = float(ce_weight), float(noise)
        self.feature_weight = float((0.0 if getattr(heads, "fused", False) else 1.0) if feature_weight is None else feature_weight)
        self.unroll, self.eval_depth = unroll, eval_depth
        self.w = [unroll_decay ** j for j in range(unroll)]

    def loss(self, batch, split: str) -> torch.Tensor:
        hidden, tokens = batch[0], batch[1]
        if self.heads.fused and hidden.shape[-1] == self.heads.dim:  # else it would read them as predicted features
            raise ValueError(f"a fused draft (layers {list(self.heads.fuse_layers)}) needs data with those layers' states: "
                             f"set data.fuse_layers to heads.fuse_layers (the default), not null")
        hidden = hidden.float()
        f_in, y_in = hidden[:, :-1], tokens[:, :-1].clamp(min=0)  # (f_t, y_{t+1})
        f_next, y_next = hidden[:, 1:, -self.heads.dim:], tokens[:, 1:]  # f_{t+1} (the last state) and y_{t+2}, -100 past the end
        q = torch.arange(f_in.shape[1], device=f_in.device)[None]
        # a set with prompt context: the first ctx[b] pairs are the prompt's, read but never scored,
        # and no chain starts in them (decoding drafts from answer positions only)
        first = batch[2][:, None] if len(batch) > 2 else 0
        valid = (y_next >= 0) & (q >= first)  # (B, T-1)
        if self.training and self.noise > 0:
            rms = f_in.pow(2).mean().sqrt()
            f_in = f_in + (torch.rand_like(f_in) - 0.5) * 2 * self.noise * rms
        depth = self.unroll if self.training else max(self.unroll, self.eval_depth)
        preds = self.heads.unrolled(f_in, y_in, depth) if depth > 1 else [self.heads(f_in, y_in)]
        dt = torch.where(valid, self.draft_targets(y_next), -100)
        loss, chain, alive = 0.0, None, None
        for j, pred in enumerate(preds):
            ok = valid & (q >= first + j)  # queries on a chain (started at q - j, in the answer) with a target
            n = ok.sum().clamp(min=1)
            logits = self.heads.logits(pred)  # (B, T-1, V')
            sel = ok & (dt >= 0)
            if j < self.unroll:
                reg = (F.smooth_l1_loss(pred, f_next, reduction="none").mean(-1) * ok).sum() / n
                ce = torch.nan_to_num(F.cross_entropy(logits[sel], dt[sel])) if sel.any() else logits.sum() * 0
                loss = loss + self.w[j] * (self.feature_weight * reg + self.ce_weight * ce)
                if j == 0:
                    self.metric(split, "feature_loss", reg, per_step=True)
                    self.metric(split, "ce", ce, per_step=True)
            with torch.no_grad():
                top5 = logits.topk(5, dim=-1).indices
                hit = (top5[..., 0] == dt) & sel
                if j == 0:
                    hit5 = ((top5 == dt[..., None]).any(-1) & sel).sum() / n
                    self.metric(split, "head1_top1", hit.sum() / n)
                    self.metric(split, "head1_top5", hit5)
                    alive, chain, starts = hit.clone(), 1.0 + hit.float(), valid
                else:
                    by_start = torch.zeros_like(hit)
                    by_start[:, :hit.shape[1] - j] = hit[:, j:]  # hit of the chain started at i = q - j
                    alive = alive & by_start
                    chain = chain + alive.float()
                if not self.training:
                    self.metric(split, f"depth{j + 1}_top1", hit.sum() / n)
        loss = loss / sum(self.w)
        if not self.training and chain is not None:
            self.metric(split, "chain", (chain * starts).sum() / starts.sum().clamp(min=1))
        return loss
