"""``GET /v1/models`` and ``GET /v1/models/{model_id}``: :class:`OpenAIServingModels`."""
from __future__ import annotations

import time
from typing import Any

from swarm.api.errors import ApiError


class OpenAIServingModels:
    """The one model this swarm serves, as OpenAI model objects (``created``: when the handler was made)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.started = int(time.time())

    def model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.started, "owned_by": "chainswarm"}

    # Route operations: no docstrings (they would become OpenAPI descriptions).
    async def list_models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    async def get_model(self, model_id: str) -> dict[str, Any]:
        if model_id != self.model_name:
            raise ApiError(404, "model_not_found", f"this swarm serves {self.model_name!r}, not {model_id!r}",
                           param="model")
        return self.model_card()
