"""The servers `python -m pipeline.loadtest server=<name>` starts itself, one subprocess on a free port
of 127.0.0.1, so that one command measures a peer:

- `ours`: `python -m pipeline.serve <the loadtest's server overrides> batch_size=<max concurrency>`
  (decode=greedy unless an override names another preset);
- `vllm`: vLLM's OpenAI server from .venv-vllm (`make peer-vllm`) on the bfloat16 Hugging Face folder
  the bench's vLLM peer loads (pipeline.vllm_peer.hf_folder), with the bench's environment (KV cache
  space, thread binding) and the folder's tokenizer, whose chat template is ours;
- `llama_cpp`: llama-cpp-python's server (`make peers`, with its `[server]` extra) on the GGUF the
  bench's llama_cpp peer runs, one sequence at a time (the server does not batch).

Every one gets the same thread count (`threads=`, auto: the cores this process may use) and is
served under one name (`served_model_name`, else the model option's: smollm2_135m, tiny).
`launched()` waits for `GET /v1/models` to answer, and at the end sends SIGTERM to the server's
process group, then SIGKILL if it has not exited; its output goes to <run dir>/<name>.log.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import httpx
from omegaconf import DictConfig

from components.model.load import smollm2_gguf
from pipeline import threads, vllm_peer
from pipeline.build import component, component_choice
from pipeline.errors import UserError

REPO_ROOT = Path(__file__).resolve().parent.parent
SERVERS = ("ours", "vllm", "llama_cpp")
STARTUP_TIMEOUT_S = {"ours": 600, "vllm": vllm_peer.STARTUP_TIMEOUT_S, "llama_cpp": 600}
STOP_TIMEOUT_S = 30  # after SIGTERM; ours drains what is in flight first (nothing, at the end of a run)
# llama-cpp-python's server imports these besides llama_cpp (its `[server]` extra)
LLAMA_SERVER_MODULES = ("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings")
LLAMA_INSTALL_HINT = "install it with `make peers` (llama-cpp-python[server]: compiles llama.cpp, 10-20 minutes)"
LLAMA_N_CTX = 2048  # a request's context: the bench's prompts (under 100 tokens, templated) and their answers fit
# the overrides a peer's launch reads; the rest are our server's knobs (ours takes them all)
PEER_KEYS = {"vllm": ("model", "served_model_name", "threads", "batch_size"),
             "llama_cpp": ("model", "served_model_name", "threads")}


@dataclass
class Launched:
    """A server started by `launched()`, serving at `url`."""
    name: str  # ours | vllm | llama_cpp
    url: str
    argv: list[str]
    log_path: Path
    # request fields this server needs to decode as the others do (llama_cpp: no repetition penalty)
    extra_body: dict = field(default_factory=dict)

    def describe(self) -> dict:
        return {"name": self.name, "url": self.url, "command": subprocess.list2cmdline(self.argv),
                "log": str(self.log_path), "extra_body": self.extra_body}


def override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def hydra_quoted(path: Path) -> str:
    """A path as one Hydra override value (a sweep's run dir holds `=`, `,` and brackets)."""
    return "'" + str(path).replace("\\", "\\\\").replace("'", "\\'") + "'"


def free_port() -> int:
    """A port nothing listens on now (the server binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def not_installed(name: str) -> str | None:
    """Why server `name` cannot start here, naming the install command (None: it can)."""
    if name not in SERVERS:
        raise UserError(f"unknown server {name!r}; known: {', '.join(SERVERS)} (or null with url=)")
    if name == "vllm" and not vllm_peer.available():
        return f"server=vllm: vLLM is not installed (no complete {Path(vllm_peer.VENV_PYTHON).parents[1]}): {vllm_peer.INSTALL_HINT}"
    if name == "llama_cpp":
        missing = [m for m in LLAMA_SERVER_MODULES if importlib.util.find_spec(m) is None]
        if missing:
            return (f"server=llama_cpp: llama-cpp-python's server is not installed ({', '.join(missing)} missing): "
                    f"{LLAMA_INSTALL_HINT}")
    return None


def check_overrides(name: str, overrides: list[str]) -> None:
    """Where the server listens is the loadtest's to choose; a peer takes the model and thread knobs
    of the overrides, and anything else would be silently ignored there, so it is refused."""
    placed = [o for o in overrides if override_key(o) in ("host", "port")]
    if placed:
        raise UserError(f"server={name} listens on a free port of 127.0.0.1, chosen by the loadtest: drop {placed[0]}")
    if name == "ours":
        return
    keys = PEER_KEYS[name]
    other = [o for o in overrides if override_key(o).split(".")[0] not in keys]
    if other:
        raise UserError(f"server={name} takes only {', '.join(k + '=' for k in keys)} of the overrides; "
                        f"{other[0]} configures our server: drop it (or measure server=ours)")


def served_name(cfg: DictConfig) -> str:
    """What clients put in `model`: the configured name, else the model option's (as ours names it)."""
    return str(cfg.get("served_model_name") or component_choice("model", cfg.model))


def gguf_path(model_cfg: DictConfig) -> Path:
    """A model config's GGUF file: model.path, else the default model's (as the bench's llama_cpp peer finds it)."""
    path = Path(model_cfg.path).expanduser() if model_cfg.get("path") else None
    if path is None and not str(model_cfg.get("_target_", "")).endswith("from_pretrained"):
        raise UserError("server=llama_cpp needs a GGUF file: the default model, or model.path=<file.gguf>")
    path = path or smollm2_gguf()
    if path.suffix != ".gguf":
        raise UserError(f"server=llama_cpp needs a .gguf model, got {path}: pass model.path=<file.gguf>")
    return path


def hf_folder(model_cfg: DictConfig, scratch: Path) -> Path:
    """vLLM's folder for this model (vllm_peer.hf_folder). Only a model without a file (model=tiny)
    is written from its built weights, so only that one is built here."""
    has_file = model_cfg.get("path") or str(model_cfg.get("_target_", "")).endswith("from_pretrained")
    return vllm_peer.hf_folder(model_cfg, None if has_file else component(model_cfg), scratch)


def command(name: str, cfg: DictConfig, overrides: list[str], port: int, slots: int,
            out_dir: Path) -> tuple[list[str], dict[str, str], dict]:
    """(argv, environment, extra request fields) of server `name` on `port`, with `slots` requests
    decoded at once where the server batches."""
    n_threads = threads.share(cfg.get("threads", "auto"))
    given = {override_key(o) for o in overrides}
    batch = int(cfg.batch_size) if "batch_size" in given else slots
    if name == "ours":
        argv = [sys.executable, "-m", "pipeline.serve", *overrides, "host=127.0.0.1", f"port={port}",
                f"hydra.run.dir={hydra_quoted(out_dir / 'ours')}"]
        if "batch_size" not in given:
            argv.append(f"batch_size={slots}")
        return argv, dict(os.environ), {}
    if name == "vllm":
        argv = [str(vllm_peer.VENV_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(hf_folder(cfg.model, out_dir)), "--dtype", "bfloat16", "--host", "127.0.0.1",
                "--port", str(port), "--served-model-name", served_name(cfg), "--max-num-seqs", str(batch),
                "--generation-config", "vllm", "--seed", "0"]  # vLLM's defaults, not the folder's generation_config
        return argv, vllm_peer.vllm_env(n_threads), {}
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf_path(cfg.model)), "--host", "127.0.0.1",
            "--port", str(port), "--n_ctx", str(LLAMA_N_CTX), "--model_alias", served_name(cfg),
            "--n_threads", str(n_threads), "--n_threads_batch", str(n_threads),
            "--interrupt_requests", "false"]  # its default cuts the stream in flight when another request comes
    # its requests default to repeat_penalty 1.1: 1.0 is greedy, as the bench's llama_cpp peer decodes
    return argv, dict(os.environ), {"repeat_penalty": 1.0}


