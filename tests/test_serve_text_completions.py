"""POST /v1/completions (OpenAI's legacy Completions) with the real `openai` client on the tiny model:
raw prompts continued as the inference core continues them, streamed and not, log-probabilities in
that API's shape and recomputed from the model's logits, the KV cache and tenants, and refusals."""

from __future__ import annotations

import http.client
import json
import math
import threading

import numpy as np
import openai
import pytest

from conftest import FIXTURES, real_cache
from llama_chat.app.serve.state import api_keys_from, open_model
from llama_chat.inference import GenerationStats, SamplingParams, chat_prompt_ids, generate, load_model
from served import BLOCK, LONG, MODEL, SYSTEM, Served, blocks_in_use, error_of, idle, queue_full, wait_for
from tiny_models import write_tiny_model

GREEDY = {"temperature": 0}
CHAT_REFERENCE = json.loads((FIXTURES / "llamacpp" / "chat_reference.json").read_text())


def complete(s: Served, prompt, **kwargs):
    return s.client.completions.create(model=MODEL, prompt=prompt, **kwargs)


def stream_of(s: Served, prompt, **kwargs) -> tuple[dict[int, str], dict[int, str], list, object]:
    """Texts and finish reasons by choice index, the logprobs of choice 0's chunks, and the usage."""
    texts, finish, logprobs, usage = {}, {}, [], None
    for chunk in complete(s, prompt, stream=True, **kwargs):
        assert chunk.object == "text_completion"
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
            if choice.index == 0 and choice.logprobs is not None:
                logprobs.append(choice.logprobs)
    return texts, finish, logprobs, usage


@pytest.fixture(scope="module")
def core(tiny_model_paths):
    """The same tiny model, loaded apart from the server's: the inference core's own answers."""
    return load_model(tiny_model_paths["qwen2"], cache_ram_mb=64, block_size=BLOCK)


def raw_ids(model, prompt: str) -> list[int]:
    """A raw prompt's tokens as llama.cpp's server makes them (add_special, parse_special)."""
    tok = model.tokenizer
    return tok.encode(prompt, add_bos=tok.add_bos and tok.bos_id is not None, special=True)


def core_text(model, ids: list[int], max_tokens: int, stats: GenerationStats | None = None) -> str:
    """The greedy continuation of `ids` by the inference core's own generation loop."""
    return "".join(
        generate(model, ids, sampling=SamplingParams(temperature=0), max_tokens=max_tokens, stats=stats)
    )


# -- replies ---------------------------------------------------------------------------------------


def test_a_raw_prompt_is_continued_as_the_inference_core_continues_it(served, core):
    # control-token text is that token, as llama.cpp reads it
    prompt = "the sun and the water <|im_start|> are"
    ids = raw_ids(core, prompt)
    (control,) = core.tokenizer.encode("<|im_start|>", special=True)
    assert control in ids and len(ids) < len(core.tokenizer.encode(prompt))
    reply = complete(served, prompt, max_tokens=12, **GREEDY)
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-") and reply.model == MODEL
    assert reply.choices[0].text == core_text(core, ids, 12)
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 12
    assert reply.choices[0].finish_reason == "length"
    # the same prompt as token ids, alone or as a list of one, is the same completion
    by_ids = complete(served, ids, max_tokens=12, **GREEDY)
    assert by_ids.choices[0].text == reply.choices[0].text
    assert complete(served, [prompt], max_tokens=12, **GREEDY).choices[0].text == reply.choices[0].text


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_bos_comes_first_where_the_vocabulary_asks_for_it(tmp_path, tiny_model_paths, arch):
    """As llama.cpp's server tokenizes a prompt (add_special): the tiny gemma3 (SentencePiece) and llama
    vocabularies ask for BOS; their completions are those of BOS and the prompt's tokens."""
    path = tiny_model_paths[arch]
    core = load_model(path, cache_ram_mb=64, block_size=BLOCK)
    ids = raw_ids(core, "the sun and the water")
    assert ids[0] == core.tokenizer.bos_id and ids[1:] == core.tokenizer.encode("the sun and the water")
    s = Served(tmp_path / "chat.db", path).wait_ready()
    try:
        reply = s.client.completions.create(
            model=path.stem, prompt="the sun and the water", max_tokens=8, **GREEDY
        )
    finally:
        s.stop()
    assert reply.usage.prompt_tokens == len(ids) and reply.choices[0].text == core_text(core, ids, 8)


