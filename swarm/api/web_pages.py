"""The orchestrator's web pages: the swarm dashboard at ``/`` and the chat page at ``/chat``.

Static files only (``swarm/api/web/``: two HTML pages, one script, one style sheet), served by the orchestrator
itself so that no page loads anything from elsewhere. The pages read the public JSON API
(``GET /v1/swarm``, ``POST /v1/chat/completions``) from the browser; nothing here renders data into markup.
A strict Content-Security-Policy (same-origin scripts, styles and connections only, no inline script) backs
that up.
"""
from __future__ import annotations

from functools import lru_cache
from importlib import resources

from fastapi import APIRouter, HTTPException
from fastapi.responses import Response

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
FILES = {"index.html": "text/html; charset=utf-8", "chat.html": "text/html; charset=utf-8",
         "app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8",
         "favicon.svg": "image/svg+xml"}

router = APIRouter(include_in_schema=False)


@lru_cache(maxsize=None)
def page(name: str) -> bytes:
    """One of :data:`FILES`, read from the installed package."""
    return resources.files("swarm.api").joinpath("web", name).read_bytes()


def _serve(name: str) -> Response:
    return Response(page(name), media_type=FILES[name],
                    headers={"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                             "Cache-Control": "no-cache", "Referrer-Policy": "no-referrer"})


@router.get("/")
async def dashboard() -> Response:
    return _serve("index.html")


@router.get("/chat")
async def chat() -> Response:
    return _serve("chat.html")


@router.get("/static/{name}")
async def static(name: str) -> Response:
    if name not in FILES or name.endswith(".html"):
        raise HTTPException(404)
    return _serve(name)