@contextlib.contextmanager
def launched(name: str, cfg: DictConfig, overrides: list[str], slots: int, out_dir: Path) -> Iterator[Launched]:
    """Server `name` started, serving; stopped when the block ends, however it ends."""
    reason = not_installed(name)
    if reason:
        raise UserError(reason)
    check_overrides(name, overrides)
    port = free_port()
    argv, env, extra = command(name, cfg, overrides, port, slots, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / f"{name}.log"
    with open(log_path, "w") as log:
        # its own session: a Ctrl-C in the terminal reaches the loadtest, which stops the server itself
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            print(f"loadtest: starting {name} on {url} (log: {log_path})", file=sys.stderr, flush=True)
            wait_ready(proc, url, STARTUP_TIMEOUT_S[name], log_path, name)
            yield Launched(name, url, argv, log_path, extra)
        finally:
            stop(proc)


def wait_ready(proc: subprocess.Popen, url: str, timeout: float, log_path: Path, name: str) -> None:
    """Returns once GET /v1/models answers 200; a server that exits or never answers is a UserError."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise UserError(f"server={name} exited (code {proc.returncode}) before serving: {last_line(log_path)} "
                            f"(its log: {log_path})")
        try:
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:  # not listening yet
            pass
        time.sleep(0.5)
    raise UserError(f"server={name} did not answer GET /v1/models within {timeout:.0f} s (its log: {log_path})")


def last_line(path: Path) -> str:
    lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "it wrote nothing"


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (vLLM runs its engine in a child process), SIGKILL after
    STOP_TIMEOUT_S."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
