"""What the test modules share (conftest.py holds the fixtures; toy.py the scripted toy model and
proposers): composing the project's real Hydra configs, `python -m pipeline` subprocesses, the tiny
model's prompts and decoders, rebuilding a runner with some parts swapped, the reference greedy
decoder, the invariants every Generation keeps, a saved module's file against its state, and the
chi-square test of sampled counts."""
from __future__ import annotations

import os
import random
import sys
from collections import Counter
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, open_dict
from safetensors.torch import load_file

import pipeline.cli
from pipeline.build import build_engine
from components.sampler.logits import Sampler
from pipeline.core import BeamSearch, Engine

REPO_ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

# One intra-op thread unless TEST_TORCH_THREADS says otherwise (conftest.py sets it for the session).
# On a 2-core machine that is also running anything else, torch's OpenMP pool spin-waits: a
# tiny-model step measured 0.7 ms with one thread and 68 ms with two, a SmolLM2 step 60 ms vs 660 ms.
# Results do not depend on it.
TORCH_THREADS = int(os.environ.get("TEST_TORCH_THREADS", "1"))


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


# ------------------------------------------------------------------------------------------------
# the tiny model: prompts, decoders, the reference greedy run, the invariants of a Generation
# ------------------------------------------------------------------------------------------------

REPEAT_TEXT = ("The cat sat on the mat and looked at the door. " * 4).strip()
TEXT_PROMPTS = [REPEAT_TEXT, "Once upon a time, in a land far away,", "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3"]

# The tiny model's tied embeddings make its greedy output repeat its last token (every draft of a
# repetition is accepted); untied, its output is a random walk (drafts from the prompt are rejected).
# Both are used, so speculation is checked when it accepts and when it rejects.
TINY_VARIANTS = {"tied": ("model=tiny",), "untied": ("model=tiny", "+model.tie_embeddings=false")}


def random_prompts(n: int, seed: int, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 7, 19, 33][:n]
    return [[rng.randrange(vocab) for _ in range(k)] for k in lengths]


def decoder_for(preset: str, backbone, *overrides: str, max_new_tokens: int = 40):
    cfg = compose_config(["model=tiny", f"decode={preset}", f"max_new_tokens={max_new_tokens}", *overrides])
    return build_engine(cfg, backbone)[0]


def rebuild(runner, **changes):
    """`runner` (an Engine or a BeamSearch) built again through its constructor from the same parts,
    with `changes` swapped in (a proposer, a verifier, EOS ids, the batch size, a wrapped model).
    The KV pool is the same object unless `kv` is given. An Engine's proposer is its `drafter`
    (the constructor sets an inactive one aside again)."""
    parts = dict(model=runner.model, kv=runner.kv, sampler=runner.sampler, eos_ids=list(runner.eos_ids),
                 max_new_tokens=runner.max_new_tokens, seed=runner.seed, batch_size=runner.batch_size,
                 constraint=runner.constraint)
    if isinstance(runner, BeamSearch):
        parts.update(num_beams=runner.num_beams, length_penalty=runner.length_penalty,
                     early_stopping=runner.early_stopping, num_return_sequences=runner.num_return_sequences,
                     num_beam_groups=runner.num_beam_groups, diversity_penalty=runner.diversity_penalty)
    elif isinstance(runner, Engine):
        parts.update(proposer=runner.drafter, verifier=runner.verifier, guard=runner.guard,
                     record_trees=runner.record_trees, greedy_verifier=runner.greedy_verifier,
                     sampling_verifier=runner.sampling_verifier)
    else:
        raise TypeError(f"rebuild takes an Engine or a BeamSearch, got {type(runner).__name__}")
    unknown = set(changes) - set(parts)
    if unknown:
        raise TypeError(f"{type(runner).__name__} takes no {sorted(unknown)}: its parts are {sorted(parts)}")
    return type(runner)(**{**parts, **changes})


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], max_new_tokens: int, eos_ids) -> list[int]:
    """Straightforward greedy: recompute the whole sequence every step, take the argmax."""
    seq, out = list(prompt), []
    for _ in range(max_new_tokens):
        logits = model.logits(model(torch.tensor([seq]), torch.arange(len(seq))[None]))[0, -1]
        tok = int(logits.argmax())
        out.append(tok)
        seq.append(tok)
        if tok in eos_ids:
            break
    return out


def assert_generation_invariants(gen, max_new_tokens, eos_ids, kv=None, prompt_len=None):
    assert sum(gen.accepted_lengths) == len(gen.token_ids)
    assert all(a >= 1 for a in gen.accepted_lengths)
    assert gen.steps == len(gen.accepted_lengths)
    assert len(gen.token_ids) <= max_new_tokens
    if gen.step_draft_ms or gen.step_verify_ms:  # the engine's split of each step: parts of it
        assert len(gen.step_draft_ms) == len(gen.step_verify_ms) == len(gen.step_ms)
        assert all(0 <= d and 0 <= v and d + v <= ms + 1e-6 for d, v, ms in zip(gen.step_draft_ms, gen.step_verify_ms, gen.step_ms))
    if gen.finish_reason == "eos":
        assert gen.token_ids[-1] in eos_ids and not any(t in eos_ids for t in gen.token_ids[:-1])
    else:
        assert gen.finish_reason in ("length", "context") and not any(t in eos_ids for t in gen.token_ids)
    if kv is not None:  # every sequence went back to the pool
        assert kv.sequences == [] and kv.stats()["bytes_in_use"] == 0


def assert_saved_state(path: Path, module: torch.nn.Module, frozen: str, dtype: torch.dtype | None = None) -> None:
    """The safetensors file at `path` holds `module`'s state: every entry but `frozen` (the backbone's
    own weights, not stored), floating tensors cast to `dtype` when given."""
    stored, state = load_file(path), module.state_dict()
    assert set(stored) == set(state) - {frozen}, set(stored) ^ (set(state) - {frozen})
    for k, t in stored.items():
        want = state[k].detach()
        want = want.to(dtype) if dtype is not None and want.is_floating_point() else want
        assert torch.equal(t, want), k


# ------------------------------------------------------------------------------------------------
# statistics
# ------------------------------------------------------------------------------------------------

def chi_square_p(counts: Counter, truth: dict[tuple, float]) -> float:
    """Pearson's chi-square test of the counts against the truth: the p-value. Outcomes expected
    fewer than 5 times are pooled into one cell (the test's approximation needs it)."""
    n = sum(counts.values())
    if any(k not in truth for k in counts):
        return 0.0  # an outcome plain sampling never produces
    big = [k for k, v in truth.items() if n * v >= 5]
    cells = [(counts.get(k, 0), n * truth[k]) for k in big]
    rest = [k for k in truth if k not in big]
    if rest:
        cells.append((sum(counts.get(k, 0) for k in rest), n * sum(truth[k] for k in rest)))
    stat = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    return float(torch.special.gammaincc(torch.tensor((len(cells) - 1) / 2), torch.tensor(stat / 2)))


def tiny_truth(bb, prompt: list[int], sampler: Sampler, n: int) -> dict[tuple, float]:
    """Plain sampling's distribution of the first n tokens on the tiny model (exact, by enumeration
    over the sampler's support)."""
    out = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for seq, prob in out.items():
            ids = torch.tensor([prompt + list(seq)])
            with torch.inference_mode():
                logits = bb.model.logits(bb.model(ids, torch.arange(ids.shape[1])[None])[0, -1])
            p = sampler.probs(logits[None])[0]
            for t in p.nonzero().flatten().tolist():
                nxt[seq + (t,)] = prob * float(p[t])
        out = nxt
    return out
