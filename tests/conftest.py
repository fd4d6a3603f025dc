"""Shared fixtures: the tiny random backbone, the real SmolLM2-135M backbone (session-scoped, so the
slow tests load it once), and a helper that composes the project's real Hydra configs."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, open_dict

import pipeline.cli

REPO_ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

# One intra-op thread unless TEST_TORCH_THREADS says otherwise. On a 2-core machine that is also
# running anything else, torch's OpenMP pool spin-waits: a tiny-model step measured 0.7 ms with one
# thread and 68 ms with two, a SmolLM2 step 60 ms vs 660 ms. Results do not depend on it.
TORCH_THREADS = int(os.environ.get("TEST_TORCH_THREADS", "1"))
torch.set_num_threads(TORCH_THREADS)


def subprocess_env() -> dict[str, str]:
    """Environment for `python -m pipeline ...` subprocesses: same thread policy, no colour codes."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(TORCH_THREADS))
    env.setdefault("MKL_NUM_THREADS", str(TORCH_THREADS))
    env.pop("HYDRA_FULL_ERROR", None)  # users see the one-line errors, not Hydra's full traces
    return env


def compose_config(overrides: list[str] | tuple[str, ...] = (), config_name: str = "config",
                   **extra) -> DictConfig:
    """Compose conf/<config_name>.yaml with command-line style overrides, as `python -m pipeline`
    would, then set `extra` keys under open_dict (e.g. output_dir=tmp_path, which pipeline.io.run_dir
    reads when not inside a Hydra app). The speculation guard is off unless asked for: whether it
    pauses drafting depends on timings, and tests pin what they draft."""
    overrides = list(overrides)
    if config_name in ("config", "bench") and not any(o.lstrip("~").split("=")[0] == "guard" for o in overrides):
        overrides.append("~guard")  # tests pin whether trees are drafted, not timings
    with initialize_config_dir(config_dir=str(pipeline.cli.CONF_DIR), version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=overrides)
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
    """The real SmolLM2-135M-Instruct in float32, de-quantized from the GGUF (a few seconds)."""
    from components.model.load import from_pretrained
    return from_pretrained(dtype="float32")


@pytest.fixture(scope="session")
def real_hf():
    """The real model as transformers loads it from the same GGUF file (fp32, eval): a reference
    independent of our conversion and cache. De-quantizing takes ~20 s, once per session."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from components.model.load import smollm2_gguf
    hf_logging.set_verbosity_error()
    path = smollm2_gguf()
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return hf.eval().requires_grad_(False)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
