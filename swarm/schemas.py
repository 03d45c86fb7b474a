"""Wire schemas of the orchestrator's HTTP API (pydantic models; they also generate the OpenAPI schema).

Requests reject unknown fields (a typo must not silently change behaviour) and out-of-range values with
HTTP 422 and a message naming the field.
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CompletionRequest(_Strict):
    """OpenAI-compatible ``POST /v1/completions`` (the subset a single-sequence swarm session supports)."""

    prompt: str = Field(min_length=1, description="the prompt text")
    max_tokens: int = Field(16, ge=1, description="tokens to generate (prompt + max_tokens <= max session length)")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy decoding")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = Field(False, description="stream tokens as server-sent events")
    model: Optional[str] = Field(None, description="accepted for OpenAI compatibility; the swarm serves one model")
    user: Optional[str] = Field(None, description="client id when the orchestrator has no API keys configured")
    n: int = Field(1, ge=1, le=1, description="only 1 is supported")


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SwarmTiming(BaseModel):
    chain_id: str
    servers: list[str] = Field(default_factory=list, description="node ids of the chain that served the request")
    route: list[tuple[str, int, int]]
    waiting_s: float
    service_s: float


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    chainswarm: SwarmTiming


class LeaseRequest(_Strict):
    input_tokens: int = Field(ge=1, description="prompt tokens the session will send")
    max_new_tokens: int = Field(ge=1)
    timeout_s: Optional[float] = Field(None, gt=0, description="give up waiting for a chain after this long")
    client_id: Optional[str] = Field(None, description="client id when no API keys are configured")


class RouteSpanModel(BaseModel):
    peer_id: str
    start: int
    end: int


class LeaseResponse(BaseModel):
    lease_id: str
    chain_id: str
    route: list[RouteSpanModel]
    max_length: int
    dht_prefix: str
    initial_peers: list[str]
    expires_in_s: float


class RerouteRequest(_Strict):
    start: int = Field(ge=0)
    end: int = Field(ge=1)
    failed_peers: list[str] = Field(default_factory=list)


class RerouteResponse(BaseModel):
    route: list[RouteSpanModel]


class ErrorResponse(BaseModel):
    error: dict
