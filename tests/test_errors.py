"""Bad input through the real entry point (`python -m pipeline ...` in a subprocess): a non-zero
exit, exactly one stderr line `error: ...` naming the knob or problem, no traceback, and no
results.json (nor a half-written one) left by the failed run."""
from __future__ import annotations

import json
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

import pipeline.cli
from conftest import PYTHON, REPO_ROOT, subprocess_env

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


@pytest.fixture(scope="module")
def error_runs(tmp_path_factory):
    """Every case, two processes at a time (most spend seconds importing torch). Validation that
    the unit tests cover in-process (top_k, dtype, proposer + sampling, ...) is not repeated here."""
    base = tmp_path_factory.mktemp("errors")
    bad_json = base / "bad.jsonl"
    bad_json.write_text('{"id": "a", "prompt": "hi"}\n{"id": "b", "prompt": \n')
    cases = dict(CASES)
    cases["invalid_json_line"] = (["model=tiny", f"input={bad_json}"], [f"{bad_json}:2", "json"])
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


@pytest.mark.parametrize("name", list(CASES) + ["invalid_json_line"])
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
    assert proc.returncode != 0
    assert path.read_bytes() == before, "an interrupted run overwrote results.json"
    assert not list(tmp_path.glob(".results.json.tmp*"))
