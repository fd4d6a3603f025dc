"""Resuming and stopping a decode run: the finished items of an earlier run in the same directory
(keyed by what decides their tokens), and signals that stop a run cleanly, never while an item is
being saved."""
from __future__ import annotations

import hashlib
import json
import signal
import threading
from contextlib import contextmanager

from omegaconf import DictConfig, OmegaConf

from pipeline.core import UserError


def load_items(path, keys: dict[str, str]) -> dict[str, dict]:
    """Finished items of an earlier run in this directory, by id. A torn last line (a kill during
    the append) is cut off so the next append starts a line of its own; an item made from another
    prompt or pipeline is refused."""
    done = {}
    if not path.is_file():
        return done
    text = path.read_text()
    if text and not text.endswith("\n"):
        text = text[:text.rfind("\n") + 1]
        path.write_text(text)
    for line in text.splitlines():
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue
        rid = item.get("id")
        if rid in keys:
            if item.get("request_key") != keys[rid]:
                raise UserError(f"{path} holds request {rid!r} decoded from another prompt or pipeline: "
                                "resume with the same input and settings, or pick a new hydra.run.dir")
            done[rid] = item
    return done


class Signals:
    """SIGINT/SIGTERM become KeyboardInterrupt, but never while a finished item is being saved."""

    def __init__(self):
        self.saving, self.pending = False, False

    def handler(self, signum, frame):
        if self.saving:
            self.pending = True
        else:
            raise KeyboardInterrupt

    @contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = {s: signal.signal(s, self.handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    @contextmanager
    def saving_item(self):
        self.saving = True
        try:
            yield
        finally:
            self.saving = False
        if self.pending:
            raise KeyboardInterrupt


def request_key(cfg: DictConfig, r) -> str:
    """What decides a request's tokens: its text, its constraint and the pipeline (model, sampler,
    proposer, verifier, constraint, limits, seed, chat). Resuming refuses items made from another."""
    parts = {"prompt": r.prompt, "messages": r.messages,
             "request_constraint": r.constraint if cfg.get("request_constraints", True) else None,
             **{k: OmegaConf.to_container(cfg[k], resolve=True) if isinstance(cfg.get(k), DictConfig) else cfg.get(k)
                for k in ("model", "sampler", "proposer", "verifier", "max_new_tokens", "seed", "chat", "system_prompt",
                          "constraint", "num_beams", "length_penalty", "early_stopping", "num_return_sequences",
                          "num_beam_groups", "diversity_penalty")}}
    return hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
