"""The 422 messages of requests the API's schemas refuse (`swarm.api.errors.validation_message`, what the app answers
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
