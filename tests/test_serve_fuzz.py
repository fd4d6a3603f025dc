"""The server's API fuzzed from its own OpenAPI document (GET /openapi.json: FastAPI serves it, with
the request bodies' JSON schemas of pipeline/server/openai_api.request_schema), by schemathesis on
hypothesis: a few hundred generated requests, well-formed by the schema and not, against a live
server on the tiny model. No answer is a 5xx, every 4xx is an OpenAI-style JSON error, and after
the run the server still answers and holds no sequence and no KV block."""
from __future__ import annotations

import hypothesis.strategies as st
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from serving import live_server, metric, wait_for

EXAMPLES = 300


def test_the_api_survives_its_fuzzer():
    # a short context keeps the generated max_tokens (up to the context) cheap
    with live_server("decode=greedy", "batch_size=8", "model.max_seq_len=192", "constraint_timeout_s=3") as (_, url):
        schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/models"}
        strategy = st.one_of([op.as_strategy(mode) for op in operations for mode in GenerationMode])
        seen: dict[int, int] = {}

        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def call(case):
            r = case.call(base_url=url, timeout=120)
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code < 500, f"{case.method} {case.path} {case.body!r:.300} -> {r.status_code} {r.text[:300]}"
            if r.status_code >= 400:
                err = r.json()["error"]
                assert isinstance(err["message"], str) and err["message"] and err["type"], r.text

        call()
        print("statuses:", dict(sorted(seen.items())))
        assert sum(seen.values()) >= EXAMPLES
        assert seen.get(200, 0) >= 20 and sum(n for s, n in seen.items() if 400 <= s < 500) >= 20
        assert wait_for(lambda: metric(url, "pipeline_kv_sequences") == 0 and metric(url, "pipeline_requests_running") == 0)
        assert metric(url, "pipeline_kv_bytes_in_use") == 0 and metric(url, "pipeline_kv_blocks_in_use") == 0
        import httpx
        assert httpx.post(f"{url}/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 4}).status_code == 200
