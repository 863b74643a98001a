"""The tool-call formats beside Hermes (inference/tool_calls.py, tool_stream.py): Llama 3.x and Mistral
Nemo, chosen from the real chat templates as llama.cpp's common/chat.cpp chooses them, on tiny models
that carry those templates (and their markers as control tokens): the template renders the tools and
the tools' results, a reply in each format parses into its calls, a call written back renders the
text the model wrote, a required call always parses, and the server streams calls as OpenAI does."""

from __future__ import annotations

import json

import jsonschema
import pytest
from test_constrain import WEATHER  # its city one of two: a tiny model's string would go on

from conftest import FIXTURES
from llama_chat.inference import SamplingParams, chat_prompt_ids, generate, load_model
from llama_chat.inference.chat_template import ChatTemplate
from llama_chat.inference.constrain import Constraint, check_grammar, lark_grammar
from llama_chat.inference.tool_calls import (
    HERMES,
    LLAMA_3_X,
    MISTRAL_NEMO,
    ToolCall,
    call_ids,
    split_offered_calls,
    tool_format,
)
from llama_chat.inference.tool_stream import CallSplitter
from served import Served
from tiny_models import write_tiny_model

TEMPLATES = FIXTURES / "chat-templates"
LLAMA_TEMPLATE = "meta-llama-Llama-3.1-8B-Instruct.jinja"
NEMO_TEMPLATE = "mistralai-Mistral-Nemo-Instruct-2407.jinja"
# Each template's markers, control tokens as in the real vocabularies; the last one ends a reply.
LLAMA_SPECIALS = ("<|start_header_id|>", "<|end_header_id|>", "<|python_tag|>", "<|eom_id|>", "<|eot_id|>")
NEMO_SPECIALS = ("[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]")
NEMO_SPECIALS += ("[/TOOL_RESULTS]", "[TOOL_CALLS]", "</s>")
MODELS = {"llama3": (LLAMA_TEMPLATE, LLAMA_SPECIALS), "nemo": (NEMO_TEMPLATE, NEMO_SPECIALS)}
FORMATS = {"llama3": LLAMA_3_X, "nemo": MISTRAL_NEMO}

TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def tool_models(tmp_path_factory) -> dict:
    """A tiny llama-architecture model per template (Mistral Nemo's architecture is llama too)."""
    folder = tmp_path_factory.mktemp("tool-models")
    paths = {}
    for name, (template, specials) in MODELS.items():
        source = (TEMPLATES / template).read_text()
        paths[name] = write_tiny_model(
            folder / f"tiny-{name}.gguf",
            "llama",
            chat_template=source,
            specials=specials,
            context_length=2048,
        )
    return paths


def _call(name: str, arguments: dict, call_id: str = "a1B2c3D4e") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _answered(call: dict) -> list[dict]:
    """The question, the model's call and the tool's result."""
    asked = [*ASK, {"role": "assistant", "content": "", "tool_calls": [call]}]
    return [*asked, {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 21}'}]


def _render(model, messages, tools=(WEATHER,), add_generation_prompt=True) -> str:
    return model.tokenizer.decode(chat_prompt_ids(model, messages, add_generation_prompt, list(tools)))


# -- the format, from the template ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "template, fmt",
    [
        ("Qwen-Qwen2.5-7B-Instruct.jinja", HERMES),
        ("Qwen-Qwen3-0.6B.jinja", HERMES),
        # <tool_call> comes first, as in chat.cpp
        ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", HERMES),
        ("meta-llama-Llama-3.1-8B-Instruct.jinja", LLAMA_3_X),
        ("meta-llama-Llama-3.2-3B-Instruct.jinja", LLAMA_3_X),
        ("meta-llama-Llama-3.3-70B-Instruct.jinja", LLAMA_3_X),
        ("mistralai-Mistral-Nemo-Instruct-2407.jinja", MISTRAL_NEMO),
        ("google-gemma-2-2b-it.jinja", None),  # renders no tools
    ],
)
def test_the_format_is_the_one_the_template_asks_for(template, fmt):
    assert tool_format(ChatTemplate((TEMPLATES / template).read_text())) is fmt


# -- the template renders the tools and their results --------------------------------------------------


