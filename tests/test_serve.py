"""`llama-chat serve` with the real `openai` client on an ephemeral loopback port and a tiny model:
replies streamed and not, usage and cached tokens, alternatives, stops, seeds, every refusal, the API
key, clients at once, disconnects, sessions, and a restart that reads the KV back from disk."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from llama_chat.app.cli import main
from llama_chat.app.serve.server import make_server, url
from llama_chat.app.serve.state import ServeOptions, open_model
from llama_chat.inference import chat_prompt_ids

BLOCK = 8  # tokens per KV block: the tiny models' prompts span several
SYSTEM = "the sun and the water are the world; " * 3
LONG = "x y z"  # greedy, the tiny qwen2 model goes on past 200 tokens from this prompt
MODEL = "tiny-qwen2"  # the file's stem is the model's id


class Served:
    """A server in a thread of this process, as `llama-chat serve --port 0` runs it."""

    def __init__(self, db: Path, model: Path, api_key: str | None = None, load=None, **options):
        opts = ServeOptions(db=db, model=str(model), port=0, block_size=BLOCK, **options)
        self.server, sock = make_server(opts, api_key, load)
        self.url = url(sock)
        self.state = self.server.state
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key or "none", max_retries=0)

    def wait_ready(self) -> Served:
        for _ in range(600):
            if self.state.phase == "ready":
                return self
            assert self.state.phase == "loading", self.state.failure
            time.sleep(0.05)
        raise AssertionError("the model did not load")

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(30)
        assert not self.thread.is_alive()

    @property
    def model(self):
        return self.state.engine.model

    @property
    def scheduler(self):
        return self.state.engine.scheduler

    def ask(self, text: str | list, **kwargs):
        messages = [{"role": "user", "content": text}] if isinstance(text, str) else text
        kwargs.setdefault("max_tokens", 12)
        return self.client.chat.completions.create(model=MODEL, messages=messages, **kwargs)

    def raw(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        """(status, headers, parsed JSON body) of a request sent as bytes."""
        request = urllib.request.Request(self.url + path, data=body, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(request) as r:
                return r.status, r.headers, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read()


@pytest.fixture
def tiny(tiny_model_paths):
    return tiny_model_paths["qwen2"]


@pytest.fixture
def served(tmp_path, tiny):
    s = Served(tmp_path / "chat.db", tiny).wait_ready()
    yield s
    s.stop()


def streamed(stream) -> tuple[dict[int, str], dict[int, str], object]:
    """Texts and finish reasons by choice index, and the usage chunk, of a stream."""
    texts, finish, usage = {}, {}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return texts, finish, usage


def idle(s: Served) -> None:
    """Wait until no reply runs or waits, and the KV pool holds no sequence: its baseline."""
    for _ in range(400):
        if s.scheduler.load() == {"active": 0, "queued": 0} and not s.model.pool.sequences:
            return
        time.sleep(0.05)
    raise AssertionError(f"still busy: {s.scheduler.load()}, {len(s.model.pool.sequences)} sequence(s)")


def blocks_in_use(s: Served) -> int:
    return s.model.pool.memory_breakdown()["in_use_bytes"] // s.model.pool.block_bytes


# -- replies ---------------------------------------------------------------------------------------


def test_a_streamed_reply_is_the_reply_sent_whole(served):
    whole = served.ask("hello there", seed=3, temperature=0.9)
    assert whole.object == "chat.completion" and whole.model == MODEL
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content
    texts, finish, usage = streamed(
        served.ask("hello there", seed=3, temperature=0.9, stream=True, stream_options={"include_usage": True})
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
    texts = [served.ask("hello there", seed=seed, temperature=1.0).choices[0].message.content for seed in (5, 5, 6, 7)]
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
    assert status == 200 and health["status"] == "ok" and health["active"] == health["queued"] == 0
    assert health["kv"]["in_use_bytes"] == 0 and health["kv"]["budget_bytes"] > 0


# -- refusals --------------------------------------------------------------------------------------


def error_of(response) -> tuple[int, dict]:
    status, _, body = response
    return status, json.loads(body)["error"]


def post(s: Served, body, **headers):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return s.raw("POST", "/v1/chat/completions", data, {"Content-Type": "application/json", **headers})


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
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True}, "logprobs"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream_options": {}}, "stream_options"),
    ],
)
def test_bad_requests_get_400_naming_the_field_and_change_nothing(served, body, param):
    sessions = served.state.engine.store.list_sessions()
    status, error = error_of(post(served, body))
    assert status == 400 and error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"]
    assert served.state.engine.store.list_sessions() == sessions


def test_a_prompt_longer_than_the_context_is_context_length_exceeded(served):
    with pytest.raises(openai.BadRequestError) as e:
        served.ask("hello the world " * 100)
    assert e.value.status_code == 400 and e.value.code == "context_length_exceeded"


def test_an_unknown_model_or_session_is_404(served):
    with pytest.raises(openai.NotFoundError) as e:
        served.client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as e:
        served.ask("hi", extra_body={"session": "abcdef012345"})
    assert e.value.code == "session_not_found"
    status, error = error_of(served.raw("GET", "/v1/nowhere"))
    assert status == 404 and error["code"] == "unknown_url"


def test_a_body_over_the_limit_is_413(tmp_path, tiny):
    s = Served(tmp_path / "chat.db", tiny, max_body=2000).wait_ready()
    try:
        big = {"model": MODEL, "messages": [{"role": "user", "content": "a" * 3000}]}
        status, error = error_of(post(s, big))
        assert status == 413 and error["code"] == "request_too_large"
        assert s.ask("hi").choices[0].message.content is not None  # the server goes on
    finally:
        s.stop()


def test_requests_beyond_the_queue_get_429_with_retry_after(tmp_path, tiny):
    s = Served(tmp_path / "chat.db", tiny, parallel=1, queue=1).wait_ready()
    try:
        with s.scheduler.lock:  # nothing advances: the first job is taken, the second waits
            first = s.ask(LONG, temperature=0, max_tokens=50, stream=True)
            next(iter(first))
            wait_for(lambda: s.scheduler.load()["queued"] == 0)
            second = s.ask(LONG, temperature=0, max_tokens=5, stream=True)
            next(iter(second))
            assert s.scheduler.load()["queued"] == 1
            status, headers, body = post(s, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
            assert status == 429 and headers["Retry-After"] == "1"
            assert json.loads(body)["error"]["code"] == "rate_limit_exceeded"
        assert streamed(first)[1] == {0: "length"} and streamed(second)[1] == {0: "length"}
    finally:
        s.stop()


def test_while_the_model_loads_requests_get_503(tmp_path, tiny):
    loaded = threading.Event()

    def slow_load(options):
        loaded.wait(30)
        return open_model(options)

    s = Served(tmp_path / "chat.db", tiny, load=slow_load)
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


def test_with_an_api_key_every_request_needs_it(tmp_path, tiny):
    s = Served(tmp_path / "chat.db", tiny, api_key="s3cret-key").wait_ready()
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


def test_listening_beyond_loopback_without_a_key_is_refused(tmp_path, tiny, capsys):
    db = ["--db", str(tmp_path / "chat.db"), "--model", str(tiny)]
    assert main([*db, "serve", "--host", "0.0.0.0", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "without an API key" in err


def wait_for(condition, timeout_s: float = 20) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError("the condition never held")


# -- many clients, and clients that leave ------------------------------------------------------------


def test_eight_clients_at_once_each_get_the_reply_they_get_alone(tmp_path, tiny, monkeypatch):
    s = Served(tmp_path / "chat.db", tiny, parallel=8).wait_ready()
    try:
        asks = [(f"{word} the world", seed) for word, seed in zip("abcdefgh", range(20, 28))]
        alone = [s.ask(text, seed=seed, temperature=1.0, max_tokens=24).choices[0].message.content for text, seed in asks]
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


def test_a_client_leaving_mid_stream_cancels_its_reply_and_frees_its_kv(served):
    served.ask("warm up")  # the pool's baseline: cached blocks, no sequence
    idle(served)
    sessions = len(served.state.engine.store.list_sessions())
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": LONG}], "temperature": 0,
                       "max_tokens": 200, "stream": True})
    host, port = served.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port))
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    wait_for(lambda: any(run.streams for run in served.scheduler._runs))  # the reply is being decoded
    with served.scheduler.lock:  # no step until the server has noticed
        runs = list(served.scheduler._runs)
        assert runs and not runs[0].job.state.ended  # mid-reply
        response.close()
        conn.close()
        wait_for(lambda: runs[0].job.cancelled)
    idle(served)
    assert blocks_in_use(served) == 0  # every block given back (cached ones stay for reuse)
    assert runs[0].job.stats[0].stop_reason == "cancelled"
    assert len(served.state.engine.store.list_sessions()) == sessions  # a cut reply is not kept


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


# -- sessions ----------------------------------------------------------------------------------------


def test_a_conversation_sent_whole_is_kept_as_one_session_turn_after_turn(served):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]
    first = served.ask(messages, seed=1)
    assert first.session
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "and the water"}]
    second = served.ask(messages, seed=1)
    assert second.session == first.session  # the same conversation goes on where it was left
    shown = json.loads(served.raw("GET", f"/v1/sessions/{first.session}")[2])
    assert shown["origin"] == "api" and shown["system_prompt"] == SYSTEM
    assert [(m["role"], m["content"]) for m in shown["messages"]] == [
        *[(m["role"], m["content"]) for m in messages[1:]],
        ("assistant", second.choices[0].message.content),
    ]
    unstored = served.ask([{"role": "user", "content": "forget me"}], extra_body={"store": False})
    assert unstored.session is None


def test_a_stored_session_over_http(served):
    status, _, body = served.raw("POST", "/v1/sessions", json.dumps({"title": "over http"}).encode())
    assert status == 201
    sid = json.loads(body)["id"]
    one = served.ask("hello there", extra_body={"session": sid}, seed=1)
    two = served.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "and then"}], max_tokens=8,
        extra_headers={"X-Session-Id": sid},
    )
    assert one.session == two.session == sid
    listed = json.loads(served.raw("GET", "/v1/sessions")[2])["data"]
    assert sid in [s["id"] for s in listed]
    messages = json.loads(served.raw("GET", f"/v1/sessions/{sid}")[2])["messages"]
    assert [m["content"] for m in messages] == [
        "hello there", one.choices[0].message.content, "and then", two.choices[0].message.content,
    ]
    fork = json.loads(served.raw("POST", f"/v1/sessions/{sid}/fork", b'{"title": "other way"}')[2])
    assert fork["forked_from"] == sid and fork["title"] == "other way"
    with pytest.raises(openai.BadRequestError):
        served.ask("hi", extra_body={"session": sid}, n=2)

    status, headers, data = served.raw("GET", f"/v1/sessions/{sid}/export")
    assert status == 200 and "attachment" in headers["Content-Disposition"]
    status, _, body = served.raw("POST", "/v1/sessions/import", data)
    assert status == 201
    imported = json.loads(body)
    assert imported["kv"] == "imported" and imported["messages"] == 4
    copy = json.loads(served.raw("GET", f"/v1/sessions/{imported['ids'][0]}")[2])
    assert [m["content"] for m in copy["messages"]] == [m["content"] for m in messages]
    assert error_of(served.raw("POST", "/v1/sessions/import", b"not a file"))[0] == 400

    status, _, body = served.raw("DELETE", f"/v1/sessions/{sid}")
    assert status == 200 and json.loads(body)["deleted"]
    assert served.raw("GET", f"/v1/sessions/{sid}")[0] == 404
    assert served.raw("GET", f"/v1/sessions/{fork['id']}")[0] == 200  # its fork keeps the messages


def test_after_a_restart_only_the_new_turn_is_computed(tmp_path, tiny):
    db = tmp_path / "chat.db"
    first = Served(db, tiny).wait_ready()
    sid = json.loads(first.raw("POST", "/v1/sessions", json.dumps({"system_prompt": SYSTEM}).encode())[2])["id"]
    first.ask("hello there, tell me of the world", extra_body={"session": sid}, seed=1, max_tokens=20)
    plain = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "the water"}]
    reply = first.ask(plain, seed=1, max_tokens=20)
    first.stop()

    again = Served(db, tiny).wait_ready()  # a new process's pool: empty; the database has the KV
    try:
        engine = again.state.engine
        held = chat_prompt_ids(again.model, engine.messages(engine.store.get_session(sid)), False)
        turn = again.ask("and the sun", extra_body={"session": sid}, seed=1)
        assert turn.usage.prompt_tokens_details.cached_tokens == len(held)  # blocks and tail, from disk

        plain += [{"role": "assistant", "content": reply.choices[0].message.content},
                  {"role": "user", "content": "and then"}]
        before = chat_prompt_ids(again.model, plain[:-1], False)
        more = again.ask(plain, seed=1)
        assert more.session == reply.session
        assert more.usage.prompt_tokens_details.cached_tokens == len(before) // BLOCK * BLOCK  # its full blocks
    finally:
        again.stop()


def test_serve_on_the_command_line(tmp_path, tiny):
    env = {**os.environ, "LLAMA_CHAT_API_KEY": "k"}
    cmd = [sys.executable, "-m", "llama_chat", "--db", str(tmp_path / "chat.db"), "--model", str(tiny),
           "serve", "--port", "0", "--host", "127.0.0.1"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stderr.readline()
        assert "listening on http://127.0.0.1:" in line and "API key required" in line
        base = line.split("listening on ")[1].split()[0]
        client = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
        for line in proc.stderr:  # until the model is loaded (or the server says why not, and ends)
            assert "error" not in line
            if "ready" in line:
                break
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert reply.usage.completion_tokens <= 4
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()


def test_the_cli_and_the_server_share_a_session_while_it_runs(served, tiny, capsys):
    sid = json.loads(served.raw("POST", "/v1/sessions", b"{}")[2])["id"]
    served.ask("hello there", extra_body={"session": sid}, seed=1, max_tokens=4)
    db = str(served.state.options.db)
    assert main(["--db", db, "--model", str(tiny), "ask", "--session", sid, "--max-tokens", "4", "the water"]) == 0
    served.ask("and the sun", extra_body={"session": sid}, seed=1, max_tokens=4)
    messages = json.loads(served.raw("GET", f"/v1/sessions/{sid}")[2])["messages"]
    assert [m["content"] for m in messages if m["role"] == "user"] == ["hello there", "the water", "and the sun"]


def test_clients_sending_one_system_prompt_at_once_compute_it_once(served, monkeypatch):
    jobs = []
    submit = served.scheduler.submit
    monkeypatch.setattr(served.scheduler, "submit", lambda job: jobs.append(job) or submit(job))
    asks = [[{"role": "user", "content": "something else"}]]
    asks += [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}] for text in ("hi", "the sun")]
    replies = {}

    def client(i):
        replies[i] = served.ask(asks[i], seed=1)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    with served.scheduler.lock:  # nothing is computed until the two are admitted together
        threads[0].start()
        wait_for(lambda: len(jobs) == 1 and served.scheduler.load()["queued"] == 0)  # taken, waiting for the lock
        threads[1].start()
        threads[2].start()
        wait_for(lambda: served.scheduler.load()["queued"] == 2)
    for t in threads:
        t.join(60)
    ids = [chat_prompt_ids(served.model, a) for a in asks[1:]]
    shared = next(i for i, (x, y) in enumerate(zip(*ids)) if x != y) // BLOCK * BLOCK
    cached = sorted(replies[i].usage.prompt_tokens_details.cached_tokens for i in (1, 2))
    assert cached == [0, shared]  # the second took the first's blocks as they were computed
