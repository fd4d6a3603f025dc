"""`GET /`: a chat page to watch speculation at work. It streams answers from the server's own
`/v1/chat/completions` (`return_token_ids`), shades each engine step's text by the tokens that step
committed, as `pipeline.report`'s strip does, and shows the live figures and the final `speculation`
object. One self-contained file, page.html (inline CSS and JS, nothing fetched from outside: the
machines it runs on may have no internet)."""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

HTML = (Path(__file__).parent / "page.html").read_text(encoding="utf-8")  # once: a missing file fails at import


def add_page(app: FastAPI) -> None:
    """Registers `GET /` on the app."""
    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(HTML)
