"""Requests the server refuses with a 400 in OpenAI's error shape, where they once failed with a 500 or
answered with a reply that could not parse: JSON nested past a fixed depth anywhere in a request, and a
JSON schema whose `$ref`s loop for ever."""

from __future__ import annotations

import json

import pytest

from llama_chat.app.serve.transport import MAX_JSON_DEPTH

ASK = [{"role": "user", "content": "hi"}]


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def error_of(served, body: dict | bytes) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, _, answer = served.raw("POST", "/v1/chat/completions", data)
    error = json.loads(answer)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return status, error


def with_arguments(arguments: str) -> dict:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    asked = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]}]
    return {
        "model": "tiny-qwen2",
        "max_tokens": 2,
        "messages": [*asked, {"role": "tool", "tool_call_id": "c", "content": "x"}],
    }


@pytest.mark.parametrize("depth", [50_000, MAX_JSON_DEPTH + 1])
def test_tool_call_arguments_nested_too_deep_are_400(served, depth):
    status, error = error_of(served, with_arguments(nested(depth)))
    assert status == 400 and error["param"] == "messages[1].tool_calls"
    assert "arguments" in error["message"]


@pytest.mark.parametrize("depth", [50_000, MAX_JSON_DEPTH + 1])
def test_a_body_nested_too_deep_is_400(served, depth):
    body = json.dumps({"model": "tiny-qwen2", "messages": ASK})[:-1] + f', "metadata": {nested(depth)}}}'
    status, error = error_of(served, body.encode())
    assert status == 400 and error["message"].startswith("The body ")


def test_a_body_within_the_depth_is_read(served):
    status, error = error_of(served, with_arguments(nested(MAX_JSON_DEPTH - 8)))
    assert status == 400 and "arguments" not in error["message"]  # refused for another reason: no tools here


@pytest.mark.parametrize(
    "schema",
    [{"$ref": "#"}, {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}],
)
def test_a_response_format_whose_refs_loop_is_400(served, schema):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    status, error = error_of(served, {"model": "tiny-qwen2", "messages": ASK, "response_format": fmt})
    assert status == 400 and error["param"] == "response_format" and "loop" in error["message"]
