"""`llama-chat serve`'s sessions: conversations sent whole kept as sessions, stored sessions over HTTP
(list, show, fork, delete, export, import), a restart that reads the KV back from disk, the command
line, and the CLI working on the same database while a server runs."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import openai
import pytest

from llama_chat.app.cli import main
from llama_chat.app.serve.completions import kept_where
from llama_chat.app.serve.state import api_keys_from
from llama_chat.inference import chat_prompt_ids
from llama_chat.storage import ChatStore, StoreError
from served import BLOCK, LONG, MODEL, SYSTEM, Served, error_of, held_loading, post, upload, wait_for

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
    status, _, body = upload(served, data)
    assert status == 201
    imported = json.loads(body)
    assert imported["kv"] == "imported" and imported["messages"] == 4
    copy = json.loads(served.raw("GET", f"/v1/sessions/{imported['ids'][0]}")[2])
    assert [m["content"] for m in copy["messages"]] == [m["content"] for m in messages]
    assert error_of(upload(served, b"not a file"))[0] == 400

    status, _, body = served.raw("DELETE", f"/v1/sessions/{sid}")
    assert status == 200 and json.loads(body)["deleted"]
    assert served.raw("GET", f"/v1/sessions/{sid}")[0] == 404
    assert served.raw("GET", f"/v1/sessions/{fork['id']}")[0] == 200  # its fork keeps the messages


def sse_texts(body: bytes) -> tuple[str, list[dict]]:
    """The text of a stream's reply, and its events, as JSON (the last is the string "[DONE]")."""
    events = [
        line.removeprefix(b"data: ").decode() for line in body.splitlines() if line.startswith(b"data: ")
    ]
    parsed = [json.loads(e) if e != "[DONE]" else e for e in events]
    text = "".join(
        c["delta"].get("content") or "" for e in parsed if isinstance(e, dict) for c in e.get("choices", [])
    )
    return text, parsed


def test_session_turns_wait_in_the_queue_and_a_client_that_leaves_first_stores_nothing(
    tmp_path, qwen2, monkeypatch
):
    s = Served(tmp_path / "chat.db", qwen2, parallel=1, queue=2).wait_ready()
    try:
        sid = json.loads(s.raw("POST", "/v1/sessions", b"{}")[2])["id"]
        jobs = []
        submit = s.scheduler.submit
        monkeypatch.setattr(s.scheduler, "submit", lambda job: jobs.append(job) or submit(job))
        host, port = s.url.removeprefix("http://").split(":")

        def turn(text: str, stream: bool) -> http.client.HTTPConnection:
            conn = http.client.HTTPConnection(host, int(port))
            body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "session": sid,
                    "max_tokens": 6, "seed": 1, "stream": stream}
            conn.request(
                "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
            )
            return conn

        with s.scheduler.lock:  # nothing advances: the first turn is taken, two wait, the rest are refused
            first = turn("one", stream=True)
            wait_for(lambda: len(jobs) == 1 and s.scheduler.load()["queued"] == 0)
            leaving = turn("two", stream=False)
            wait_for(lambda: len(jobs) == 2)
            third = turn("three", stream=True)
            wait_for(lambda: len(jobs) == 3)
            for i in range(6):
                status, headers, body = post(s, {"model": MODEL, "session": sid, "max_tokens": 6,
                                                 "messages": [{"role": "user", "content": f"more {i}"}]})
                assert status == 429 and headers["Retry-After"] == "1"
                assert json.loads(body)["error"]["code"] == "rate_limit_exceeded"
            assert json.loads(s.raw("GET", "/health")[2])["queued"] == 2  # /health waits on no lock
            leaving.close()  # before its turn began
            wait_for(lambda: jobs[1].cancelled)
        replies = []
        for conn in (first, third):
            response = conn.getresponse()
            assert response.status == 200
            text, events = sse_texts(response.read())
            assert events[-1] == "[DONE]"
            replies.append(text)
        stored = json.loads(s.raw("GET", f"/v1/sessions/{sid}")[2])["messages"]
        # one after another, each turn read the one before it; the client that left left nothing
        assert [m["content"] for m in stored] == ["one", replies[0], "three", replies[1]]
        assert json.loads(s.raw("GET", "/health")[2])["queued"] == 0
    finally:
        s.stop()