def test_llama3_renders_the_tools_in_the_system_message_and_results_as_ipython(tool_models):
    model = load_model(tool_models["llama3"])
    text = _render(model, _answered(_call("get_weather", {"city": "Paris"})))
    system = text.split("<|eot_id|>")[0]
    assert "Environment: ipython" in system and '"name": "get_weather"' in system  # as llama.cpp renders it
    assert "respond with JSON for a function call" in system and '"enum": [' in system
    assert (
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": '
        '"Paris"}}<|eot_id|>'
        in text
    )
    # (a string is iterable to Jinja: the template writes the result as a JSON string, as transformers does)
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"{\\"temperature\\": 21}"<|eot_id|>' in text
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_nemo_renders_the_tools_before_the_last_question_and_results_with_their_call_id(tool_models):
    model = load_model(tool_models["nemo"])
    text = _render(model, _answered(_call("get_weather", {"city": "Paris"})))
    tools = '[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "get_weather"'
    assert tools in text and text.index(tools) < text.index("[INST]What is the weather")
    assert (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1B2c3D4e"}]</s>' in text
    )
    assert text.endswith(
        '[TOOL_RESULTS]{"content": {"temperature": 21}, "call_id": "a1B2c3D4e"}[/TOOL_RESULTS]'
    )


# -- a reply parsed into its calls ---------------------------------------------------------------------


def test_llama3_replies_parse_into_their_call():
    call = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert LLAMA_3_X.split(call) == ("", [ToolCall("get_weather", {"city": "Paris"})])
    assert LLAMA_3_X.split(" <|python_tag|>" + call) == ("", [ToolCall("get_weather", {"city": "Paris"})])
    assert LLAMA_3_X.split('{"type": "function", "name": "f", "parameters": "{\\"a\\": 1}"}') == (
        "",
        [ToolCall("f", {"a": 1})],  # the type llama.cpp allows, and arguments written as a JSON string
    )
    # called only at the start of a reply, as llama.cpp reads it: JSON after some text is text
    assert LLAMA_3_X.split("Let me look. " + call) is None
    assert LLAMA_3_X.split(call + "\n" + call) is None  # its template renders one call per reply


def test_nemo_replies_parse_into_their_calls_and_ids():
    text = (
        'Let me look.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, '
        '"id": "a1B2c3D4e"}, '
        '{"name": "get_time", "arguments": "{}", "id": "Z9y8X7w6v"}]'
    )
    assert MISTRAL_NEMO.split(text) == (
        "Let me look.",
        [ToolCall("get_weather", {"city": "Paris"}, "a1B2c3D4e"), ToolCall("get_time", {}, "Z9y8X7w6v")],
    )
    assert MISTRAL_NEMO.split('[TOOL_CALLS] [ {"name": "f", "arguments": {}} ]') == ("", [ToolCall("f", {})])


@pytest.mark.parametrize(
    "fmt, text",
    [
        (LLAMA_3_X, "no call here"),
        (LLAMA_3_X, '{"name": "f", "parameters": {"a": 1}'),  # cut short
        (LLAMA_3_X, '{"name": 5, "parameters": {}}'),
        (LLAMA_3_X, '{"city": "Paris"}'),  # JSON, not a call
        (MISTRAL_NEMO, "no call here"),
        (MISTRAL_NEMO, "[TOOL_CALLS][not json]"),
        (MISTRAL_NEMO, '[TOOL_CALLS][{"name": "f", "arguments": {}}'),  # cut short
        (MISTRAL_NEMO, '[TOOL_CALLS][{"arguments": {}}]'),  # no name
        (MISTRAL_NEMO, '[TOOL_CALLS][{"name": "f", "arguments": 5}]'),
        (MISTRAL_NEMO, '[TOOL_CALLS][{"name": "f", "arguments": {}}] and more'),
    ],
)
def test_text_that_is_not_a_call_stays_content(fmt, text):
    assert fmt.split(text) is None
    splitter = CallSplitter(fmt)
    deltas = [d for i in range(0, len(text), 3) for d in splitter.feed(text[i : i + 3])] + splitter.finish()
    assert all(d.index < 0 for d in deltas) and "".join(d.content for d in deltas) == text


def test_llama3_content_streams_unless_the_reply_begins_with_a_call():
    splitter = CallSplitter(LLAMA_3_X)
    pieces = ["Hi", ' {"name": "f", "parameters": {}}']
    assert [d.content for p in pieces for d in splitter.feed(p)] == ["Hi", pieces[1]]
    splitter = CallSplitter(LLAMA_3_X)
    assert [splitter.feed(p) for p in [" ", '{"na', 'me": "f", "parameters": {}}']] == [[], [], []]
    assert [(d.index, d.name, d.arguments) for d in splitter.finish()] == [(0, "f", ""), (0, None, "{}")]