def test_a_completion_keeps_the_space_its_first_token_begins_with(tmp_path):
    """A SentencePiece vocabulary that puts a space before the text (Llama 2's) has a reply's first
    token drop its space, but a completion goes on from the prompt's text: it keeps it, as llama.cpp's
    server gives each token's piece whole."""
    path = write_tiny_model(tmp_path / "tiny-spm.gguf", "gemma3", space_prefix=True)
    core, stats = load_model(path, cache_ram_mb=64, block_size=BLOCK), GenerationStats()
    core_text(core, raw_ids(core, "water "), 6, stats)
    pieces = b"".join(core.tokenizer.token_bytes(t) for t in stats.token_ids).decode()
    assert pieces.startswith(" ")  # the case: the first token is a space
    s = Served(tmp_path / "chat.db", path).wait_ready()
    try:
        reply = s.client.completions.create(
            model=path.stem, prompt="water ", max_tokens=6, logprobs=0, **GREEDY
        )
    finally:
        s.stop()
    assert reply.choices[0].text == pieces and "".join(reply.choices[0].logprobs.tokens) == pieces
    assert reply.choices[0].logprobs.text_offset == list(range(len(pieces)))


def test_max_tokens_is_16_unless_given(served):
    reply = complete(served, LONG, **GREEDY)  # the tiny model goes on past 200 tokens from it
    assert reply.usage.completion_tokens == 16 and reply.choices[0].finish_reason == "length"


def test_a_stop_string_ends_the_completion_before_it(served):
    whole = complete(served, LONG, max_tokens=30, **GREEDY).choices[0].text
    stop = whole[len(whole) // 2 :][:3]
    reply = complete(served, LONG, max_tokens=30, stop=[stop], **GREEDY)
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].text == whole[: whole.index(stop)]


def test_echo_puts_the_prompt_before_the_completion(served):
    plain = complete(served, LONG, max_tokens=5, **GREEDY).choices[0].text
    assert complete(served, LONG, max_tokens=5, echo=True, **GREEDY).choices[0].text == LONG + plain
    texts, _, _, _ = stream_of(served, LONG, max_tokens=5, echo=True, **GREEDY)
    assert texts == {0: LONG + plain}


def test_a_stream_is_the_completion_sent_whole_with_usage(served):
    whole = complete(served, "hello there", max_tokens=10, n=2, seed=3, temperature=0.9)
    texts, finish, _, usage = stream_of(
        served,
        "hello there",
        max_tokens=10,
        n=2,
        seed=3,
        temperature=0.9,
        stream_options={"include_usage": True},
    )
    assert texts == {c.index: c.text for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert whole.choices[0].text != whole.choices[1].text  # alternative i is drawn with seed + i
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
    )
    assert stream_of(served, "hello there", max_tokens=3)[3] is None  # usage only when asked for


# -- log-probabilities -----------------------------------------------------------------------------


def token_text(tokenizer, token: int) -> str:
    """A token as this API writes it: its text, or its bytes when it holds part of a character."""
    data = tokenizer.token_bytes(token)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def log_softmax(row: np.ndarray) -> np.ndarray:
    row = row.astype(np.float64)
    return row - row.max() - np.log(np.exp(row - row.max()).sum())


