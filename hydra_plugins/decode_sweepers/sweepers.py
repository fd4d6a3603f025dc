"""Hydra sweepers that give every sweep its fair baseline (Hydra finds plugins only under the
`hydra_plugins` namespace; the logic lives in pipeline/sweep.py).

- `BaselineSweeper` (the project's default `hydra.sweeper`, conf/config.yaml): Hydra's basic grid
  sweeper, plus one plain greedy job before and one after the others for every context (the
  overrides that are not speculative settings: model, dtype, prompts, ...) that has a speculative
  job and no plain job.
- `TreeSearchSweeper` (sweep=tree_search / ngram_search): Hydra's Optuna sweeper, plus the same
  baseline job launched before and after the trials, and, at the end, best.json: the best trial's
  overrides, tokens/s, speedup over the baseline and the tree it verified (installable as a
  proposer's tree file).
"""
from __future__ import annotations

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper


class _Lazy:
    """pipeline.sweep on first use: Hydra imports this module whenever it starts an app."""

    def __getattr__(self, name):
        from pipeline import sweep  # torch and the whole pipeline: not for every app Hydra starts
        return getattr(sweep, name)


_sweep = _Lazy()


class BaselineSweeper(BasicSweeper):
    def split_arguments(self, overrides, max_batch_size):  # called by BasicSweeper.sweep as a method
        jobs = BasicSweeper.split_arguments(overrides, None)[0]
        jobs = _sweep.with_baselines(jobs, self._plain)
        return list(BasicSweeper.split_overrides_to_chunks(jobs, max_batch_size))

    def _plain(self, job: list[str]) -> bool:
        from pipeline.build import is_plain  # the one definition of a plain run (it imports torch)
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(job))
        return is_plain(cfg)


try:
    from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper
except ImportError:  # the Optuna sweeper plugin is not installed: only the grid sweeper exists
    OptunaSweeper = None

if OptunaSweeper is not None:
    class TreeSearchSweeper(OptunaSweeper):
        def sweep(self, arguments: list[str]) -> None:
            # Optuna takes seconds to import: only these sweeps load it (as the Optuna plugin itself does)
            import optuna
            from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides
            impl = self.sweeper
            _, fixed = create_params_from_overrides(impl._parse_sweeper_params_config() + list(arguments))
            baseline = _sweep.baseline_job([f"{k}={v}" for k, v in fixed.items()])
            impl.launcher.launch([baseline], initial_job_idx=impl.job_idx)  # first, in the same launcher
            impl.job_idx += 1
            optuna.logging.set_verbosity(optuna.logging.WARNING)  # its per-trial lines: summary.md has them
            out = super().sweep(arguments)
            impl.launcher.launch([baseline], initial_job_idx=impl.job_idx)  # and last: drift moves both
            impl.job_idx += 1
            _sweep.write_best(impl.config.hydra.sweep.dir)
            return out
