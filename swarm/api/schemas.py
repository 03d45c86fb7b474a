"""Wire schemas of the orchestrator's HTTP API (pydantic models; they also generate the OpenAPI schema).

Requests reject unknown fields (a typo must not silently change behaviour) and out-of-range values with
HTTP 400 (OpenAI's status; :func:`swarm.api.errors.validation_error`) and a message naming the field.
"""
from __future__ import annotations

from typing import Annotated, Any, Callable, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


MAX_STOP = 4
MAX_LOGIT_BIAS = 300
MAX_MESSAGES = 256
MAX_PROMPT_CHARS = 1_000_000  # bounded before any tokenization; the token limit is the swarm's session length
MAX_PROMPTS = 64  # prompts of one completions request (a batch, as evaluation harnesses send)
MAX_PROMPT_IDS = 131_072  # token ids of a prompt given as ids (the session length is checked when it is queued)

# OpenAI request fields Chainswarm does not implement: accepted by the schema so that a request using one gets
# a 400 with code unsupported_parameter that names it (a field OpenAI does not define at all is a 400 with code
# invalid_request, like any typo).
UNSUPPORTED_COMPLETION_FIELDS = ("best_of", "suffix")
UNSUPPORTED_CHAT_FIELDS = ("functions", "function_call", "audio", "modalities", "prediction", "service_tier",
                           "store", "metadata", "reasoning_effort", "web_search_options")

# Structured outputs and tools (swarm.api.structured): what one request may ask the grammar engine for.
MAX_SCHEMA_CHARS = 65_536  # the compact JSON of the response schema plus every tool's definition, together
MAX_SCHEMA_DEPTH = 32  # JSON containers (objects, arrays) nested in any one schema document
MAX_TOOLS = 128
MAX_TOOL_CALLS = 64  # tool calls of one assistant message in ``messages``
TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


# A union field's branches carry tags that start with this; `swarm.api.errors.validation_message` leaves them out
# of the field's path ("prompt[1]", not "prompt.~token ids.1").
BRANCH = "~"


def _json_kind(value: Any) -> str | None:
    """The JSON kind of a value (string, boolean, number, list, object), ``None`` for null."""
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, list):
        return "list"
    if isinstance(value, (dict, BaseModel)):
        return "object"
    return None


def one_of(expected: str, kind: Callable[[Any], str | None] = _json_kind, **branches: Any) -> Any:
    """A union field validated against the one branch named by ``kind`` of the value (a pydantic ``Discriminator``):
    a bad value gets that branch's errors, e.g. "prompt[1]: Input should be a valid integer", instead of one error
    per branch ("prompt.constrained-str: Input should be a valid string; prompt.list[constrained-str]…"). A value of
    no branch's kind gets "Input should be ``expected``"."""
    members = tuple(Annotated[branch, Tag(BRANCH + name)] for name, branch in branches.items())

    def branch_of(value: Any) -> str | None:
        name = kind(value)  # from the request: a "type" may be any JSON value
        return BRANCH + name if isinstance(name, str) and name in branches else None

    return Annotated[Union[members], Discriminator(branch_of, custom_error_type="invalid_kind",
                                                   custom_error_message=f"Input should be {expected}")]


def _prompt_kind(value: Any) -> str | None:
    """Which of a completion prompt's four forms a value has, from its first item."""
    if not isinstance(value, list):
        return "text" if isinstance(value, str) else None
    first = value[0] if value else None
    if isinstance(first, str):
        return "texts"
    if isinstance(first, list):
        return "token id lists"
    return "token ids" if isinstance(first, int) and not isinstance(first, bool) else None


def _item_kind(value: Any) -> str | None:
    """A Responses input item's ``type`` (a message when it has none)."""
    return value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)


def _part_kind(value: Any) -> str | None:
    """A content part's ``type``."""
    return value.get("type") if isinstance(value, dict) else getattr(value, "type", None)


TEXT_ONLY = "a text part: the served model reads text only"


JsonSchema = one_of("a JSON schema: an object or a boolean", object=dict[str, Any], boolean=bool)


class StreamOptions(_Strict):
    include_usage: bool = Field(False, description="send a last chunk with the usage of the whole request")


