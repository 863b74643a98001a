"""Constrained decoding (inference/constrain.py) and the Hermes tool-call format (inference/tool_calls.py)
on the tiny models: whatever random weights prefer, a reply follows its grammar."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llama_chat.inference import SamplingParams, generate, load_model
from llama_chat.inference.constrain import (
    Constraint,
    GrammarError,
    check_grammar,
    json_schema_grammar,
    lark_grammar,
)
from llama_chat.inference.tool_calls import HERMES, ToolCall
from llama_chat.inference.tool_stream import CallSplitter, Delta

CHOICE = {
    "type": "object",
    "properties": {"w": {"enum": ["hello", "world"]}},
    "required": ["w"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # byte-level BPE, SPM with byte tokens
@pytest.mark.parametrize("temperature", [0, 5.0])  # greedy, and draws from a nearly flat distribution
def test_a_reply_under_a_schema_is_json_valid_under_it(tiny_model_paths, arch, temperature):
    model = load_model(tiny_model_paths[arch])
    grammar = check_grammar(model.tokenizer, json_schema_grammar(CHOICE))
    sampling = SamplingParams(temperature=temperature, seed=3, grammar=grammar)
    text = "".join(generate(model, model.tokenizer.encode("x y z"), sampling=sampling, max_tokens=300))
    assert json.loads(text)["w"] in ("hello", "world")


def test_unconstrained_the_tiny_model_writes_no_json(tiny_model_paths):
    """What the test above proves: without the mask the same reply is not JSON."""
    model = load_model(tiny_model_paths["qwen2"])
    text = "".join(
        generate(
            model, model.tokenizer.encode("x y z"), sampling=SamplingParams(temperature=0), max_tokens=20
        )
    )
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_the_mask_allows_only_what_the_grammar_allows_next(tiny_model_paths):
    tok = load_model(tiny_model_paths["qwen2"]).tokenizer
    constraint = Constraint(tok, check_grammar(tok, lark_grammar('start: "ab" | "ac"')))
    logits = np.zeros(tok.n_vocab + 5, dtype=np.float32)  # some output layers have rows past the vocabulary
    allowed = {tok.decode([i]) for i in np.flatnonzero(np.isfinite(constraint.mask(logits)))}
    assert allowed == {"a"} or allowed <= {"a", "ab", "ac"} and "a" in allowed
    assert constraint.accept(tok.encode("a")[0])
    allowed = {tok.decode([i]) for i in np.flatnonzero(np.isfinite(constraint.mask(logits)))}
    assert allowed == {"b", "c"}
    assert not constraint.accept(tok.encode("z")[0])


@pytest.mark.parametrize(
    "schema, problem",
    [
        ('{"type": "nonsense"}', "nonsense"),
        ("[1, 2]", "must be an object"),
        ("{not json", "not JSON"),
        ('{"properties": 5}', "properties"),
        ('{"$ref": "#/missing"}', "missing"),
    ],
)
def test_a_schema_that_is_not_a_schema_is_one_line_naming_the_problem(tiny_model_paths, schema, problem):
    tok = load_model(tiny_model_paths["qwen2"]).tokenizer
    with pytest.raises(GrammarError) as e:
        check_grammar(tok, json_schema_grammar(schema))
    assert problem in str(e.value) and "\n" not in str(e.value)


LIST = {"type": "object", "properties": {"w": {"enum": ["a", "b"]}, "next": {"$ref": "#"}}, "required": ["w"]}


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#"},
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        {**LIST, "required": ["w", "next"]},  # each object must hold another
        {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
        {"anyOf": [{"$ref": "#"}, {"allOf": [{"$ref": "#"}]}]},
    ],
)
def test_a_schema_whose_refs_loop_for_ever_is_refused(schema):
    """llguidance lets such a reply end at once, empty, or never close: no reply could parse."""
    with pytest.raises(GrammarError, match="loop: no JSON document of finite length"):
        json_schema_grammar(schema)


@pytest.mark.parametrize(
    "schema", [LIST, {"type": "array", "items": {"$ref": "#"}}, {"anyOf": [{"$ref": "#"}, {"type": "null"}]}]
)
def test_a_schema_that_refers_to_itself_with_a_way_out_is_kept(tiny_model_paths, schema):
    check_grammar(load_model(tiny_model_paths["qwen2"]).tokenizer, json_schema_grammar(schema))


def test_a_required_call_always_parses_into_a_call_of_the_tool(tiny_model_paths):
    model = load_model(tiny_model_paths["qwen2"])
    grammar = check_grammar(model.tokenizer, lark_grammar(HERMES.grammar([WEATHER])))
    sampling = SamplingParams(temperature=0, grammar=grammar)
    text = "".join(generate(model, model.tokenizer.encode("x y z"), sampling=sampling, max_tokens=200))
    content, calls = HERMES.split(text)
    assert content == "" and [c.name for c in calls] == ["get_weather"]
    assert calls[0].arguments["city"] in ("Paris", "Oslo")


def test_one_call_unless_several_are_allowed(tiny_model_paths):
    tok = load_model(tiny_model_paths["qwen2"]).tokenizer
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    for several in (False, True):
        constraint = Constraint(
            tok, check_grammar(tok, lark_grammar(HERMES.grammar([WEATHER], several=several)))
        )
        assert all(constraint.accept(t) for t in tok.encode(call, special=True))
        assert constraint.finished is not several  # one call: nothing but the end may follow


def test_tool_call_text_splits_into_content_and_calls():
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert HERMES.split("Let me look. " + call + "\n" + call) == (
        "Let me look.",
        [ToolCall("get_weather", {"city": "Paris"})] * 2,
    )
    assert HERMES.split("no call here") is None


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\nnot json at all\n</tool_call>",
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}',  # cut short
        '<tool_call>\n["a list"]\n</tool_call>',
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "f", "arguments": 5}\n</tool_call>',
    ],
)
def test_a_tool_call_that_is_not_json_stays_content(text):
    assert HERMES.split(text) is None
    splitter = CallSplitter()
    deltas = [d for i in range(0, len(text), 3) for d in splitter.feed(text[i : i + 3])] + splitter.finish()
    assert all(d.index < 0 for d in deltas) and "".join(d.content for d in deltas) == text


def test_streamed_content_stops_where_a_call_begins():
    splitter = CallSplitter()
    pieces = ["Hel", "lo <to", "ol_c", 'all>\n{"name": "f", "arguments": {}}\n</tool_call>']
    assert [[d.content for d in splitter.feed(p)] for p in pieces] == [["Hel"], ["lo "], [], []]
    assert splitter.finish() == [Delta(index=0, name="f"), Delta(index=0, arguments="{}")]
    splitter = CallSplitter()
    assert [d.content for p in ["a <to", "y"] for d in splitter.feed(p)] == [
        "a ",
        "<toy",
    ]  # not a call after all


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_constrained_calls_stream_their_arguments_as_they_come(step):
    args = ['{"city": "Paris", "days": [1, 2], "where": {"x": "}"}}', "{}"]
    text = "".join(
        f'<tool_call>\n{{"name": "f{i}", "arguments": {a}}}\n</tool_call>\n' for i, a in enumerate(args)
    )
    splitter = CallSplitter(constrained=True)
    deltas = [
        d for i in range(0, len(text), step) for d in splitter.feed(text[i : i + step])
    ] + splitter.finish()
    assert [(d.index, d.name) for d in deltas if d.name] == [(0, "f0"), (1, "f1")]
    for i, a in enumerate(args):
        pieces = [d.arguments for d in deltas if d.index == i and d.name is None]
        assert "".join(pieces) == a and (step > 5 or len(pieces) > 1 or a == "{}")
    assert not "".join(d.content for d in deltas)


def test_ask_json_schema_prints_json_valid_under_it(tiny_model_paths, tmp_path, capsys):
    from llama_chat.app.cli import main

    schema = tmp_path / "w.json"
    schema.write_text(json.dumps(CHOICE))
    ask = ["ask", "--model", str(tiny_model_paths["qwen2"]), "--db", str(tmp_path / "x.db"), "--temp", "0"]
    assert main([*ask, "--max-tokens", "300", "--json-schema", str(schema), "x y z"]) == 0
    assert json.loads(capsys.readouterr().out)["w"] in ("hello", "world")


@pytest.mark.parametrize(
    "content, complaint",
    [
        ('{"type": "nonsense"}', "nonsense"),
        (None, "cannot be read"),
        ("[" * 50_000 + "]" * 50_000, "not JSON"),
    ],
)
def test_ask_with_a_schema_that_is_not_one_is_one_line(
    tiny_model_paths, tmp_path, capsys, content, complaint
):
    from llama_chat.app.cli import main

    schema = tmp_path / "bad.json"
    if content is not None:
        schema.write_text(content)
    ask = ["ask", "--model", str(tiny_model_paths["qwen2"]), "--db", str(tmp_path / "x.db")]
    assert main([*ask, "--json-schema", str(schema), "x y z"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and complaint in err and str(schema) in err
