"""Bad input through the real entry point (`python -m pipeline ...` in a subprocess): a non-zero
exit, exactly one stderr line `error: ...` naming the knob or problem, no traceback, and no
results.json (nor a half-written one) left by the failed run."""
from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

import pipeline.cli
from helpers import PYTHON, REPO_ROOT, compose_config, subprocess_env

LONG_PROMPT = "prompt=" + "_".join(["word"] * 40)  # far more than 16 tokens, no Hydra-special characters

# id -> (overrides, patterns the one error line must contain, case-insensitively)
CASES: dict[str, tuple[list[str], list[str]]] = {
    "unknown_decode": (["decode=nope"], ["decode", "nope", "greedy", "tree_ngram"]),
    "unknown_proposer": (["model=tiny", "proposer=nope"], ["proposer", "nope", "ngram"]),
    "unknown_kv": (["model=tiny", "kv=nope"], ["kv", "nope", "contiguous"]),
    "unknown_sampler": (["model=tiny", "sampler=nope"], ["sampler", "nope", "greedy"]),
    "missing_model_path": (["model.path=/nonexistent.gguf", "prompt=hi"], ["/nonexistent.gguf", "model.path"]),
    "missing_input": (["model=tiny", "input=/nonexistent/requests.jsonl"], ["/nonexistent/requests.jsonl", "input"]),
    "prompt_too_long": (["model=tiny", "model.max_seq_len=16", "chat=false", LONG_PROMPT],
                        ["prompt", "16", "context"]),
    "max_new_tokens_0": (["model=tiny", "max_new_tokens=0", "prompt=hi"], ["max_new_tokens", "0"]),
    "max_new_tokens_neg": (["model=tiny", "max_new_tokens=-1", "prompt=hi"], ["max_new_tokens", "-1"]),
    "top_p_1.5": (["model=tiny", "sampler=sample", "sampler.top_p=1.5", "prompt=hi"], ["sampler.top_p", "1.5"]),
    "top_p_0": (["model=tiny", "sampler=sample", "sampler.top_p=0", "prompt=hi"], ["sampler.top_p"]),
    "temperature_0": (["model=tiny", "sampler=sample", "sampler.temperature=0", "prompt=hi"],
                      ["sampler.temperature"]),
    # a sampling knob given with the default (greedy) sampler is bad input too, and must say so on one line
    "temperature_0_greedy_sampler": (["model=tiny", "sampler.temperature=0", "prompt=hi"], ["temperature"]),
    # so is a misspelt top-level knob
    "misspelt_knob": (["model=tiny", "max_new_token=5", "prompt=hi"], ["max_new_token"]),
    "nothing_to_decode": (["model=tiny"], ["input", "prompt"]),
}


# bad input files: id -> (lines, patterns the error must name; {path} = the file)
INPUT_CASES: dict[str, tuple[list[str], list[str]]] = {
    "invalid_json_line": (['{"id": "a", "prompt": "hi"}', '{"id": "b", "prompt": '], ["{path}:2", "json"]),
    "empty_input_file": ([], ["{path}", "no requests"]),
    "empty_messages": (['{"id": "a", "messages": []}'], ["{path}:1", "messages", "non-empty"]),
    "message_without_role": (['{"id": "a", "messages": [{"content": "hi"}]}'], ["{path}:1", "role"]),
    "message_without_content": (['{"id": "a", "messages": [{"role": "user"}]}'], ["{path}:1", "content"]),
    "unknown_role": (['{"id": "a", "messages": [{"role": "robot", "content": "hi"}]}'], ["robot", "user"]),
    "empty_prompt_chat_false": (['{"id": "a", "prompt": ""}'], ["{path}:1", "prompt", "empty"]),
    "non_string_prompt": (['{"id": "a", "prompt": 5}'], ["{path}:1", "prompt", "string"]),
    "duplicate_ids": (['{"id": "a", "prompt": "hi"}', '{"id": "a", "prompt": "ho"}'], ["{path}:2", "'a'", "unique"]),
    "prompt_and_messages": (['{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}'], ["both"]),
    "not_an_object": (['["hi"]'], ["{path}:1", "prompt"]),
}


def tiny_heads(base):
    """Medusa heads for model=tiny, saved as the training job saves them."""
    from components.model.load import tiny
    from pipeline.build import component
    import torch
    bb = tiny()
    cfg = compose_config(["model=tiny"], config_name="train")
    heads = component(cfg.heads, bb, token_counts=torch.ones(bb.model.args.vocab_size, dtype=torch.long))
    return heads.save(base / "heads.safetensors", {"vocab_size": bb.model.args.vocab_size,
                                                   "fingerprint": bb.model.fingerprint(), "backbone": bb.name})


