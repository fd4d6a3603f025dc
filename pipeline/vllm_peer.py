"""Benchmark peer `vllm`: vLLM's CPU build on the same weights, greedy, on the same prompt token ids
(our tokenizer applies the chat template; vLLM's tokenizer is not loaded), stopping at the same EOS
ids. An optional extra in its own venv (`make peer-vllm`, ~3.5 GB: vLLM pins its own torch and
transformers); the bench skips the entry with one line when .venv-vllm is absent.

vLLM runs in a subprocess with .venv-vllm's python (pipeline/vllm_worker.py, a JSON-lines protocol):
it starts once, when the bench builds its pipelines (minutes: torch.compile of the model, cached by
vLLM after the first time), and every `run` is one line to it and one line back, so the bench's
timing covers generation alone. `batch_size=B` gives vLLM B slots: every request is handed to it and
it runs at most B at once, admitting the next as one finishes (B=1: one after another).

vLLM needs a Hugging Face folder: a GGUF (the default model's included) is written once as a
bfloat16 LlamaForCausalLM (`pipeline.hf_peer.to_hf` of the float32 backbone, the same dequantized
weights as ours, then cast) plus its tokenizer, cached by the file's content; an HF folder is
loaded as it is. vLLM computes in bfloat16 whatever `model.dtype` says.

Entry options (`"vllm speculative=ngram num_speculative_tokens=5"`): `speculative=ngram` turns on
vLLM's n-gram (prompt lookup) speculation with `num_speculative_tokens` drafted tokens, matched on
the last `prompt_lookup_min`..`prompt_lookup_max` tokens; the defaults are vLLM's documented example.
`speculative=eagle draft=<draft.safetensors | exported folder>` (`speculative=eagle3` for a fused
draft) runs our EAGLE draft in vLLM (method eagle / eagle3, `num_speculative_tokens` default 3): a
.safetensors draft (default: the shipped one) is exported once by `pipeline.export.export_eagle`
under the cache dir, keyed by its content; the export says what does not map exactly.
"""
from __future__ import annotations

import json
import os
import selectors
import subprocess
import tempfile
from pathlib import Path

import torch

from components.model.load import cache_dir, content_key, from_pretrained, smollm2_gguf
from pipeline.core import Generation, UserError, positive_int
from pipeline.io import atomic_write
from pipeline.hf_peer import to_hf
from components.proposer.eagle import shipped_draft
from pipeline.export import EAGLE_EXPORT_VERSION, backbone_for, export_eagle

REPO_ROOT = Path(__file__).resolve().parent.parent
VENV_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
WORKER = Path(__file__).resolve().with_name("vllm_worker.py")
INSTALL_HINT = "install it with `make peer-vllm` (vLLM's CPU build in .venv-vllm, ~3.5 GB)"
# entry overrides with these keys configure vLLM; every other one goes to the composed decode config
KNOBS = ("speculative", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "draft")
NGRAM_DEFAULTS = {"num_speculative_tokens": 5, "prompt_lookup_max": 4}
EAGLE_DEFAULTS = {"num_speculative_tokens": 3}
KV_CACHE_GB = 2  # VLLM_CPU_KVCACHE_SPACE: 2 GB hold ~90k tokens of the default model
STARTUP_TIMEOUT_S = 1800  # vLLM's first start compiles the model: 2-3 minutes on 2 busy cores
MEASURED = ("generation only: the bench's clock around each round, which is one JSON line to the vLLM "
            "process and one back (vLLM's engine steps over every request); vLLM's start-up "
            "(model load, torch.compile, KV cache) happens before the warm-up and is not timed")


def available() -> bool:
    """Installed and complete: `make peer-vllm` stamps .installed last, so a venv still being built
    (or whose install failed) is not taken for one."""
    python = Path(VENV_PYTHON)
    return python.is_file() and (python.parents[1] / ".installed").is_file()