class _Sampling(_Strict):
    """The sampling surface both endpoints share (OpenAI semantics)."""

    model: Optional[str] = Field(None, description="the served model's id (GET /v1/models); optional")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy decoding")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=8, description="choices to generate: n sessions through the fair queue")
    stream: bool = Field(False, description="stream tokens as server-sent events")
    stream_options: Optional[StreamOptions] = None
    stop: Optional[one_of("a string or a list of strings", string=str, list=list[str])] = Field(
        None, description=f"up to {MAX_STOP} stop strings, never part of the returned text")
    seed: Optional[int] = Field(None, ge=-(2**63), lt=2**63, description="same seed and prompt -> same text "
                                "(a 64-bit integer)")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[str, float]] = Field(None, description="token id -> bias in [-100, 100]")
    user: Optional[str] = Field(None, max_length=256, description="client id when the orchestrator has no API keys")
    dual_execution: bool = Field(False, description="Chainswarm: every span of the session is re-executed on "
                                 "another server and the answer is sent only when both agree (costs the client "
                                 "twice the tokens; a disagreement bans the liar as any spot check and reruns)")
    speculative: bool = Field(True, description="Chainswarm: where the orchestrator runs speculative decoding "
                              "(--speculative), this request may draft and verify several tokens per step (the same "
                              "greedy text, the same sampling distribution); false: one token per step")
    # the sampling extensions serving tools send (vLLM's meaning)
    ignore_eos: bool = Field(False, description="the end-of-sequence token does not end the generation (vLLM); "
                             "max_tokens does")
    min_tokens: int = Field(0, ge=0, description="tokens generated before the end-of-sequence token or a stop "
                            "string may end the generation (vLLM); at most max_tokens")
    top_k: int = Field(-1, ge=-1, description="sample from the k most likely tokens; -1 or 0: all (vLLM)")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="drop tokens less likely than min_p times the most "
                         "likely one (vLLM)")
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0, description="divide positive (multiply negative) "
                                      "logits of tokens in the prompt or the output by this; 1 = none (vLLM)")
    response_format: Optional["ResponseFormat"] = Field(None, description="text, json_object or json_schema: "
                                                        "the output is constrained to parse (and validate)")

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP or any(len(x) > 256 for x in stops):
            raise ValueError(f"at most {MAX_STOP} stop strings of at most 256 characters")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value):
        if value is None:
            return value
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} logit_bias entries")
        for key, bias in value.items():
            if len(key) > 12 or not key.isdigit() or not -100 <= bias <= 100:  # "-1" biased the last token
                raise ValueError("logit_bias maps token ids (as strings of digits) to biases in [-100, 100]")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())


class CompletionRequest(_Sampling):
    """OpenAI-compatible ``POST /v1/completions``."""

    prompt: one_of(
        "a text, a list of texts, a list of token ids or a list of token id lists, none of them empty",
        _prompt_kind,
        text=Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)],
        texts=Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]],
                        Field(min_length=1, max_length=MAX_PROMPTS)],
        **{"token ids": Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=MAX_PROMPT_IDS)],
           "token id lists": Annotated[list[Annotated[list[Annotated[int, Field(ge=0)]],
                                                      Field(min_length=1, max_length=MAX_PROMPT_IDS)]],
                                       Field(min_length=1, max_length=MAX_PROMPTS)]}) = Field(
        description=f"the prompt: a text, token ids, or a batch of up to {MAX_PROMPTS} of either (the choices "
                    "come in prompt order, n per prompt: choice p·n + i is prompt p's i-th, streamed too)")
    max_tokens: Optional[int] = Field(16, ge=0, description="tokens to generate (prompt + max_tokens <= max "
                                      "session length); null = up to the session length; 0 only with echo "
                                      "(the prompt scored, nothing generated)")
    logprobs: Optional[int] = Field(None, ge=0, le=5, description="log-probabilities of the chosen tokens and "
                                    "the top N alternatives")
    echo: bool = Field(False, description="the text starts with the prompt; with logprobs, every prompt token "
                       "but the first has its log-probability and alternatives too (one more prefill of the prompt)")
    best_of: Optional[Any] = None
    suffix: Optional[Any] = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request, each a text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(pattern=TOOL_NAME, description="the schema's name")
    description: Optional[str] = Field(None, max_length=MAX_SCHEMA_CHARS)
    schema_: Optional[JsonSchema] = Field(None, alias="schema", description="a JSON schema "
                                                           "(draft 2020-12); absent: any JSON object")
    strict: Optional[bool] = Field(None, description="accepted; the output always follows the schema")


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = Field(None, description="with type json_schema")