def test_nemo_content_streams_up_to_the_calls_which_go_out_whole_once_they_parse():
    text = 'Let me look.[TOOL_CALLS][{"name": "f", "arguments": {"a": [1]}, "id": "a1B2c3D4e"}]'
    splitter = CallSplitter(MISTRAL_NEMO)
    out = [d for i in range(0, len(text), 4) for d in splitter.feed(text[i : i + 4])]
    assert "".join(d.content for d in out) == "Let me look." and all(d.index < 0 for d in out)
    assert [(d.index, d.name, d.id, d.arguments) for d in splitter.finish()] == [
        (0, "f", "a1B2c3D4e", ""),
        (0, None, None, '{"a": [1]}'),
    ]


# -- calls written as JSON of an offered tool: one reading, whole and streamed --------------------------

PARIS = ToolCall("get_weather", {"city": "Paris", "unit": "celsius"})
# What the default model wrote with get_weather offered and tool_choice "auto" (greedy and sampled).
LOOSE_REPLIES = [
    '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris",\n    "unit": "celsius"\n  '
    '}\n}\n```',
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    '<tools>\n{"type": "function", "function": {"name": "get_weather", "description": "The weather.", '
    '"parameters": {"type": "object"}}}\n</tools>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"unit": "celsius"}}',
    'Let me look.\n```json\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n```',
]


def _streamed(splitter: CallSplitter, text: str, size: int) -> tuple[str, list[ToolCall]]:
    deltas = [
        d for i in range(0, len(text), size) for d in splitter.feed(text[i : i + size])
    ] + splitter.finish()
    calls = [ToolCall(d.name, json.loads(deltas[k + 1].arguments)) for k, d in enumerate(deltas) if d.name]
    return "".join(d.content for d in deltas), calls


@pytest.mark.parametrize("fmt", [HERMES, LLAMA_3_X])
@pytest.mark.parametrize("text", LOOSE_REPLIES)
def test_json_calls_of_offered_tools_read_the_same_whole_and_streamed(fmt, text):
    content, calls = split_offered_calls(text, {"get_weather"}, fmt)
    assert calls == [PARIS] and "get_weather" not in content.replace("The weather", "").split("</tools>")[-1]
    for size in (1, 3, 7):
        streamed_content, streamed_calls = _streamed(CallSplitter(fmt, offered={"get_weather"}), text, size)
        assert streamed_calls == [PARIS] and streamed_content.strip() == content


@pytest.mark.parametrize(
    "text",
    [
        *LOOSE_REPLIES[:2],  # the tool is not offered: JSON someone may have asked for
        # a definition
        '```json\n{"name": "get_weather", "description": "The weather.", "parameters": {}}\n```',
        '```python\nprint({"name": "x"})\n```',
        '{"name": "get_weather", "arguments": {"city": "Par',  # cut short
        # a call repeated with the tool's answer made up after it: calls end a reply, in every format
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n{"temperature": 21, "sky": "sunny"}',
    ],
)
def test_json_that_is_no_offered_call_stays_content_whole_and_streamed(text):
    offered = {"get_time"} if text in LOOSE_REPLIES else {"get_weather"}
    assert split_offered_calls(text, offered) is None
    assert _streamed(CallSplitter(offered=offered), text, 2) == (text, [])


def test_content_streams_up_to_json_that_may_be_a_call_and_on_once_it_is_none():
    splitter = CallSplitter(offered={"get_weather"})
    assert [d.content for d in splitter.feed("Here:\n```json\n{")] == ["Here:\n"]
    assert splitter.feed('"name": "Ada"}') == []  # a fence not closed yet may still hold a call
    assert [d.content for d in splitter.feed("\n```\nDone.")] == ['```json\n{"name": "Ada"}\n```\nDone.']
    code = CallSplitter(offered={"get_weather"})
    assert [d.content for d in code.feed("```python\nx = 1\n")] == ["```python\nx = 1\n"]


# -- the round trip: a call written back is the text the model wrote ---------------------------------


