"""Coverage of JSON-schema constraints on JSONSchemaBench's real schemas (../shared/jsonschemabench).

Per category: how many schemas compile (XGrammar, through `constraint=json_schema`; every other one
is refused with the engine's one-line message, listed), and of the outputs generated under the
compiled ones how many end complete, parse as JSON and validate against their schema (the
`jsonschema` package, the draft the schema names). Generation goes through `python -m pipeline`'s
decode (per-request `json_schema`, the schema added to the prompt), so a run is resumable: re-run
with the same --out to finish an interrupted one.

    python scripts/jsonschemabench.py [--data ../shared/jsonschemabench] [--out outputs/jsonschemabench]
        [--per-category N] [--max-new-tokens 512] [--batch-size 8] [--close-margin 128] [--approximate] [overrides ...]

Writes <out>/coverage.json and <out>/coverage.md (the table the README shows) and prints the table.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jsonschema
from omegaconf import open_dict

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from components.constraint.grammar import JSONSchema  # noqa: E402
from pipeline.cli import compose_config, composing  # noqa: E402
from pipeline.core import UserError  # noqa: E402
from pipeline.decode import decode  # noqa: E402

PROMPT = "Generate one realistic example object for this JSON schema"
SCHEMA_IN_PROMPT = 6000  # characters of compact schema shown in the prompt at most (larger: the title only)


def prompt_for(schema: dict) -> str:
    text = json.dumps(schema, ensure_ascii=False)
    if len(text) <= SCHEMA_IN_PROMPT:
        return f"{PROMPT}. Reply with JSON only.\n{text}"
    title = schema.get("title") or schema.get("description") or ""
    return f"{PROMPT}{f' ({title[:200]})' if title else ''}. Reply with JSON only."


def load_schemas(data: Path, per_category: int | None) -> list[tuple[str, str, dict]]:
    """(category, file stem, schema), categories and files in sorted order."""
    out = []
    for cat in sorted(p for p in data.iterdir() if p.is_dir()):
        files = sorted(cat.glob("*.json"))[:per_category]
        for f in files:
            out.append((cat.name, f.stem, json.loads(f.read_text())))
    return out


def compile_check(schema: dict, options: dict) -> tuple[str | None, list[str]]:
    """(None, warnings) when the schema compiles, else (the one-line reason, [])."""
    try:
        return None, JSONSchema.check(json.dumps(schema), **options)
    except UserError as e:
        return str(e), []


def validate(schema: dict, text: str) -> tuple[bool, bool, str | None]:
    """(parses, validates, the first validation error)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return False, False, f"not JSON: {e.msg}"
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    errors = sorted(cls(schema).iter_errors(value), key=lambda e: list(e.path))
    return True, not errors, None if not errors else errors[0].message[:200]


def run(data: Path, out: Path, per_category: int | None = None, max_new_tokens: int = 512, batch_size: int = 8,
        overrides: list[str] | None = None, backbone=None, close_margin: int = 128, approximate: bool = False) -> dict:
    schemas = load_schemas(data, per_category)
    with composing():
        cfg = compose_config([f"max_new_tokens={max_new_tokens}", f"batch_size={batch_size}", "stream=false",
                              "constraint=json_schema", f"constraint.close_margin={close_margin}",
                              f"constraint.approximate={str(approximate).lower()}",
                              *(overrides or [])])
    js = dict(any_whitespace=False, strict_mode=True, approximate=approximate)
    rows, requests = [], []
    for cat, name, schema in schemas:
        why, approx = compile_check(schema, js)
        rows.append({"category": cat, "schema": name, "compiled": why is None, "refused": why, "approximated": approx})
        if why is None:
            requests.append({"id": f"{cat}/{name}", "prompt": prompt_for(schema), "json_schema": schema})
    out.mkdir(parents=True, exist_ok=True)
    inp = out / "requests.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in requests))
    with open_dict(cfg):
        cfg.input, cfg.output_dir = str(inp), str(out / "decode")
    metrics, _ = decode(cfg, backbone)
    items = {it["id"]: it for it in json.loads((out / "decode" / "results.json").read_text())["items"]}
    by_id = {f"{c}/{n}": s for c, n, s in schemas}
    for row in rows:
        it = items.get(f"{row['category']}/{row['schema']}")
        if it is None:
            continue
        parses, valid, err = validate(by_id[f"{row['category']}/{row['schema']}"], it["text"])
        row.update(generated=True, complete=bool(it.get("constraint_complete")), finish_reason=it["finish_reason"],
                   parses=parses, valid=valid, error=err, new_tokens=it["new_tokens"])
    table = summarize(rows)
    result = {"rows": rows, "table": table, "summary": {k: metrics.get(k) for k in (
        "tokens_per_s", "mask_us_per_token", "precision", "device", "constraint_complete", "constrained_requests")}}
    (out / "coverage.json").write_text(json.dumps(result, indent=1))
    (out / "coverage.md").write_text(markdown(table, rows))
    return result


