"""The OpenAI wire format: a request body read into a `Spec` (every field checked, a bad one refused
with a 400 that names it), OpenAI-style error objects, and the response and chunk objects of
`/v1/chat/completions` and `/v1/completions`."""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field

from pipeline.core.runner import SEED_RANGE
from pipeline.requests import ROLES, Request

# the engine's finish reasons -> OpenAI's; "abort": ended by a forced shutdown (vLLM's name)
FINISH = {"eos": "stop", "constraint_complete": "stop", "length": "length", "context": "length", "stop": "stop",
          "abort": "abort"}
MAX_STOPS = 4  # OpenAI's limit on stop strings
MAX_STOP_CHARS = 256  # characters in one stop string
MAX_N = 16  # choices per request (each a sequence of the batch)
MAX_TOP_LOGPROBS = {"chat": 20, "completion": 5}  # OpenAI's limits
# fields that change nothing in what is generated, accepted as OpenAI accepts them
INERT = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}
COMMON = {"model", "max_tokens", "seed", "stop", "stream", "stream_options", "temperature", "top_p", "top_k", "n",
          "logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "regex", "grammar", "return_token_ids"}
FIELDS = {"chat": COMMON | INERT | {"messages", "max_completion_tokens", "top_logprobs", "response_format"},
          "completion": COMMON | INERT | {"prompt", "echo", "best_of", "suffix", "response_format"}}


class APIError(Exception):
    """An error answered as OpenAI does: `{"error": {"message", "type", "param", "code"}}`."""
    TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
             500: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = {**(headers or {}), **({} if retry_after is None else {"Retry-After": str(retry_after)})}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"{param}: {message}", param, code)


@dataclass
class Spec:
    """One request as the server reads it, before it touches the engine."""
    kind: str  # chat | completion
    request: Request  # the prompt text or messages, and a constraint line (as a CLI request line carries)
    chat: bool  # apply the chat template (the chat endpoint) or feed the text raw (completions)
    max_tokens: int | None  # None: the preset's max_new_tokens
    seed: int | None  # None: the config's seed
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False  # extension: each choice / chunk also carries its token ids
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1  # choices: sibling sequences sharing the prompt's KV, choice i seeded seed + i
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k best
    model: str = ""  # the served name the request asked for (answers carry it)
    draft: str | None = None  # ... and the draft it names (None: the preset's own)


def read_body(raw: bytes, max_depth: int) -> dict:
    """A request body: one JSON object nested at most `max_depth` deep. NaN and Infinity parse (as
    Python's json does) and are refused by the field that holds them (`check_values`)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON ({e}): send one JSON object", None, "invalid_json") from None
    except RecursionError:
        raise APIError(400, f"the body nests too deep: at most {max_depth} levels", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(body).__name__}", None, "invalid_json")
    check_values(body, max_depth)
    return body


def check_values(body: dict, max_depth: int) -> None:
    """Every value of the body nested at most max_depth deep and every number finite (a JSON schema's
    too): else a 400 naming the top-level field that holds it."""
    for key, value in body.items():
        todo = [(value, 2)]
        while todo:
            v, depth = todo.pop()
            if depth > max_depth:
                raise bad(key, f"nests too deep: a body holds at most {max_depth} levels")
            if isinstance(v, float) and not math.isfinite(v):
                raise bad(key, f"holds {v!r}: numbers must be finite")
            if isinstance(v, dict):
                todo += [(x, depth + 1) for x in v.values()]
            elif isinstance(v, list):
                todo += [(x, depth + 1) for x in v]


def _int(body: dict, key: str, low: int, high: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < low or (high is not None and v > high):
        span = f">= {low}" if high is None else f"in {low}..{high}"
        raise bad(key, f"must be an integer {span}, got {_short(v)}")
    return v


def _short(v) -> str:
    """A value as an error message quotes it: its repr, cut at 60 characters."""
    text = repr(v)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _finite(v) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:  # an int too large for a float
        return False


def _number(body: dict, key: str, low: float, high: float | None = None, open_low: bool = False) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not _finite(v) or v < low or \
            (open_low and v == low) or (high is not None and v > high):
        span = f"{'>' if open_low else '>='} {low}" + ("" if high is None else f" and <= {high}")
        raise bad(key, f"must be a finite number {span}, got {_short(v)}")
    return float(v)


def _flag(body: dict, key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(key, f"must be true or false, got {_short(v)}")
    return v


def unsupported(param: str, what: str) -> APIError:
    return APIError(400, f"{param}: {what} is not supported per request yet", param, "unsupported_parameter")


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (conf/serve.yaml)."""
    max_tokens: int  # max_tokens at most: the model's context
    json_depth: int = 64  # nesting of the body (a JSON schema's included)
    constraint_bytes: int = 65536  # a regex, grammar or JSON schema (as JSON) at most this long


