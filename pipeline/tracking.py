"""Weights & Biases for decoding runs and sweeps (`logger=wandb`; offline unless logger.offline=false).

A decode job logs `decode/<metric>` summary metrics (tokens/s, mean accepted length, step times,
...), a per-step table (request, step, committed tokens, tree nodes, depth, ms) and, when it recorded
its trees (`record_trees=true`), the pictures of `python -m pipeline.report`. A bench job logs
`bench/<pipeline>/<metric>`. A sweep logs its summary table and its heatmaps as one more run,
grouped with its jobs. Runs are written under `<run dir>/wandb/` (offline: `wandb sync` uploads
them later).

A sink: it is handed results, rows and the paths of pictures already drawn (by decode, bench and
the sweep callback); of the project it imports only the Hydra-runtime helper of pipeline.io.
"""
from __future__ import annotations

import os
from pathlib import Path

from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from pipeline.io import hydra_config

SUMMARY_KEYS = ("tokens_per_s", "mean_accepted_length", "new_tokens", "requests", "steps", "wall_s",
                "tree_step_ms", "plain_step_ms", "mean_tree_nodes", "mask_us_per_token")


def _init(cfg: DictConfig, out: Path, name: str, group: str | None, job_type: str, config: dict | None):
    os.environ.setdefault("WANDB_SILENT", "true")  # wandb's banners stay out of the terminal
    import wandb  # optional and slow to import: only runs with logger=wandb load it
    node = cfg.logger
    offline = bool(node.get("offline", True))
    out.mkdir(parents=True, exist_ok=True)
    return wandb.init(project=node.get("project") or "llm-decode", entity=node.get("entity"),
                      mode="offline" if offline else "online", dir=str(out), name=name, group=group,
                      job_type=job_type, config=config, reinit="finish_previous")


def _sweep_group(out: Path) -> str | None:
    """Jobs of one sweep share a wandb group: the multirun directory's name."""
    hc = hydra_config()
    return Path(hc.sweep.dir).name if hc is not None and hc.mode == RunMode.MULTIRUN else None


def log_decode(cfg: DictConfig, results: dict, out: Path, pictures: list[Path] = ()) -> None:
    """results: the run's results.json; pictures: the run's pictures (the .png ones are logged)."""
    import wandb  # optional, see _init
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
        logged.update({f"pictures/{Path(p).stem}": wandb.Image(str(p)) for p in pictures if Path(p).suffix == ".png"})
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


def log_sweep(cfg: DictConfig, sweep_dir: Path, columns: list[str], table: list[dict],
              heatmaps: Path | None = None) -> None:
    """columns, table: the sweep's summary rows (`pipeline.sweep.rows`); heatmaps: its summary.png."""
    import wandb  # optional, see _init
    run = _init(cfg, sweep_dir, name=f"sweep {sweep_dir.name}", group=sweep_dir.name, job_type="sweep", config=None)
    try:
        data = [[None if r[c] is None else (r[c] if isinstance(r[c], (int, float)) else str(r[c])) for c in columns]
                for r in table]
        logged = {"sweep/summary": wandb.Table(columns=columns, data=data)}
        if heatmaps is not None:
            logged["sweep/heatmaps"] = wandb.Image(str(heatmaps))
        run.log(logged)
    finally:
        run.finish()
