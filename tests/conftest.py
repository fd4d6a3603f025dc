"""Shared fixtures: the tiny random backbone, the real SmolLM2-135M backbone (session-scoped, so the
slow tests load it once), and a helper that composes the project's real Hydra configs."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, open_dict

import pipeline.cli

REPO_ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def compose_config(overrides: list[str] | tuple[str, ...] = (), config_name: str = "config",
                   **extra) -> DictConfig:
    """Compose conf/<config_name>.yaml with command-line style overrides, as `python -m pipeline`
    would, then set `extra` keys under open_dict (e.g. output_dir=tmp_path, which pipeline.io.run_dir
    reads when not inside a Hydra app)."""
    with initialize_config_dir(config_dir=str(pipeline.cli.CONF_DIR), version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=list(overrides))
    with open_dict(cfg):
        for k, v in extra.items():
            cfg[k] = str(v) if isinstance(v, Path) else v
    return cfg


@pytest.fixture(scope="session")
def compose_cfg():
    return compose_config


@pytest.fixture(scope="session")
def tiny_backbone():
    """conf/model/tiny.yaml's backbone: random weights, the real tokenizer, float32."""
    from components.model.load import tiny
    return tiny()


@pytest.fixture(scope="session")
def real_backbone():
    """The real SmolLM2-135M-Instruct (float32). The first conversion of the GGUF takes ~25 s and is
    cached under ~/.cache/llm-decode; later loads take ~2 s."""
    from components.model.load import from_pretrained
    return from_pretrained()


@pytest.fixture(scope="session")
def real_hf(real_backbone):
    """transformers' LlamaForCausalLM holding exactly the real backbone's weights (fp32, eval)."""
    from pipeline.hf_peer import to_hf
    return to_hf(real_backbone)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