@pytest.mark.parametrize("name", ["llama3", "nemo"])
def test_a_call_written_back_renders_the_reply_the_model_wrote(tool_models, name):
    """What the KV of a continued conversation rests on: the prompt, then the reply as the model wrote
    it (constrained, so in the format's exact form), is how the template renders the returned call."""
    model, fmt = load_model(tool_models[name]), FORMATS[name]
    (call_id,) = call_ids(fmt, several=False) or ["unused"]
    grammar = check_grammar(
        model.tokenizer, lark_grammar(fmt.grammar([WEATHER], ids=[call_id], tokenizer=model.tokenizer))
    )
    prompt = chat_prompt_ids(model, ASK, tools=[WEATHER])
    reply = "".join(
        generate(model, prompt, sampling=SamplingParams(temperature=0, grammar=grammar), max_tokens=200)
    )
    content, (call,) = fmt.split(reply)
    returned = {
        "role": "assistant",
        "content": content,
        "tool_calls": [_call(call.name, call.arguments, call_id)],
    }
    assert fmt.call_text(returned["tool_calls"]) == reply
    after = chat_prompt_ids(model, [*ASK, returned], add_generation_prompt=False, tools=[WEATHER])
    assert after[: len(prompt)] == prompt
    assert model.tokenizer.decode(after[len(prompt) :]).startswith(reply)
    assert fmt.as_message(reply)["tool_calls"][0]["function"] == {
        "name": call.name,
        "arguments": call.arguments,
    }


# -- a required call, constrained by the format's grammar ----------------------------------------------


@pytest.mark.parametrize("name", ["llama3", "nemo"])
@pytest.mark.parametrize("temperature", [0, 5.0])  # greedy, and draws from a nearly flat distribution
@pytest.mark.parametrize("several", [False, True])
def test_a_required_call_always_parses_into_calls_of_the_tools(tool_models, name, temperature, several):
    model, fmt = load_model(tool_models[name]), FORMATS[name]
    ids = call_ids(fmt, several)
    lark = fmt.grammar([WEATHER, TIME], several=several, ids=ids, tokenizer=model.tokenizer)
    sampling = SamplingParams(
        temperature=temperature, seed=4, grammar=check_grammar(model.tokenizer, lark_grammar(lark))
    )
    prompt = chat_prompt_ids(model, ASK, tools=[WEATHER, TIME])
    reply = "".join(generate(model, prompt, sampling=sampling, max_tokens=400))
    content, calls = fmt.split(reply)
    assert content == "" and calls and (len(calls) == 1 or several and fmt is MISTRAL_NEMO)
    for i, call in enumerate(calls):
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.name]
        jsonschema.validate(call.arguments, tool["function"]["parameters"])
        assert call.id == (ids[i] if ids else None)


def test_nemo_calls_without_ids_chosen_get_ids_its_template_takes(tool_models):
    model = load_model(tool_models["nemo"])
    lark = MISTRAL_NEMO.grammar([WEATHER, TIME], several=True, tokenizer=model.tokenizer)
    sampling = SamplingParams(
        temperature=5.0, seed=2, grammar=check_grammar(model.tokenizer, lark_grammar(lark))
    )
    reply = "".join(
        generate(model, chat_prompt_ids(model, ASK, tools=[WEATHER, TIME]), sampling=sampling, max_tokens=400)
    )
    _, calls = MISTRAL_NEMO.split(reply)
    assert calls and all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    assert MISTRAL_NEMO.as_message(reply)["tool_calls"][0]["id"] == calls[0].id


def test_nemo_calls_open_with_the_control_token_the_template_renders(tool_models):
    tok = load_model(tool_models["nemo"]).tokenizer
    lark = MISTRAL_NEMO.grammar([WEATHER], ids=["a1B2c3D4e"], tokenizer=tok)
    (control,) = tok.encode("[TOOL_CALLS]", special=True)
    spelled = Constraint(tok, check_grammar(tok, lark_grammar(lark)))
    assert not spelled.accept(tok.encode("[")[0])  # the model is trained on the token, not its letters
    constraint = Constraint(tok, check_grammar(tok, lark_grammar(lark)))
    assert constraint.accept(control)


def test_named_and_constrained_calls_stream_their_arguments_as_they_come():
    args = '{"city": "Paris", "days": [1, 2], "where": {"x": "}]\\""}}'
    text = (
        f'[TOOL_CALLS][{{"name": "f", "arguments": {args}, "id": "a1B2c3D4e"}}, '
        '{"name": "g", "arguments": {}, "id": "Z9y8X7w6v"}]'
    )
    for step in (1, 2, 7, 1000):
        splitter = CallSplitter(MISTRAL_NEMO, constrained=True, ids=["a1B2c3D4e", "Z9y8X7w6v"])
        deltas = [d for i in range(0, len(text), step) for d in splitter.feed(text[i : i + step])]
        deltas += splitter.finish()
        assert [(d.index, d.name, d.id) for d in deltas if d.name] == [
            (0, "f", "a1B2c3D4e"),
            (1, "g", "Z9y8X7w6v"),
        ]
        pieces = [d.arguments for d in deltas if d.index == 0 and d.name is None and d.arguments]
        assert "".join(pieces) == args and (step > 7 or len(pieces) > 1)
        assert "".join(d.arguments for d in deltas if d.index == 1) == "{}"
        assert not "".join(d.content for d in deltas)