class FunctionDefinition(_Strict):
    name: str = Field(pattern=TOOL_NAME)
    description: Optional[str] = Field(None, max_length=MAX_SCHEMA_CHARS)
    parameters: Optional[JsonSchema] = Field(None, description="a JSON schema of the arguments "
                                                              "object; absent: no arguments")
    strict: Optional[bool] = Field(None, description="accepted; the arguments always follow the schema")


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Strict):
    name: str = Field(max_length=64)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ToolChoiceFunction


class ToolCallFunction(BaseModel):
    """(Response objects sent back in ``messages`` carry client-side extras such as ``parsed_arguments``:
    ignored, like the stream's ``index``.)"""
    model_config = ConfigDict(extra="ignore")

    name: str = Field(max_length=64)
    arguments: str = Field(max_length=MAX_PROMPT_CHARS, description="the arguments as JSON text")


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class TextPart(_Strict):
    type: Literal["text"]
    text: str = Field(max_length=MAX_PROMPT_CHARS)


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Optional[one_of("a text or a list of text parts", string=str,
                             list=list[one_of(TEXT_ONLY, _part_kind, text=TextPart)])] = Field(
        None, description="text, or text parts; null only in an assistant message with tool_calls")
    name: Optional[str] = Field(None, max_length=64)
    tool_calls: Optional[list[ToolCall]] = Field(None, max_length=MAX_TOOL_CALLS, description="assistant: the "
                                                 "calls it made")
    tool_call_id: Optional[str] = Field(None, max_length=256, description="tool: the call this result answers")
    refusal: Optional[str] = Field(None, max_length=MAX_PROMPT_CHARS)
    # what an assistant message object of a response carries when it is sent back (``message.model_dump()``):
    # annotations and the client-side ``parsed`` are ignored; a non-null audio or function_call is a 400
    annotations: Optional[list[Any]] = Field(None, max_length=64)
    parsed: Optional[Any] = None
    audio: Optional[Any] = None
    function_call: Optional[Any] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    """OpenAI-compatible ``POST /v1/chat/completions``: messages rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: Optional[int] = Field(None, ge=1, description="null = up to the session length")
    max_completion_tokens: Optional[int] = Field(None, ge=1, description="the newer name of max_tokens")
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[list[ToolDefinition]] = Field(None, max_length=MAX_TOOLS, description="functions the model "
                                                  "may call")
    tool_choice: Optional[one_of("none, auto, required or a named function", string=Literal["none", "auto", "required"],
                                 object=NamedToolChoice)] = Field(
        None, description="none, auto (the default with tools), required, or a named function")
    parallel_tool_calls: Optional[bool] = Field(None, description="more than one call per answer (default true)")
    functions: Optional[Any] = None
    function_call: Optional[Any] = None
    audio: Optional[Any] = None
    modalities: Optional[Any] = None
    prediction: Optional[Any] = None
    service_tier: Optional[Any] = None
    store: Optional[Any] = None
    metadata: Optional[Any] = None
    reasoning_effort: Optional[Any] = None
    web_search_options: Optional[Any] = None


# -- the Responses API (POST /v1/responses) ----------------------------------------------------------------
UNSUPPORTED_RESPONSE_FIELDS = ("previous_response_id", "conversation", "reasoning", "include", "background",
                               "prompt", "truncation", "service_tier", "top_logprobs", "max_tool_calls")


class InputText(BaseModel):
    """A text part of an input message (``input_text``; ``output_text`` when a client sends back an earlier
    response's output, whose ``annotations`` and ``logprobs`` are ignored)."""
    model_config = ConfigDict(extra="ignore")

    type: Literal["input_text", "output_text"]
    text: str = Field(max_length=MAX_PROMPT_CHARS)


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # an earlier response's items carry id and status

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: one_of("a text or a list of text parts", string=str, list=list[one_of(
        TEXT_ONLY, _part_kind, input_text=InputText, output_text=InputText)])

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class InputFunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    call_id: str = Field(max_length=256)
    name: str = Field(max_length=64)
    arguments: str = Field(max_length=MAX_PROMPT_CHARS)


class InputFunctionCallOutput(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    call_id: str = Field(max_length=256)
    output: str = Field(max_length=MAX_PROMPT_CHARS)


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME)
    description: Optional[str] = Field(None, max_length=MAX_SCHEMA_CHARS)
    parameters: Optional[JsonSchema] = None
    strict: Optional[bool] = Field(None, description="accepted; the arguments always follow the schema")


class FunctionToolChoice(_Strict):
    type: Literal["function"]
    name: str = Field(max_length=64)


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = Field(None, pattern=TOOL_NAME)
    description: Optional[str] = Field(None, max_length=MAX_SCHEMA_CHARS)
    schema_: Optional[JsonSchema] = Field(None, alias="schema")
    strict: Optional[bool] = None


class TextConfig(_Strict):
    format: Optional[TextFormat] = None


class ResponsesRequest(_Strict):
    """OpenAI-compatible ``POST /v1/responses``: text and function calls, no stored state (each request carries
    its whole conversation in ``input``)."""

    model: Optional[str] = Field(None, description="the served model's id (GET /v1/models); optional")
    input: one_of("a text or a list of items", string=str, list=list[one_of(
        "an item of type message, function_call or function_call_output", _item_kind, message=InputMessage,
        function_call=InputFunctionCall, function_call_output=InputFunctionCallOutput)]) = Field(
        description="a user message, or the conversation's items: messages, function calls and their outputs")
    instructions: Optional[str] = Field(None, max_length=MAX_PROMPT_CHARS, description="a system message first")
    max_output_tokens: Optional[int] = Field(None, ge=1, description="null = up to the session length")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy decoding")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = Field(False, description="stream the response's events as server-sent events")
    tools: Optional[list[FunctionTool]] = Field(None, max_length=MAX_TOOLS)
    tool_choice: Optional[one_of("none, auto, required or a function", string=Literal["none", "auto", "required"],
                                 object=FunctionToolChoice)] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextConfig] = Field(None, description="text.format: text, json_object or json_schema")
    user: Optional[str] = Field(None, max_length=256, description="client id when the orchestrator has no API keys")
    store: Optional[bool] = Field(None, description="accepted; nothing is stored")
    metadata: Optional[dict[str, str]] = Field(None, description="echoed back")
    previous_response_id: Optional[Any] = None
    conversation: Optional[Any] = None
    reasoning: Optional[Any] = None
    include: Optional[Any] = None
    background: Optional[Any] = None
    prompt: Optional[Any] = None
    truncation: Optional[Any] = None
    service_tier: Optional[Any] = None
    top_logprobs: Optional[Any] = None
    max_tool_calls: Optional[Any] = None


CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"]
    logprobs: Optional[dict] = None


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
    request_id: str = Field("", description="the swarm's id of the request: GET /v1/swarm/requests/{request_id}")
    verified: Optional[Literal["true", "false", "pending"]] = Field(
        None, description="spot checks: 'pending' until every server that served it has passed a check of it or "
        "of a later session ('true'); 'false' if one was caught on it or banned before passing another check")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    chainswarm: Optional[SwarmTiming] = Field(None, description="how the swarm served it (absent only for an echo of "
                                              "max_tokens 0 without logprobs: nothing ran)")


class LeaseRequest(_Strict):
    input_tokens: int = Field(ge=1, description="prompt tokens the session will send")
    max_new_tokens: int = Field(ge=1)
    timeout_s: Optional[float] = Field(None, gt=0, description="give up waiting for a chain after this long")
    client_id: Optional[str] = Field(None, max_length=256, description="client id when no API keys are configured")


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
    ttl_s: float = Field(description="renew the lease (POST /v1/leases/{id}/renew) more often than this while the "
                         "session runs; an unrenewed lease expires and its slot goes to the next request")
    ticket: Optional[str] = Field(None, description="the orchestrator's signed session ticket (base64): send it in "
                                  "every server request of the session (swarm.trust.tickets)")


class RenewResponse(BaseModel):
    lease_id: str
    expires_in_s: float


class RerouteRequest(_Strict):
    start: int = Field(ge=0)
    end: int = Field(ge=1)
    failed_peers: list[Annotated[str, Field(max_length=128)]] = Field(
        default_factory=list, max_length=16, description="peers of this lease's route that failed (at most 16)")


class RerouteResponse(BaseModel):
    route: list[RouteSpanModel]
    ticket: Optional[str] = Field(None, description="a fresh session ticket covering the route after the reroute")


class ErrorResponse(BaseModel):
    error: dict
