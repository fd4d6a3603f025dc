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
photosynthesis in one or two sentences.") and shared templates. The same test keeps training prompts
apart from the held-out test sets (HELD_OUT: ../shared/eval/vicuna80.jsonl where it exists), read at
run time only to filter: never trained on, their text never copied into the project.

`data.prompts` mixes sources of prompts (`parse_sources`): this pool (`templates`), the backbone's
own user turns (`magpie`, components/data/magpie.py) and JSONL files of prompts (`file_prompts`: a
user's traffic, as the server's `record_prompts=` writes it), each filtered as the pool is (`excluded`)
and interleaved by weight in an order any prefix of which keeps the weights (`mix_order`). A prompt
is a user text, or a list of chat messages ending with a user turn (a multi-turn conversation).
"""

import collections
import functools
import gzip
import hashlib
import json
import random
import math
import re
from dataclasses import dataclass
from pathlib import Path

from pipeline.core import UserError
from pipeline.requests import load_requests

_POOL_FILE = Path(__file__).with_name("prompts.json.gz")
BENCH_DIR = Path(__file__).resolve().parent.parent.parent / "pipeline" / "prompts"
SIMILARITY = 0.5  # trigram containment at which a training prompt counts as a benchmark prompt's near copy
FILTER = f"trigram-containment>={SIMILARITY},tuning-split"
TUNING = "tuning.jsonl"
# test sets: read at run time to keep training prompts apart from them, only where they exist
HELD_OUT = (Path(__file__).resolve().parents[3] / "shared" / "eval" / "vicuna80.jsonl",)
SOURCES = ("magpie", "templates")  # the named sources of data.prompts; anything else is a .jsonl file
EXAMPLE = "data.prompts='[magpie:0.6,templates:0.3,my_prompts.jsonl:0.1]'"


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


def _index(texts: list[str]) -> tuple[list[set], dict]:
    grams = [trigrams(t) for t in texts]
    index = collections.defaultdict(list)
    for k, g in enumerate(grams):
        for x in g:
            index[x].append(k)
    return grams, index


def _near(prompt: str, indexed: tuple[list[set], dict], threshold: float) -> bool:
    grams, index = indexed
    mine = trigrams(prompt)
    shared = collections.Counter(k for x in mine for k in index.get(x, ()))
    return any(n / max(1, min(len(mine), len(grams[k]))) >= threshold for k, n in shared.items())


@functools.lru_cache(maxsize=1)
def _benchmark() -> tuple[list[set], dict]:
    return _index(_benchmark_texts())


def _benchmark_texts() -> list[str]:
    return [t for f in sorted(BENCH_DIR.glob("*.jsonl")) if f.name != TUNING for t in _prompt_texts(f)]


def _held_out_texts() -> list[str]:
    return [t for f in HELD_OUT if f.is_file() for t in _prompt_texts(f)]


@functools.lru_cache(maxsize=1)
def _held_out() -> tuple[list[set], dict]:
    return _index(_held_out_texts())


def _tuning() -> set[str]:
    return set(_prompt_texts(BENCH_DIR / TUNING)) if (BENCH_DIR / TUNING).is_file() else set()


def similar(prompt: str, threshold: float = SIMILARITY) -> bool:
    """Whether a benchmark prompt shares >= threshold of the smaller one's trigrams with `prompt`."""
    return _near(prompt, _benchmark(), threshold)


def held_out(prompt: str, threshold: float = SIMILARITY) -> bool:
    """Whether a question of a held-out test set (HELD_OUT) is `prompt`'s near copy, as `similar`."""
    return _near(prompt, _held_out(), threshold)


def user_turns(prompt: str | list[dict]) -> list[str]:
    """A prompt's user texts: the text itself, or its messages' user contents."""
    return [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt if m.get("role") == "user"]


def excluded(prompt: str | list[dict], tuning: set[str] | None = None) -> bool:
    """Whether a prompt may not be trained on: one of its user turns is a tuning prompt, or a near
    copy of a benchmark prompt or of a held-out test question."""
    tuning = _tuning() if tuning is None else tuning
    return any(t in tuning or similar(t) or held_out(t) for t in user_turns(prompt))


