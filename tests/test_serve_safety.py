"""A server you can expose (docs/serve.md, "Errors and limits" and "Who may call"), on the tiny model
through live servers on 127.0.0.1. Each bad request runs beside a well-formed stream (`beside`),
which must finish with exactly its batch-1 tokens:

- request data is data: a regex, grammar or schema is never resolved (`${oc.env:...}`) nor opened as
  a path, over HTTP and in a CLI input line; NaN, infinities, out-of-range seeds and every sampling
  field out of range are 400s naming the field;
- one request never fails another: a request whose constraint or sampling knobs fail in the engine
  fails alone (the step is redone without it); a failure of the model is counted and shown by
  /health; if the engine thread dies, requests end with an error, new ones get 503, and the server
  exits 1;
- bounded work: body size (413), prompts over the context (400 before tokenizing), JSON depth,
  constraint size and compile time (a slow compile blocks neither cache hits nor other requests),
  the compile cache's byte budget; the drain's deadline and a second SIGTERM;
- who may call: the API key, loopback Host names (DNS rebinding), cross-origin pages and CORS.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time

import httpx
import openai
import pytest

from pipeline.build import constraint_spec
from pipeline.core import UserError
from pipeline.decode import decode
from pipeline.server.admit import GrammarCache

from helpers import PYTHON, REPO_ROOT, compose_config, subprocess_env
from serving import live_server, metric, reference, wait_for

SECRET = "s3cr3t-value-7f3a"
GOOD = "Tell me about the sea."
GOOD_TOKENS = 300  # long enough that every bad request lands while the good stream runs
MSGS = [{"role": "user", "content": "x"}]


@pytest.fixture(scope="module")
def server():
    os.environ["PIPELINE_TEST_SECRET"] = SECRET
    with live_server("decode=greedy", "batch_size=8", "constraint_timeout_s=0.5", "max_body_bytes=200000") as s:
        yield s
    os.environ.pop("PIPELINE_TEST_SECRET", None)


@pytest.fixture(scope="module")
def good_tokens(tmp_path_factory):
    return reference("greedy", [GOOD], tmp_path_factory.mktemp("ref"), max_new_tokens=GOOD_TOKENS)[0]


@contextlib.contextmanager
def beside(url: str, want: list[int]):
    """A well-formed stream runs while the body of the with-block does (entered once its first
    chunk came); on exit it must have finished with exactly `want`, its batch-1 tokens."""
    out, started = {}, threading.Event()

    def good():
        ids, finish = [], None
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60, json={
                "model": "tiny", "messages": [{"role": "user", "content": GOOD}], "max_tokens": GOOD_TOKENS,
                "stream": True, "return_token_ids": True}) as r:
            for line in r.iter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                started.set()
                c = json.loads(line[5:])["choices"][0]
                ids += c.get("token_ids", [])
                finish = c["finish_reason"] or finish
        out["answer"] = (ids, finish)

    t = threading.Thread(target=good)
    t.start()
    assert started.wait(30)
    yield
    t.join(60)
    started.set()
    assert out["answer"] == (want, "length"), "the well-formed stream beside the bad request changed"


def post(url: str, body, path: str = "/v1/chat/completions", **kw) -> httpx.Response:
    if not isinstance(body, dict):  # raw bytes, or a generator of chunks (a chunked body)
        return httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"}, timeout=60, **kw)
    return httpx.post(f"{url}{path}", json=body, timeout=60, **kw)


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


# --- request data is data ----------------------------------------------------------------------
@pytest.mark.parametrize("regex", ["${oc.env:PIPELINE_TEST_SECRET}", "${oc.env:PIPELINE_TEST_SECRET}(",
                                   "(${oc.env:PIPELINE_TEST_SECRET}|x)"])
def test_a_regex_is_never_resolved(server, good_tokens, regex):
    _, url = server
    with beside(url, good_tokens):
        r = post(url, {"model": "tiny", "messages": MSGS, "max_tokens": 30, "regex": regex})
        assert SECRET not in r.text
        assert r.status_code in (200, 400), r.text
        if r.status_code == 400:
            assert_error(r, 400, "regex")


def test_a_path_looking_grammar_is_grammar_text(server, good_tokens, tmp_path):
    _, url = server
    leak = tmp_path / "some_file.ebnf"
    leak.write_text('root ::= "LEAKED-FILE-CONTENT"\n')
    with beside(url, good_tokens):
        r = post(url, {"model": "tiny", "messages": MSGS, "max_tokens": 30, "grammar": str(leak)})
        assert_error(r, 400, "grammar")
        assert "LEAKED" not in r.text
        r = post(url, {"model": "tiny", "messages": MSGS, "max_tokens": 30, "grammar": 'root ::= "ok" | "no"'})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in ("ok", "no")


def test_a_cli_input_line_carries_text_not_paths_or_interpolations(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_TEST_SECRET", SECRET)
    leak = tmp_path / "schema.json"
    leak.write_text('{"type": "object", "properties": {"LEAKED": {"type": "integer"}}}')
    spec = constraint_spec(compose_config(["model=tiny"]), {"json_schema": str(leak)})
    with pytest.raises(UserError, match="not JSON") as e:
        spec.check()
    assert "LEAKED" not in str(e.value)
    lines = [{"id": "a", "prompt": "x", "regex": "(${oc.env:PIPELINE_TEST_SECRET}|y)"},
             {"id": "b", "prompt": "x", "grammar": str(tmp_path / "g.ebnf")}]
    (tmp_path / "g.ebnf").write_text('root ::= "LEAKED"\n')
    for k, line in enumerate(lines):
        path = tmp_path / f"in{k}.jsonl"
        path.write_text(json.dumps(line) + "\n")
        cfg = compose_config(["model=tiny", f"input={path}", "max_new_tokens=8", "stream=false"],
                             output_dir=tmp_path / f"run{k}")
        try:
            _, objects = decode(cfg)
            text = json.dumps(objects["results"]["items"])
        except UserError as e:
            text = str(e)
        assert SECRET not in text and "LEAKED" not in text


BAD_FIELDS = [  # (raw body or dict, the field named)
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "temperature"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_p": Infinity}', "top_p"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 1e400}', "temperature"),
    ({"model": "tiny", "messages": MSGS, "temperature": 10 ** 400}, "temperature"),
    ({"model": "tiny", "messages": MSGS, "seed": 2 ** 64}, "seed"),
    ({"model": "tiny", "messages": MSGS, "seed": -1}, "seed"),
    ({"model": "tiny", "messages": MSGS, "seed": 2 ** 64 - 2, "n": 3}, "seed"),  # choice 2's seed is past the range
    ({"model": "tiny", "messages": MSGS, "max_tokens": 0}, "max_tokens"),
    ({"model": "tiny", "messages": MSGS, "max_tokens": 10 ** 9}, "max_tokens"),
    ({"model": "tiny", "messages": MSGS, "top_p": 0}, "top_p"),
    ({"model": "tiny", "messages": MSGS, "top_k": -5}, "top_k"),
    ({"model": "tiny", "messages": MSGS, "n": 0}, "n"),
    ({"model": "tiny", "messages": MSGS, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"model": "tiny", "messages": MSGS, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": "tiny", "messages": MSGS, "stop": "x" * 257}, "stop"),
    ({"model": "tiny", "messages": MSGS, "stop": [""]}, "stop"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema",'
     b' "json_schema": {"name": "s", "schema": {"type": "number", "maximum": NaN}}}}', "response_format"),
]


def test_every_field_is_checked_at_admission(server, good_tokens):
    _, url = server
    with beside(url, good_tokens):
        for body, param in BAD_FIELDS:
            assert_error(post(url, body), 400, param)
    r = post(url, {"model": "tiny", "messages": MSGS, "max_tokens": 3, "seed": 2 ** 64 - 1, "temperature": 1.0})
    assert r.status_code == 200, r.text  # the top of the generator's range is a seed


# --- one request never fails another --------------------------------------------------------------
class Broken:
    """A grammar whose state raises after `after` masks: a constraint failing in the engine."""
    kind, add_to_prompt, close_margin = "regex", False, 0

    def __init__(self, grammar, after: int):
        self.grammar, self.after = grammar, after

    def text(self) -> str:
        return ""

    def start(self):
        state, calls = self.grammar.start(), [0]
        fill = state.fill

        def failing(bits):
            calls[0] += 1
            if calls[0] > self.after:
                raise RuntimeError("injected constraint fault")
            fill(bits)
        state.fill = failing
        return state


def test_a_failing_constraint_fails_its_request_alone(server, good_tokens, monkeypatch):
    srv, url = server
    admitter, engine = srv.service.admitter, srv.service.engine
    get = admitter.grammars.get

    async def broken(spec, field):
        return Broken(await get(spec, field), after=3)

    monkeypatch.setattr(admitter.grammars, "get", broken)
    with beside(url, good_tokens):
        r = post(url, {"model": "tiny", "messages": MSGS, "max_tokens": 40, "regex": "[a-z ]+"})
        assert_error(r, 500, code="request_failed")
        assert "injected constraint fault" in r.json()["error"]["message"]
    assert engine.failed_steps == 0 and httpx.get(f"{url}/health").json()["status"] == "ok"
    assert wait_for(lambda: metric(url, "pipeline_kv_sequences") == 0)


def test_failing_sampling_knobs_fail_their_request_alone(server, good_tokens, monkeypatch):
    srv, url = server
    sampler = srv.service.engine.runner.sampler
    warpers = sampler.warpers

    def boom(ids, scores):
        raise FloatingPointError("injected warper fault")

    monkeypatch.setattr(sampler, "warpers", lambda p: [boom] if p.temperature == 0.77 else warpers(p))
    with beside(url, good_tokens):
        r = post(url, {"model": "tiny", "messages": MSGS, "max_tokens": 20, "temperature": 0.77, "seed": 3})
        assert_error(r, 500, code="request_failed")
        ok = post(url, {"model": "tiny", "messages": MSGS, "max_tokens": 20, "temperature": 0.8, "seed": 3})
        assert ok.status_code == 200
    assert srv.service.engine.failed_steps == 0
    assert wait_for(lambda: metric(url, "pipeline_kv_sequences") == 0)


def test_a_model_failure_is_shown_by_health_until_a_step_succeeds(server):
    srv, url = server
    runner, engine = srv.service.engine.runner, srv.service.engine

    def boom(live):
        del runner._step  # once: the class's own step again
        raise RuntimeError("injected model fault")

    before = engine.failed_steps
    runner._step = boom
    assert_error(post(url, {"model": "tiny", "messages": MSGS, "max_tokens": 5}), 500)
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "degraded" and health["failed_steps"] == before + 1
    assert "injected model fault" in health["last_failure"]["error"]
    assert post(url, {"model": "tiny", "messages": MSGS, "max_tokens": 5}).status_code == 200
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


class Fatal(BaseException):
    """Not an Exception: what no step handler catches."""


def test_when_the_engine_thread_dies_everyone_is_told_and_the_server_exits_1():
    with live_server("decode=greedy", "batch_size=4") as (srv, url):
        engine = srv.service.engine
        out, started = {}, threading.Event()

        def stream():
            with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60, json={
                    "model": "tiny", "messages": MSGS, "max_tokens": 1800, "stream": True}) as r:
                out["lines"] = []
                for line in r.iter_lines():
                    started.set()
                    out["lines"].append(line)

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(30)
        step = engine.runner.step

        def fatal():
            engine.runner.step = step
            raise Fatal("injected engine death")

        engine.runner.step = fatal
        t.join(30)
        events = [json.loads(x[5:]) for x in out["lines"] if x.startswith("data: {")]
        assert "engine stopped" in events[-1]["error"]["message"] and [x for x in out["lines"] if x][-1] == "data: [DONE]"
        assert not engine.alive and "injected engine death" in engine.failure
        assert_error(post(url, {"model": "tiny", "messages": MSGS, "max_tokens": 5}), 503)
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "injected engine death" in health.json()["engine_error"]
        assert wait_for(lambda: srv.should_exit, 10) and srv.exit_code == 1


# --- bounded work ----------------------------------------------------------------------------------
def test_bodies_prompts_and_nesting_are_bounded(server, good_tokens):
    _, url = server
    with beside(url, good_tokens):
        big = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "w " * 150000}]})
        assert_error(post(url, big), 413, code="body_too_large")

        def chunks():
            yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
            for _ in range(30):
                yield b"w" * 10000
            yield b'"}]}'
        assert_error(post(url, chunks()), 413, code="body_too_large")
        long = {"model": "tiny", "messages": [{"role": "user", "content": "word " * 38000}]}
        err = assert_error(post(url, long), 400, "messages", "context_length_exceeded")
        assert "bytes" in err["message"]  # refused by its size, before it was tokenized
        assert_error(post(url, b"[" * 5000 + b"]" * 5000), 400)
        nested = {"a": 1}
        for _ in range(100):
            nested = {"a": nested}
        assert_error(post(url, {"model": "tiny", "messages": MSGS, "metadata": nested}), 400, "metadata")


def test_a_slow_compile_blocks_no_other_request(server, good_tokens, monkeypatch):
    srv, url = server
    cache = srv.service.admitter.grammars
    compile_ = cache._compile

    def slow(key, spec):  # this schema's compile takes 2 s, past the server's 0.5 s cap
        if "slow_one" in key:
            time.sleep(2)
        return compile_(key, spec)

    monkeypatch.setattr(cache, "_compile", slow)
    schema = {"type": "object", "properties": {"slow_one": {"type": "string"}}}
    hit = {"model": "tiny", "messages": MSGS, "max_tokens": 5, "regex": "(yes|no)"}
    assert post(url, hit).status_code == 200  # compiled: a cache hit from now on
    with beside(url, good_tokens):
        slow = {}
        t = threading.Thread(target=lambda: slow.update(r=post(url, {
            "model": "tiny", "messages": MSGS, "max_tokens": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "slow", "schema": schema}}})))
        t.start()
        time.sleep(0.1)
        for body in (hit, {"model": "tiny", "messages": MSGS, "max_tokens": 5}):
            t0 = time.monotonic()
            assert post(url, body).status_code == 200
            assert time.monotonic() - t0 < 0.5, "a request waited behind another's compile"
        t.join(30)
        assert_error(slow["r"], 400, "response_format", "constraint_timeout")
    huge = {"model": "tiny", "messages": MSGS, "regex": "a" * 70000}
    assert_error(post(url, huge), 400, "regex", "constraint_too_large")


def test_the_compile_cache_keeps_its_byte_budget(tiny_backbone):
    cache = GrammarCache(tiny_backbone, max_bytes=1, timeout=30)
    cfg = compose_config(["model=tiny"])

    async def compile_all():
        return [await cache.get(constraint_spec(cfg, {"regex": p}), "regex") for p in ("a+", "b+", "a+")]
    first, second, again = asyncio.run(compile_all())
    assert len(cache) == 1 and first is not again  # evicted by "b+", compiled anew
    cache = GrammarCache(tiny_backbone, max_bytes=1 << 30, timeout=30)
    first, second, again = asyncio.run(compile_all())
    assert len(cache) == 2 and first is again and cache.bytes > 0


def serve(tmp_path, *overrides: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([PYTHON, "-m", "pipeline.serve", "model=tiny", "port=0", f"hydra.run.dir={tmp_path}",
                             *overrides], cwd=REPO_ROOT, env=subprocess_env(), stderr=subprocess.PIPE, text=True)
    line = ""
    while "serving" not in line:
        line = proc.stderr.readline()
        assert line or proc.poll() is None, "the server exited before serving"
    return proc, re.search(r"http://\S+", line).group(0)


def test_a_drain_past_its_deadline_aborts_and_a_second_signal_exits_at_once(tmp_path):
    for second in (False, True):
        proc, url = serve(tmp_path / str(second), "shutdown_timeout=0.2" if not second else "shutdown_timeout=60")
        try:
            body = {"model": "tiny", "messages": MSGS, "max_tokens": 1900, "stream": True}
            finish, t0 = None, None
            with contextlib.suppress(httpx.HTTPError), \
                    httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
                for raw in r.iter_lines():  # a second signal may cut the stream: the process is gone
                    if t0 is None:
                        proc.send_signal(signal.SIGTERM)
                        t0 = time.monotonic()
                        if second:
                            time.sleep(0.2)
                            proc.send_signal(signal.SIGTERM)
                    if raw.startswith("data: {"):
                        finish = json.loads(raw[5:])["choices"][0]["finish_reason"] or finish
            assert proc.wait(30) == 1
            assert time.monotonic() - t0 < 10
            if not second:
                assert finish == "abort"
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.stderr.close()


def test_a_client_that_stops_reading_does_not_hold_the_drain(tmp_path):
    proc, url = serve(tmp_path, "shutdown_timeout=2")
    try:
        body = json.dumps({"model": "tiny", "messages": MSGS, "max_tokens": 1900, "stream": True}).encode()
        host, port = url.removeprefix("http://").split(":")
        s = socket.create_connection((host, int(port)))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        s.recv(100)  # the answer started; then nothing more is read
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        assert proc.wait(30) in (0, 1)
        assert time.monotonic() - t0 < 10
        s.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


# --- who may call ------------------------------------------------------------------------------------
def test_an_api_key_guards_the_api(monkeypatch, tmp_path):
    monkeypatch.setenv("PIPELINE_TEST_KEY", "k-123")
    with live_server("decode=greedy", "api_key_env=PIPELINE_TEST_KEY") as (srv, url):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k-123"}):
            assert_error(httpx.get(f"{url}/v1/models", headers=headers), 401, code="invalid_api_key")
            assert_error(post(url, {"model": "tiny", "messages": MSGS}, headers=headers), 401)
        assert httpx.get(f"{url}/health").status_code == 200 and httpx.get(f"{url}/metrics").status_code == 200
        assert httpx.get(f"{url}/").status_code == 200  # the page asks for the key itself
        ok = openai.OpenAI(base_url=f"{url}/v1", api_key="k-123", max_retries=0)
        assert ok.chat.completions.create(model="tiny", messages=MSGS, max_tokens=3).choices[0].finish_reason
    with live_server("decode=greedy", "api_key=k-456", "public_routes=[]") as (srv, url):
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer k-456"}).status_code == 200


def test_loopback_answers_loopback_hosts_and_no_foreign_page(server, good_tokens):
    _, url = server
    port = url.rsplit(":", 1)[1]
    with beside(url, good_tokens):
        for host in ("evil.example.com", f"evil.example.com:{port}", "127.0.0.1.evil.example.com"):
            assert_error(httpx.get(f"{url}/v1/models", headers={"Host": host}), 400, code="invalid_host")
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
            assert httpx.get(f"{url}/v1/models", headers={"Host": host}).status_code == 200
        r = post(url, {"model": "tiny", "messages": MSGS, "max_tokens": 3}, headers={"Origin": "http://evil.example.com"})
        assert_error(r, 403, code="origin_not_allowed")
        assert "access-control-allow-origin" not in r.headers
        r = post(url, {"model": "tiny", "messages": MSGS, "max_tokens": 3}, headers={"Origin": url})
        assert r.status_code == 200  # the page's own origin


def test_cors_origins_open_the_api_to_a_page():
    with live_server("decode=greedy", "cors_origins=[http://app.example]") as (_, url):
        pre = httpx.options(f"{url}/v1/chat/completions", headers={
            "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type,authorization"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://app.example"
        r = post(url, {"model": "tiny", "messages": MSGS, "max_tokens": 3}, headers={"Origin": "http://app.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
        r = post(url, {"model": "tiny", "messages": MSGS, "max_tokens": 3}, headers={"Origin": "http://other.example"})
        assert_error(r, 403)
