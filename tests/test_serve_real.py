"""The server on the real model (SmolLM2-135M, q4) through the official `openai` client: one server
serving `greedy` and, routed by model, the drafts of `tree_ngram` and `tree_eagle`. Every greedy
answer, whole and streamed, is the tokens `python -m pipeline decode=<preset>` gives (decode(), the
CLI's entry point, with the same precision), and a seeded sampled request the CLI's with that seed.
The precision is pinned: `model.dtype=auto` weighs the rows of the run's steps, which differ between
a 16-request server and a batch-1 CLI run."""
from __future__ import annotations

import contextlib
import json
import threading
import time

import openai
import pytest

from pipeline.build import component, needs_invariance, step_rows
from pipeline.decode import decode
from pipeline.server.app import build_server

from helpers import compose_config

DTYPE = "model.dtype=q4"
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3", "Explain photosynthesis in one sentence."]
MAX_TOKENS = 32
MODELS = {"greedy": "smollm2_135m", "tree_ngram": "smollm2_135m:ngram", "tree_eagle": "smollm2_135m:eagle"}


@pytest.fixture(scope="module")
def served():
    """(url, backbone): the q4 server with its drafts, on a free port of 127.0.0.1."""
    cfg = compose_config(["port=0", DTYPE, "decode=greedy", "drafts=[tree_ngram,tree_eagle]", "batch_size=8"],
                         config_name="serve")
    backbone = component(cfg.model, invariant=needs_invariance(cfg), step_rows=step_rows(cfg))
    server = build_server(cfg, backbone)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", backbone
    finally:
        server.should_exit = True
        thread.join(30)


def cli(preset: str, tmp_path, backbone, *overrides: str) -> list[list[int]]:
    """decode()'s tokens for PROMPTS (request k seeded seed + k), in the server's precision."""
    path = tmp_path / f"{preset}.jsonl"
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    cfg = compose_config([DTYPE, f"decode={preset}", f"max_new_tokens={MAX_TOKENS}", f"input={path}", "stream=false",
                          *overrides], output_dir=tmp_path / f"run-{preset}")
    return [it["token_ids"] for it in decode(cfg, backbone)[1]["results"]["items"]]


@pytest.mark.parametrize("preset", list(MODELS))
def test_greedy_over_http_equals_the_cli(served, preset, tmp_path):
    url, backbone = served
    want = cli(preset, tmp_path, backbone)
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    accepted = []
    with contextlib.ExitStack():
        for p, w in zip(PROMPTS, want):
            body = dict(model=MODELS[preset], messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS,
                        extra_body={"return_token_ids": True})
            r = c.chat.completions.create(**body)
            assert r.choices[0].token_ids == w, p
            got = [t for ch in c.chat.completions.create(**body, stream=True) if ch.choices
                   for t in ch.choices[0].model_extra.get("token_ids", [])]
            assert got == w, p
            accepted.append(r.model_extra["speculation"]["mean_accepted_length"])
    if preset != "greedy":  # the draft really drafted (and was verified) on some prompt
        assert max(accepted) > 1.2, accepted
    else:
        assert accepted == [1.0] * len(PROMPTS)


def test_a_seeded_sampled_request_equals_the_cli(served, tmp_path):
    url, backbone = served
    knobs = ("sampler.temperature=0.8", "sampler.top_p=0.95", "seed=21")
    want = cli("sample", tmp_path, backbone, *knobs)
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    for k, (p, w) in enumerate(zip(PROMPTS[:2], want)):
        r = c.chat.completions.create(model=MODELS["greedy"], messages=[{"role": "user", "content": p}],
                                      max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.95, seed=21 + k,
                                      extra_body={"return_token_ids": True})
        assert r.choices[0].token_ids == w, p
