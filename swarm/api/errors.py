"""The errors the HTTP API answers with, and how the orchestrator's refusals map onto them.

Every error is OpenAI's error object, ``{"error": {"message", "type", "param", "code"}}``: ``type`` is OpenAI's
class of the status (``invalid_request_error``, ``authentication_error``, …), ``code`` says which error it is
(``context_length_exceeded``, ``unsupported_parameter``, ``model_not_found``, ``rate_limited`` …; what
applications branch on, as they do on OpenAI's) and ``param`` names the request field at fault, where one is.
``Retry-After`` is sent when the orchestrator can say when to come back (a full queue: 429; a queue timeout: 503).
"""
from __future__ import annotations

from swarm.api.schemas import BRANCH
from swarm.engine.completion import CompletionFailed
from swarm.control.orchestrator import NoChainsError, QueueFull, QueueTimeout
from swarm.control.reservations import ContextLengthExceeded

ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
"""OpenAI's error ``type`` by HTTP status; other 4xx are ``invalid_request_error``, 5xx ``server_error``."""


def error_body(status: int, code: str, message: str, param: str | None = None) -> dict:
    """The JSON of an error response (and of a stream's error event)."""
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ApiError(Exception):
    """An error answered as OpenAI's error object (:func:`error_body`), with ``Retry-After`` when it is known."""

    def __init__(self, status: int, code: str, message: str, retry_after_s: float | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.retry_after_s = status, code, message, retry_after_s
        self.param = param

    def body(self) -> dict:
        return error_body(self.status, self.code, self.message, self.param)


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


def validation_error(errors: list[dict], content_type: str | None) -> ApiError:
    """The 400 of a request FastAPI could not validate (OpenAI's status for any invalid request, and vLLM's; not
    FastAPI's 422, which the openai SDK raises as ``UnprocessableEntityError``, an exception applications written
    for OpenAI's API do not catch): :func:`validation_message`, and the first error's field as ``param``."""
    loc = tuple(errors[0].get("loc", ())) if errors else ()
    param = None if errors and errors[0].get("type") == "json_invalid" else field_path(loc) or None
    return ApiError(400, "invalid_request", validation_message(errors, content_type), param=param)


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


def refusal(exc: Exception, prompt_param: str | None = None) -> ApiError:
    """The HTTP answer to one of :data:`REFUSALS` (``prompt_param``: the request's field of the prompt, named as a
    too-long context's ``param``, as OpenAI does)."""
    if isinstance(exc, ContextLengthExceeded):
        return ApiError(400, "context_length_exceeded", str(exc), param=prompt_param)
    if isinstance(exc, ValueError):
        return ApiError(400, "invalid_request", str(exc))
    if isinstance(exc, QueueFull):
        return ApiError(429, "rate_limited", str(exc), exc.retry_after_s)
    if isinstance(exc, QueueTimeout):
        return ApiError(503, "unavailable", str(exc), exc.retry_after_s)
    if isinstance(exc, CompletionFailed):
        return ApiError(503, "swarm_failure", str(exc))
    return ApiError(503, "unavailable", str(exc))  # NoChainsError
