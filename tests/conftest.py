"""Shared fixtures: the tiny random backbone and its tied/untied variants, the real SmolLM2-135M
backbone (session-scoped, so the slow tests load it once), transformers' copy of it, and the
project's config composer (tests/helpers.py holds it and what else the modules share)."""
from __future__ import annotations

import pytest
import torch

from pipeline.build import component

from helpers import TINY_VARIANTS, TORCH_THREADS, compose_config

torch.set_num_threads(TORCH_THREADS)  # why one thread: see helpers.TORCH_THREADS


@pytest.fixture(scope="session")
def compose_cfg():
    return compose_config


@pytest.fixture(scope="session")
def tiny_variants():
    """helpers.TINY_VARIANTS built: {"tied": backbone, "untied": backbone}."""
    return {name: component(compose_config(list(ov)).model) for name, ov in TINY_VARIANTS.items()}


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
