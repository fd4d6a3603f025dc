"""How close each precision's greedy decoding is to float32's (the exact reference, equal to transformers).

    python scripts/precision_agreement.py [max_new_tokens=64]

On the 24 benchmark prompts: per mode, the requests whose tokens equal float32 greedy's exactly, and
the mean index of the first differing token (64 = never). llama.cpp on the same GGUF is included
when it is installed (`make peers`), and a second table compares every mode with llama.cpp's tokens
(w4a8 multiplies as llama.cpp does: int8 rows in blocks of 32 against the file's Q4_1 and Q8_0
blocks). Prints Markdown tables (README, "Precision"; docs/precision.md).
"""
from __future__ import annotations

import sys

import torch

from components.model.load import from_pretrained, smollm2_gguf
from pipeline import llama_cpp_peer
from pipeline.bench import DEFAULT_INPUT
from pipeline.build import build_engine
from pipeline.cli import compose_config
from pipeline.metrics import first_divergence
from pipeline.requests import encode, load_requests


def greedy(bb, dtype: str, prompts, n: int) -> list[list[int]]:
    eng, _ = build_engine(compose_config(["decode=greedy", f"max_new_tokens={n}", f"model.dtype={dtype}",
                                          "batch_size=8"]), bb)
    return [g.token_ids for g in eng.run(prompts)]


def row(name: str, got, ref, n: int) -> str:
    firsts = [first_divergence(a, b) for a, b in zip(got, ref)]
    same = sum(d is None for d in firsts)
    mean_first = sum(min(len(a), len(b)) if d is None else d for d, a, b in zip(firsts, got, ref)) / len(ref)
    return f"| {name} | {same}/{len(ref)} | {mean_first:.1f} |"


def main():
    n = int(sys.argv[1].split("=")[1]) if len(sys.argv) > 1 else 64
    bb = from_pretrained(dtype="float32")
    prompts = [encode(bb.tokenizer, r, True) for r in load_requests(str(DEFAULT_INPUT), None)]
    got = {"float32": greedy(bb, "float32", prompts, n)}
    eos = bb.eos_ids
    del bb
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"{cpu}, CPU capability {torch.backends.cpu.get_cpu_capability()}, {len(prompts)} prompts x {n} tokens\n")
    for dtype in ("bfloat16", "q4", "w4a8"):
        got[dtype] = greedy(from_pretrained(dtype=dtype), dtype, prompts, n)
    if llama_cpp_peer.available():
        peer = llama_cpp_peer.LlamaCppPeer(smollm2_gguf(), eos, n)
        got["llama.cpp (same GGUF)"] = [g.token_ids for g in peer.run(prompts)]
    for ref_name in ["float32", "llama.cpp (same GGUF)"]:
        if ref_name not in got:
            continue
        print(f"| precision | requests identical to {ref_name} greedy | mean first differing position (identical: its length) |")
        print("|---|---:|---:|")
        for name, tokens in got.items():
            if name != ref_name:
                print(row(name, tokens, got[ref_name], n))
        print()


if __name__ == "__main__":
    main()
