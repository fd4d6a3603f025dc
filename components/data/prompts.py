"""Synthetic prompts for self-distillation training of Medusa heads.

`training_prompts(n, seed)` returns n distinct chat prompts (explanations, stories, poems, emails,
lists, comparisons, how-to steps, Python coding tasks, arithmetic word problems, definitions,
advice, rewrite/summary tasks, trivia, ...). The pool is fixed: prompts.json.gz holds it as a list
of groups (one per instruction template), generated once from the former template code (~100
templates filled from a few hundred topics and objects, pool seed 1234). `seed` only decides the
order, which interleaves the groups so any prefix is varied.

Kept apart from every benchmark prompt file (pipeline/prompts/*.jsonl) by similarity, not only by
exact string (the tuning split, pipeline/prompts/tuning.jsonl, drawn from this pool's tail for
tuning presets, is left out exactly, its template siblings stay): a training prompt is left out when `similar` finds a benchmark prompt sharing at
least SIMILARITY of the smaller one's normalised word trigrams (lower case, words and numbers only),
which catches paraphrases ("Define the word 'photosynthesis'." against "Define the word
photosynthesis in one or two sentences.") and shared templates.
"""

import collections
import functools
import gzip
import hashlib
import json
import random
import re
from pathlib import Path

_POOL_FILE = Path(__file__).with_name("prompts.json.gz")
BENCH_DIR = Path(__file__).resolve().parent.parent.parent / "pipeline" / "prompts"
SIMILARITY = 0.5  # trigram containment at which a training prompt counts as a benchmark prompt's near copy
FILTER = f"trigram-containment>={SIMILARITY},tuning-split"
TUNING = "tuning.jsonl"


def _prompt_texts(path: Path) -> list[str]:
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            out.append(r.get("prompt") or " ".join(m.get("content", "") for m in r.get("messages") or []))
    return out


def trigrams(text: str) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9]+", text.lower())
    return {tuple(words[i:i + 3]) for i in range(len(words) - 2)} or ({tuple(words)} if words else set())


@functools.lru_cache(maxsize=1)
def _benchmark() -> tuple[list[set], dict]:
    texts = [t for f in sorted(BENCH_DIR.glob("*.jsonl")) if f.name != TUNING for t in _prompt_texts(f)]
    grams = [trigrams(t) for t in texts]
    index = collections.defaultdict(list)
    for k, g in enumerate(grams):
        for x in g:
            index[x].append(k)
    return grams, index


def similar(prompt: str, threshold: float = SIMILARITY) -> bool:
    """Whether a benchmark prompt shares >= threshold of the smaller one's trigrams with `prompt`."""
    grams, index = _benchmark()
    mine = trigrams(prompt)
    shared = collections.Counter(k for x in mine for k in index.get(x, ()))
    return any(n / max(1, min(len(mine), len(grams[k]))) >= threshold for k, n in shared.items())


@functools.lru_cache(maxsize=1)
def _pool() -> tuple[tuple[str, ...], ...]:
    with gzip.open(_POOL_FILE, "rt", encoding="utf-8") as f:
        return tuple(tuple(group) for group in json.load(f))


@functools.lru_cache(maxsize=1)
def _kept() -> tuple[tuple[str, ...], ...]:
    """The pool without the prompts similar to a benchmark prompt and without the tuning split."""
    tuning = set(_prompt_texts(BENCH_DIR / TUNING)) if (BENCH_DIR / TUNING).is_file() else set()
    return tuple(tuple(p for p in group if p not in tuning and not similar(p)) for group in _pool())


def prompt_filter() -> str:
    """The filter and a digest of the prompts it keeps, for the data config: another filter, or a
    benchmark file added or edited so that other prompts are left out, is another data set."""
    digest = hashlib.sha1(json.dumps(_kept()).encode()).hexdigest()[:10]
    return f"{FILTER},kept={digest}"


def available_prompts() -> int:
    """How many distinct training prompts `training_prompts` can return."""
    return sum(len(g) for g in _kept())


def training_prompts(n: int, seed: int = 0) -> list[str]:
    """Return `n` distinct training prompts, deterministically ordered by `seed`: each group is
    shuffled with `random.Random(seed)`, then groups are interleaved (round-robin, random ties)."""
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    total = available_prompts()
    if n > total:
        raise ValueError(f"requested {n} training prompts but only {total} distinct prompts are available")
    rng = random.Random(seed)
    keyed = []
    for group in _kept():
        items = list(group)
        rng.shuffle(items)
        keyed.extend((i + rng.random(), p) for i, p in enumerate(items))
    keyed.sort(key=lambda kp: kp[0])
    return [p for _, p in keyed[:n]]