def test_logprobs_are_the_log_softmax_of_the_models_logits(served, core):
    reply = complete(served, LONG, max_tokens=8, logprobs=3, **GREEDY)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    # the logits of every position, recomputed by a model of our own: prompt, then the completion
    ids, stats = raw_ids(core, LONG), GenerationStats()
    assert core_text(core, ids, 8, stats) == reply.choices[0].text
    completion = stats.token_ids
    assert lp.tokens == [token_text(core.tokenizer, t) for t in completion]
    seq = core.new_sequence(64)
    try:
        rows = core.forward(ids + completion[:-1], seq, all_logits=True)[len(ids) - 1 :]
    finally:
        seq.free()
    for i, row in enumerate(rows):
        expected = log_softmax(row)
        assert math.isclose(lp.token_logprobs[i], expected[completion[i]], abs_tol=1e-4)
        likeliest = np.argsort(-expected, kind="stable")[:3]
        top = lp.top_logprobs[i]
        assert list(top) == [token_text(core.tokenizer, t) for t in likeliest]  # likeliest first
        assert all(
            math.isclose(top[token_text(core.tokenizer, t)], expected[t], abs_tol=1e-4) for t in likeliest
        )
        assert list(top)[0] == lp.tokens[i]  # greedy: the drawn token is the likeliest
    # each token's offset is where its text begins in the completion (a part of a character: where the
    # character it ends, or begins, does)
    text, whole = reply.choices[0].text, [not t.startswith("bytes:") for t in lp.tokens]
    assert [text[o : o + len(t)] for o, t, w in zip(lp.text_offset, lp.tokens, whole) if w] == [
        t for t, w in zip(lp.tokens, whole) if w
    ]
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_streamed_logprobs_are_those_sent_whole(served):
    whole = complete(served, LONG, max_tokens=8, logprobs=2, **GREEDY).choices[0].logprobs
    _, _, chunks, _ = stream_of(served, LONG, max_tokens=8, logprobs=2, **GREEDY)
    joined = {
        k: [v for c in chunks for v in getattr(c, k)] for k in ("tokens", "token_logprobs", "text_offset")
    }
    assert joined == {
        "tokens": whole.tokens,
        "token_logprobs": whole.token_logprobs,
        "text_offset": whole.text_offset,
    }
    assert [t for c in chunks for t in c.top_logprobs] == whole.top_logprobs


def test_logprobs_0_gives_the_drawn_token_alone_and_none_without(served):
    lp = complete(served, LONG, max_tokens=4, logprobs=0, **GREEDY).choices[0].logprobs
    assert [list(top) for top in lp.top_logprobs] == [[t] for t in lp.tokens]
    assert complete(served, LONG, max_tokens=4).choices[0].logprobs is None


# -- the KV cache ----------------------------------------------------------------------------------


def test_a_repeated_prompt_prefix_comes_from_the_cache(served):
    first = complete(served, SYSTEM + "hello", max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = complete(served, SYSTEM + "the water", max_tokens=2)
    assert second.usage.prompt_tokens_details.cached_tokens >= 3 * BLOCK


def test_blocks_a_stored_chat_left_on_disk_serve_a_text_prompt_after_a_restart(tmp_path, qwen2):
    db, messages = (
        tmp_path / "chat.db",
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}],
    )
    first = Served(db, qwen2).wait_ready()
    try:
        first.ask(messages, max_tokens=2)  # kept as an API session, its KV stored
        ids = chat_prompt_ids(first.model, messages)
    finally:
        first.stop()
    again = Served(db, qwen2).wait_ready()  # a new process's pool: empty; the database has the blocks
    try:
        reply = complete(again, ids, max_tokens=2)  # the same tokens, sent as a raw prompt
    finally:
        again.stop()
    assert (len(ids) - 1) // BLOCK >= 3  # every full block before the last token, from disk
    assert reply.usage.prompt_tokens_details.cached_tokens == (len(ids) - 1) // BLOCK * BLOCK


def test_tenants_share_no_kv_through_text_completions(tmp_path, qwen2):
    s = Served(tmp_path / "chat.db", qwen2, api_key=api_keys_from(["k-alice", "k-bob"])).wait_ready()
    try:
        alice, bob = (
            openai.OpenAI(base_url=s.url + "/v1", api_key=k, max_retries=0) for k in ("k-alice", "k-bob")
        )
        ask = {"model": MODEL, "prompt": SYSTEM + "hello", "max_tokens": 2}
        assert alice.completions.create(**ask).usage.prompt_tokens_details.cached_tokens == 0
        assert alice.completions.create(**ask).usage.prompt_tokens_details.cached_tokens >= 3 * BLOCK
        assert bob.completions.create(**ask).usage.prompt_tokens_details.cached_tokens == 0
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="nobody", max_retries=0).completions.create(**ask)
    finally:
        s.stop()


