"""The vLLM side of the `vllm` benchmark peer, run by pipeline/vllm_peer.py with .venv-vllm's python
(it imports nothing from this project). `python vllm_worker.py '<settings json>'`.

Protocol, one JSON object a line. The worker starts the engine, then writes
  {"ready": true, "vllm": "<version>", "startup_s": s}
and for each line it reads, {"prompts": [[ids], ...], "max_new_tokens": N, "stop_token_ids": [ids],
"max_running": B}, it decodes every prompt of the line, B at a time, and writes
  {"outputs": [{"token_ids", "finish_reason": "eos|length", "accepted_lengths", "step_ms",
                "prefill_ms", "wall_s"}, ...], "wall_s": s}
in the order of the prompts; {"error": "..."} and exit 1 on a failure. It ends at end of input.
Only these lines go to stdout: vLLM's own output (logs, progress) goes to stderr.

Each request's tokens arrive step by step (RequestOutputKind.DELTA), so `accepted_lengths` are the
tokens it committed per engine step (the prefill's token first; more than one per step only under
speculation) and `step_ms` the time between its commits after the first.
"""
import os
import sys

# this folder holds modules named like the ones vLLM imports (requests, io): keep it off the path
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
import itertools  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402


def decode(engine, next_id, job: dict) -> dict:
    """Every prompt of the job, at most `max_running` at once: a request is admitted as soon as a
    slot is free (continuous batching; 1 = one request after another)."""
    from vllm import SamplingParams  # in .venv-vllm only, as main's `import vllm` says
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"], ignore_eos=False,
                            stop_token_ids=job["stop_token_ids"], detokenize=False,
                            output_kind=RequestOutputKind.DELTA)
    queue = list(enumerate(job["prompts"]))[::-1]
    records: list[dict] = [{} for _ in queue]
    live: dict[str, dict] = {}  # request id -> its record, while it runs
    t0 = time.perf_counter()
    while queue or live:
        while queue and len(live) < job["max_running"]:
            k, prompt = queue.pop()
            rid = str(next(next_id))
            engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
            now = time.perf_counter()
            live[rid] = records[k] = {"token_ids": [], "finish_reason": "length", "accepted_lengths": [],
                                      "step_ms": [], "prefill_ms": 0.0, "wall_s": 0.0, "_admitted": now, "_last": now}
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            rec, c = live[out.request_id], out.outputs[0]
            if c.token_ids:
                if rec["token_ids"]:
                    rec["step_ms"].append((now - rec["_last"]) * 1e3)
                else:
                    rec["prefill_ms"] = (now - rec["_admitted"]) * 1e3
                rec["token_ids"] += list(c.token_ids)
                rec["accepted_lengths"].append(len(c.token_ids))
                rec["_last"] = now
            if out.finished:
                rec["finish_reason"] = "eos" if c.finish_reason == "stop" else "length"
                rec["wall_s"] = now - rec.pop("_admitted")
                del rec["_last"], live[out.request_id]
    return {"outputs": records, "wall_s": time.perf_counter() - t0}


def main() -> None:
    settings = json.loads(sys.argv[1])
    reply = os.fdopen(os.dup(1), "w")  # the protocol's stdout; fd 1 (vLLM, its engine process) -> stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(obj):
        reply.write(json.dumps(obj) + "\n")
        reply.flush()

    try:
        import vllm  # in .venv-vllm only: imported here so that a failure goes back as an {"error"} line
        t0 = time.perf_counter()
        llm = vllm.LLM(**settings)
        send({"ready": True, "vllm": vllm.__version__, "startup_s": time.perf_counter() - t0})
        next_id = itertools.count()
        for line in sys.stdin:
            if line.strip():
                send(decode(llm.llm_engine, next_id, json.loads(line)))
    except Exception as e:  # noqa: BLE001 - the peer shows it in one line, the traceback is in the log
        traceback.print_exc()
        send({"error": f"{type(e).__name__}: {e}".splitlines()[0]})
        sys.exit(1)


if __name__ == "__main__":  # vLLM starts its engine in a new process, which imports this module again
    main()
