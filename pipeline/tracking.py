"""Weights & Biases for decoding runs and sweeps (`logger=wandb`; offline unless logger.offline=false).

A decode job logs `decode/<metric>` summary metrics (tokens/s, mean accepted length, step times,
...), a per-step table (request, step, committed tokens, tree nodes, depth, ms) and, when it recorded
its trees (`record_trees=true`), the pictures of `python -m pipeline.report`. A bench job logs
`bench/<pipeline>/<metric>`. A sweep logs its summary table and its heatmaps as one more run,
grouped with its jobs. Runs are written under `<run dir>/wandb/` (offline: `wandb sync` uploads
them later).
"""
from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

SUMMARY_KEYS = ("tokens_per_s", "mean_accepted_length", "new_tokens", "requests", "steps", "wall_s",
                "tree_step_ms", "plain_step_ms", "mean_tree_nodes", "mask_us_per_token")


def _init(cfg: DictConfig, out: Path, name: str, group: str | None, job_type: str, config: dict | None):
    os.environ.setdefault("WANDB_SILENT", "true")  # wandb's banners stay out of the terminal
    import wandb
    node = cfg.logger
    offline = bool(node.get("offline", True))
    out.mkdir(parents=True, exist_ok=True)
    return wandb.init(project=node.get("project") or "llm-decode", entity=node.get("entity"),
                      mode="offline" if offline else "online", dir=str(out), name=name, group=group,
                      job_type=job_type, config=config, reinit="finish_previous")


def _sweep_group(out: Path) -> str | None:
    """Jobs of one sweep share a wandb group: the multirun directory's name."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
        hc = HydraConfig.get()
        return Path(hc.sweep.dir).name if hc.mode == RunMode.MULTIRUN else None
    except ValueError:
        return None


def log_decode(cfg: DictConfig, results: dict, out: Path) -> None:
    import wandb
    run = _init(cfg, out, name=f"{results['decode']} {out.name}", group=_sweep_group(out), job_type="decode",
                config=OmegaConf.to_container(cfg, resolve=True))
    try:
        s = results["summary"]
        metrics = {f"decode/{k}": s[k] for k in SUMMARY_KEYS if isinstance(s.get(k), (int, float))}
        metrics.update({f"decode/acceptance_depth_{d}": v for d, v in s.get("acceptance_by_depth", {}).items()})
        run.summary.update(metrics)
        table = wandb.Table(columns=["id", "step", "committed", "tree_nodes", "tree_depth", "step_ms"])
        for it in results["items"]:
            for k, (acc, nodes, depth, ms) in enumerate(zip(it["accepted_lengths"][1:], it["step_nodes"],
                                                             it["tree_depths"], it["step_ms"]), 1):
                table.add_data(it["id"], k, acc, nodes, depth, ms)
        logged = {**metrics, "decode/steps": table}
        if any(it.get("trees") for it in results["items"]):
            from pipeline.report import draw_run
            for path in draw_run(out, results):
                if path.suffix == ".png":
                    logged[f"pictures/{path.stem}"] = wandb.Image(str(path))
        run.log(logged)
    finally:
        run.finish()


def log_bench(cfg: DictConfig, result: dict, out: Path) -> None:
    run = _init(cfg, out, name=f"bench {out.name}", group=_sweep_group(out), job_type="bench",
                config=OmegaConf.to_container(cfg, resolve=True))
    try:
        metrics = {f"bench/{label}/{k}": v for label, p in result["pipelines"].items() for k, v in p.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        run.summary.update(metrics)
        run.log(metrics)
    finally:
        run.finish()


def log_sweep(cfg: DictConfig, sweep_dir: Path) -> None:
    import wandb
    from pipeline.sweep import load_jobs, rows
    columns, table = rows(load_jobs(sweep_dir))
    run = _init(cfg, sweep_dir, name=f"sweep {sweep_dir.name}", group=sweep_dir.name, job_type="sweep", config=None)
    try:
        data = [[None if r[c] is None else (r[c] if isinstance(r[c], (int, float)) else str(r[c])) for c in columns]
                for r in table]
        logged = {"sweep/summary": wandb.Table(columns=columns, data=data)}
        if (sweep_dir / "summary.png").is_file():
            logged["sweep/heatmaps"] = wandb.Image(str(sweep_dir / "summary.png"))
        run.log(logged)
    finally:
        run.finish()