def fill_up(write) -> None:
    """write() until the database says the disk is full (with SQLite's max_page_count at the file's
    size, what is left of its last pages): then a write of that kind finds no room."""
    for _ in range(10_000):
        try:
            write()
        except StoreError as e:
            assert "the disk is full" in str(e)
            return
    raise AssertionError("the database never filled up")


def test_a_full_disk_is_said_in_the_api_shape_and_a_reply_made_still_comes_back(tmp_path, qwen2, capfd):
    s = Served(tmp_path / "chat.db", qwen2).wait_ready()
    try:
        sid = json.loads(s.raw("POST", "/v1/sessions", b"{}")[2])["id"]
        first = s.ask("hello there", extra_body={"session": sid}, seed=1)
        store = s.state.sessions.store
        filler = store.create_session("filler")
        with store.connection.lock:  # SQLite itself then answers SQLITE_FULL to a write that needs a new page
            pages = store.db.conn.execute("PRAGMA page_count").fetchone()[0]
            store.db.conn.execute(f"PRAGMA max_page_count = {pages}")
        fill_up(lambda: store.add_message(filler.id, "user", "x"))  # no room for a message any more
        sessions = len(store.list_sessions())

        turn = s.client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "and the water"}], max_tokens=6, temperature=0,
            extra_body={"session": sid},
        )
        reply = turn.parse()
        assert reply.choices[0].message.content  # the reply made is the client's, with a note
        assert reply.session is None and reply.model_extra["stored"] is False
        assert "not stored: the disk is full" in reply.model_extra["store_error"]
        assert turn.headers["X-Store-Error"] == "disk_full" and turn.headers["X-Session-Id"] == sid
        streamed = list(s.ask("and the sun", extra_body={"session": sid}, stream=True))
        assert "disk is full" in streamed[-1].model_extra["store_error"]

        whole = s.ask([{"role": "user", "content": "a new conversation"}], temperature=0)
        assert whole.choices[0].message.content and whole.model_extra["stored"] is False
        assert len(store.list_sessions()) == sessions  # not an empty session: none at all
        messages = json.loads(s.raw("GET", f"/v1/sessions/{sid}")[2])["messages"]
        assert [m["content"] for m in messages] == ["hello there", first.choices[0].message.content]

        fill_up(lambda: store.create_session("x"))  # no room for a session either
        for method, path in [("POST", "/v1/sessions"), ("POST", f"/v1/sessions/{sid}/fork")]:
            status, error = error_of(s.raw(method, path, b"{}", {"Content-Type": "application/json"}))
            assert status == 507 and error["code"] == "disk_full" and str(tmp_path) not in error["message"]
    finally:
        s.stop()
    log = capfd.readouterr().err
    assert "Traceback" not in log
    assert sum("disk is full" in line for line in log.splitlines()) == 5  # one line for each


def test_a_client_leaving_while_its_conversation_is_stored_does_not_cancel_the_storing():
    storing = Future()  # the writer's: it stores the conversation, then frees the KV it holds
    job = SimpleNamespace(result=storing, error=None)

    async def stream_left():
        waiting = asyncio.ensure_future(kept_where(job))
        await asyncio.sleep(0)
        waiting.cancel()  # as the stream's task is, when its client leaves
        for _ in range(3):
            await asyncio.sleep(0)

    asyncio.run(stream_left())
    assert not storing.cancelled()  # (once cancelled, the writer would never run it, nor free its KV)


def test_after_a_restart_only_the_new_turn_is_computed(tmp_path, qwen2):
    db = tmp_path / "chat.db"
    first = Served(db, qwen2).wait_ready()
    sid = json.loads(first.raw("POST", "/v1/sessions", json.dumps({"system_prompt": SYSTEM}).encode())[2])[
        "id"
    ]
    first.ask("hello there, tell me of the world", extra_body={"session": sid}, seed=1, max_tokens=20)
    plain = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "the water"}]
    reply = first.ask(plain, seed=1, max_tokens=20)
    first.stop()

    again = Served(db, qwen2).wait_ready()  # a new process's pool: empty; the database has the KV
    try:
        engine = again.state.engine
        held = chat_prompt_ids(again.model, engine._cache.messages(engine._store.get_session(sid)), False)
        turn = again.ask("and the sun", extra_body={"session": sid}, seed=1)
        assert turn.usage.prompt_tokens_details.cached_tokens == len(held)  # blocks and tail, from disk

        plain += [{"role": "assistant", "content": reply.choices[0].message.content},
                  {"role": "user", "content": "and then"}]
        before = chat_prompt_ids(again.model, plain[:-1], False)
        more = again.ask(plain, seed=1)
        assert more.session == reply.session
        assert len(before) % BLOCK  # so its stored tail is needed too: only the new message is computed
        assert more.usage.prompt_tokens_details.cached_tokens == len(before)
    finally:
        again.stop()


