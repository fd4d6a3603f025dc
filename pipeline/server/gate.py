"""Who may call, and how much they may send: one ASGI middleware in front of every route.

In order, for each HTTP request:
1. Host: on a server bound to loopback, a Host header that does not name a loopback address (or
   one of `allowed_hosts`) is refused, 400: a web page cannot reach the server through DNS rebinding.
2. Origin: a browser request from a page of another origin than the server's own is refused, 403,
   unless `cors_origins` lists it (CORS itself, its preflights and headers, is Starlette's
   middleware, added only when `cors_origins` is set).
3. Key: with an API key set, every route but the page and `public_routes` needs
   `Authorization: Bearer <key>`, 401 otherwise (compared in constant time).
4. Body: at most `max_body_bytes`, 413 otherwise, before anything parses it (a declared
   Content-Length at once, a chunked body as it arrives).

Every refusal is an OpenAI-style JSON error (`openai_api.APIError`).
"""
from __future__ import annotations

import hmac
import ipaddress
import json
from urllib.parse import urlsplit

from pipeline.server.openai_api import APIError

LOOPBACK_NAMES = {"localhost", "localhost.", "ip6-localhost"}
PAGE = "/"  # the chat page: public (it asks for the key itself)


def is_loopback(host: str) -> bool:
    """A host name or address that means this machine."""
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(value: str) -> str:
    """The host of a Host header (`name`, `name:port`, `[v6]:port`), lower case."""
    return (urlsplit(f"//{value}").hostname or "").lower()


class Gate:
    """The checks above, around an ASGI app. loopback: the server's bind address is loopback."""

    def __init__(self, app, *, loopback: bool, allowed_hosts=(), cors_origins=(), api_key: str | None = None,
                 public_routes=(), max_body_bytes: int):
        self.app, self.loopback = app, loopback
        self.hosts = {h.lower() for h in allowed_hosts}
        self.origins = set(cors_origins)
        self.key = None if api_key is None else api_key.encode()
        self.public = set(public_routes) | {PAGE}
        self.max_body = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        error = self._refusal(scope, headers)
        if error is None and scope["method"] not in ("GET", "HEAD", "OPTIONS"):
            declared = headers.get("content-length", "")
            if declared.isdigit() and int(declared) > self.max_body:
                error = self._too_large()
            else:
                body, error = await self._read(receive)
                if error is None:
                    receive = _replay(body, receive)
        if error is not None:
            return await _answer(send, error)
        return await self.app(scope, receive, send)

    def _refusal(self, scope, headers: dict) -> APIError | None:
        host = headers.get("host", "")
        name = host_name(host)
        if self.loopback and not (is_loopback(name) or name in self.hosts):
            return APIError(400, f"Host {host!r} is not this server's: it is bound to loopback and answers only "
                            "loopback names (allowed_hosts= adds others, for a reverse proxy)", None, "invalid_host")
        origin = headers.get("origin")
        if origin is not None and origin not in self.origins and "*" not in self.origins and \
                urlsplit(origin).netloc.lower() != host.lower():
            return APIError(403, f"Origin {origin!r} may not call this server (cors_origins= opens it to a page's "
                            "origin)", None, "origin_not_allowed")
        path = scope["path"]
        if self.key is not None and path not in self.public and scope["method"] != "OPTIONS":
            given = headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.key):
                return APIError(401, "a valid API key is required: send Authorization: Bearer <key>", None,
                                "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return None

    def _too_large(self) -> APIError:
        return APIError(413, f"the body is over {self.max_body} bytes (max_body_bytes)", None, "body_too_large")

    async def _read(self, receive) -> tuple[bytes, APIError | None]:
        """The whole body, or an error once it passes the cap (the rest is not read)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", APIError(400, "the client went away before sending its body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return b"", self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None


def _replay(body: bytes, receive):
    """A receive that gives the body read already, then the client's own messages (its disconnect)."""
    sent = False

    async def again():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return again


async def _answer(send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *((k.lower().encode(), v.encode()) for k, v in error.headers.items())]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
