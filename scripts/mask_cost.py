"""What a constraint costs per token, in isolation: replay the outputs of a constrained run through
fresh constraint states and time, for every token, computing the allowed set (XGrammar's mask plus
the special-token ban) and applying it to a logits row (the full masked row, as sampling needs it;
and the greedy path, which checks the unmasked argmax against the packed set first).

    python scripts/mask_cost.py <run dir with results.json> [input.jsonl]

Inside the engine the same work runs between target forwards that stream the weights through the
caches, which makes each call several times slower than here (the README quotes both).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from components.model.load import from_pretrained_tokenizer  # noqa: E402
from pipeline.build import constraint_spec  # noqa: E402
from pipeline.cli import compose_config, composing  # noqa: E402
from pipeline.core import Target  # noqa: E402
from pipeline.core.bits import words  # noqa: E402
from pipeline.requests import load_requests  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    run = Path(sys.argv[1])
    results = json.loads((run / "results.json").read_text())
    inp = sys.argv[2] if len(sys.argv) > 2 else results["config"]["input"]
    reqs = {r.id: r for r in load_requests(inp, None)}
    tok = from_pretrained_tokenizer()
    vocab = 49152
    bb = SimpleNamespace(tokenizer=tok, eos_ids=[tok.eos_token_id],
                         model=SimpleNamespace(args=SimpleNamespace(vocab_size=vocab)))
    with composing():
        cfg = compose_config([])
    fills, full, greedy = [], [], []
    g = torch.Generator().manual_seed(0)
    for item in results["items"]:
        spec = constraint_spec(cfg, reqs[item["id"]].constraint)
        if spec is None:
            continue
        state = spec.build(bb).start()
        bits = torch.zeros(1, words(vocab), dtype=torch.int32)
        for t in item["token_ids"]:
            if t in bb.eos_ids:
                break
            t0 = time.perf_counter()
            state.fill(bits[0])
            t1 = time.perf_counter()
            logits = torch.randn(1, vocab, generator=g)
            logits[0, t] = 30.0  # the model's choice, as in the run: the greedy path's common case
            t2 = time.perf_counter()
            Target(logits, greedy=False, allowed=bits).scores
            t3 = time.perf_counter()
            Target(logits, greedy=True, allowed=bits).argmax
            t4 = time.perf_counter()
            Target(logits, greedy=True).argmax  # what unconstrained greedy pays anyway
            t5 = time.perf_counter()
            fills.append(t1 - t0)
            full.append(t3 - t2)
            greedy.append((t4 - t3) - (t5 - t4))
            assert state.advance(t), (item["id"], t)
    med = lambda xs: statistics.median(xs) * 1e6  # noqa: E731
    print(f"{len(fills)} tokens of {sum(1 for _ in results['items'])} requests ({run}):")
    print(f"  allowed set (XGrammar mask + ban): median {med(fills):.1f} us")
    print(f"  apply, whole masked row (sampling): median {med(full):.1f} us -> total {med(fills) + med(full):.1f} us")
    print(f"  apply, greedy (argmax checked first; beyond the argmax plain greedy takes): median {med(greedy):.1f} us -> total {med(fills) + med(greedy):.1f} us")


if __name__ == "__main__":
    main()