def test_serve_on_the_command_line(tmp_path, qwen2):
    env = {**os.environ, "LLAMA_CHAT_API_KEY": "k"}
    cmd = [sys.executable, "-m", "llama_chat", "--db", str(tmp_path / "chat.db"), "--model", str(qwen2),
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
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.usage.completion_tokens <= 4
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()


def up_to_its_first_text(response) -> bytes:
    """What a stream sent up to the first piece of its reply's text (the lines read)."""
    read = b""
    while True:
        line = response.readline()
        assert line, "the stream ended"
        read += line
        if line.startswith(b"data: {") and sse_texts(line)[0]:
            return read


@pytest.mark.parametrize("drain", [None, "0"])
def test_sigterm_mid_stream_lets_each_stream_finish_or_cuts_it_at_drain_seconds(tmp_path, qwen2, drain):
    """SIGTERM drains: the streams under way finish whole (for --drain-seconds, 30 by default), their
    turns stored, then the server exits 0. Past --drain-seconds (here 0) each stream ends saying it was
    cut short, and what was made is stored."""
    db = tmp_path / "chat.db"
    cmd = [sys.executable, "-m", "llama_chat", "--db", str(db), "--model", str(qwen2), "--no-lookup",
           "serve", "--port", "0", *(["--drain-seconds", drain] if drain else [])]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        base = proc.stderr.readline().split("listening on ")[1].split()[0]
        for line in proc.stderr:
            assert "error" not in line
            if "ready" in line:
                break
        host, port = base.removeprefix("http://").split(":")
        created = http.client.HTTPConnection(host, int(port))
        created.request("POST", "/v1/sessions", "{}", {"Content-Type": "application/json"})
        sid = json.loads(created.getresponse().read())["id"]
        asks = [{"session": sid, "messages": [{"role": "user", "content": LONG}]},  # a stored session's turn
                {"messages": [{"role": "user", "content": LONG + " z"}]}]  # a conversation sent whole
        streams = []
        for ask in asks:
            conn = http.client.HTTPConnection(host, int(port))
            body = {"model": MODEL, "stream": True, "temperature": 0, "max_tokens": 240, **ask}
            conn.request(
                "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
            )
            response = conn.getresponse()
            assert response.status == 200
            streams.append((response, up_to_its_first_text(response)))
        proc.send_signal(signal.SIGTERM)  # mid-reply: each has sent some of its text
        for response, began in streams:
            text, events = sse_texts(began + response.read())  # read() fails on a cut chunked body
            assert events[-1] == "[DONE]"
            end = events[-2]
            if drain == "0":
                assert end["error"]["code"] == "shutting_down" and "cut short" in end["error"]["message"]
                assert end["session"] in end["error"]["message"]
            else:
                assert "error" not in end and end["choices"][0]["finish_reason"] in ("stop", "length")
            assert end["stored"]
            with contextlib.closing(ChatStore(db)) as store:  # (SQLite lets another reader in)
                last = store.path(store.get_session(end["session"]).head_id)[-1]
            assert last.role == "assistant" and last.content == text
            assert (last.stats["stop_reason"] == "cancelled") == (drain == "0")
        assert proc.wait(60) == 0
        log = proc.stderr.read()
        assert "Traceback" not in log and "without completing response" not in log
        assert ("draining" in log) == (drain is None) and log.rstrip().endswith("stopped (SIGTERM)")
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()


def health_of(s: Served) -> tuple[int, dict]:
    """GET /health, given 10 s at most to answer."""
    conn = http.client.HTTPConnection(*s.url.removeprefix("http://").split(":"), timeout=10)
    try:
        conn.request("GET", "/health")
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_health_says_loading_ready_or_draining_and_never_waits_on_the_engine(tmp_path, qwen2):
    s, loaded = held_loading(tmp_path / "chat.db", qwen2)
    try:
        assert health_of(s) == (503, {"status": "loading", "model": MODEL})
        loaded.set()
        s.wait_ready()
        conn = http.client.HTTPConnection(*s.url.removeprefix("http://").split(":"), timeout=30)
        body = {"model": MODEL, "stream": True, "temperature": 0, "max_tokens": 40,
                "messages": [{"role": "user", "content": LONG}]}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        taken, deadline = False, time.monotonic() + 30
        while not taken:  # the engine's lock taken while the reply is under way, as through a step of a
            assert time.monotonic() < deadline, "the reply never ran"  # long prefill: between two of its
            time.sleep(0.001)  # steps (taken after its first text, a fast reply could end first)
            with s.scheduler.lock:
                if s.scheduler.load()["active"] != 1:
                    continue
                taken = True
                status, health = health_of(s)
                assert status == 200 and health["status"] == "ready" and health["active"] == 1
                s.server.handle_exit(signal.SIGTERM, None)  # (a signal: the server's thread cannot get one)
                assert health_of(s) == (503, {"status": "draining", "model": MODEL})
                status, error = error_of(
                    post(s, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
                )
                assert status == 503 and error["code"] == "draining"
        text, events = sse_texts(response.read())  # the stream under way finishes whole
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert events[-2]["stored"] and len(text) > 0
        s.thread.join(30)  # then the server stops by itself
        assert not s.thread.is_alive() and s.server.stopped_by == "SIGTERM"
    finally:
        loaded.set()
        if s.thread.is_alive():
            s.stop()


def test_a_request_taken_before_a_sigterm_is_answered_whole_though_its_reply_was_not_yet_queued(
    tmp_path, qwen2, monkeypatch
):
    """The drain waits for every request taken while ready, not only for the replies the engine runs:
    one still being prepared at the SIGTERM (tokenized, its KV looked for in the tiers) streams whole
    and is stored, where closing would have answered it 503."""
    s = Served(tmp_path / "chat.db", qwen2).wait_ready()
    engine, preparing, go = s.state.engine, threading.Event(), threading.Event()
    reply = engine.reply

    def prepared_slowly(*args, **kwargs):
        preparing.set()
        go.wait(30)
        return reply(*args, **kwargs)

    monkeypatch.setattr(engine, "reply", prepared_slowly)
    answer = Future()

    def ask() -> None:
        body = {"model": MODEL, "stream": True, "temperature": 0, "max_tokens": 8,
                "messages": [{"role": "user", "content": "hello"}]}
        try:
            answer.set_result(post(s, body))
        except Exception as e:  # noqa: BLE001 — the test says it
            answer.set_exception(e)

    client = threading.Thread(target=ask)
    try:
        client.start()
        assert preparing.wait(30)
        s.server.handle_exit(signal.SIGTERM, None)  # (a signal, as the server's thread cannot get one)
        with contextlib.suppress(AssertionError):
            wait_for(lambda: s.server.should_exit, timeout_s=1)  # (without the count it stops at once)
        assert not s.server.should_exit and s.state.phase == "draining"
        go.set()
        status, _, body = answer.result(60)
        text, events = sse_texts(body)
        assert status == 200 and events[-1] == "[DONE]" and events[-2]["stored"] and text
        s.thread.join(30)  # then the server stops by itself
        assert not s.thread.is_alive() and s.server.stopped_by == "SIGTERM"
    finally:
        go.set()
        client.join(60)
        if s.thread.is_alive():
            s.stop()


def test_tenants_see_only_their_own_sessions_and_reuse_only_their_own_kv(tmp_path, qwen2):
    keys = tmp_path / "keys.txt"
    keys.write_text("# name:key\nalice:key-a\nbob:key-b\n")
    tenants = api_keys_from(["@" + str(keys)])
    assert tenants == {"key-a": "alice", "key-b": "bob"}
    s = Served(tmp_path / "chat.db", qwen2, api_key=tenants).wait_ready()
    try:
        alice, bob = (
            openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0) for key in ("key-a", "key-b")
        )

        def as_(key: str, method: str, path: str, body: dict | None = None):
            data = None if body is None else json.dumps(body).encode()
            return s.raw(
                method, path, data, {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
            )

        sid = json.loads(as_("key-a", "POST", "/v1/sessions", {"system_prompt": SYSTEM})[2])["id"]
        hello = [{"role": "user", "content": "hello there"}]
        alice.chat.completions.create(model=MODEL, messages=hello, max_tokens=4, extra_body={"session": sid})
        assert [x["id"] for x in json.loads(as_("key-a", "GET", "/v1/sessions")[2])["data"]] == [sid]
        assert json.loads(as_("key-b", "GET", "/v1/sessions")[2])["data"] == []
        for method, path, body in [
            ("GET", f"/v1/sessions/{sid[:2]}", None),
            ("GET", f"/v1/sessions/{sid}", None),
            ("POST", f"/v1/sessions/{sid}/fork", {}),
            ("GET", f"/v1/sessions/{sid}/export", None),
            ("DELETE", f"/v1/sessions/{sid}", None),
        ]:
            assert as_("key-b", method, path, body)[0] == 404, path
        with pytest.raises(openai.NotFoundError):
            bob.chat.completions.create(
                model=MODEL, messages=hello, max_tokens=4, extra_body={"session": sid}
            )
        assert as_("key-a", "GET", f"/v1/sessions/{sid}")[0] == 200  # still there, as alice left it

        # the system prompt's blocks alice's session computed are hers: bob's same prompt computes them
        asked = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "the sun"}]
        cached = {}
        for name, client in [("bob", bob), ("alice", alice), ("bob again", bob)]:
            reply = client.chat.completions.create(model=MODEL, messages=asked, max_tokens=4)
            cached[name] = reply.usage.prompt_tokens_details.cached_tokens
        assert cached["bob"] == 0 and cached["alice"] >= BLOCK and cached["bob again"] >= BLOCK

        # a prompt_cache_key scopes sharing within a tenant
        other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "the water"}]
        scoped = [alice.chat.completions.create(model=MODEL, messages=other, max_tokens=4,
                                                extra_body={"prompt_cache_key": "team-x"}) for _ in range(2)]
        assert [r.usage.prompt_tokens_details.cached_tokens for r in scoped][0] == 0
        assert scoped[1].usage.prompt_tokens_details.cached_tokens >= BLOCK
    finally:
        s.stop()