def filter_digest() -> str:
    """What `excluded` tests against (threshold and reference texts), for the configs of the sets
    made from other sources than the pool (the pool's own `prompt_filter` names what it keeps)."""
    refs = [FILTER, _benchmark_texts(), sorted(_tuning()), _held_out_texts()]
    return hashlib.sha1(json.dumps(refs).encode()).hexdigest()[:10]


def normalized(prompt: str | list[dict]) -> str:
    """The key that finds duplicates: the user turns' words and numbers, lower case."""
    return " ".join(re.findall(r"[a-z0-9]+", " ".join(user_turns(prompt)).lower()))


@functools.lru_cache(maxsize=1)
def _pool() -> tuple[tuple[str, ...], ...]:
    with gzip.open(_POOL_FILE, "rt", encoding="utf-8") as f:
        return tuple(tuple(group) for group in json.load(f))


@functools.lru_cache(maxsize=1)
def _kept() -> tuple[tuple[str, ...], ...]:
    """The pool without the prompts similar to a benchmark prompt or a held-out question and without
    the tuning split."""
    tuning = _tuning()
    return tuple(tuple(p for p in group if not excluded(p, tuning)) for group in _pool())


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


@dataclass(frozen=True)
class Source:
    """One entry of data.prompts: `templates`, `magpie`, or a JSONL `file`, with its weight."""
    kind: str  # templates | magpie | file
    weight: float = 1.0
    path: Path | None = None  # kind == "file"

    @property
    def name(self) -> str:
        return str(self.path) if self.kind == "file" else self.kind


def parse_sources(spec) -> list[Source]:
    """data.prompts as sources. `spec` is one entry or a list of them; an entry is `<source>[:<weight>]`
    (`magpie:0.6`, `templates`, `path/to/prompts.jsonl:0.2`) or a mapping {source: magpie|templates|file,
    path: <file.jsonl> (file only), weight: <number>}. Weights are relative (default 1 each)."""
    entries = [spec] if isinstance(spec, (str, dict)) else list(spec or ["templates"])
    if not entries:
        entries = ["templates"]
    out = []
    for e in entries:
        if isinstance(e, str):
            name, _, w = e.rpartition(":")
            if not name or not _number(w):
                name, w = e, 1.0
            source = _source(name, None, w, e)
        elif isinstance(e, dict):
            unknown = set(e) - {"source", "path", "weight"}
            if unknown or "source" not in e and "path" not in e:
                raise UserError(f"data.prompts: entry {e!r} needs `source` (magpie, templates, file) and may have "
                                f"`path` (file) and `weight`, nothing else: e.g. {EXAMPLE}")
            source = _source(str(e.get("source", "file")), e.get("path"), e.get("weight", 1.0), e)
        else:
            raise UserError(f"data.prompts: entry {e!r} is neither `source[:weight]` nor a mapping: e.g. {EXAMPLE}")
        if any(s.name == source.name for s in out):
            raise UserError(f"data.prompts: {source.name} is listed twice: list each source once, with its weight")
        out.append(source)
    return out


def _number(text) -> bool:
    try:
        float(text)
    except (TypeError, ValueError):
        return False
    return True


def _source(name: str, path, weight, entry) -> Source:
    if isinstance(weight, bool) or not _number(weight) or not 0 < float(weight) < math.inf:
        raise UserError(f"data.prompts: the weight of {entry!r} must be a positive number, got {weight!r}: e.g. {EXAMPLE}")
    if name in SOURCES:
        if path is not None:
            raise UserError(f"data.prompts: {name} takes no path (only source: file does)")
        return Source(name, float(weight))
    if name == "file" and path is not None or name.endswith(".jsonl") and path is None:
        file = Path(str(path if name == "file" else name)).expanduser()
        if not file.is_file():
            raise UserError(f"data.prompts: no file {file}: give an existing JSONL file of "
                            '{"prompt": ...} or {"messages": [...]} lines (the server writes one with record_prompts=)')
        return Source("file", float(weight), file.resolve())
    raise UserError(f"data.prompts: unknown source {name!r}: use magpie, templates or a .jsonl file of prompts "
                    f"({{source: file, path: ...}}), e.g. {EXAMPLE}")