def read_spec(body: dict, kind: str, models: dict[str, str | None], limits: Limits) -> Spec:
    """Every field of a chat (`kind="chat"`) or completion request checked; raises APIError.
    models: the served names, each with the draft it routes to (None: the preset's own)."""
    unknown = sorted(set(body) - FIELDS[kind])
    if unknown:
        raise bad(_short(unknown[0])[1:-1], "unknown field (docs/serve.md lists the fields this server takes)",
                  "unknown_parameter")
    model = body.get("model")
    if not isinstance(model, str) or model not in models:
        raise APIError(400, f"model: no model {_short(model)} here; this server serves "
                       f"{', '.join(map(repr, models))}", "model", "model_not_found")
    if kind == "chat":
        request, chat = Request("chat", *_messages(body.get("messages"))), True
    else:
        request, chat = Request("completion", _prompt(body.get("prompt"))), False
    request.constraint = _constraint(body, limits.constraint_bytes)
    max_tokens = _int(body, "max_tokens", 1, limits.max_tokens)
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        max_tokens = _int(body, "max_completion_tokens", 1, limits.max_tokens)
    n = _int(body, "n", 1, MAX_N) or 1
    seed = _int(body, "seed", SEED_RANGE[0], SEED_RANGE[1] - (n - 1))  # choice i is seeded seed + i
    if kind == "completion" and (_int(body, "best_of", 1, MAX_N) or n) != n:
        raise unsupported("best_of", "best_of other than n (ranking choices)")
    logprobs = _logprobs(body, kind)
    for key in ("presence_penalty", "frequency_penalty"):
        if _number(body, key, -2.0, 2.0) not in (None, 0.0):
            raise unsupported(key, key.replace("_", " "))
    if body.get("logit_bias"):
        raise unsupported("logit_bias", "logit_bias")
    if kind == "completion" and (_flag(body, "echo") or body.get("suffix") is not None):
        raise unsupported("echo" if body.get("echo") else "suffix", "echo / suffix")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad("stream_options", "is only allowed with stream: true")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise bad("stream_options", f'takes {{"include_usage": true|false}}, got {_short(options)}')
    include_usage = _flag(options or {}, "include_usage")
    top_k = _int(body, "top_k", -1)  # -1 (vLLM's) or 0: off
    return Spec(kind, request, chat, max_tokens, seed, _stops(body.get("stop")), stream,
                include_usage, _flag(body, "return_token_ids"), _number(body, "temperature", 0.0),
                _number(body, "top_p", 0.0, 1.0, open_low=True), None if top_k is None else max(top_k, 0),
                n, logprobs, model, models[model])


def _logprobs(body: dict, kind: str) -> int | None:
    """How many top log-probabilities per token the request asks for (None: none). Chat: `logprobs`
    true and `top_logprobs` k; completions: `logprobs` k."""
    most = MAX_TOP_LOGPROBS[kind]
    if kind == "completion":
        k = _int(body, "logprobs", 0)
    else:
        k = _int(body, "top_logprobs", 0)
        if not _flag(body, "logprobs"):
            if k:
                raise bad("top_logprobs", "needs logprobs: true")
            return None
        k = k or 0
    if k is not None and k > most:
        raise bad("logprobs" if kind == "completion" else "top_logprobs", f"must be at most {most}, got {k}")
    return k