# -- the server, with the real openai client -----------------------------------------------------------


@pytest.fixture(scope="module", params=["llama3", "nemo"])
def tool_served(request, tool_models, tmp_path_factory):
    s = Served(tmp_path_factory.mktemp("served") / "chat.db", tool_models[request.param]).wait_ready()
    s.name, s.format = tool_models[request.param].stem, FORMATS[request.param]
    yield s
    s.stop()


def _create(s: Served, messages, **kwargs):
    kwargs = {"tools": [WEATHER, TIME], "temperature": 0, "max_tokens": 300, **kwargs}
    return s.client.chat.completions.create(model=s.name, messages=messages, **kwargs)


def _returned(call) -> dict:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": call.function.arguments},
    }


def test_a_required_call_comes_back_as_openai_tool_calls_and_its_answer_reuses_the_kv(tool_served):
    s = tool_served
    reply = _create(s, ASK, tool_choice="required")
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name in ("get_weather", "get_time")
    assert isinstance(json.loads(call.function.arguments), dict)
    if s.format.with_id:  # the id the model wrote, which its template checks
        assert len(call.id) == 9 and call.id.isalnum()
    answer = _create(s, _answered(_returned(call)), max_tokens=5)
    # the call written back is the reply the model wrote: its KV is reused, up to the last full block
    assert answer.usage.prompt_tokens_details.cached_tokens >= reply.usage.total_tokens - 8


def test_a_named_call_streams_as_openai_streams_it(tool_served):
    s = tool_served
    choice = {"type": "function", "function": {"name": "get_weather"}}
    stream = _create(s, ASK, tool_choice=choice, stream=True, temperature=1.0, seed=3)
    calls, finish, pieces = {}, None, 0
    for chunk in stream:  # as a client accumulates OpenAI's deltas
        delta = chunk.choices[0].delta if chunk.choices else None
        for part in (delta.tool_calls or []) if delta else []:
            if part.id:  # a call's first delta: its id and its name
                assert part.index not in calls and part.function.name
                calls[part.index] = {"id": part.id, "name": part.function.name, "arguments": ""}
            calls[part.index]["arguments"] += part.function.arguments or ""
            pieces += bool(part.function.arguments)
        finish = (
            chunk.choices[0].finish_reason if chunk.choices and chunk.choices[0].finish_reason else finish
        )
    assert finish == "tool_calls" and list(calls) == [0] and calls[0]["name"] == "get_weather"
    assert pieces > 1  # the arguments stream as the model writes them
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])
    if s.format.with_id:
        assert len(calls[0]["id"]) == 9 and calls[0]["id"].isalnum()


@pytest.mark.parametrize("name", ["llama3", "nemo"])
def test_a_call_answered_after_a_restart_reuses_the_stored_kv(tool_models, tmp_path, name):
    """The reply that made the call is kept as the client will send it back (its calls as tool_calls,
    Mistral's opening as its control token): a server started again on the same database answers the
    call's result from the stored KV (all but the tokens after the last full block)."""
    first = Served(tmp_path / "chat.db", tool_models[name]).wait_ready()
    first.name = tool_models[name].stem
    try:
        reply = _create(first, ASK, tool_choice="required")
    finally:
        first.stop()
    (call,) = reply.choices[0].message.tool_calls
    again = Served(tmp_path / "chat.db", tool_models[name]).wait_ready()
    again.name = first.name
    try:
        answer = _create(again, _answered(_returned(call)), max_tokens=5)
    finally:
        again.stop()
    cached = answer.usage.prompt_tokens_details.cached_tokens
    assert cached >= reply.usage.total_tokens - 8, (cached, reply.usage.total_tokens)


# -- MCP tools in `chat` ---------------------------------------------------------------------------------


def test_chat_offers_mcp_tools_to_llama3_but_not_to_nemo_which_needs_call_ids(
    monkeypatch, tmp_path, tool_models, capsys
):
    from test_mcp_tools import chat

    assert chat(monkeypatch, tmp_path, tool_models["llama3"], "well", 120.0, "") == 0
    assert "MCP server 'test': 2 tool(s): get_weather, add" in capsys.readouterr().err
    assert chat(monkeypatch, tmp_path, tool_models["nemo"], "well", 120.0, "") == 0
    err = capsys.readouterr().err
    assert (
        "(Mistral Nemo) needs call ids the chat does not keep: the MCP servers of config.toml are not started"
        in err
    )
    assert "MCP server 'test'" not in err