def summarize(rows: list[dict]) -> list[dict]:
    cats = sorted({r["category"] for r in rows})
    table = []
    for cat in cats + ["all"]:
        rs = [r for r in rows if cat in ("all", r["category"])]
        gen = [r for r in rs if r.get("generated")]
        table.append({"category": cat, "schemas": len(rs), "compiled": sum(r["compiled"] for r in rs),
                      "approximated": sum(bool(r["approximated"]) for r in rs),
                      "generated": len(gen), "complete": sum(r["complete"] for r in gen),
                      "parse": sum(r["parses"] for r in gen), "valid": sum(r["valid"] for r in gen)})
    return table


def markdown(table: list[dict], rows: list[dict]) -> str:
    lines = ["| category | schemas | compile | of which approximated | generated | complete | parse | validate |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for t in table:
        name = f"**{t['category']}**" if t["category"] == "all" else t["category"]
        lines.append(f"| {name} | {t['schemas']} | {t['compiled']} | {t['approximated']} | {t['generated']} | "
                     f"{t['complete']} | {t['parse']} | {t['valid']} |")
    refused = [r for r in rows if not r["compiled"]]
    if refused:
        lines += ["", "Refused at compile time:", ""]
        lines += [f"- {r['category']}/{r['schema']}: {r['refused']}" for r in refused]
    approx = sorted({w for r in rows for w in r["approximated"]})
    if approx:
        lines += ["", "What XGrammar only approximates (its warnings, each schema's listed in coverage.json):", ""]
        lines += [f"- {w}" for w in approx]
    bad = [r for r in rows if r.get("generated") and not r["valid"]]
    if bad:
        lines += ["", "Generated but not valid:", ""]
        lines += [f"- {r['category']}/{r['schema']} ({r['finish_reason']}, {r['new_tokens']} tokens): {r['error']}"
                  for r in bad]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "jsonschemabench")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "jsonschemabench")
    ap.add_argument("--per-category", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--approximate", action="store_true",
                    help="accept schemas XGrammar only approximates (default: refuse them, with the reason)")
    ap.add_argument("--close-margin", type=int, default=128,
                    help="constraint.close_margin: the last tokens of the budget close the JSON (0: off)")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. model.dtype=float32")
    a = ap.parse_args()
    if not a.data.is_dir():
        sys.exit(f"no JSONSchemaBench data at {a.data}: pass --data <folder with one sub-folder per category>")
    result = run(a.data, a.out, a.per_category, a.max_new_tokens, a.batch_size, a.overrides, close_margin=a.close_margin,
                 approximate=a.approximate)
    print((a.out / "coverage.md").read_text())
    s = result["summary"]
    print(f"{s['precision']} on {s['device']}: {s['tokens_per_s']:.1f} tokens/s, constraint cost "
          f"{s['mask_us_per_token']:.1f} us per token (median) -> {a.out / 'coverage.json'}")


if __name__ == "__main__":
    main()
