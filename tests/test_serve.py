"""`llama-chat serve` with the real `openai` client on an ephemeral loopback port and a qwen2 model:
replies streamed and not, usage and cached tokens, alternatives, stops, seeds, every refusal, the API
key, clients at once, disconnects, sessions, and a restart that reads the KV back from disk."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import threading

import openai
import pytest

from llama_chat.app.cli import main
from llama_chat.inference import chat_prompt_ids
from served import (
    BLOCK,
    LONG,
    MODEL,
    SYSTEM,
    Served,
    blocks_in_use,
    error_of,
    held_loading,
    idle,
    post,
    queue_full,
    streamed,
    wait_for,
)

# -- replies ---------------------------------------------------------------------------------------


def test_a_streamed_reply_is_the_reply_sent_whole(served):
    whole = served.ask("hello there", seed=3, temperature=0.9)
    assert whole.object == "chat.completion" and whole.model == MODEL
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content
    texts, finish, usage = streamed(
        served.ask(
            "hello there", seed=3, temperature=0.9, stream=True, stream_options={"include_usage": True}
        )
    )
    assert texts == {0: whole.choices[0].message.content}
    assert finish == {0: whole.choices[0].finish_reason}
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_without_include_usage_a_stream_has_no_usage(served):
    chunks = list(served.ask("hello there", seed=3, stream=True))
    assert all(c.usage is None for c in chunks) and chunks[-1].choices[0].finish_reason


def test_usage_counts_the_prompt_and_a_repeated_prefix_comes_from_the_cache(served):
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]
    second = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "the water"}]
    a = served.ask(first, seed=1)
    assert a.usage.prompt_tokens == len(chat_prompt_ids(served.model, first))
    assert a.usage.prompt_tokens_details.cached_tokens == 0  # nothing computed before
    b = served.ask(second, seed=1)
    ids_a, ids_b = chat_prompt_ids(served.model, first), chat_prompt_ids(served.model, second)
    shared = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y)
    assert shared >= 3 * BLOCK
    assert b.usage.prompt_tokens_details.cached_tokens == shared // BLOCK * BLOCK  # every full block shared


def test_max_tokens_ends_a_reply_with_length(served):
    reply = served.ask(LONG, temperature=0, max_tokens=7)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 7
    newer = served.ask(LONG, temperature=0, max_completion_tokens=5)
    assert newer.usage.completion_tokens == 5
    assert reply.choices[0].message.content.startswith(newer.choices[0].message.content)


def test_a_seed_makes_a_reply_reproducible(served):
    texts = [
        served.ask("hello there", seed=seed, temperature=1.0).choices[0].message.content
        for seed in (5, 5, 6, 7)
    ]
    assert texts[0] == texts[1]
    assert len(set(texts[1:])) > 1  # other seeds draw other replies


def test_n_alternatives_are_the_replies_of_seed_plus_i(served):
    both = served.ask("hello there", seed=11, temperature=1.0, n=2)
    assert [c.index for c in both.choices] == [0, 1]
    alone = [served.ask("hello there", seed=s, temperature=1.0).choices[0].message.content for s in (11, 12)]
    assert [c.message.content for c in both.choices] == alone
    assert both.usage.completion_tokens == sum(
        served.ask("hello there", seed=s, temperature=1.0).usage.completion_tokens for s in (11, 12)
    )
    texts, finish, _ = streamed(served.ask("hello there", seed=11, temperature=1.0, n=2, stream=True))
    assert texts == {0: alone[0], 1: alone[1]} and set(finish) == {0, 1}


def test_a_stop_string_ends_the_reply_before_it(served):
    full = served.ask(LONG, temperature=0, max_tokens=40).choices[0].message.content
    stop = full[10:12]
    cut = served.ask(LONG, temperature=0, max_tokens=40, stop=[stop, "never there"])
    assert cut.choices[0].message.content == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    texts, _, _ = streamed(served.ask(LONG, temperature=0, max_tokens=40, stop=stop, stream=True))
    assert texts[0] == full[: full.index(stop)]


def test_models_and_health(served):
    assert [m.id for m in served.client.models.list()] == [MODEL]
    status, _, body = served.raw("GET", "/health")
    health = json.loads(body)
    assert status == 200 and health["status"] == "ready" and health["active"] == health["queued"] == 0
    assert health["kv"]["in_use_bytes"] == 0 and health["kv"]["budget_bytes"] > 0


# -- refusals --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param",
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        ({"messages": [{"role": "user", "content": "hi"}]}, "model"),
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 99}, "n"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "seed": -3}, "seed"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 2}, "top_p"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": [1]}, "stop"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "bogus": 1}, "bogus"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
            "top_logprobs",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream_options": {}},
            "stream_options",
        ),
    ],
)
def test_bad_requests_get_400_naming_the_field_and_change_nothing(served, body, param):
    sessions = served.state.sessions.store.list_sessions()
    status, error = error_of(post(served, body))
    assert status == 400 and error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"]
    assert served.state.sessions.store.list_sessions() == sessions


def test_a_prompt_longer_than_the_context_is_context_length_exceeded(served):
    with pytest.raises(openai.BadRequestError) as e:
        served.ask("hello the world " * 100)
    assert e.value.status_code == 400 and e.value.code == "context_length_exceeded"


def words(size: int) -> str:
    """`size` bytes of words that repeat nowhere (so no tokenizer cache makes them cheap)."""
    text = " ".join(f"w{i:x}q" for i in range(size // 5 + 1))
    return text[:size]


@pytest.fixture
def tokenized(served, monkeypatch) -> list[int]:
    """How many tokens each tokenizing of a piece of text had made by its end, on the server."""
    made = []
    algo = served.model.tokenizer._algo
    tokenize = algo.tokenize

    def counted(text, out, *limit):
        tokenize(text, out, *limit)
        made.append(len(out))

    monkeypatch.setattr(algo, "tokenize", counted)
    return made


@pytest.fixture
def shielded(served, monkeypatch) -> list[int]:
    """One entry per prompt whose control text the server looked for (every string of it scanned)."""
    made = []
    tokenizer = served.model.tokenizer
    shield = tokenizer.control_text_shield
    monkeypatch.setattr(tokenizer, "control_text_shield", lambda outside: made.append(1) or shield(outside))
    return made


def test_huge_prompts_are_refused_untokenized_while_health_and_models_answer(served, tokenized, shielded):
    """Four 7.5 MB prompts at once (the probe: 25 s of CPU each to tokenize before their 400, and
    /health took 27 s meanwhile): more bytes than the window's tokens can stand for, refused before
    they are tokenized; the server answers /health and /v1/models all along."""
    huge = words(7_500_000)
    bodies = [{"model": MODEL, "messages": [{"role": "user", "content": huge}]}] * 2
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        asked = [pool.submit(post, served, body) for body in bodies]
        asked += [
            pool.submit(
                served.raw, "POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": huge}).encode()
            )
            for _ in range(2)
        ]
        answers = []
        for _ in range(10_000):
            answers += [served.raw("GET", "/health")[0], served.raw("GET", "/v1/models")[0]]
            if all(a.done() for a in asked):
                break
    for response in asked:
        status, error = error_of(response.result())
        assert status == 400 and error["code"] == "context_length_exceeded"
        assert error["message"].startswith(
            ("'messages' makes 256 tokens or more", "'prompt' makes 256 tokens or more")
        )
    assert answers and set(answers) == {200}
    assert tokenized == [] and shielded == []  # refused by their length before any scan of their text


def test_tokenizing_a_prompt_over_the_window_stops_at_the_window(served, tokenized):
    n_ctx = served.state.engine.n_ctx
    # few enough bytes to be tokenized (a token of this vocabulary stands for 13 at most)
    prompt = words(6 * n_ctx)
    status, error = error_of(
        post(served, {"model": MODEL, "messages": [{"role": "user", "content": prompt}]})
    )
    assert status == 400 and error["code"] == "context_length_exceeded"
    assert tokenized and max(tokenized) <= n_ctx + 8  # what it made: up to the word that passed the window
    assert len(served.model.tokenizer.encode(prompt)) > 2 * n_ctx  # what a whole tokenizing makes


def test_an_unknown_model_or_session_is_404(served):
    with pytest.raises(openai.NotFoundError) as e:
        served.client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as e:
        served.ask("hi", extra_body={"session": "abcdef012345"})
    assert e.value.code == "session_not_found"
    status, error = error_of(served.raw("GET", "/v1/nowhere"))
    assert status == 404 and error["code"] == "unknown_url"


def test_a_body_over_the_limit_is_413(tmp_path, qwen2):
    s = Served(tmp_path / "chat.db", qwen2, max_body=2000).wait_ready()
    try:
        big = {"model": MODEL, "messages": [{"role": "user", "content": "a" * 3000}]}
        status, error = error_of(post(s, big))
        assert status == 413 and error["code"] == "request_too_large"
        assert s.ask("hi").choices[0].message.content is not None  # the server goes on
    finally:
        s.stop()


def test_requests_beyond_the_queue_get_429_with_retry_after(tmp_path, qwen2):
    s = Served(tmp_path / "chat.db", qwen2, parallel=1, queue=1).wait_ready()
    try:
        with queue_full(s, lambda n: s.ask(LONG, temperature=0, max_tokens=n, stream=True)) as (
            first,
            second,
        ):
            status, headers, body = post(s, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
            assert status == 429 and headers["Retry-After"] == "1"
            assert json.loads(body)["error"]["code"] == "rate_limit_exceeded"
        assert streamed(first)[1] == {0: "length"} and streamed(second)[1] == {0: "length"}
    finally:
        s.stop()


def test_while_the_model_loads_requests_get_503(tmp_path, qwen2):
    s, loaded = held_loading(tmp_path / "chat.db", qwen2)
    try:
        status, _, _ = s.raw("GET", "/health")
        assert status == 503
        with pytest.raises(openai.InternalServerError) as e:
            s.ask("hi")
        assert e.value.status_code == 503 and e.value.code == "model_loading"
        loaded.set()
        s.wait_ready()
        assert s.raw("GET", "/health")[0] == 200
        assert s.ask("hi").choices[0].message.content is not None
    finally:
        loaded.set()
        s.stop()


def test_a_stopping_server_turns_requests_away_with_503(served):
    served.state.begin_closing()
    with pytest.raises(openai.InternalServerError) as e:
        served.ask("hi")
    assert e.value.status_code == 503 and e.value.code == "shutting_down"


def test_with_an_api_key_every_request_needs_it(tmp_path, qwen2):
    s = Served(tmp_path / "chat.db", qwen2, api_key="s3cret-key").wait_ready()
    try:
        assert s.ask("hi").choices[0].message.content is not None
        for key in ("wrong-key", ""):
            client = openai.OpenAI(base_url=s.url + "/v1", api_key=key or "x", max_retries=0)
            with pytest.raises(openai.AuthenticationError) as e:
                client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
            assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        assert s.raw("GET", "/v1/models")[0] == 401
        assert s.raw("GET", "/v1/sessions")[0] == 401
        assert s.raw("GET", "/health")[0] == 200  # probes need no key
    finally:
        s.stop()


def test_listening_beyond_loopback_without_a_key_is_refused(tmp_path, qwen2, capsys):
    db = ["--db", str(tmp_path / "chat.db"), "--model", str(qwen2)]
    assert main([*db, "serve", "--host", "0.0.0.0", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "without an API key" in err


# -- many clients, and clients that leave ------------------------------------------------------------


def test_eight_clients_at_once_each_get_the_reply_they_get_alone(tmp_path, qwen2, monkeypatch):
    s = Served(tmp_path / "chat.db", qwen2, parallel=8).wait_ready()
    try:
        asks = [(f"{word} the world", seed) for word, seed in zip("abcdefgh", range(20, 28))]
        alone = [
            s.ask(text, seed=seed, temperature=1.0, max_tokens=24).choices[0].message.content
            for text, seed in asks
        ]
        together: dict[int, str] = {}

        def client(i: int) -> None:
            text, seed = asks[i]
            stream = s.ask(text, seed=seed, temperature=1.0, max_tokens=24, stream=i % 2 == 0)
            together[i] = streamed(stream)[0][0] if i % 2 == 0 else stream.choices[0].message.content

        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        jobs = []
        submit = s.scheduler.submit
        monkeypatch.setattr(s.scheduler, "submit", lambda job: jobs.append(job) or submit(job))
        with s.scheduler.lock:  # hold every step until all eight wait: then they run together
            for t in threads:
                t.start()
            wait_for(lambda: len(jobs) == 8)
        for t in threads:
            t.join(60)
        assert [together[i] for i in range(8)] == alone
    finally:
        s.stop()


def test_a_client_leaving_mid_stream_cancels_its_reply_and_frees_its_kv(served, monkeypatch):
    served.ask("warm up")  # the pool's baseline: cached blocks, no sequence
    idle(served)
    sessions = len(served.state.sessions.store.list_sessions())
    # the reply's first token goes out, then its next pass waits until the client has left
    left = threading.Event()
    verify_rows = served.scheduler.model.verify_rows
    monkeypatch.setattr(
        served.scheduler.model, "verify_rows", lambda batch: left.wait(20) and verify_rows(batch)
    )
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": LONG}], "temperature": 0,
                       "max_tokens": 200, "stream": True})
    host, port = served.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port))
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    wait_for(lambda: any(run.streams for run in served.scheduler._runs))  # the reply is being decoded
    runs = list(served.scheduler._runs)
    assert runs and not runs[0].job.state.ended  # mid-reply
    response.close()
    conn.close()
    wait_for(lambda: runs[0].job.cancelled)
    left.set()
    idle(served)
    assert blocks_in_use(served) == 0  # every block given back (cached ones stay for reuse)
    assert runs[0].job.stats[0].stop_reason == "cancelled"
    assert len(served.state.sessions.store.list_sessions()) == sessions  # a cut reply is not kept


def test_a_client_leaving_before_a_whole_reply_cancels_it(served, monkeypatch):
    jobs = []
    submit = served.scheduler.submit
    monkeypatch.setattr(served.scheduler, "submit", lambda job: jobs.append(job) or submit(job))
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": LONG}], "max_tokens": 200})
    host, port = served.url.removeprefix("http://").split(":")
    with served.scheduler.lock:  # nothing is computed until the server has noticed
        conn = http.client.HTTPConnection(host, int(port))
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        wait_for(lambda: jobs)
        conn.close()
        wait_for(lambda: jobs[0].cancelled)
    idle(served)
    assert blocks_in_use(served) == 0 and jobs[0].stats[0].generated_tokens < 200


def test_clients_sending_one_system_prompt_at_once_compute_it_once(served, monkeypatch):
    jobs = []
    submit = served.scheduler.submit
    monkeypatch.setattr(served.scheduler, "submit", lambda job: jobs.append(job) or submit(job))
    asks = [[{"role": "user", "content": "something else"}]]
    asks += [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
        for text in ("hi", "the sun")
    ]
    replies = {}

    def client(i):
        replies[i] = served.ask(asks[i], seed=1)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    with served.scheduler.lock:  # nothing is computed until the two are admitted together
        threads[0].start()
        # taken, waiting for the lock
        wait_for(lambda: len(jobs) == 1 and served.scheduler.load()["queued"] == 0)
        threads[1].start()
        threads[2].start()
        wait_for(lambda: served.scheduler.load()["queued"] == 2)
    for t in threads:
        t.join(60)
    ids = [chat_prompt_ids(served.model, a) for a in asks[1:]]
    shared = next(i for i, (x, y) in enumerate(zip(*ids)) if x != y) // BLOCK * BLOCK
    cached = sorted(replies[i].usage.prompt_tokens_details.cached_tokens for i in (1, 2))
    assert cached == [0, shared]  # the second took the first's blocks as they were computed