# -- the queue and clients that leave (the chat route's code) -----------------------------------------


def test_requests_beyond_the_queue_get_429_with_retry_after(tmp_path, qwen2):
    s = Served(tmp_path / "chat.db", qwen2, parallel=1, queue=1).wait_ready()
    try:
        with queue_full(s, lambda n: complete(s, LONG, max_tokens=n, stream=True, **GREEDY)) as (
            first,
            second,
        ):
            with pytest.raises(openai.RateLimitError) as e:
                complete(s, "hi")
            assert e.value.response.headers["Retry-After"] == "1" and e.value.code == "rate_limit_exceeded"
        assert [c.choices[0].finish_reason for c in first if c.choices][-1] == "length"
        assert [c.choices[0].finish_reason for c in second if c.choices][-1] == "length"
    finally:
        s.stop()


def test_a_client_leaving_mid_stream_cancels_its_completion_and_frees_its_kv(served, monkeypatch):
    complete(served, "warm up")  # the pool's baseline: cached blocks, no sequence
    idle(served)
    # the first token goes out, then the next pass waits until the client has left
    left = threading.Event()
    verify_rows = served.scheduler.model.verify_rows
    monkeypatch.setattr(
        served.scheduler.model, "verify_rows", lambda batch: left.wait(20) and verify_rows(batch)
    )
    body = {"model": MODEL, "prompt": LONG, "max_tokens": 200, "stream": True, "echo": True, **GREEDY}
    host, port = served.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port))
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")  # the echoed prompt
    wait_for(lambda: any(run.streams for run in served.scheduler._runs))  # being decoded
    (run,) = served.scheduler._runs
    response.close()
    conn.close()
    wait_for(lambda: run.job.cancelled)
    left.set()
    idle(served)
    assert blocks_in_use(served) == 0 and run.job.stats[0].stop_reason == "cancelled"


# -- refusals --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"suffix": "def f():"}, "suffix"),
        ({"logprobs": 6}, "logprobs"),
        ({"logprobs": 2, "echo": True}, "echo"),
        ({"prompt": ["one", "two"]}, "prompt"),
        ({"prompt": [1, 2, 10**9]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": {"text": "hi"}}, "prompt"),
        ({"best_of": 3}, "best_of"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"messages": []}, "messages"),
    ],
)
def test_bad_requests_get_400_in_openais_shape(served, extra, param):
    body = {"model": MODEL, "prompt": "hi", **extra}
    status, _, data = served.raw("POST", "/v1/completions", json.dumps(body).encode())
    error = json.loads(data)["error"]
    assert status == 400 and error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"]


def test_several_prompts_are_refused_naming_the_limit(served):
    with pytest.raises(openai.BadRequestError) as e:
        complete(served, ["one", "two", "three"])
    assert e.value.body["param"] == "prompt" and "3 prompts" in e.value.body["message"]


def test_a_prompt_longer_than_the_context_is_context_length_exceeded(served):
    n_ctx = served.state.engine.n_ctx
    status, error = error_of(
        served.raw("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": [5] * n_ctx}).encode())
    )
    assert status == 400 and error["code"] == "context_length_exceeded" and error["param"] == "prompt"


# -- the default model -----------------------------------------------------------------------------


def load_real(options):
    with real_cache():  # the prepared model of the user's cache, not one prepared again
        return open_model(options)


def test_the_default_model_continues_a_chat_prompt_written_out_as_llamacpp_replies(tmp_path, qwen_model_path):
    """A chat prompt written out as text, control tokens and all, is the prompt llama.cpp's chat reply
    was made from (its server reads control-token text as those tokens); the greedy completion is
    that reply."""
    ref = CHAT_REFERENCE["greedy"]["hello"]
    s = Served(tmp_path / "chat.db", qwen_model_path, load=load_real).wait_ready()
    try:
        reply = s.client.completions.create(
            model=qwen_model_path.stem, prompt=ref["prompt"], max_tokens=len(ref["greedy_ids"]), **GREEDY
        )
    finally:
        s.stop()
    assert reply.usage.prompt_tokens == len(ref["prompt_ids"])
    assert reply.choices[0].text == ref["greedy_text"]