def test_one_api_key_has_no_tenant_and_several_one_each(monkeypatch):
    assert api_keys_from(["k1"]) == {"k1": None}  # as before tenants: it sees every session
    monkeypatch.setenv("LLAMA_CHAT_API_KEY", "from-env")
    assert api_keys_from(None) == {"from-env": None}
    several = api_keys_from(["k1", "k2"])
    assert set(several) == {"k1", "k2"} and len(set(several.values())) == 2 and None not in several.values()
    assert api_keys_from(["k2", "k1"]) == several  # named by the key, not by its place
    with pytest.raises(ValueError):
        api_keys_from(["k1", "k1"])


def test_a_bad_api_keys_file_is_one_line(tmp_path, qwen2, capsys):
    keys = tmp_path / "keys.txt"
    keys.write_text("alice:key-a\njust-a-key\n")
    db = ["--db", str(tmp_path / "chat.db"), "--model", str(qwen2)]
    assert main([*db, "serve", "--port", "0", "--api-key", f"@{keys}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "line 2: expected 'name:key'" in err


def test_the_cli_and_the_server_share_a_session_while_it_runs(served, qwen2, capsys):
    sid = json.loads(served.raw("POST", "/v1/sessions", b"{}")[2])["id"]
    served.ask("hello there", extra_body={"session": sid}, seed=1, max_tokens=4)
    db = str(served.state.options.db)
    assert (
        main(["--db", db, "--model", str(qwen2), "ask", "--session", sid, "--max-tokens", "4", "the water"])
        == 0
    )
    served.ask("and the sun", extra_body={"session": sid}, seed=1, max_tokens=4)
    messages = json.loads(served.raw("GET", f"/v1/sessions/{sid}")[2])["messages"]
    assert [m["content"] for m in messages if m["role"] == "user"] == [
        "hello there",
        "the water",
        "and the sun",
    ]
