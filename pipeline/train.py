"""python -m pipeline.train [heads=medusa|eagle|medusa2] [data=self_distill] [trainer.max_steps=N] [logger=wandb]

`train(cfg) -> (metrics, objects)`: self-distillation data, then draft heads (Medusa heads, or an EAGLE
draft with heads=eagle) trained by Lightning on
the frozen backbone. Everything goes into the run directory: checkpoints/ (Lightning, resumable),
wandb/ (offline unless logger.offline=false), csv/, heads.safetensors (what decoding loads with
proposer.checkpoint=...), metrics.json and train_config.yaml; with heads=medusa2 (the backbone
trained with its heads) also backbone/, the Hugging Face folder that model.path= loads.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import sys
import time
import warnings

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from pipeline.build import component
from pipeline.cli import CONF_DIR, check_overrides
from pipeline.errors import one_line_errors
from pipeline.io import run_dir, write_json


def train(cfg: DictConfig) -> tuple[dict, dict]:
    # Lightning takes seconds to import: loaded when training starts, after check_overrides has read the command line
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    out = run_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    quiet_lightning(out / "train.log")
    L.seed_everything(int(cfg.seed), workers=True)
    backbone = component(cfg.model)
    data = component(cfg.data, backbone, num_heads=cfg.heads.num_heads)
    if cfg.data.get("only"):  # data only (shard jobs): this job's parts of the set, no training
        return data.make(out), {"data": data, "backbone": backbone}
    data.setup("fit")  # the draft vocabulary is chosen from the training answers' token counts
    heads = instantiate(cfg.heads)(backbone=backbone, token_counts=data.token_counts())
    module = instantiate(cfg.module, heads=heads, optimizer=instantiate(cfg.optimizer),
                         scheduler=instantiate(cfg.scheduler) if cfg.get("scheduler") else None)
    if isinstance(module, functools.partial):  # a module that trains the backbone too (heads=medusa2)
        module = module(backbone=backbone, data=data)
    fit_data = getattr(module, "fit_data", data)  # such a module reads the data its own way (whole conversations)
    loggers = [CSVLogger(str(out), name="csv")]
    if cfg.get("logger"):
        loggers.append(instantiate(cfg.logger, save_dir=str(out)))
    ckpt_dir = out / "checkpoints"
    ckpt = ModelCheckpoint(dirpath=str(ckpt_dir), save_last=True, every_n_train_steps=cfg.checkpoint_every,
                           save_top_k=-1)
    trainer = instantiate(cfg.trainer, logger=loggers, callbacks=[ckpt], default_root_dir=str(out))
    last = ckpt_dir / "last.ckpt"
    t0 = time.perf_counter()
    try:
        trainer.fit(module, datamodule=fit_data, ckpt_path=str(last) if cfg.resume and last.is_file() else None)
        wall = time.perf_counter() - t0
        val = trainer.validate(module, datamodule=fit_data, verbose=False)[0]
    finally:
        for lg in loggers:
            if hasattr(lg, "experiment") and type(lg).__name__ == "WandbLogger":
                import wandb  # optional and slow to import: only logger=wandb loads it
                wandb.finish()
    metrics = {k: float(v) for k, v in val.items()}
    metrics.update({"train_wall_s": round(wall, 1), "train_tokens": int(data.train_set.tokens.numel()),
                    "val_tokens": int(data.val_set.tokens.numel()), "steps": int(trainer.global_step),
                    "draft_vocab": int(heads.vocab_ids.numel())})
    if trainer.is_global_zero:
        meta = {"vocab_size": backbone.model.args.vocab_size, "fingerprint": backbone.model.fingerprint(),
                "backbone": backbone.name, "metrics": metrics, "command": " ".join(sys.argv)}
        if cfg.data.get("sequences"):  # an EAGLE draft: what its attention was trained over
            meta["context"] = "prompt" if cfg.data.get("context") else "answer"
        if hasattr(module, "write_backbone"):  # heads=medusa2: the heads belong to the backbone trained with them
            meta.update(module.write_backbone(out / "backbone"))
        heads.save(out / "heads.safetensors", meta)
        write_json(out / "metrics.json", metrics)
        (out / "train_config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    return metrics, {"heads": heads, "module": module, "trainer": trainer, "data": data, "backbone": backbone}


def quiet_lightning(path) -> None:
    """Lightning's banners and tips (accelerator lines, model summaries, "consider increasing
    num_workers") go to <run dir>/train.log and wandb's are silenced, not the terminal: what the
    job says there is its progress bars and its last line."""
    os.environ.setdefault("WANDB_SILENT", "true")  # wandb's own banner lines too (its files say where the run is)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        log = logging.getLogger(name)
        for h in list(log.handlers):  # their own terminal handlers, or an earlier run's file
            log.removeHandler(h)
        log.addHandler(handler)
        log.propagate = False
    warnings.filterwarnings("ignore", message=".*(num_workers|log_every_n_steps|LeafSpec).*")


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
@one_line_errors
def main(cfg: DictConfig) -> dict:
    metrics, _ = train(cfg)
    print(json.dumps(metrics, indent=2), file=sys.stderr)
    if cfg.data.get("only"):
        return metrics
    heads = run_dir(cfg) / "heads.safetensors"
    how = (f"decode=tree_eagle proposer.checkpoint={heads}" if "eagle" in str(cfg.heads._target_) else
           f"decode=tree_medusa proposer.checkpoint={heads} proposer.tree_file=null")
    if (run_dir(cfg) / "backbone").is_dir():  # heads=medusa2: its heads belong to the backbone trained with them
        how += f" model.path={run_dir(cfg) / 'backbone'}"
    print(f"heads written to {heads}; decode with them: python -m pipeline {how}", file=sys.stderr)
    return metrics


if __name__ == "__main__":
    check_overrides(sys.argv[1:], "train")
    main()
