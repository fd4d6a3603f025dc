"""The GPU checks in one command, for a machine with a CUDA device:

    python scripts/gpu_check.py            # or: make gpu-check

1. float32 on the GPU equals transformers on the GPU (logits within 1e-3 on a chat prompt, and the
   same greedy tokens);
2. in every precision (float32, bfloat16, q4), every tree preset gives the tokens of plain greedy
   decoding in the same precision on the GPU (8 benchmark prompts x 48 tokens, batch 1 and 4);
3. the bench on the GPU: greedy per precision and the tree presets.
Exits non-zero on the first failed check. Needs no network: the model is the installed GGUF.
"""
from __future__ import annotations

import subprocess
import sys

import torch

from components.model.load import from_pretrained
from pipeline.bench import DEFAULT_INPUT
from pipeline.build import build_engine
from pipeline.cli import compose_config
from pipeline.hf_peer import to_hf
from pipeline.requests import encode, load_requests


def check(ok: bool, what: str):
    print(("ok    " if ok else "FAIL  ") + what, flush=True)
    if not ok:
        sys.exit(1)


@torch.inference_mode()
def main():
    if not torch.cuda.is_available():
        sys.exit("gpu_check: torch sees no GPU here")
    bb = from_pretrained(dtype="float32", device="cuda")
    hf = to_hf(bb)
    tok = bb.tokenizer
    ids = torch.tensor([encode(tok, load_requests(None, "Name three colours of the rainbow.")[0], True)], device="cuda")
    ours = bb.model.logits(bb.model(ids, torch.arange(ids.shape[1], device="cuda")[None]))
    ref = hf(ids).logits.float()
    diff = float((ours - ref).abs().max())
    check(diff < 1e-3, f"float32 logits vs transformers on cuda: max abs diff {diff:.2e}")
    prompts = [encode(tok, r, True) for r in load_requests(str(DEFAULT_INPUT), None)][:8]
    eng, _ = build_engine(compose_config(["decode=greedy", "max_new_tokens=48", "model.dtype=float32",
                                          "model.device=cuda"]), bb)
    ours_tokens = [g.token_ids for g in eng.run(prompts[:2])]
    for p, t in zip(prompts[:2], ours_tokens):
        out = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=48, do_sample=False,
                          eos_token_id=bb.eos_ids, pad_token_id=bb.eos_ids[0])[0, len(p):].tolist()
        stop = next((i for i, x in enumerate(out) if x in bb.eos_ids), None)
        check(out[:None if stop is None else stop + 1] == t, "float32 greedy tokens equal transformers' generate")
    del hf
    for dtype in ("float32", "bfloat16", "q4"):
        bb = from_pretrained(dtype=dtype, device="cuda")
        base = [f"max_new_tokens=48", f"model.dtype={dtype}", "model.device=cuda"]
        ref = [g.token_ids for g in build_engine(compose_config(["decode=greedy", *base]), bb)[0].run(prompts)]
        for preset in ("tree_ngram", "tree_medusa", "self_spec"):
            for batch in (1, 4):
                eng, _ = build_engine(compose_config([f"decode={preset}", f"batch_size={batch}", *base]), bb)
                got = [g.token_ids for g in eng.run(prompts)]
                same = sum(a == b for a, b in zip(got, ref))
                check(same == len(ref), f"{dtype} {preset} batch {batch}: {same}/{len(ref)} equal plain greedy")
    cmd = [sys.executable, "-m", "pipeline.bench", "model.device=cuda", "repeats=2",
           'decodes=[greedy,"greedy model.dtype=bfloat16","greedy model.dtype=q4",tree_ngram,tree_medusa,hf_greedy]']
    print(" ".join(cmd), flush=True)
    sys.exit(subprocess.call(cmd))


if __name__ == "__main__":
    main()
