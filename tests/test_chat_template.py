"""Chat templates: the exact Qwen2.5 prompt, every fixture template, the ChatML fallback and the sandbox."""

import json
import re
from datetime import datetime
from pathlib import Path

import pytest

from conftest import vocab_metadata
from llama_chat.inference.chat_template import (
    CHATML_TEMPLATE,
    ChatTemplate,
    TemplateError,
    completion_prompt,
)
from llama_chat.inference.errors import ModelError
from llama_chat.inference.gguf_file import open_gguf, read_metadata

FIXTURES = Path(__file__).parent / "fixtures"
TEMPLATES = FIXTURES / "chat-templates"
QWEN25_TEMPLATE = TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja"
REFERENCE = json.loads((FIXTURES / "llamacpp" / "chat_reference.json").read_text())["greedy"]

EXCHANGE = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2+2?"},
]

# Fixture templates that cannot render a plain system/user/assistant exchange, and why: the tool-use variants
# need tools (or a `functions` variable), and Gemma 2 has no system role. Each must fail with a clear line.
EXPECTED_FAILURES = {
    "CohereForAI-c4ai-command-r-plus-tool_use.jinja": "'NoneType' object is not iterable",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja": "'NoneType' object is not iterable",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": "'NoneType' object is not iterable",
    "fireworks-ai-llama-3-firefunction-v2.jinja": "'functions' is undefined",
    "google-gemma-2-2b-it.jinja": "System role not supported",
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city, e.g. Zürich",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def qwen25() -> ChatTemplate:
    return ChatTemplate(QWEN25_TEMPLATE.read_text(), name="Qwen2.5")


# --- the default model's prompt -----------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(REFERENCE))
def test_qwen25_template_renders_llamacpp_reference_prompt(case):
    assert qwen25().render(REFERENCE[case]["messages"]) == REFERENCE[case]["prompt"]


@pytest.mark.real_model
def test_real_qwen_model_carries_the_qwen25_template(qwen_model_path):
    meta = read_metadata(open_gguf(qwen_model_path))
    source = meta["tokenizer.chat_template"]
    assert source == QWEN25_TEMPLATE.read_text()
    template = ChatTemplate(source, name=str(qwen_model_path))
    for case in REFERENCE.values():
        assert template.render(case["messages"]) == case["prompt"]


@pytest.mark.xdist_group("vocab")  # on the worker that reads the vocab files for test_tokenizer
def test_qwen2_vocab_template_is_the_older_qwen2_one():
    # The llama.cpp vocab file carries Qwen2's template, not Qwen2.5's: its default system prompt differs,
    # but with a system message of its own both render the same prompt.
    source = vocab_metadata("qwen2")["tokenizer.chat_template"]
    assert source != QWEN25_TEMPLATE.read_text()
    template = ChatTemplate(source, name="ggml-vocab-qwen2")
    assert template.render(REFERENCE["python"]["messages"]) == REFERENCE["python"]["prompt"]
    assert template.render([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_add_generation_prompt_false_leaves_off_the_assistant_header():
    prompt = qwen25().render(REFERENCE["hello"]["messages"], add_generation_prompt=False)
    assert REFERENCE["hello"]["prompt"] == prompt + "<|im_start|>assistant\n"


def test_tools_reach_the_template_as_unescaped_json():
    prompt = qwen25().render(REFERENCE["python"]["messages"], tools=[WEATHER_TOOL])
    assert "# Tools" in prompt
    # transformers' tojson: ensure_ascii=False, so non-ASCII text stays as it is.
    assert json.dumps(WEATHER_TOOL, ensure_ascii=False) in prompt


def test_render_does_not_change_the_messages():
    messages = json.loads(json.dumps(EXCHANGE))
    qwen25().render(messages, tools=[WEATHER_TOOL])
    assert messages == EXCHANGE


# --- every fixture template ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(TEMPLATES.glob("*.jinja")), ids=lambda p: p.stem)
def test_fixture_template_renders_an_exchange_or_fails_clearly(path):
    template = ChatTemplate(path.read_text(), bos_token="<s>", eos_token="</s>", name=path.name)
    if path.name in EXPECTED_FAILURES:
        with pytest.raises(TemplateError) as info:
            template.render(EXCHANGE, add_generation_prompt=True)
        message = str(info.value)
        assert message.startswith(f"{path.name}: ")
        assert EXPECTED_FAILURES[path.name] in message
        assert "\n" not in message
    else:
        prompt = template.render(EXCHANGE, add_generation_prompt=True)
        for message in EXCHANGE:
            assert message["content"] in prompt


def test_tool_use_templates_render_when_given_tools():
    for name in (
        "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja",
        "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
    ):
        template = ChatTemplate((TEMPLATES / name).read_text(), name=name)
        prompt = template.render(EXCHANGE, tools=[WEATHER_TOOL])
        assert "get_weather" in prompt and "What is 2+2?" in prompt


def test_gemma2_renders_without_a_system_message():
    template = ChatTemplate((TEMPLATES / "google-gemma-2-2b-it.jinja").read_text(), bos_token="<bos>")
    assert template.render([{"role": "user", "content": "Hi"}]) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    )


def test_extra_variables_reach_the_template():
    template = ChatTemplate((TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text())
    prompt = template.render(EXCHANGE, enable_thinking=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_bos_token_reaches_the_template():
    template = ChatTemplate(
        (TEMPLATES / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text(), bos_token="<|begin_of_text|>"
    )
    assert template.render(EXCHANGE).startswith("<|begin_of_text|><|start_header_id|>system")


# --- the ChatML fallback ------------------------------------------------------------------------------------


def test_no_template_falls_back_to_chatml():
    template = ChatTemplate(None)
    assert template.source == CHATML_TEMPLATE
    assert template.render(EXCHANGE) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert template.render(EXCHANGE, add_generation_prompt=False).endswith("What is 2+2?<|im_end|>\n")


# --- the environment: HF-compatible globals and filters -----------------------------------------------------


def render(source: str, **variables) -> str:
    return ChatTemplate(source).render([], **variables)


def test_tojson_is_plain_json_with_options():
    value = {"b": "<ä>", "a": [1, 2]}
    assert render("{{ v | tojson }}", v=value) == '{"b": "<ä>", "a": [1, 2]}'
    assert render("{{ v | tojson(indent=2) }}", v=value) == json.dumps(value, ensure_ascii=False, indent=2)
    assert render("{{ v | tojson(sort_keys=true) }}", v=value) == '{"a": [1, 2], "b": "<ä>"}'


def test_loop_controls_and_whitespace_control():
    source = (
        "{% for i in range(5) %}\n"
        "  {% if i == 1 %}{% continue %}{% endif %}\n"
        "  {% if i == 3 %}{% break %}{% endif %}\n"
        "{{ i }}\n"
        "{% endfor %}"
    )
    # trim_blocks/lstrip_blocks: block tags leave no newlines or indentation behind.
    assert render(source) == "0\n2\n"


def test_strftime_now_gives_todays_date():
    before = datetime.now().strftime("%Y-%m-%d")
    rendered = render("{{ strftime_now('%Y-%m-%d') }}")
    after = datetime.now().strftime("%Y-%m-%d")  # in case the test straddles midnight
    assert rendered in {before, after}


def test_generation_tag_renders_its_body():
    assert render("a{% generation %}b{% endgeneration %}c") == "abc"


def test_tools_default_to_none():
    assert render("{{ tools is none }}") == "True"


# --- errors -------------------------------------------------------------------------------------------------


def test_raise_exception_becomes_template_error_with_its_message():
    template = ChatTemplate("{{ raise_exception('Conversation roles must alternate') }}", name="strict.jinja")
    with pytest.raises(TemplateError, match=r"^strict\.jinja: Conversation roles must alternate$"):
        template.render(EXCHANGE)


def test_template_error_is_a_model_error():
    assert issubclass(TemplateError, ModelError)


def test_syntax_error_names_the_template_on_one_line():
    with pytest.raises(TemplateError) as info:
        ChatTemplate("{% for m in messages %}\n{{ m.content }}\n", name="broken.jinja")
    message = str(info.value)
    assert message.startswith("broken.jinja: does not compile: ")
    assert "\n" not in message


def test_empty_template_is_refused():
    with pytest.raises(TemplateError, match=r"^model\.gguf: is empty$"):
        ChatTemplate("  \n", name="model.gguf")


def test_runtime_error_names_the_template_and_line():
    template = ChatTemplate("first line\n{{ messages[0].content + 1 }}", name="bad.jinja")
    with pytest.raises(TemplateError) as info:
        template.render([{"role": "user", "content": "hi"}])
    assert re.match(r"^bad\.jinja: failed to render at line 2 \(.*\): TypeError: ", str(info.value))


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__ }}",
        "{{ raise_exception.__globals__ }}",
        "{{ strftime_now.__globals__['datetime'] }}",
        "{{ cycler.__init__.__globals__.os }}",
    ],
)
def test_sandbox_refuses_python_internals(source):
    with pytest.raises(TemplateError, match=r"^evil\.jinja: blocked by the sandbox .*unsafe"):
        ChatTemplate(source, name="evil.jinja").render(EXCHANGE)


def test_sandbox_refuses_to_change_the_messages():
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(TemplateError, match="blocked by the sandbox"):
        ChatTemplate("{% set _ = messages.append({'role': 'system'}) %}").render(messages)
    assert messages == [{"role": "user", "content": "hi"}]


# --- plain-completion prompts for base models ---------------------------------------------------------------


def test_completion_prompt_ends_with_the_last_user_text():
    messages = [{"role": "system", "content": "A story."}, {"role": "user", "content": "Once upon a time"}]
    assert completion_prompt(messages) == "A story.\n\nOnce upon a time"


def test_completion_prompt_continues_assistant_text_directly():
    messages = [
        {"role": "user", "content": "Once upon a time"},
        {"role": "assistant", "content": " there was a fox."},
        {"role": "user", "content": "The fox"},
    ]
    # The reply is the model's own continuation, so it follows its prompt with nothing in between.
    assert completion_prompt(messages) == "Once upon a time there was a fox.\n\nThe fox"
    assert completion_prompt(messages).startswith(completion_prompt(messages[:1]) + messages[1]["content"])


def test_completion_prompt_edge_cases():
    assert completion_prompt([]) == ""
    assert completion_prompt([{"role": "system", "content": ""}, {"role": "user", "content": "x"}]) == "x"
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert completion_prompt([{"role": "user", "content": parts}]) == "ab"
