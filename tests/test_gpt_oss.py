"""gpt-oss (llama.cpp's openai-moe): its switches read from the GGUF as llama.cpp reads them, each new
idea against the maths it stands for (sinks in the softmax, the clamped SwiGLU, a softmax over the
chosen experts' logits, YaRN's frequencies), its MXFP4 experts loaded, and a harmony reply's analysis
channel shown and stored apart from its final answer through the chat engine. (Its logits against
llama.cpp's: test_llamacpp_tiny.py.)"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from test_constrain import WEATHER  # its city one of two: a tiny model's string would go on
from test_thinking import forced  # (the grammar that makes a tiny model write a text)

from llama_chat.app.chat.engine import ChatEngine
from llama_chat.app.chat.jobs import State
from llama_chat.inference import (
    GenerationStats,
    SamplingParams,
    chat_prompt_ids,
    chat_template,
    generate,
    kernels,
    load_model,
)
from llama_chat.inference.attention import one_token_attention_reference
from llama_chat.inference.constrain import check_grammar, lark_grammar
from llama_chat.inference.experts import route
from llama_chat.inference.forward import SWIGLU_OAI_LIMIT, attention, swiglu_oai
from llama_chat.inference.prompt import prompt_text
from llama_chat.inference.rope import rope, yarn_frequencies
from llama_chat.inference.tool_calls import HARMONY, ToolCall, tool_format
from llama_chat.inference.tool_stream import CallSplitter
from llama_chat.storage import ChatStore
from served import Served
from tiny_later_archs import N_EXPERT, N_EXPERT_USED, YARN_FACTOR, YARN_ORIGINAL_CONTEXT
from tiny_models import FixtureDay

GREEDY = SamplingParams(temperature=0)
THOUGHT = "I weigh the words."
ANSWER = "Hello there"
# as gpt-oss writes a reply after the template's "<|start|>assistant"
REPLY = (
    f"<|channel|>analysis<|message|>{THOUGHT}<|end|>"
    f"<|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>"
)


@pytest.fixture(scope="module")
def gpt_oss(tiny_model_paths):
    return load_model(tiny_model_paths["gpt-oss"])


def test_gpt_oss_reads_its_switches_and_its_mxfp4_experts(gpt_oss, tiny_model_paths):
    """A window of 8 on the even layers, YaRN's factor and original context, sinks and biases per layer,
    post_attention_norm as the FFN's norm, and the experts' MXFP4 tensors loaded (as float32 until
    MXFP4 has kernels of its own)."""
    cfg, layer = gpt_oss.config, gpt_oss.weights.layers[0]
    assert cfg.sliding_window == 8 and [cfg.is_sliding(i) for i in range(cfg.n_layer)] == [True, False]
    assert cfg.yarn == (YARN_FACTOR, YARN_ORIGINAL_CONTEXT)
    assert cfg.rope_scale == pytest.approx(1 + 0.1 * np.log(YARN_FACTOR))
    assert (cfg.n_expert, cfg.n_expert_used, cfg.expert_gating) == (N_EXPERT, N_EXPERT_USED, "softmax_weight")
    assert layer.attn_sinks.shape == (cfg.n_head,) and layer.attn_output_bias.shape == (cfg.n_embd,)
    assert layer.ffn_norm.shape == (cfg.n_embd,) and layer.post_attention_norm is None
    experts = layer.experts
    assert experts.router_bias.shape == (N_EXPERT,) and experts.down_bias.shape == (N_EXPERT, cfg.n_embd)
    assert experts.gate_up_bias.shape == (N_EXPERT, 2 * cfg.n_ff_exp)
    tensors = {t.name: t for t in gguf.GGUFReader(tiny_model_paths["gpt-oss"]).tensors}
    assert tensors["blk.0.ffn_gate_exps.weight"].tensor_type == gguf.GGMLQuantizationType.MXFP4
    logits = gpt_oss.logits(gpt_oss.tokenizer.encode("the hello world is in the air"))
    assert np.isfinite(logits).all()


def test_a_sink_takes_its_share_of_the_softmax_and_gives_no_value():
    """softmax over [scores, sink] · [values, 0], by BLAS and by the one-token kernel alike; a sink far
    below every score changes nothing."""
    rng = np.random.default_rng(5)
    n_kv, group, hd, S = 2, 2, 16, 40
    q = rng.standard_normal((n_kv * group, 1, hd)).astype(np.float32)
    k = rng.standard_normal((n_kv, S, hd)).astype(np.float32)
    v = rng.standard_normal((n_kv, S, hd)).astype(np.float32)
    sinks = np.array([3.0, -1.0, 0.5, 2.0], np.float32)
    qg, head_sinks = q.reshape(n_kv, group, hd), sinks.reshape(n_kv, group)
    expected = one_token_attention_reference(qg, k, v, [(0, S)], head_sinks)
    by_blas = attention(q, [(k, v)], None, 1.0, 0.0, sinks)
    by_kernel = kernels.one_token_attention(qg, k, v, [(0, S)], head_sinks)
    assert np.abs(by_blas - expected.reshape(1, -1)).max() < 1e-5
    assert np.abs(by_kernel - expected).max() < 1e-5
    without = attention(q, [(k, v)], None, 1.0, 0.0)
    assert np.abs(attention(q, [(k, v)], None, 1.0, 0.0, np.full(4, -1e4, np.float32)) - without).max() < 1e-6
    assert np.abs(by_blas).max() < np.abs(without).max()  # the sink's share went to no value


def test_the_clamped_swiglu_saturates_at_its_limit():
    """llama.cpp's swiglu_oai: the gate clamped above at 7, up both ways, gate·σ(1.702·gate)·(up+1)."""
    gate = np.array([-3.0, 0.0, 2.0, 7.0, 50.0], np.float32)
    up = np.array([-9.0, 1.0, 0.5, 8.0, -20.0], np.float32)
    g, u = np.minimum(gate, 7.0).astype(np.float64), np.clip(up, -7.0, 7.0).astype(np.float64)
    assert np.allclose(swiglu_oai(gate, up), g / (1 + np.exp(-1.702 * g)) * (u + 1), rtol=1e-6)
    saturated = swiglu_oai(np.float32([1e3]), np.float32([0]))[0]
    assert saturated == pytest.approx(float(SWIGLU_OAI_LIMIT), rel=1e-5)


