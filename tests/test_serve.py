"""The OpenAI-compatible server (`python -m pipeline.serve`) on the tiny model, through the official
`openai` client against a live uvicorn server on 127.0.0.1: greedy answers, streamed or whole, are
the tokens `decode()` gives for the same prompts (presets greedy and tree_ngram); 32 concurrent
streams, half of them sampled, each equal their batch-1 decode; a seeded sampled request equals the
CLI's sampler with its knobs and seed; a client that disconnects is aborted and the KV pool
empties; bad requests get 4xx errors while a good one completes; the queue limit answers 429; a
failing step answers 500 and the server goes on; stop strings; JSON-schema output validates;
SIGTERM drains (a subprocess)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import subprocess
import threading

import httpx
import jsonschema
import openai
import pytest

from pipeline.server.app import StopText

from helpers import PYTHON, REPO_ROOT, subprocess_env
from serving import client, live_server, metric, reference, stream_tokens, wait_for

PROMPTS = ["Tell me about the sea.", "Once upon a time, in a land far away,", "1, 2, 3, 4, 5, 1, 2, 3",
           "Why is the sky blue?"]
MAX_TOKENS = 24
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}}, "required": ["color"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def greedy():
    with live_server("decode=greedy", "batch_size=8", "drafts=[tree_ngram]") as s:  # tiny:ngram routes to a draft
        yield s


@pytest.mark.parametrize("preset", ["greedy", "tree_ngram"])
def test_greedy_answers_equal_decode(preset, tmp_path, greedy):
    ctx = live_server(f"decode={preset}", "batch_size=4") if preset != "greedy" else contextlib.nullcontext(greedy)
    with ctx as (server, url):
        c, ids = client(url), {"return_token_ids": True}
        ref_chat, ref_raw = reference(preset, PROMPTS, tmp_path), reference(preset, PROMPTS, tmp_path, chat=False)
        tok = server.service.tokenizer
        depth = []
        for p, want_chat, want_raw in zip(PROMPTS, ref_chat, ref_raw):
            msgs = [{"role": "user", "content": p}]
            r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=MAX_TOKENS, extra_body=ids)
            assert r.choices[0].token_ids == want_chat
            assert r.choices[0].message.content == tok.decode(want_chat, skip_special_tokens=True)
            assert r.usage.completion_tokens == len(want_chat)
            assert r.choices[0].finish_reason == "length"
            got, text, finish, extra = stream_tokens(c.chat.completions.create(
                model="tiny", messages=msgs, max_tokens=MAX_TOKENS, stream=True, extra_body=ids))
            assert (got, text, finish) == (want_chat, r.choices[0].message.content, "length")
            r = c.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS, extra_body=ids)
            assert r.choices[0].token_ids == want_raw
            got, text, _, _ = stream_tokens(c.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS,
                                                                 stream=True, extra_body=ids))
            assert (got, text) == (want_raw, r.choices[0].text)
            spec = r.model_extra["speculation"]
            assert spec["steps"] * spec["mean_accepted_length"] == pytest.approx(len(want_raw))
            depth.append(spec["mean_accepted_length"])
        if preset == "tree_ngram":  # the tiny model repeats itself: drafts of a repetition are accepted
            assert max(depth) > 1.5


def test_models_health_and_usage_chunk(greedy):
    _, url = greedy
    c = client(url)
    assert [m.id for m in c.models.list().data] == ["tiny", "tiny:ngram"]
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert all(ch.usage is None for ch in chunks[:-1])


HOT = {"temperature": 1.5, "top_k": 3}  # sampling knobs the tiny model's answers vary under
HOT_CLI = ("sampler.temperature=1.5", "sampler.top_k=3")


def test_32_concurrent_streams_each_equal_batch_1(greedy, tmp_path):
    """32 streams at once, each with its own max_tokens, on a batch of 8 (the rest queue), every
    other one sampled with its own seed: every one completes with exactly its batch-1 tokens (the
    greedy ones decode=greedy's, the sampled ones decode=sample's with their knobs), in order."""
    server, url = greedy
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} ({i})" for i in range(32)]
    budgets = [4 + (7 * i) % 29 for i in range(32)]
    greedy_ref = reference("greedy", prompts[0::2], tmp_path, True, max(budgets))
    sampled_ref = reference("sample", prompts[1::2], tmp_path, True, max(budgets), *HOT_CLI)  # seeds 0, 1, ...
    ref = [r for pair in zip(greedy_ref, sampled_ref) for r in pair]
    assert any(a != b for a, b in zip(sampled_ref, reference("greedy", prompts[1::2], tmp_path, True, max(budgets)))), \
        "sampling changed nothing: the sampled half checks nothing"

    async def one(c, i, p, n):
        ids, text = [], ""
        knobs = {} if i % 2 == 0 else {**HOT, "seed": i // 2}
        stream = await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}],
                                                 max_tokens=n, stream=True,
                                                 extra_body={"return_token_ids": True, **knobs})
        async for ch in stream:
            ids += ch.choices[0].token_ids
            text += ch.choices[0].delta.content or ""
        return ids, text

    async def all_of():
        async with client(url, openai.AsyncOpenAI) as c:
            return await asyncio.gather(*(one(c, i, p, n) for i, (p, n) in enumerate(zip(prompts, budgets))))

    tok = server.service.tokenizer
    for (ids, text), want, n in zip(asyncio.run(all_of()), ref, budgets):
        assert ids == want[:n]
        assert text == tok.decode(ids, skip_special_tokens=True)
    assert wait_for(lambda: metric(url, "pipeline_kv_sequences") == 0)


def test_a_client_that_disconnects_is_aborted(greedy):
    _, url = greedy
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 1800, "stream": True}
    before = metric(url, "pipeline_requests_total", '{endpoint="/v1/chat/completions",outcome="disconnected"}')
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as r:
        lines = 0
        for line in r.iter_lines():
            lines += line.startswith("data:")
            if lines == 4:
                break
    assert wait_for(lambda: metric(url, "pipeline_requests_total",
                                   '{endpoint="/v1/chat/completions",outcome="disconnected"}') == before + 1)
    assert wait_for(lambda: metric(url, "pipeline_kv_sequences") == 0 and metric(url, "pipeline_requests_running") == 0)
    assert metric(url, "pipeline_kv_bytes_in_use") == 0


BAD = [  # (body or raw bytes, the field the error names)
    (b'{"model": "tiny", "messages": [', None),
    ({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": -3}, "max_tokens"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_p": 1.5}, "top_p"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_k": -2}, "top_k"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 17}, "n"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ({"model": "tiny:medusa", "messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "frobnicate"}}}},
     "response_format"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "regex": "a(b"}, "regex"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "word " * 2100}]}, "messages"),
    ({"model": "tiny", "prompt": "x", "frobnicate": 1}, "frobnicate"),
]


def test_bad_requests_get_4xx_while_a_good_one_completes(greedy, tmp_path):
    _, url = greedy
    want = reference("greedy", [PROMPTS[0]], tmp_path, max_new_tokens=200)[0]
    out = {}

    def good():
        out["answer"] = stream_tokens(client(url).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=200, stream=True,
            extra_body={"return_token_ids": True}))

    t = threading.Thread(target=good)
    t.start()
    for body, param in BAD:
        path = "/v1/completions" if isinstance(body, dict) and "prompt" in body else "/v1/chat/completions"
        r = httpx.post(f"{url}{path}", **({"content": body} if isinstance(body, bytes) else {"json": body}))
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["message"] and err["type"] == "invalid_request_error"
    t.join(60)
    assert out["answer"][0] == want and out["answer"][2] == "length"


def test_a_seeded_sampled_request_equals_the_cli_with_its_knobs(greedy, tmp_path):
    """On the greedy preset's server, a request with its own temperature / top_p / top_k and seed
    gives the tokens of `python -m pipeline decode=sample` with those sampler knobs and that seed,
    whole or streamed, chat or completion; another seed gives other tokens."""
    _, url = greedy
    c, knobs = client(url), {"temperature": 1.5, "top_k": 3, "top_p": 0.95}
    cli = (*HOT_CLI, "sampler.top_p=0.95", "seed=7")
    want_chat = reference("sample", [PROMPTS[2]], tmp_path, True, MAX_TOKENS, *cli)[0]
    want_raw = reference("sample", [PROMPTS[2]], tmp_path, False, MAX_TOKENS, *cli)[0]
    body = {"return_token_ids": True, "top_k": 3}
    msgs = [{"role": "user", "content": PROMPTS[2]}]
    args = dict(model="tiny", max_tokens=MAX_TOKENS, temperature=1.5, top_p=0.95, seed=7, extra_body=body)
    assert c.chat.completions.create(messages=msgs, **args).choices[0].token_ids == want_chat
    assert stream_tokens(c.chat.completions.create(messages=msgs, stream=True, **args))[0] == want_chat
    assert c.completions.create(prompt=PROMPTS[2], **args).choices[0].token_ids == want_raw
    others = {tuple(c.chat.completions.create(messages=msgs, **{**args, "seed": s}).choices[0].token_ids)
              for s in (8, 9, 10)}
    assert others - {tuple(want_chat)}, f"seeds 7-10 all gave the same tokens with {knobs}: the seed checks nothing"
    assert wait_for(lambda: metric(url, "pipeline_kv_sequences") == 0)


def test_stop_strings_cut_the_text_and_leave_the_engine(greedy, tmp_path):
    server, url = greedy
    want = server.service.tokenizer.decode(reference("greedy", [PROMPTS[1]], tmp_path)[0], skip_special_tokens=True)
    stop = want[7:10]
    c = client(url)
    msgs = [{"role": "user", "content": PROMPTS[1]}]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=MAX_TOKENS, stop=[stop, "never"])
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (want[:want.find(stop)], "stop")
    _, text, finish, _ = stream_tokens(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=MAX_TOKENS,
                                                                 stop=stop, stream=True))
    assert (text, finish) == (want[:want.find(stop)], "stop")
    assert wait_for(lambda: metric(url, "pipeline_kv_sequences") == 0)


def test_stop_text_holds_back_what_may_begin_a_stop():
    s = StopText(["END", "xy"])
    assert s.push("abcE") == ("abc", False)
    assert s.push("N") == ("", False)
    assert s.push("Dzz") == ("", True)
    s = StopText(["END"])
    assert s.push("aE") == ("a", False) and s.push("b") == ("Eb", False) and s.flush() == ""


def test_json_schema_response_format_validates(greedy):
    _, url = greedy
    c = client(url)
    fmt = {"type": "json_schema", "json_schema": {"name": "color", "schema": SCHEMA}}
    msgs = [{"role": "user", "content": "a color"}]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=60, response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    _, text, finish, _ = stream_tokens(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=60,
                                                                 response_format=fmt, stream=True))
    assert finish == "stop" and text == r.choices[0].message.content
    r = c.completions.create(model="tiny", prompt="color:", max_tokens=20, extra_body={"regex": "(red|blue)!"})
    assert r.choices[0].text in ("red!", "blue!")


def test_a_failing_step_answers_500_and_the_server_goes_on(greedy):
    server, url = greedy
    runner = server.service.engine.runner

    def boom(live):
        del runner._step  # once: the class's own step again
        raise RuntimeError("injected fault")

    runner._step = boom
    c = client(url)
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(openai.InternalServerError, match="injected fault"):
        c.chat.completions.create(model="tiny", messages=msgs, max_tokens=50)
    assert wait_for(lambda: metric(url, "pipeline_kv_sequences") == 0)
    assert metric(url, "pipeline_failed_steps_total") >= 1
    assert c.chat.completions.create(model="tiny", messages=msgs, max_tokens=5).choices[0].finish_reason == "length"


def test_past_the_queue_limit_requests_get_429():
    with live_server("decode=greedy", "batch_size=1", "max_queue=1") as (_, url):
        async def one(c):
            try:
                r = await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                    max_tokens=300)
                return r.choices[0].finish_reason
            except openai.RateLimitError as e:
                assert e.response.headers["retry-after"] == "1"
                return 429

        async def all_of():
            async with client(url, openai.AsyncOpenAI) as c:
                return await asyncio.gather(*(one(c) for _ in range(5)))

        out = asyncio.run(all_of())
        assert out.count(429) >= 1 and out.count("length") >= 2 and set(out) <= {429, "length"}


def test_sigterm_drains_and_exits_0(tmp_path):
    """SIGTERM: the streaming request in flight finishes, a new one gets 503, the process exits 0."""
    proc = subprocess.Popen([PYTHON, "-m", "pipeline.serve", "model=tiny", "port=0", f"hydra.run.dir={tmp_path}"],
                            cwd=REPO_ROOT, env=subprocess_env(), stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        while "serving" not in line:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "the server exited before serving"
        url = re.search(r"http://\S+", line).group(0)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 1900, "stream": True}
        events = []
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
            for raw in r.iter_lines():
                if not raw.startswith("data:"):
                    continue
                events.append(raw[5:].strip())
                if len(events) == 3:  # once (a second signal would abort what is in flight)
                    proc.send_signal(signal.SIGTERM)
                    assert wait_for(lambda: httpx.get(f"{url}/health").status_code == 503)
                    refused = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": False})
                    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


def test_a_draft_is_routed_by_model_and_stays_lossless(greedy, tmp_path):
    """The greedy server's `tiny:ngram` drafts with the n-gram proposer, `tiny` does not; both give
    decode=greedy's tokens, in the same batch."""
    _, url = greedy
    prompts = [PROMPTS[2], PROMPTS[1]]
    want = reference("greedy", prompts, tmp_path)

    async def both():
        async with client(url, openai.AsyncOpenAI) as c:
            return await asyncio.gather(*(
                c.chat.completions.create(model=m, messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS,
                                          extra_body={"return_token_ids": True})
                for p in prompts for m in ("tiny", "tiny:ngram")))

    answers = asyncio.run(both())
    assert [a.choices[0].token_ids for a in answers] == [w for w in want for _ in range(2)]
    assert [a.model for a in answers] == ["tiny", "tiny:ngram"] * 2
    plain, drafted = answers[0].model_extra["speculation"], answers[1].model_extra["speculation"]
    assert plain["mean_accepted_length"] == 1.0 and plain["acceptance_by_depth"] == {}
    assert drafted["mean_accepted_length"] > 1.5 and drafted["acceptance_by_depth"]["1"] > 0


