"""The errors the HTTP API answers with, and how the orchestrator's refusals map onto them.

Every error is JSON ``{"error": {"type", "message"}}``; ``Retry-After`` is sent when the orchestrator can say
when to come back (a full queue: 429; a queue timeout: 503).
"""
from __future__ import annotations

from swarm.api.schemas import BRANCH
from swarm.engine.completion import CompletionFailed
from swarm.control.orchestrator import NoChainsError, QueueFull, QueueTimeout


class ApiError(Exception):
    """An error answered as ``{"error": {"type", "message"}}`` (with ``Retry-After`` when it is known)."""

    def __init__(self, status: int, kind: str, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.kind, self.message, self.retry_after_s = status, kind, message, retry_after_s


def field_path(loc: tuple) -> str:
    """A validation error's field as the request spells it: ``messages[0].content[1].type``, without the ``body``
    FastAPI puts first or the branch tags of union fields (:func:`swarm.api.schemas.one_of`)."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part != "body" and not str(part).startswith(BRANCH):
            path += f".{part}" if path else str(part)
    return path


def validation_message(errors: list[dict], content_type: str | None) -> str:
    """One sentence per error of a request FastAPI could not validate (``RequestValidationError.errors()``): the
    field and what is wrong with it; a body that is not JSON says where it breaks, and one that is not a JSON object
    says so (and which ``Content-Type`` to send, when that was the cause)."""
    parts = []
    for err in errors:
        loc = tuple(err.get("loc", ()))
        if err.get("type") == "json_invalid":  # loc: ("body", character offset)
            reason = (err.get("ctx") or {}).get("error", "malformed")
            parts.append(f"the request body is not valid JSON ({reason} at character {loc[-1]})")
        elif loc == ("body",) and err.get("type") in ("model_attributes_type", "dict_type"):
            json_sent = (content_type or "").split(";")[0].strip().lower() == "application/json"
            parts.append("the request body must be a JSON object" + (
                "" if json_sent else f" sent as 'Content-Type: application/json' (it came as {content_type!r})"))
        else:
            parts.append(f"{field_path(loc) or 'body'}: {err.get('msg')}")
    return "; ".join(parts)


REFUSALS = (ValueError, NoChainsError, QueueFull, QueueTimeout, CompletionFailed)
"""What admitting or running a request may raise instead of serving it."""


def refusal(exc: Exception) -> ApiError:
    """The HTTP answer to one of :data:`REFUSALS`."""
    if isinstance(exc, ValueError):  # too long for the swarm's sessions
        return ApiError(400, "invalid_request", str(exc))
    if isinstance(exc, QueueFull):
        return ApiError(429, "rate_limited", str(exc), exc.retry_after_s)
    if isinstance(exc, QueueTimeout):
        return ApiError(503, "unavailable", str(exc), exc.retry_after_s)
    if isinstance(exc, CompletionFailed):
        return ApiError(503, "swarm_failure", str(exc))
    return ApiError(503, "unavailable", str(exc))  # NoChainsError
