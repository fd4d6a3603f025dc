"""python -m pipeline.serve decode=<preset> [host=127.0.0.1] [port=8000] [overrides]: an
OpenAI-compatible HTTP server over the preset's engine (pipeline/server/, docs/serve.md)."""
from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from pipeline import threads
from pipeline.cli import CONF_DIR, check_overrides
from pipeline.errors import one_line_errors
from pipeline.server.app import build_server


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="serve")
@one_line_errors
def main(cfg: DictConfig) -> None:
    threads.configure(cfg)
    server = build_server(cfg)
    server.run()
    if server.exit_code:  # a drain cut short, or the engine thread died: a supervisor restarts it
        sys.exit(server.exit_code)


if __name__ == "__main__":
    check_overrides(sys.argv[1:], "serve")
    main()
