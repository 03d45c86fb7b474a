"""The OpenAI-compatible endpoints: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``, ``/v1/models``.

The handlers are objects (as vLLM's ``OpenAIServingChat`` / ``OpenAIServingCompletion``):
:class:`~swarm.api.serving_base.OpenAIServing` holds what the generation endpoints share (admission, the ``n``
runs through the fair queue, refusal mapping, SSE streaming), :class:`~swarm.api.serving_completion.
OpenAIServingCompletion`, :class:`~swarm.api.serving_chat.OpenAIServingChat` and
:class:`~swarm.api.serving_models.OpenAIServingModels` serve one endpoint family each. This module only binds
their methods to paths.
"""
from __future__ import annotations

from typing import Callable

from fastapi import FastAPI

from swarm.api.schemas import CompletionResponse
from swarm.api.serving_base import prompt_char_limit
from swarm.api.serving_chat import OpenAIServingChat
from swarm.api.serving_completion import OpenAIServingCompletion
from swarm.api.serving_models import OpenAIServingModels
from swarm.api.serving_responses import OpenAIServingResponses

__all__ = ["add_openai_routes", "prompt_char_limit"]  # prompt_char_limit: re-exported

GENERATION_ERRORS = {400: {}, 401: {}, 404: {}, 429: {}, 503: {}}


def add_openai_routes(app: FastAPI, *, runner, engine, model_name: str, max_length: int,
                      client_of: Callable[[str | None, str | None], str]) -> None:
    """Register the OpenAI-compatible routes on ``app``. ``client_of(authorization, fallback)`` names the
    client (API key or self-declared id)."""
    handles = dict(runner=runner, engine=engine, model_name=model_name, max_length=max_length, client_of=client_of)
    completion, chat = OpenAIServingCompletion(**handles), OpenAIServingChat(**handles)
    responses = OpenAIServingResponses(**handles)
    models = OpenAIServingModels(model_name)
    # route names are the operations' names (OpenAPI summary and operationId)
    app.add_api_route("/v1/completions", completion.completions, methods=["POST"], name="completions",
                      response_model=CompletionResponse, response_model_exclude_none=True,
                      responses=GENERATION_ERRORS)
    app.add_api_route("/v1/chat/completions", chat.chat_completions, methods=["POST"], name="chat_completions",
                      responses=GENERATION_ERRORS)
    app.add_api_route("/v1/responses", responses.responses, methods=["POST"], name="responses",
                      responses=GENERATION_ERRORS)
    app.add_api_route("/v1/models", models.list_models, methods=["GET"], name="list_models")
    app.add_api_route("/v1/models/{model_id}", models.get_model, methods=["GET"], name="get_model",
                      responses={404: {}})
