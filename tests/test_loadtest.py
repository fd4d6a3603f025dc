"""The load generator (`python -m pipeline.loadtest`) against our server on the tiny model, run
in-process on a free port: every request is counted, as done or as an error of its kind (a 429 too);
the completion tokens are the server's usage and what its metrics counted; the greedy answers under
concurrency are the text of the ones at concurrency 1 (the tiny model runs float32, and batched
float32 steps give batch 1's tokens: test_serve.py's 32 streams check the same); loadtest.json and
loadtest.png are written. Bad input fails with one line naming the fix."""
from __future__ import annotations

import json
import re
import socket

import httpx
import pytest

from pipeline.errors import UserError
from pipeline.loadtest import loadtest, markdown_table

from helpers import compose_config
from serving import live_server

MAX_TOKENS = 8

def generated_tokens(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return float(re.search(r"^pipeline_generation_tokens_total (\S+)$", text, re.M).group(1))


def run(tmp_path, *overrides: str):
    cfg = compose_config([f"max_tokens={MAX_TOKENS}", *overrides], config_name="loadtest", output_dir=tmp_path)
    return loadtest(cfg, [])


def test_every_request_is_measured_and_greedy_answers_match_alone(tmp_path):
    with live_server("decode=greedy", "batch_size=3") as (_, url):
        before = generated_tokens(url)
        result, objects = run(tmp_path, f"url={url}", "concurrency=[1,3]", "requests=7")
        after = generated_tokens(url)
    assert result["server"]["model"] == "tiny"
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 3]
    for lv in result["levels"]:
        outs = lv["outcomes"]
        assert lv["requests"] == lv["done"] == len(outs) == 7 and lv["errors"] == {}
        assert [o["prompt"] for o in outs] == [k % len(result["prompts"]) for k in range(7)]
        assert lv["tokens_from_usage"]
        for o in outs:
            assert 1 <= o["tokens"] <= MAX_TOKENS and o["text"]
            assert 0 < o["ttft_s"] <= o["latency_s"]
            assert o["ttft_s"] + sum(o["itl_s"]) <= o["latency_s"]
        assert lv["same_as_alone"] == {"same": 7, "of": 7}
        assert lv["ttft_s"]["p50"] <= lv["ttft_s"]["p99"] and lv["tpot_s"]["p50"] is not None
        assert lv["mean_accepted_length"] == 1.0  # plain decoding: one token per forward
    # the server committed exactly what the client counted (the warm-up included)
    assert after - before == result["warmup"]["tokens"] + sum(lv["tokens"] for lv in result["levels"])
    saved = json.loads(objects["paths"]["json"].read_text())
    assert saved["levels"][1]["outcomes"][0]["text"] == result["levels"][1]["outcomes"][0]["text"]
    assert saved["machine"]["cpu"] and saved["config"]["concurrency"] == [1, 3]
    assert objects["paths"]["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert markdown_table(result).count("\n") == 3  # header, rule, two levels


def test_refused_requests_are_counted_as_errors(tmp_path):
    """One slot and no queue: of 3 clients at once, those refused get 429, counted, never lost."""
    with live_server("decode=greedy", "batch_size=1", "max_queue=0") as (_, url):
        result, _ = run(tmp_path, f"url={url}", "concurrency=[3]", "requests=6", "max_tokens=40")
    lv = result["levels"][0]
    assert lv["done"] >= 1 and lv["errors"].get("HTTP 429", 0) >= 1
    assert lv["done"] + sum(lv["errors"].values()) == lv["requests"] == 6
    assert set(lv["errors"]) == {"HTTP 429"} and lv["first_error"].startswith("HTTP 429: ")


def test_an_unreachable_url_is_one_line(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(UserError, match=rf"nothing answers at http://127.0.0.1:{port}/v1 .*start the server"):
        run(tmp_path, f"url=http://127.0.0.1:{port}", "concurrency=[1]", "requests=1")
    assert not (tmp_path / "loadtest.json").exists()


@pytest.mark.parametrize("overrides, message", [
    ((), "nothing to measure: pass url="),
    (("url=http://127.0.0.1:1", "server=ours"), "not both"),
    (("server=frob",), "unknown server 'frob'"),
    (("url=http://127.0.0.1:1", "concurrency=[4,1]"), "increasing positive ints"),
    (("url=http://127.0.0.1:1", "concurrency=[1,a]"), "increasing positive ints"),
    (("url=http://127.0.0.1:1", "concurrency=[]"), "increasing positive ints"),
    (("url=http://127.0.0.1:1", "requests=0"), "requests must be a positive int"),
    (("url=http://127.0.0.1:1", "temperature=-1"), "temperature must be a number >= 0"),
    (("url=127.0.0.1:1",), "url must be http://host:port"),
])
def test_bad_input_is_one_line(tmp_path, overrides, message):
    with pytest.raises(UserError, match=re.escape(message)):
        run(tmp_path, *overrides)


def test_server_overrides_with_a_running_url_are_refused(tmp_path):
    cfg = compose_config(["url=http://127.0.0.1:1", "decode=tree_eagle"], config_name="loadtest", output_dir=tmp_path)
    with pytest.raises(UserError, match=r"decode=tree_eagle configures a server the loadtest starts"):
        loadtest(cfg, ["url=http://127.0.0.1:1", "decode=tree_eagle"])


def test_server_ours_is_started_measured_and_stopped(tmp_path):
    """server=ours: our server in a subprocess with the loadtest's server overrides and a batch as
    large as the largest level; it no longer answers once the loadtest returns."""
    overrides = ["server=ours", "model=tiny", "decode=tree_ngram", "~guard", "concurrency=[2]", "requests=2"]
    cfg = compose_config([f"max_tokens={MAX_TOKENS}", *overrides], config_name="loadtest", output_dir=tmp_path)
    result, _ = loadtest(cfg, overrides)
    server = result["server"]
    assert server["name"] == "ours" and server["model"] == "tiny"
    assert server["command"].endswith("batch_size=2") and " decode=tree_ngram " in server["command"]
    assert "serving tiny (tree_ngram)" in (tmp_path / "ours.log").read_text()
    lv = result["levels"][0]
    assert lv["done"] == 2 and lv["errors"] == {} and lv["mean_accepted_length"] >= 1.0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server['url']}/v1/models", timeout=5)


@pytest.mark.parametrize("server, override", [("vllm", "kv=paged"), ("llama_cpp", "decode=tree_eagle"),
                                              ("ours", "port=8000")])
def test_a_peer_refuses_overrides_it_would_ignore(server, override):
    from pipeline.serve_peers import check_overrides
    with pytest.raises(UserError, match=re.escape(override)):
        check_overrides(server, ["model=tiny", override])
    check_overrides(server, ["model=tiny", "threads=1"])  # what every server takes
