"""What the server's test modules share: a live server on a thread of the test process, the
`openai` client of one, `decode()`'s batch-1 tokens for prompts (the reference a served answer must
equal), a Prometheus gauge read from /metrics, polling, and a streamed answer's tokens."""
from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
import time

import httpx
import openai

from pipeline.decode import decode
from pipeline.server.app import build_server

from helpers import compose_config

MAX_TOKENS = 24


@contextlib.contextmanager
def live_server(*overrides: str, backbone=None):
    """A server on a free port of 127.0.0.1, run on a thread of this process (over `backbone`, one
    already loaded, where given: then the overrides name its model)."""
    cfg = compose_config(["model=tiny", "port=0", "~guard", *overrides], config_name="serve")
    server = build_server(cfg, backbone)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def client(url: str, cls=openai.OpenAI):
    return cls(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def reference(preset: str, prompts: list[str], tmp_path, chat: bool = True, max_new_tokens: int = MAX_TOKENS,
              *overrides: str):
    """decode()'s tokens for each prompt at batch 1 (what `python -m pipeline` gives; request k is
    seeded seed + k)."""
    tag = "-".join([preset, str(chat), *overrides, hashlib.md5(json.dumps(prompts).encode()).hexdigest()[:8]])
    tag = tag.replace("=", "_")
    path = tmp_path / f"{tag}.jsonl"
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    cfg = compose_config(["model=tiny", f"decode={preset}", f"max_new_tokens={max_new_tokens}", f"input={path}",
                          "stream=false", f"chat={str(chat).lower()}", *overrides], output_dir=tmp_path / f"run-{tag}")
    _, objects = decode(cfg)
    return [it["token_ids"] for it in objects["results"]["items"]]


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{url}/metrics").text
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def wait_for(cond, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def stream_tokens(stream) -> tuple[list[int], str, str | None, dict]:
    """(token ids, text, finish_reason, the final chunk's extension fields) of a streamed answer."""
    ids, text, finish, extra = [], "", None, {}
    for ch in stream:
        if not ch.choices:
            continue
        c = ch.choices[0]
        ids += (c.model_extra or {}).get("token_ids", [])
        text += (c.delta.content or "") if hasattr(c, "delta") else c.text
        if c.finish_reason:
            finish, extra = c.finish_reason, ch.model_extra
    return ids, text, finish, extra