@dataclass
class Run:
    rc: int
    stdout: str
    stderr: str
    run_dir: object


def run_pipeline(args: list[str], run_dir, timeout=240) -> Run:
    p = subprocess.run([PYTHON, "-m", "pipeline", *args, "stream=false", f"hydra.run.dir={run_dir}"],
                       cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
    return Run(p.returncode, p.stdout, p.stderr, run_dir)


@pytest.fixture(scope="session")  # made once per worker that runs one of these tests
def error_runs(tmp_path_factory):
    """Every case, two processes at a time (most spend seconds importing torch). Validation that
    the unit tests cover in-process (top_k, dtype, proposer + sampling, ...) is not repeated here."""
    base = tmp_path_factory.mktemp("errors")
    cases = dict(CASES)
    for name, (lines, patterns) in INPUT_CASES.items():  # bad input files
        path = base / f"{name}.jsonl"
        path.write_text("".join(line + "\n" for line in lines))
        cases[name] = (["model=tiny", f"input={path}", *(["chat=false"] if name == "empty_prompt_chat_false" else [])],
                       [p.replace("{path}", str(path)) for p in patterns])
    heads = tiny_heads(base)
    tree = base / "tree.json"
    tree.write_text(json.dumps({"nodes": 3}))
    noise = base / "noise.safetensors"
    noise.write_bytes(bytes(random.Random(0).randrange(256) for _ in range(4096)))
    partial = base / "partial.safetensors"
    with safe_open(str(heads), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys() if not k.startswith("blocks.0")}
    save_file(tensors, partial, metadata=meta)
    medusa = ["model=tiny", "decode=tree_medusa", "prompt=hi"]
    cases["tree_file_without_choices"] = ([*medusa, f"proposer.checkpoint={heads}", f"proposer.tree_file={tree}"],
                                          [str(tree), "choices"])
    cases["heads_random_bytes"] = ([*medusa, f"proposer.checkpoint={noise}"], [str(noise), "safetensors"])
    cases["heads_missing_tensors"] = ([*medusa, f"proposer.checkpoint={partial}"], [str(partial), "missing", "blocks.0"])
    cases["missing_heads"] = ([*medusa, "proposer.checkpoint=/nonexistent/heads.safetensors"],
                              ["/nonexistent/heads.safetensors", "proposer.checkpoint"])
    cases["batch_size_0"] = (["model=tiny", "batch_size=0", "prompt=hi"], ["batch_size", "0"])
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run_pipeline, args, base / name) for name, (args, _) in cases.items()}
        return {name: (f.result(), cases[name][1]) for name, f in futures.items()}


def assert_one_line_error(run: Run, patterns: list[str]):
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.rc != 0, f"exit code 0; stderr: {run.stderr!r}"
    assert "Traceback" not in run.stderr, run.stderr
    assert len(lines) == 1 and run.stderr.count("\n") <= 1, f"expected one stderr line, got:\n{run.stderr}"
    line = lines[0]
    assert line.startswith("error:") and len(line) > len("error: ") + 10, line
    for pat in patterns:
        assert pat.lower() in line.lower(), f"{pat!r} not named in {line!r}"
    assert not (run.run_dir / "results.json").exists(), "a failed run wrote results.json"
    assert not list(run.run_dir.glob(".results.json.tmp*")), "a failed run left a temporary results file"


ALL_CASES = list(CASES) + list(INPUT_CASES) + ["tree_file_without_choices", "heads_random_bytes",
                                              "heads_missing_tensors", "missing_heads", "batch_size_0"]


@pytest.mark.parametrize("name", ALL_CASES)
def test_bad_input_is_one_line_error(error_runs, name):
    run, patterns = error_runs[name]
    assert_one_line_error(run, patterns)


def test_unknown_component_lists_every_known_option(error_runs):
    known = pipeline.cli.groups()
    for name, group in (("unknown_decode", "decode"), ("unknown_kv", "kv"), ("unknown_proposer", "proposer")):
        line = error_runs[name][0].stderr.strip()
        for option in known[group]:
            assert option in line, f"{option!r} missing from {line!r}"