def speculative_config(knobs: dict) -> dict | None:
    """The entry's options -> vLLM's `speculative_config` (None: plain decoding)."""
    unknown = set(knobs) - set(KNOBS)
    if unknown:
        raise UserError(f"unknown vllm option(s) {sorted(unknown)}; known: {', '.join(KNOBS)}")
    method = knobs.get("speculative")
    if method in (None, "none", False):
        if set(knobs) - {"speculative"}:
            raise UserError(f"vllm options {sorted(set(knobs) - {'speculative'})} need speculation: "
                            'add speculative=ngram, e.g. "vllm speculative=ngram num_speculative_tokens=5"')
        return None
    if method in ("eagle", "eagle3"):
        return eagle_config(method, knobs)
    if method != "ngram":
        raise UserError(f"vllm speculative={method!r} is not supported: give speculative=ngram, eagle, eagle3 (or none)")
    if "draft" in knobs:
        raise UserError("vllm draft= is for speculative=eagle / eagle3 (our EAGLE draft), not ngram: drop it")
    cfg = {"method": "ngram", **NGRAM_DEFAULTS, **{k: v for k, v in knobs.items() if k != "speculative"}}
    for k, v in cfg.items():
        if k != "method":
            positive_int(v, f"vllm {k}")
    if cfg.get("prompt_lookup_min", 1) > cfg["prompt_lookup_max"]:
        raise UserError(f"vllm prompt_lookup_min={cfg['prompt_lookup_min']} is above prompt_lookup_max="
                        f"{cfg['prompt_lookup_max']}: lower it")
    return cfg


def eagle_config(method: str, knobs: dict) -> dict:
    """speculative=eagle / eagle3: our EAGLE draft in vLLM's layout of that method (an unfused draft
    is EAGLE-1's, a fused one EAGLE-3's)."""
    k = positive_int(knobs.get("num_speculative_tokens", EAGLE_DEFAULTS["num_speculative_tokens"]),
                     "vllm num_speculative_tokens")
    extra = set(knobs) - {"speculative", "draft", "num_speculative_tokens"}
    if extra:
        raise UserError(f"vllm options {sorted(extra)} are n-gram speculation's, not speculative={method}'s: drop them")
    folder = eagle_folder(knobs.get("draft"))
    have = json.loads((folder / "config.json").read_text()).get("llm_decode", {}).get("method")
    if have != method:
        raise UserError(f"draft {knobs.get('draft') or folder} is in vLLM's {have} layout: give speculative={have}")
    return {"method": method, "model": str(folder), "num_speculative_tokens": k}


def eagle_folder(draft: str | None) -> Path:
    """A vLLM draft folder: an exported one as it is; a draft .safetensors (None: the shipped draft of
    the default model) exported once under the cache dir, keyed by its content."""
    path = Path(draft).expanduser() if draft else shipped_draft("smollm2_135m")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"vllm draft={path} has no config.json: export the draft with "
                            "`python -m pipeline.export <draft.safetensors> <dir> --format eagle`")
        return path
    if not path.is_file():
        raise UserError(f"vllm draft={path} does not exist: give an EAGLE draft .safetensors or an exported folder")
    out = cache_dir() / f"{path.stem}-{content_key(path)}-vllm-eagle-v{EAGLE_EXPORT_VERSION}"
    if (out / "config.json").is_file():
        return out

    def write(tmp: Path):
        export_eagle(str(path), str(tmp), backbone_for(path, None))

    try:
        atomic_write(out, write)
    except OSError:
        if not (out / "config.json").is_file():
            raise  # not a lost race with another process writing the same folder
    return out


def hf_folder(model_cfg, backbone, scratch: Path) -> Path:
    """A Hugging Face folder vLLM can load for this model config: an HF model.path as it is; a GGUF
    (model.path, or the default model's) written once in bfloat16 under the cache dir, keyed by the
    file's content; any other backbone (model=tiny) written from its weights into `scratch`."""
    path = model_cfg.get("path")
    if path and Path(path).expanduser().is_dir():
        return Path(path).expanduser()
    default = str(model_cfg.get("_target_", "")).endswith("from_pretrained")  # path: null is the default GGUF
    source = Path(path).expanduser() if path else smollm2_gguf() if default else None
    if source is None:
        out, dense = scratch / "vllm_model", backbone
    else:
        out, dense = cache_dir() / f"{source.stem}-{content_key(source)}-hf-bfloat16", None
    if (out / "config.json").is_file():
        return out

    def write(tmp: Path):
        bb = dense or from_pretrained(str(source), dtype="float32")  # our exact dequantization
        to_hf(bb).to(torch.bfloat16).save_pretrained(tmp)
        bb.tokenizer.save_pretrained(tmp)

    try:
        atomic_write(out, write)
    except OSError:
        if not (out / "config.json").is_file():
            raise  # not a lost race with another process writing the same folder
    return out


def vllm_env(threads: int) -> dict[str, str]:
    """vLLM's environment: its KV cache space, and its compute on `threads` cores (vLLM's own default
    binds all cores but one, kept for its front end)."""
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GB), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "OMP_NUM_THREADS": str(threads),
            "TOKENIZERS_PARALLELISM": "false"}