def test_n_choices_are_the_seeded_requests_they_stand_for(greedy, tmp_path):
    """n = 3 sampled choices: choice i is what the CLI's request seeded seed + i gives (the seeds
    of a CLI run with the prompt three times), whole and streamed; usage counts every choice."""
    _, url = greedy
    want = reference("sample", [PROMPTS[0]] * 3, tmp_path, True, MAX_TOKENS, *HOT_CLI, "seed=5")
    assert len({tuple(w) for w in want}) > 1, "the seeds gave one answer: the choices check nothing"
    c, body = client(url), dict(model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}],
                                max_tokens=MAX_TOKENS, n=3, seed=5, extra_body={"return_token_ids": True, **HOT})
    r = c.chat.completions.create(**body)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert [ch.token_ids for ch in r.choices] == want
    assert r.usage.completion_tokens == sum(map(len, want))
    got, finish = {i: [] for i in range(3)}, {}
    for ch in c.chat.completions.create(**body, stream=True):
        for choice in ch.choices:
            got[choice.index] += choice.model_extra.get("token_ids", [])
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert [got[i] for i in range(3)] == want and finish == {0: "length", 1: "length", 2: "length"}
    assert wait_for(lambda: metric(url, "pipeline_kv_sequences") == 0)


def test_logprobs_whole_and_streamed(greedy):
    """Greedy tokens with their log-probabilities: each chosen token is its row's best, the top
    list is sorted, the streamed pieces join into the whole answer's; completions give the legacy form."""
    _, url = greedy
    c = client(url)
    body = dict(model="tiny", messages=[{"role": "user", "content": PROMPTS[3]}], max_tokens=12, logprobs=True,
                top_logprobs=3, extra_body={"return_token_ids": True})
    r = c.chat.completions.create(**body)
    content = r.choices[0].logprobs.content
    assert len(content) == len(r.choices[0].token_ids) == 12
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and entry.logprob <= 0
        assert entry.top_logprobs[0].token == entry.token and entry.logprob == pytest.approx(tops[0])
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    streamed = [e for ch in c.chat.completions.create(**body, stream=True) if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    legacy = c.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=6, logprobs=2).choices[0]
    lp = legacy.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == legacy.text and lp.text_offset[0] == 0
    assert all(len(t) == 2 and max(t.values()) == pytest.approx(v) for t, v in zip(lp.top_logprobs, lp.token_logprobs))