def _text(content, where: str) -> str:
    """A message's content: a string, or a list of text parts (OpenAI's content parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                         isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise bad(where, 'content must be a string or a list of {"type": "text", "text": "..."} parts')


def _messages(msgs) -> tuple[str, list[dict]]:
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", 'must be a non-empty list of {"role": ..., "content": ...} objects')
    out = []
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise bad(f"messages[{j}]", 'must be an object with "role" and "content"')
        if m["role"] not in ROLES:
            raise bad(f"messages[{j}].role", f"{_short(m['role'])} is not one of {', '.join(ROLES)}")
        out.append({"role": m["role"], "content": _text(m["content"], f"messages[{j}].content")})
    return out[-1]["content"], out


def _prompt(prompt) -> str:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad("prompt", "must be one string (batches of prompts and token-id prompts are not supported)")
    if not prompt:
        raise bad("prompt", "is empty: give the text to continue")
    return prompt


def _stops(stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or \
            not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise bad("stop", f"must be a string of 1..{MAX_STOP_CHARS} characters or a list of at most {MAX_STOPS} "
                  f"of them, got {_short(stop)}")
    return list(stops)


def _constraint(body: dict, most: int) -> dict | None:
    """The request's constraint as a CLI request line carries it: `json_schema`, `regex` or `grammar`
    (text, at most `most` bytes; a schema as JSON)."""
    given = {}
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            given["json_schema"] = {"type": "object"}
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise bad("response_format", 'json_schema needs {"json_schema": {"name": ..., "schema": {...}}}')
            given["json_schema"] = spec["schema"]
        elif kind != "text":
            raise bad("response_format", f'type must be "text", "json_object" or "json_schema", got {_short(fmt)}')
    for key in ("regex", "grammar"):
        v = body.get(key)
        if v is not None:
            if not isinstance(v, str) or not v:
                raise bad(key, f"must be a non-empty string, got {_short(v)}")
            given[key] = v
    if len(given) > 1:
        raise bad("response_format", "give at most one of response_format (json), regex and grammar")
    for key, v in given.items():
        size = len(v.encode() if isinstance(v, str) else json.dumps(v).encode())
        if size > most:
            raise bad("response_format" if key == "json_schema" else key,
                      f"is {size} bytes: this server compiles constraints of at most {most} (max_constraint_bytes)",
                      "constraint_too_large")
    return given or None


def request_schema(kind: str, models: list[str], limits: Limits) -> dict:
    """The JSON schema of a chat (`kind="chat"`) or completion request body, as `read_spec` checks
    it: served in the OpenAPI document (GET /openapi.json), which the API's fuzz test draws from."""
    text = {"type": "string", "minLength": 1}
    maybe = lambda schema: {"anyOf": [schema, {"type": "null"}]}  # noqa: E731 - OpenAI's fields take null
    stop = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
    props = {
        "model": {"type": "string", "enum": models},
        "max_tokens": maybe({"type": "integer", "minimum": 1, "maximum": limits.max_tokens}),
        "seed": maybe({"type": "integer", "minimum": SEED_RANGE[0], "maximum": SEED_RANGE[1] - (MAX_N - 1)}),
        "stop": maybe({"anyOf": [stop, {"type": "array", "items": stop, "maxItems": MAX_STOPS}]}),
        "stream": maybe({"type": "boolean"}),
        "stream_options": maybe({"type": "object", "properties": {"include_usage": {"type": "boolean"}},
                                 "additionalProperties": False}),
        "temperature": maybe({"type": "number", "minimum": 0}),
        "top_p": maybe({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": maybe({"type": "integer", "minimum": -1}),
        "n": maybe({"type": "integer", "minimum": 1, "maximum": MAX_N}),
        "presence_penalty": maybe({"type": "number", "minimum": 0, "maximum": 0}),
        "frequency_penalty": maybe({"type": "number", "minimum": 0, "maximum": 0}),
        "regex": maybe({**text, "maxLength": limits.constraint_bytes}),
        "grammar": maybe({**text, "maxLength": limits.constraint_bytes}),
        "return_token_ids": maybe({"type": "boolean"}),
        "response_format": maybe({"type": "object", "required": ["type"], "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]},
            "json_schema": {"type": "object", "required": ["name", "schema"],
                            "properties": {"name": {"type": "string"}, "schema": {"type": "object"}}}}}),
        "user": maybe({"type": "string"}),
        "metadata": maybe({"type": "object"}),
    }
    if kind == "chat":
        content = {"anyOf": [{"type": "string"}, {"type": "array", "items": {
            "type": "object", "required": ["type", "text"],
            "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}}}}]}
        props.update(
            messages={"type": "array", "minItems": 1, "items": {"type": "object", "required": ["role", "content"],
                                                                 "properties": {"role": {"enum": list(ROLES)},
                                                                                "content": content}}},
            max_completion_tokens=props["max_tokens"], logprobs=maybe({"type": "boolean"}),
            top_logprobs=maybe({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS["chat"]}))
    else:
        props.update(prompt={"anyOf": [text, {"type": "array", "items": text, "minItems": 1, "maxItems": 1}]},
                     logprobs=maybe({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS["completion"]}))
    return {"type": "object", "required": ["model", "messages" if kind == "chat" else "prompt"],
            "properties": props, "additionalProperties": False}


# --- responses --------------------------------------------------------------------------------------
def response_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def logprobs_object(spec: Spec, entries: list[tuple[str, float, list[tuple[str, float]]]], offset: int) -> dict:
    """OpenAI's logprobs of a choice (or of a chunk's part of it): entries are (token text, its
    log-probability, [(text, log-probability)] of the best); offset: the text length before them."""
    if spec.kind == "chat":
        item = lambda t, v: {"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))}  # noqa: E731
        return {"content": [{**item(t, v), "top_logprobs": [item(a, b) for a, b in top]} for t, v, top in entries],
                "refusal": None}
    offsets = []
    for t, _, _ in entries:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": [t for t, _, _ in entries], "token_logprobs": [v for _, v, _ in entries],
            "top_logprobs": [dict(top) for _, _, top in entries], "text_offset": offsets}


def _choice(spec: Spec, index: int, text: str, finish: str | None, token_ids: list[int] | None, delta: bool,
            first: bool = False, logprobs: dict | None = None) -> dict:
    if spec.kind == "chat":
        body = {"role": "assistant", "content": text} if not delta or first else ({"content": text} if text else {})
        out = {"index": index, "delta" if delta else "message": body}
    else:
        out = {"index": index, "text": text}
    out.update(logprobs=logprobs, finish_reason=finish)
    if spec.return_token_ids:
        out["token_ids"] = token_ids or []
    return out


@dataclass
class Answer:
    """One choice of a whole response."""
    text: str
    finish: str
    token_ids: list[int]
    logprobs: dict | None = None


def completion(spec: Spec, rid: str, answers: list[Answer], prompt_tokens: int, speculation: dict) -> dict:
    """The whole response of a request that is not streamed."""
    return {"id": rid, "object": "chat.completion" if spec.kind == "chat" else "text_completion",
            "created": int(time.time()), "model": spec.model,
            "choices": [_choice(spec, i, a.text, a.finish, a.token_ids, delta=False, logprobs=a.logprobs)
                        for i, a in enumerate(answers)],
            "usage": usage(prompt_tokens, sum(len(a.token_ids) for a in answers)), "speculation": speculation}


def chunk(spec: Spec, rid: str, index: int = 0, text: str = "", finish: str | None = None,
          token_ids: list[int] | None = None, first: bool = False, speculation: dict | None = None,
          usage_: dict | None = None, empty: bool = False, logprobs: dict | None = None) -> str:
    """One server-sent event of a streamed response, for choice `index`. `empty`: the usage chunk
    (no choices)."""
    out = {"id": rid, "object": "chat.completion.chunk" if spec.kind == "chat" else "text_completion",
           "created": int(time.time()), "model": spec.model,
           "choices": [] if empty else [_choice(spec, index, text, finish, token_ids, delta=True, first=first,
                                                logprobs=logprobs)]}
    if spec.include_usage:
        out["usage"] = usage_  # null on every chunk but the last, as OpenAI sends it
    if speculation is not None:
        out["speculation"] = speculation
    return sse(out)


def sse(obj) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"
