"""Benchmark peer `llama_cpp`: llama.cpp (through llama-cpp-python) on the same GGUF file, greedy, the
same prompt token ids (our tokenizer applies the chat template; llama.cpp's own tokenizer is not
used), the same thread count. An optional extra: `make peers` builds it (10-20 minutes of
compiling); the bench skips the entry with one line when it is absent.

llama.cpp decodes one sequence at a time through this API; with batch_size > 1 the peer still
runs the requests one after another (what a user of `Llama` gets), and says so in bench.json.
Its prompt cache is cleared between requests, so a shared system prompt is not reused.
"""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import torch

from pipeline.core import Generation, UserError

INSTALL_HINT = "install it with `make peers` (builds llama-cpp-python, 10-20 minutes)"


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


class LlamaCppPeer:
    """`llama_cpp.Llama` behind the Engine's interface: `run(prompts, seeds) -> list[Generation]`."""

    def __init__(self, gguf_path: Path, eos_ids: list[int], max_new_tokens: int, n_ctx: int = 2048,
                 threads: int | None = None, batch_size: int = 1):
        if not available():
            raise UserError(f"llama_cpp is not installed: {INSTALL_HINT}")
        if Path(gguf_path).suffix != ".gguf":
            raise UserError(f"the llama_cpp peer needs a .gguf model, got {gguf_path}: pass model.path=<file.gguf>")
        from llama_cpp import Llama  # an optional extra (make peers): imported only when the peer runs
        threads = threads or torch.get_num_threads()
        self.llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, verbose=False)
        self.eos_ids, self.max_new_tokens, self.batch_size = set(eos_ids), max_new_tokens, batch_size
        self.threads = threads

    def run(self, prompts: list[list[int]], seeds: list[int] | None = None, on_finish=None) -> list[Generation]:
        out = []
        for i, p in enumerate(prompts):
            out.append(self._one(p))
            if on_finish is not None:
                on_finish(i, out[-1])
        return out

    def _one(self, prompt: list[int]) -> Generation:
        if not prompt:
            raise UserError("a request has an empty prompt: give it some text")
        llm = self.llm
        llm.reset()
        t0 = time.perf_counter()
        toks, step_ms, finish = [], [], "length"
        last = t0
        for tok in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            now = time.perf_counter()
            step_ms.append((now - last) * 1e3)
            last = now
            toks.append(int(tok))
            if tok in self.eos_ids:
                finish = "eos"
                break
            if len(toks) >= self.max_new_tokens:
                break
            if len(prompt) + len(toks) >= llm.n_ctx():
                finish = "context"
                break
        wall = time.perf_counter() - t0
        prefill = step_ms[0] if step_ms else 0.0
        return Generation(token_ids=toks, finish_reason=finish, accepted_lengths=[1] * len(toks),
                          step_ms=step_ms[1:], step_nodes=[1] * max(len(toks) - 1, 0), tree_depths=[],
                          wall_s=wall, prefill_ms=prefill)