def test_the_router_weights_the_top_k_logits_by_their_own_softmax():
    """llama.cpp's gating for gpt-oss (SOFTMAX_WEIGHT): the k highest logits, a softmax over only those."""
    logits = np.random.default_rng(6).standard_normal((5, N_EXPERT)).astype(np.float32)
    chosen, weights = route(logits, N_EXPERT_USED, False, "softmax_weight")
    best = np.argsort(-logits, axis=1)[:, :N_EXPERT_USED]
    top = np.exp(np.take_along_axis(logits, best, axis=1).astype(np.float64))
    assert (chosen == best).all()
    assert np.abs(weights - top / top.sum(axis=1, keepdims=True)).max() < 1e-6


def test_yarn_keeps_the_fast_frequencies_and_stretches_the_slow_ones():
    """ggml's rope_yarn on a 16-channel head over a 64-token original context at base 10000: pair 0 turns
    as trained, pairs 3 on at 1/factor of it, pairs 1 and 2 on the ramp between; a rotation all the same
    (YaRN's temperature scales it)."""
    inv = 10000.0 ** (-np.arange(0, 16, 2) / 16)
    got = yarn_frequencies(inv, 16, 10000.0, YARN_FACTOR, YARN_ORIGINAL_CONTEXT)
    assert got[0] == inv[0] and np.allclose(got[3:], inv[3:] / YARN_FACTOR)
    ramp = np.array([2 / 3, 1 / 3])  # pairs 1 and 2: this much of their trained frequency
    assert np.allclose(got[1:3], inv[1:3] / YARN_FACTOR * (1 - ramp) + inv[1:3] * ramp)
    x = np.random.default_rng(7).standard_normal((2, 5, 16)).astype(np.float32)
    turned = rope(x, np.arange(5), 10000.0, True, None, yarn=(YARN_FACTOR, YARN_ORIGINAL_CONTEXT))
    assert np.allclose(np.linalg.norm(turned, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


# -- harmony through the chat engine ------------------------------------------------------------------


@pytest.fixture
def engine(tiny_model_paths, tmp_path, monkeypatch):
    monkeypatch.setattr(chat_template, "datetime", FixtureDay)
    return ChatEngine(load_model(tiny_model_paths["gpt-oss"], block_size=8), ChatStore(tmp_path / "chat.db"))


def test_a_harmony_replys_analysis_is_its_thinking_and_final_its_answer(engine):
    """The analysis channel streams and is stored as the reply's thinking, the final channel as its text;
    the next turn's prompt has the answer and, as gpt-oss's template writes it, not the thinking."""
    session = engine.new_session("harmony", system_prompt="")
    stats = GenerationStats()
    grammar = forced(engine.model_info.tokenizer, REPLY)
    job = engine.reply(session, "Hi", sampling=GREEDY, grammar=grammar, max_tokens=80, stats=stats)
    events = [(e.kind, e.text) for e in job.events() if e.kind in ("text", "thinking")]
    assert job.state is State.DONE and stats.stop_reason == "eog"
    assert "".join(t for kind, t in events if kind == "thinking") == job.thinking() == THOUGHT
    assert "".join(t for kind, t in events if kind == "text") == job.text() == ANSWER
    session = engine._store.get_session(job.result.session.id)
    (_, reply) = engine._store.path(session.head_id)
    assert (reply.content, reply.reasoning) == (ANSWER, THOUGHT)
    asked = [*engine._cache.messages(session), {"role": "user", "content": "And?"}]
    text = prompt_text(engine._model, asked)
    assert f"<|channel|>final<|message|>{ANSWER}<|end|>" in text and THOUGHT not in text


def test_the_reasoning_effort_reaches_the_template(engine):
    """The chat's reasoning effort is the template's: "Reasoning: low" in the prompt the model read."""
    session = engine.new_session("low", system_prompt="", sampling={"reasoning_effort": "low"})
    asked = [*engine._cache.messages(session), {"role": "user", "content": "Hi"}]
    assert "Reasoning: medium" in prompt_text(engine._model, asked)  # the template's own default
    job = engine.reply(session, "Hi", sampling=GREEDY, max_tokens=1)
    job.wait()
    session = engine._store.get_session(job.result.session.id)
    read = engine._model.tokenizer.decode(engine._cache.stored_conversation(session)[1])
    assert "Reasoning: low" in read and "Reasoning: medium" not in read


# -- harmony's tool calls -------------------------------------------------------------------------------

ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]
# gpt-oss's template writes every tool's description
TOOL = {**WEATHER, "function": {**WEATHER["function"], "description": "The weather in a city"}}


def test_the_gpt_oss_template_asks_for_harmony_calls(gpt_oss):
    assert tool_format(gpt_oss.chat_template) is HARMONY


@pytest.mark.parametrize(
    "text",
    [
        ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}',  # as rendered back
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}',
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Paris"}<|call|>',
    ],
)
def test_a_harmony_call_parses_whole_and_streamed(text):
    """Either order harmony allows, after a thought's `<|start|>assistant` or not; streamed a few
    characters at a time it is the same call."""
    assert HARMONY.split(text) == ("", [ToolCall("get_weather", {"city": "Paris"})])
    splitter = CallSplitter(HARMONY, offered={"get_weather"})
    deltas = [d for at in range(0, len(text), 5) for d in splitter.feed(text[at : at + 5])]
    deltas += splitter.finish()
    expected = [("", "get_weather", ""), ("", None, '{"city": "Paris"}')]
    assert [(d.content, d.name, d.arguments) for d in deltas] == expected


