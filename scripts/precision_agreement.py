"""How close each precision's greedy decoding is to float32's (the exact reference, equal to transformers).

    python scripts/precision_agreement.py [max_new_tokens=64]

On the 24 benchmark prompts: per mode, the requests whose tokens equal float32 greedy's exactly, and
the mean index of the first differing token (64 = never). llama.cpp on the same GGUF is included
when it is installed (`make peers`). Prints a Markdown table (README, "Precision").
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
    ref = greedy(bb, "float32", prompts, n)
    eos = bb.eos_ids
    del bb
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {len(prompts)} prompts x {n} tokens\n")
    print("| precision | requests identical to float32 greedy | mean first differing position (identical: its length) |")
    print("|---|---:|---:|")
    print(row("float32", ref, ref, n))
    for dtype in ("bfloat16", "q4"):
        print(row(dtype, greedy(from_pretrained(dtype=dtype), dtype, prompts, n), ref, n), flush=True)
    if llama_cpp_peer.available():
        peer = llama_cpp_peer.LlamaCppPeer(smollm2_gguf(), eos, n)
        print(row("llama.cpp (same GGUF)", [g.token_ids for g in peer.run(prompts)], ref, n))


if __name__ == "__main__":
    main()
