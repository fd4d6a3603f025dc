"""python -m pipeline decode=<preset> [input=...] [prompt="..."] [overrides]"""
from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from pipeline import threads
from pipeline.cli import CONF_DIR, check_overrides, quote_free_text
from pipeline.decode import decode
from pipeline.errors import one_line_errors


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
@one_line_errors
def main(cfg: DictConfig) -> float:
    """Returns the run's tokens/s: what a search sweeper (sweep=tree_search) maximises."""
    threads.configure(cfg)
    metrics, _ = decode(cfg)
    s = metrics
    print(f"{s['requests']} requests, {s['new_tokens']} tokens in {s['wall_s']:.2f} s "
          f"({s['tokens_per_s']:.1f} tokens/s, mean accepted length {s['mean_accepted_length']:.2f}) "
          f"-> {s['results_path']}", file=sys.stderr)
    return float(s["tokens_per_s"])


if __name__ == "__main__":
    sys.argv[1:] = quote_free_text(sys.argv[1:])
    check_overrides(sys.argv[1:], "config")
    main()