def file_prompts(path: Path, seed: int = 0) -> list[str | list[dict]]:
    """A JSONL file's prompts (`"prompt"` lines: the text; `"messages"` lines: the messages), without
    duplicates and without what `excluded` refuses, in an order shuffled by `seed`."""
    seen, out = set(), []
    tuning = _tuning()
    for r in load_requests(str(path), None):
        prompt = [{"role": m["role"], "content": m["content"]} for m in r.messages] if r.messages else r.prompt
        key = normalized(prompt)
        if key and key not in seen and not excluded(prompt, tuning):
            seen.add(key)
            out.append(prompt)
    random.Random(seed).shuffle(out)
    return out


def file_digest(path: Path) -> str:
    return hashlib.sha1(Path(path).read_bytes()).hexdigest()[:12]


def mix_order(weights: list[float], capacities: list[int | None], n: int) -> list[tuple[int, int]]:
    """The first n positions of a mix: (source, the index of its next prompt) each. Smooth weighted
    round-robin (each position goes to the source furthest behind its share, ties to the first listed),
    so every prefix keeps the weights within one prompt per source; a source whose `capacity` is spent
    (None: unbounded) leaves the rest to the others. The order does not depend on n: a set that grows
    keeps its prompts."""
    total_cap = math.inf if any(c is None for c in capacities) else sum(capacities)
    if n > total_cap:
        raise UserError(f"data.prompts: the sources hold {total_cap} prompts, data.max_samples={n} asks for more: "
                        "add a source (magpie makes as many as asked) or lower data.max_samples")
    credit, taken, out = [0.0] * len(weights), [0] * len(weights), []
    while len(out) < n:
        live = [s for s, c in enumerate(capacities) if c is None or taken[s] < c]
        total = sum(weights[s] for s in live)
        for s in live:
            credit[s] += weights[s]
        s = max(live, key=lambda s: (credit[s], -s))
        credit[s] -= total
        out.append((s, taken[s]))
        taken[s] += 1
    return out


class PromptMix:
    """data.prompts resolved: `take(n)`, the first n prompts of the mix; `describe()`, what decides
    them, for the data set's config. `magpie`: the source that makes the backbone's own prompts
    (components.data.magpie.Magpie), where the mix lists it."""

    def __init__(self, sources: list[Source], seed: int = 0, magpie=None):
        if any(s.kind == "magpie" for s in sources) and magpie is None:
            raise ValueError("a mix with the magpie source needs `magpie`, the source that makes its prompts")
        total = sum(s.weight for s in sources)
        self.sources, self.seed, self.magpie = sources, int(seed), magpie
        self.weights = [s.weight / total for s in sources]
        self._files = {s.path: file_prompts(s.path, self.seed) for s in sources if s.kind == "file"}

    @property
    def templates_only(self) -> bool:
        return [s.kind for s in self.sources] == ["templates"]

    def describe(self) -> list[dict] | None:
        """None for the template pool alone (today's sets keep their key), else each source with its
        weight and what decides its prompts (the pool's kept digest, magpie's config, the file's bytes)."""
        if self.templates_only:
            return None
        out = []
        for s, w in zip(self.sources, self.weights):
            d = {"source": s.kind, "weight": round(w, 6)}
            if s.kind == "templates":
                d["kept"] = prompt_filter()
            elif s.kind == "magpie":
                d.update(self.magpie.describe())
            else:
                d.update(file=s.path.name, sha1=file_digest(s.path), filter=filter_digest())
            out.append(d)
        return out

    def take(self, n: int) -> list[str | list[dict]]:
        if self.templates_only:
            return training_prompts(n, self.seed)
        caps = [available_prompts() if s.kind == "templates" else None if s.kind == "magpie"
                else len(self._files[s.path]) for s in self.sources]
        order = mix_order(self.weights, caps, n)
        counts = [sum(1 for k, _ in order if k == i) for i in range(len(self.sources))]
        lists = [training_prompts(c, self.seed) if s.kind == "templates" else self.magpie.prompts(c) if s.kind == "magpie"
                 else self._files[s.path][:c] for s, c in zip(self.sources, counts)]
        return [lists[k][j] for k, j in order]
