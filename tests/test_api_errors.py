"""The 400 messages of requests the API's schemas refuse (`swarm.api.errors.validation_message`, what the app answers
with): one sentence per error, naming the field as the request spells it (`messages[0].content[1]`), and for a
field of several forms (a prompt's text, texts, token ids or token id lists; text or parts; a schema or a boolean)
only the errors of the form the value has, or, for a value of no form, what the forms are: pydantic alone gives one
error per form ("prompt.constrained-str: …; prompt.list[constrained-str]: …; …") whatever was sent."""
import pytest
from pydantic import ValidationError

from swarm.api.errors import field_path, validation_message
from swarm.api.schemas import ChatCompletionRequest, CompletionRequest, ResponsesRequest

HI = [{"role": "user", "content": "hi"}]
PROMPT_FORMS = "a text, a list of texts, a list of token ids or a list of token id lists, none of them empty"


def message(schema, body: dict) -> str:
    with pytest.raises(ValidationError) as refused:
        schema.model_validate(body)
    # FastAPI's errors carry the body's place first
    return validation_message([{**e, "loc": ("body", *e["loc"])} for e in refused.value.errors()],
                              "application/json")


@pytest.mark.parametrize("body, expected", [
    ({"prompt": ""}, "prompt: String should have at least 1 character"),
    ({"prompt": []}, f"prompt: Input should be {PROMPT_FORMS}"),
    ({"prompt": 5}, f"prompt: Input should be {PROMPT_FORMS}"),
    ({"prompt": [[]]}, "prompt[0]: List should have at least 1 item after validation, not 0"),
    ({"prompt": [7, -1]}, "prompt[1]: Input should be greater than or equal to 0"),
    ({"prompt": [1, "a"]}, "prompt[1]: Input should be a valid integer, unable to parse string as an integer"),
    ({"prompt": [[1], [2, "x"]]}, "prompt[1][1]: Input should be a valid integer, unable to parse string as an integer"),
    ({"prompt": ["hi"] * 65}, "prompt: List should have at most 64 items after validation, not 65"),
    ({"prompt": "hi", "stop": 5}, "stop: Input should be a string or a list of strings"),
    # a seed past 64 bits failed the session on the swarm three times (a 503), a negative logit_bias key biased a
    # token counted from the vocabulary's end
    ({"prompt": "hi", "seed": 2**64}, "seed: Input should be less than 9223372036854775808"),
    ({"prompt": "hi", "seed": -(2**63) - 1}, "seed: Input should be greater than or equal to -9223372036854775808"),
    ({"prompt": "hi", "logit_bias": {"-1": 5}},
     "logit_bias: Value error, logit_bias maps token ids (as strings of digits) to biases in [-100, 100]"),
])
def test_a_prompt_of_the_wrong_form_gets_the_errors_of_its_own_form(body, expected):
    assert message(CompletionRequest, body) == expected


@pytest.mark.parametrize("body", [{"prompt": "hi"}, {"prompt": ["a", "b"]}, {"prompt": [1, 2]},
                                  {"prompt": [[1], [2, 3]]}, {"prompt": "hi", "stop": "."},
                                  {"prompt": "hi", "stop": [".", "!"]}])
def test_every_form_of_prompt_and_stop_is_accepted_as_sent(body):
    request = CompletionRequest.model_validate(body)
    stop = body.get("stop")
    assert request.prompt == body["prompt"] and request.stop == ([stop] if isinstance(stop, str) else stop)


@pytest.mark.parametrize("extra, expected", [
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]},
     "messages[0].content[0]: Input should be a text part: the served model reads text only"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content: Input should be a text or a list of text parts"),
    ({"tool_choice": "always"}, "tool_choice: Input should be 'none', 'auto' or 'required'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters: Input should be a JSON schema: an object or a boolean"),
])
def test_chat_fields_of_several_forms_say_what_they_take(extra, expected):
    assert message(ChatCompletionRequest, {"messages": HI, **extra}) == expected


def test_responses_items_are_checked_by_their_type():
    assert message(ResponsesRequest, {"input": [{"type": "reasoning"}]}) == \
        "input[0]: Input should be an item of type message, function_call or function_call_output"
    assert message(ResponsesRequest, {"input": [*HI, {"type": "function_call", "call_id": "c"}]}) == \
        "input[1].name: Field required; input[1].arguments: Field required"
    assert message(ResponsesRequest, {"input": 4}) == "input: Input should be a text or a list of items"
    # a "type" that is no string (any JSON value may come) is no known type either, not a server error
    assert message(ResponsesRequest, {"input": [{"type": ["message"]}]}) == \
        "input[0]: Input should be an item of type message, function_call or function_call_output"
    assert message(ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": {"text": 1}}]}]}) == \
        "messages[0].content[0]: Input should be a text part: the served model reads text only"
    parsed = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "sunny"}]})
    assert [type(item).__name__ for item in parsed.input] == ["InputMessage", "InputFunctionCall",
                                                               "InputFunctionCallOutput"]


def test_field_paths_read_as_the_request_spells_them():
    assert field_path(("body", "messages", 0, "content", 1, "type")) == "messages[0].content[1].type"
    assert field_path(("body", "prompt", "~token id lists", 2, 0)) == "prompt[2][0]"
    assert field_path(("body",)) == ""


def test_every_error_is_openais_error_object():
    """``{"error": {"message", "type", "param", "code"}}``: OpenAI's class of the status as ``type``, which error it is
    as ``code`` (what applications branch on), the field at fault as ``param``."""
    from swarm.api.errors import error_body, validation_error

    assert error_body(429, "rate_limited", "wait") == {
        "error": {"message": "wait", "type": "rate_limit_error", "param": None, "code": "rate_limited"}}
    assert {status: error_body(status, "x", "")["error"]["type"] for status in (400, 401, 403, 404, 413, 422, 503)} == {
        400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
        404: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error", 503: "server_error"}
    refused = validation_error([{"loc": ("body", "messages", 0, "content"), "msg": "Field required",
                                 "type": "missing"}], "application/json")
    assert (refused.status, refused.code, refused.param) == (400, "invalid_request", "messages[0].content")
    not_json = validation_error([{"loc": ("body", 7), "type": "json_invalid", "ctx": {"error": "Expecting value"}}],
                                "application/json")
    assert not_json.param is None and not_json.body()["error"]["message"].startswith("the request body is not valid")