def test_successful_run_then_failed_runs_keep_results(tmp_path):
    """A good run writes results.json; a failing run into the same directory, and one interrupted
    in the middle of decoding, leave it byte-for-byte intact and leave no temporary file."""
    ok = run_pipeline(["model=tiny", "max_new_tokens=4", "chat=false", "prompt=hello"], tmp_path)
    assert ok.rc == 0, ok.stderr
    path = tmp_path / "results.json"
    before = path.read_bytes()
    assert json.loads(before)["summary"]["new_tokens"] == 4

    bad = run_pipeline(["model=tiny", "max_new_tokens=0", "prompt=hello"], tmp_path)
    assert bad.rc != 0
    assert path.read_bytes() == before

    inp = tmp_path / "many.jsonl"
    inp.write_text("\n".join(json.dumps({"id": f"r{i}", "prompt": f"story number {i}"}) for i in range(200)))
    proc = subprocess.Popen([PYTHON, "-m", "pipeline", "model=tiny", f"input={inp}", "max_new_tokens=1500",
                             "chat=false", "stream=true", f"hydra.run.dir={tmp_path}"],
                            cwd=REPO_ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        proc.stdout.read(64)  # decoding has started: text is streaming
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130
    assert path.read_bytes() == before, "an interrupted run with nothing finished overwrote results.json"
    assert not list(tmp_path.glob(".results.json.tmp*"))


def test_interrupted_run_resumes_with_every_request_exactly_once(tmp_path):
    """SIGTERM part-way through a batched run: finished requests are in items.jsonl and results.json,
    one line says so; the rerun in the same directory decodes only the rest, leaves the finished
    lines untouched, and the tokens are those of an uninterrupted run."""
    inp = tmp_path / "in.jsonl"
    ids = [f"q{i}" for i in range(6)]
    inp.write_text("\n".join(json.dumps({"id": i, "prompt": f"Tell story {i}."}) for i in ids) + "\n")
    run_dir = tmp_path / "run"
    args = [PYTHON, "-m", "pipeline", "model=tiny", f"input={inp}", "max_new_tokens=1200", "batch_size=2",
            "stream=false", f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(args, cwd=REPO_ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    items = run_dir / "items.jsonl"
    try:
        deadline = time.time() + 120
        while time.time() < deadline and (not items.is_file() or len(items.read_text().splitlines()) < 2):
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("interrupted:") and str(run_dir) in lines[0], err
    before = items.read_text().splitlines()
    assert 2 <= len(before) < 6, "the run was not interrupted part-way: lengthen the requests"
    partial = json.loads((run_dir / "results.json").read_text())
    assert partial["summary"]["interrupted"] and len(partial["items"]) == len(before)

    again = subprocess.run(args, cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "resuming" in again.stderr
    after = items.read_text().splitlines()
    assert after[:len(before)] == before, "finished items were rewritten"
    assert sorted(json.loads(x)["id"] for x in after) == ids, "a request ran twice or not at all"
    final = json.loads((run_dir / "results.json").read_text())
    assert [it["id"] for it in final["items"]] == ids and not final["summary"]["interrupted"]

    fresh = subprocess.run([*args[:-1], f"hydra.run.dir={tmp_path / 'fresh'}"], cwd=REPO_ROOT, env=subprocess_env(),
                           capture_output=True, text=True, timeout=300)
    assert fresh.returncode == 0, fresh.stderr
    ref = json.loads((tmp_path / "fresh" / "results.json").read_text())
    assert [it["token_ids"] for it in final["items"]] == [it["token_ids"] for it in ref["items"]]


def test_a_prompt_typed_with_commas_works(tmp_path):
    run = run_pipeline(["model=tiny", "max_new_tokens=3", "chat=false", "prompt=Hi, who are you? It's ${me}"], tmp_path)
    assert run.rc == 0, run.stderr
    assert json.loads((tmp_path / "results.json").read_text())["items"][0]["prompt"] == "Hi, who are you? It's ${me}"


@pytest.mark.parametrize("typed", ["Hi, who are you?", r"C:\Users\me", "say \\n", "ends with \\", "It's ${me}",
                                   '"Stop," he said, "now"', "'a' or 'b'", "plain", "[1,2]", "a=b", "42", "x\\'y"])
def test_free_text_reaches_the_config_as_typed(typed):
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf
    arg = pipeline.cli.quote_free_text([f"prompt={typed}"])[0]
    value = OverridesParser.create().parse_override(arg).value()
    assert OmegaConf.create({"p": value}).p == typed
