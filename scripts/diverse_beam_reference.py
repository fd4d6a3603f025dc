"""The stored reference for diverse beam search (tests/data/diverse_beam_reference.json).

transformers 5 no longer ships group beam search in its core (4.57 fetches it from the Hub), so the
reference comes from transformers 4.53.3's `_group_beam_search`, in a separate environment, on the
default model in float32 exported from this project:

    .venv/bin/python scripts/diverse_beam_reference.py export /tmp/dbs          # the model as an HF folder + prompts
    python3 -m venv /tmp/tf4 && /tmp/tf4/bin/pip install torch==2.13.0 transformers==4.53.3
    /tmp/tf4/bin/python scripts/diverse_beam_reference.py generate /tmp/dbs tests/data/diverse_beam_reference.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

PROMPTS = ["Write a haiku about autumn.", "What is the capital of France?", "List three colors.",
           "Explain gravity to a child."]
SETTINGS = [  # generate() knobs of each reference run (num_return_sequences = num_beams)
    {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 1.0, "early_stopping": False, "length_penalty": 1.0},
    {"num_beams": 4, "num_beam_groups": 4, "diversity_penalty": 0.5, "early_stopping": True, "length_penalty": 0.7},
    {"num_beams": 6, "num_beam_groups": 3, "diversity_penalty": 2.0, "early_stopping": "never", "length_penalty": 1.0},
]
MAX_NEW_TOKENS = 20


def export(out: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    # the project only here: `generate` runs in a transformers-4 environment that lacks its dependencies
    from components.model.load import from_pretrained
    from pipeline.core import encode_chat
    from pipeline.hf_peer import to_hf
    bb = from_pretrained(dtype="float32")
    out.mkdir(parents=True, exist_ok=True)
    to_hf(bb).save_pretrained(out / "model")
    cfg_path = out / "model" / "config.json"  # transformers 4.x reads rope_theta at the top level
    cfg = json.loads(cfg_path.read_text())
    cfg["rope_theta"] = cfg.get("rope_parameters", {}).get("rope_theta", bb.model.args.rope_theta)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    ids = [encode_chat(bb.tokenizer, None, p, True, None) for p in PROMPTS]
    (out / "prompts.json").write_text(json.dumps({"prompts": PROMPTS, "ids": ids, "eos_ids": bb.eos_ids}))


def generate(src: Path, dst: Path) -> None:
    meta = json.loads((src / "prompts.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(src / "model", torch_dtype=torch.float32).eval()
    eos = meta["eos_ids"]
    runs = []
    for knobs in SETTINGS:
        for prompt, ids in zip(meta["prompts"], meta["ids"]):
            with torch.inference_mode():
                out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                     num_return_sequences=knobs["num_beams"], eos_token_id=eos, pad_token_id=eos[0],
                                     return_dict_in_generate=True, output_scores=True, **knobs)
            seqs = []
            for row in out.sequences[:, len(ids):].tolist():
                toks = []
                for t in row:
                    toks.append(t)
                    if t in eos:
                        break
                seqs.append(toks)
            runs.append({"knobs": knobs, "prompt": prompt, "prompt_ids": ids, "sequences": seqs,
                         "scores": out.sequences_scores.tolist()})
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(json.dumps({"transformers": transformers.__version__, "max_new_tokens": MAX_NEW_TOKENS,
                               "eos_ids": eos, "runs": runs}, indent=1))


if __name__ == "__main__":
    if sys.argv[1] == "export":
        export(Path(sys.argv[2]))
    else:
        generate(Path(sys.argv[2]), Path(sys.argv[3]))
