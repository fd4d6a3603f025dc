"""Magpie-style prompts (Xu et al., 2024, "Magpie: alignment data synthesis from scratch by prompting
aligned LLMs with nothing"): the backbone writes the user turns itself. Fed its chat template up to
the opening of a user turn (the template's default system prompt included, where it has one), an
instruction-tuned model samples what a user of it would ask, ending at its end-of-turn token; so the
drafts train on prompts like the ones the model is used with, not only on a template pool's.

A round samples `batch_size` first turns (temperature, top_p, each with its own seed, through the
core engine in one continuous batch). A `multi_turn` fraction of them (chosen by seed) gets a second
turn: the backbone's greedy answer to the first (where it ends within `answer_tokens`), then the
template's next user opening, sampled again; such a prompt is the messages [user, assistant, user], which the training answer continues.
Rounds are saved as they are made (`round-*.jsonl` under `<root>/magpie-<key>`, the key a digest of
what decides their text: model, precision, seed and sampling knobs), raw, and read in order through
the filters: stripped, `min_words`..`max_words` words per user turn, no duplicate (normalised text),
nothing `prompts.excluded` refuses (near copies of benchmark or held-out prompts, the tuning split).
A follow-up that fails them leaves its prompt single-turn. Asking for more prompts makes only the
rounds missing; an interrupted job resumes from its last saved round.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import random
from pathlib import Path

from tqdm import tqdm

from components.data.prompts import excluded, filter_digest, normalized
from components.kv.paged import PagedKV
from components.sampler.logits import Sampler
from pipeline.core import Engine, UserError, atomic_write, positive_int

OPENING = "\x00user turn\x00"  # stands for a user's text in the rendered template, cut there
MIN_YIELD = 0.02  # below this fraction of kept prompts per sampled turn (after 8 rounds), generation gives up


class Magpie:
    """The backbone's own user turns, `prompts(n)` the first n that pass the filters."""

    def __init__(self, backbone, root: str | Path = "outputs/data", seed: int = 0, temperature: float = 1.0,
                 top_p: float = 0.95, max_new_tokens: int = 128, answer_tokens: int = 192, min_words: int = 3,
                 max_words: int = 200, multi_turn: float = 0.25, batch_size: int = 48, keep_unfinished: bool = False):
        """max_new_tokens: a user turn's budget; one cut there is dropped (it did not end: often a
        small model's run-on), unless keep_unfinished. answer_tokens: the greedy answer's before a
        second turn (an answer cut there gets none, unless keep_unfinished)."""
        for name, v in (("max_new_tokens", max_new_tokens), ("answer_tokens", answer_tokens),
                        ("min_words", min_words), ("max_words", max_words), ("batch_size", batch_size)):
            positive_int(v, f"data.magpie.{name}")
        if min_words > max_words:
            raise UserError(f"data.magpie.min_words ({min_words}) is above data.magpie.max_words ({max_words})")
        if not 0 < temperature < float("inf") or not 0 < top_p <= 1:
            raise UserError(f"data.magpie: temperature must be > 0 and top_p in (0, 1], got {temperature}, {top_p}")
        if not 0 <= multi_turn <= 1:
            raise UserError(f"data.magpie.multi_turn must be a fraction in [0, 1], got {multi_turn}")
        if not getattr(backbone.tokenizer, "chat_template", None):
            raise UserError(f"data.prompts=magpie needs a chat template: the tokenizer of {backbone.name} has none")
        self.backbone, self.seed = backbone, int(seed)
        self.sampler = Sampler(do_sample=True, temperature=float(temperature), top_p=float(top_p))
        self.max_new_tokens, self.answer_tokens = max_new_tokens, answer_tokens
        self.min_words, self.max_words, self.multi_turn, self.batch_size = min_words, max_words, multi_turn, batch_size
        self.keep_unfinished = bool(keep_unfinished)
        self.generation = {"model": backbone.name, "fingerprint": backbone.model.fingerprint(),
                           "precision": backbone.precision, "seed": self.seed, "temperature": float(temperature),
                           "top_p": float(top_p), "max_new_tokens": max_new_tokens, "answer_tokens": answer_tokens,
                           "multi_turn": float(multi_turn), "batch_size": batch_size}
        if self.keep_unfinished:  # only then: the sets made without it keep their key
            self.generation["keep_unfinished"] = True
        key = hashlib.sha1(json.dumps(self.generation, sort_keys=True).encode()).hexdigest()[:12]
        self.dir = Path(root) / f"magpie-{key}"

    def describe(self) -> dict:
        """What decides the prompts: the rounds' config and the filters read through."""
        return dict(self.generation, min_words=self.min_words, max_words=self.max_words, filter=filter_digest())

    def prompts(self, n: int) -> list[str | list[dict]]:
        """The first n kept prompts, the rounds they need made first."""
        if n <= 0:
            return []
        kept = self._kept(n)
        if len(kept) < n:
            self.dir.mkdir(parents=True, exist_ok=True)
            with open(self.dir / ".lock", "w") as lock:  # one process makes rounds; the others wait, then read
                fcntl.flock(lock, fcntl.LOCK_EX)
                atomic_write(self.dir / "config.json", json.dumps(self.generation, indent=2))
                kept = self._kept(n)
                bar = tqdm(total=n, initial=len(kept), desc="magpie prompts", unit="prompt")
                while len(kept) < n:
                    made = self._rounds()
                    if made >= 8 and len(kept) < MIN_YIELD * made * self.batch_size:
                        raise UserError(f"{self.dir}: {len(kept)} prompts kept of {made * self.batch_size} sampled: "
                                        "the filters refuse almost all of them (data.magpie.min_words / max_words)")
                    atomic_write(self.dir / f"round-{made:06d}.jsonl", "".join(
                        json.dumps(c) + "\n" for c in self._round(made)))
                    bar.update(len(kept := self._kept(n)) - bar.n)
                bar.close()
        return kept[:n]

    def _rounds(self) -> int:
        """How many rounds are saved (they are written in order, one at a time, under the lock)."""
        k = 0
        while (self.dir / f"round-{k:06d}.jsonl").is_file():
            k += 1
        return k

    def _kept(self, n: int) -> list[str | list[dict]]:
        """Up to n prompts from the saved rounds, in order, through the filters."""
        seen, out = set(), []
        for k in range(self._rounds()):
            for line in (self.dir / f"round-{k:06d}.jsonl").read_text().splitlines():
                turns = json.loads(line)["turns"]
                first = turns[0]
                if not self._fits(first):
                    continue
                key = normalized(first)
                if not key or key in seen or excluded(first):
                    continue
                seen.add(key)
                if len(turns) == 3 and self._fits(turns[2]) and not excluded(turns[2]):
                    out.append([{"role": r, "content": t} for r, t in zip(("user", "assistant", "user"), turns)])
                else:
                    out.append(first)
                if len(out) == n:
                    return out
        return out

    def _fits(self, text: str | None) -> bool:
        return text is not None and self.min_words <= len(text.split()) <= self.max_words

    def _round(self, k: int) -> list[dict]:
        """Round k's candidates, raw: {"turns": [user]} or [user, answer, follow-up]; a user turn that
        did not end within max_new_tokens is null."""
        tok, B = self.backbone.tokenizer, self.batch_size
        firsts = self._sample([self._opening([])] * B, [self._seed(k, i, 0) for i in range(B)])
        pick = [i for i in range(B) if firsts[i] and random.Random(f"{self.seed}:{k}:{i}").random() < self.multi_turn]
        out = [{"turns": [t]} for t in firsts]
        if pick:
            asked = [[{"role": "user", "content": firsts[i]}] for i in pick]
            rendered = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in asked]
            answers = self._decode([tok.encode(r, add_special_tokens=False) for r in rendered],
                                   Sampler(do_sample=False), self.answer_tokens)
            ended = [j for j, (_, e) in enumerate(answers) if e or self.keep_unfinished]  # a cut answer: one turn
            histories = [asked[j] + [{"role": "assistant", "content": answers[j][0]}] for j in ended]
            follow = self._sample([self._opening(h) for h in histories], [self._seed(k, pick[j], 1) for j in ended])
            for j, f in zip(ended, follow):
                out[pick[j]]["turns"] += [answers[j][0], f]
        return out

    def _seed(self, k: int, i: int, turn: int) -> int:
        return int.from_bytes(hashlib.sha1(f"{self.seed}:{k}:{i}:{turn}".encode()).digest()[:6], "big")

    def _opening(self, history: list[dict]) -> list[int]:
        """The template's tokens after `history` up to where a user's next text begins."""
        text = self.backbone.tokenizer.apply_chat_template(history + [{"role": "user", "content": OPENING}],
                                                           tokenize=False, add_generation_prompt=False)
        return self.backbone.tokenizer.encode(text[:text.index(OPENING)], add_special_tokens=False)

    def _sample(self, prompts: list[list[int]], seeds: list[int]) -> list[str | None]:
        """Sampled user turns, stripped; None for one that did not end (cut at max_new_tokens), unless
        keep_unfinished."""
        return [t if ended or self.keep_unfinished else None for t, ended in self._decode(prompts, self.sampler, self.max_new_tokens, seeds)]

    def _decode(self, prompts: list[list[int]], sampler: Sampler, max_new_tokens: int,
                seeds: list[int] | None = None) -> list[tuple[str, bool]]:
        """Each prompt's continuation as stripped text, and whether it ended (end-of-turn token)."""
        b = self.backbone
        engine = Engine(b.model, PagedKV(b), sampler, b.eos_ids, max_new_tokens, batch_size=len(prompts))
        gens = engine.run(prompts, seeds=seeds)
        return [(b.tokenizer.decode(g.token_ids, skip_special_tokens=True).strip(), g.finish_reason == "eos")
                for g in gens]