class VllmPeer:
    """vLLM behind the Engine's interface: `run(prompts, seeds) -> list[Generation]`."""

    def __init__(self, model_dir: Path, eos_ids: list[int], max_new_tokens: int, max_model_len: int,
                 batch_size: int = 1, speculative: dict | None = None, threads: int | None = None,
                 python: Path | None = None, worker: Path | None = None, log_path: Path | None = None,
                 eager: bool = False):
        """eager: vLLM's enforce_eager (no torch.compile: starts in ~30 s, decodes slower; tests)."""
        positive_int(max_new_tokens, "max_new_tokens"), positive_int(batch_size, "batch_size")
        python = Path(python or VENV_PYTHON)
        if not python.is_file():
            raise UserError(f"vllm is not installed ({python} is missing): {INSTALL_HINT}")
        self.eos_ids, self.max_new_tokens, self.batch_size = list(eos_ids), max_new_tokens, batch_size
        self.threads = threads or torch.get_num_threads()
        self.speculative = speculative
        settings = {"model": str(model_dir), "dtype": "bfloat16", "skip_tokenizer_init": True,
                    "generation_config": "vllm",  # not the folder's generation defaults
                    "max_model_len": max_model_len, "max_num_seqs": batch_size, "seed": 0,
                    "speculative_config": speculative, "enforce_eager": eager}
        # vLLM's own defaults bind its compute to all cores but one (kept for its front end): give it
        # the thread count our pipelines get
        env = vllm_env(self.threads)
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="vllm-", suffix=".log")[1])
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([str(python), str(worker or WORKER), json.dumps(settings)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)
        ready = self._read(STARTUP_TIMEOUT_S)
        self.version, self.startup_s = ready.get("vllm"), ready.get("startup_s")
        self.engine_wall_s = None  # the worker's own clock over the last run (excludes the pipe)

    def _read(self, timeout: float) -> dict:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        ready = sel.select(timeout)
        sel.close()
        line = self.proc.stdout.readline() if ready else ""
        msg = json.loads(line) if line.strip() else {"error": self._last_log_line() if ready else
                                                     f"no answer in {timeout:.0f} s"}
        if "error" in msg:
            self.close()
            raise UserError(f"vllm failed: {msg['error']} (its log: {self.log_path})")
        return msg

    def _last_log_line(self) -> str:
        self._log.flush()
        lines = [ln.strip() for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        return f"it exited: {lines[-1][:300]}" if lines else "it exited without a word"

    def run(self, prompts: list[list[int]], seeds: list[int] | None = None, on_finish=None) -> list[Generation]:
        """Every prompt, `batch_size` at a time. `seeds` is accepted for the Engine's interface: greedy
        does not sample. on_finish(i, generation) once all are done (vLLM answers a whole run)."""
        for i, p in enumerate(prompts):
            if not p:
                raise UserError(f"request {i} has an empty prompt: give it some text")
        job = {"prompts": [list(map(int, p)) for p in prompts], "max_new_tokens": self.max_new_tokens,
               "stop_token_ids": self.eos_ids, "max_running": self.batch_size}
        if self.proc.poll() is not None:
            raise UserError(f"vllm exited (code {self.proc.returncode}); its log: {self.log_path}")
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        reply = self._read(STARTUP_TIMEOUT_S)
        self.engine_wall_s = reply["wall_s"]
        out = [self._generation(o) for o in reply["outputs"]]
        if on_finish is not None:
            for i, g in enumerate(out):
                on_finish(i, g)
        return out

    def _generation(self, o: dict) -> Generation:
        spec = self.speculative is not None
        k = self.speculative["num_speculative_tokens"] if spec else 0
        steps = len(o["accepted_lengths"]) - 1  # after the prefill: a plain step, or a verified draft
        return Generation(token_ids=o["token_ids"], finish_reason=o["finish_reason"],
                          accepted_lengths=o["accepted_lengths"], step_ms=o["step_ms"],
                          step_nodes=[1 + k] * steps,  # the drafted tokens: at most k, fewer without a match
                          tree_depths=[k] * steps if spec else [], wall_s=o["wall_s"], prefill_ms=o["prefill_ms"])

    def describe(self) -> dict:
        """What bench.json records of the peer."""
        return {"precision": "bfloat16 (vLLM)", "peer": f"vLLM {self.version} CPU build, {self.threads} threads",
                "speculative_config": self.speculative, "startup_s": round(self.startup_s or 0.0, 1),
                "engine_wall_s": None if self.engine_wall_s is None else round(self.engine_wall_s, 4),
                "measured": MEASURED}

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __del__(self):
        if getattr(self, "proc", None) is not None and getattr(self, "_log", None) is not None:
            self.close()
