"""The server's prompt recorder (record_prompts=<file>): off by default; on, one JSON line per
admitted request with its prompt only (the messages of a chat, the text of a completion), never an
answer, whole lines under concurrent requests, nothing for a refused request; a write that fails
never fails a request; and the file is a data.prompts source."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from components.data.self_distill import prompt_mix
from pipeline.errors import UserError
from pipeline.requests import Request
from pipeline.server.admit import PromptRecorder
from pipeline.server.openai_api import Spec

from serving import live_server

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three rivers of Europe."}]


def _chat(url: str, content: str, **kw) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2, **kw})


def test_nothing_is_recorded_by_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with live_server() as (server, url):
        assert server.service.recorder is None
        assert _chat(url, "What is a river delta?").status_code == 200
    assert not list(tmp_path.rglob("*.jsonl"))


def test_admitted_prompts_are_recorded_and_feed_training(tmp_path, tiny_backbone):
    path = tmp_path / "traffic" / "prompts.jsonl"
    with live_server(f"record_prompts={path}", backbone=tiny_backbone) as (server, url):
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                       json={"model": "tiny", "messages": CHAT, "max_tokens": 3})
        assert r.status_code == 200
        answer = r.json()["choices"][0]["message"]["content"]
        r = httpx.post(f"{url}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "Once upon a time, a fox", "max_tokens": 3})
        assert r.status_code == 200
        assert _chat(url, "Refused: bad temperature.", temperature=-1).status_code == 400  # not admitted
        with ThreadPoolExecutor(8) as pool:  # concurrent requests: whole lines, one each
            codes = list(pool.map(lambda i: _chat(url, f"Question number {i}: why is the sky blue?").status_code,
                                  range(16)))
        assert codes == [200] * 16
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 18
    assert rows[0] == {"messages": CHAT} and rows[1] == {"prompt": "Once upon a time, a fox"}
    assert sorted(r["messages"][0]["content"] for r in rows[2:]) == sorted(
        f"Question number {i}: why is the sky blue?" for i in range(16))
    assert all(set(r) in ({"messages"}, {"prompt"}) for r in rows)
    assert (answer not in path.read_text()) or not answer.strip()  # prompts only, never an answer
    got = prompt_mix(tiny_backbone, str(path)).take(18)  # the recorded file is a data.prompts source
    assert CHAT in got and "Once upon a time, a fox" in got


def test_a_failed_write_never_fails_the_request(capsys):
    recorder = PromptRecorder("/dev/full")  # every write: no space left on device
    spec = Spec("completion", Request("r", "Hello there"), chat=False, max_tokens=None, seed=None)
    recorder.record(spec)
    recorder.record(spec)
    err = capsys.readouterr().err
    assert err.count("record_prompts") == 1 and recorder.failed
    recorder.close()


def test_an_unwritable_file_is_refused_at_start(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="record_prompts=.*cannot open"):
        PromptRecorder(tmp_path / "file" / "below.jsonl")