def test_a_final_answer_that_names_functions_is_no_call():
    assert HARMONY.split("Call to=functions.get_weather yourself.") is None


@pytest.mark.parametrize("temperature", [0, 5.0])
def test_a_required_harmony_call_parses_and_renders_back_as_the_model_wrote_it(
    gpt_oss, temperature, monkeypatch
):
    """Constrained by HARMONY.grammar, the tiny gpt-oss calls one of the tools with valid arguments; the
    call given back renders the tokens it wrote after the prompt (so a continued conversation keeps its
    KV)."""
    monkeypatch.setattr(chat_template, "datetime", FixtureDay)
    tok = gpt_oss.tokenizer
    lark = HARMONY.grammar([TOOL], tokenizer=tok)
    sampling = SamplingParams(temperature=temperature, seed=4, grammar=check_grammar(tok, lark_grammar(lark)))
    prompt = chat_prompt_ids(gpt_oss, ASK, tools=[TOOL])
    reply = "".join(generate(gpt_oss, prompt, sampling=sampling, max_tokens=200))
    content, (call,) = HARMONY.split(reply)
    assert content == "" and call.name == "get_weather" and call.arguments["city"] in ("Paris", "Oslo")
    returned = HARMONY.as_message(reply)
    assert HARMONY.call_text(returned["tool_calls"]) == reply
    after = chat_prompt_ids(gpt_oss, [*ASK, returned], add_generation_prompt=False, tools=[TOOL])
    assert after[: len(prompt)] == prompt and tok.decode(after[len(prompt) :]).startswith(reply)


def test_the_server_answers_a_required_call_as_openai_tool_calls_whole_and_streamed(
    tiny_model_paths, tmp_path
):
    """gpt-oss behind `serve`: a required call comes back as `tool_calls` (finish_reason "tool_calls"),
    streamed as OpenAI streams a call (its name, then its arguments), the same call either way."""
    path = tiny_model_paths["gpt-oss"]
    s = Served(tmp_path / "chat.db", path).wait_ready()
    try:
        asked = {"model": path.stem, "messages": ASK, "tools": [TOOL], "tool_choice": "required"}
        reply = s.client.chat.completions.create(**asked, temperature=0, max_tokens=200)
        choice = reply.choices[0]
        (call,) = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
        chunks = list(s.client.chat.completions.create(**asked, temperature=0, max_tokens=200, stream=True))
        deltas = [c for chunk in chunks for d in chunk.choices for c in d.delta.tool_calls or []]
        assert [d.function.name for d in deltas if d.function.name] == ["get_weather"]
        assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    finally:
        s.stop()
