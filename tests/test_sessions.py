"""Persistent sessions end to end on tiny models: resume, fork, corrupt KV, crashes, two writers."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import time

import numpy as np
import pytest

from llama_chat.app.chat.engine import ChatEngine
from llama_chat.app.chat.jobs import stream_text
from llama_chat.app.cli import main
from llama_chat.inference import GenerationStats, SamplingParams, load_model
from llama_chat.storage import ChatStore

GREEDY = SamplingParams(temperature=0)


def engine_for(path, db, block_size=8):
    """A fresh model object and store: what a new process sees."""
    return ChatEngine(load_model(path, block_size=block_size), ChatStore(db))


@pytest.fixture
def qwen2(tiny_model_paths):
    return tiny_model_paths["qwen2"]


def chat(engine, session, text, max_tokens=12):
    stats = GenerationStats()
    reply = "".join(
        stream_text(engine.reply(session, text, sampling=GREEDY, max_tokens=max_tokens, stats=stats))
    )
    return reply, stats


def test_a_session_resumes_in_a_new_process_without_recomputing(qwen2, tmp_path):
    db = tmp_path / "chat.db"
    first = engine_for(qwen2, db)
    session = first.new_session("resume me", system_prompt="the sun")
    chat(first, session, "hello the world " * 2, max_tokens=6)
    chat(first, session, "and then", max_tokens=6)
    session = first._store.get_session(session.id)

    again = engine_for(qwen2, db)
    info = again.resume(session)
    assert info.tokens > 3 * 8 and info.restored == info.tokens  # every token back, nothing computed
    live_reply, _ = chat(first, first.fork(session), "is it", max_tokens=6)
    resumed_reply, stats = chat(again, again.fork(session), "is it", max_tokens=6)
    assert resumed_reply == live_reply
    assert stats.prefilled_tokens == stats.prompt_tokens - info.tokens  # only the new user turn was computed


def test_ask_with_sessions_on_the_command_line(qwen2, tmp_path, capsys):
    db = ["--db", str(tmp_path / "chat.db"), "--model", str(qwen2)]
    assert main([*db, "ask", "--new-session", "--temp", "0", "--max-tokens", "5", "hello the world"]) == 0
    err = capsys.readouterr().err
    session_id = next(line.split()[1] for line in err.splitlines() if line.startswith("session "))
    assert main([*db, "ask", "--session", session_id[:6], "--max-tokens", "5", "and then"]) == 0
    err = capsys.readouterr().err
    assert "restored" in err
    store = ChatStore(tmp_path / "chat.db")
    roles = [m.role for m in store.path(store.get_session(session_id).head_id)]
    assert roles == ["user", "assistant", "user", "assistant"]
    assert store.get_session(session_id).sampling == {"temperature": 0.0}  # settings persist
    assert main([*db, "ask", "--session", "0000ffff", "hi"]) == 2
    assert "unknown session '0000ffff'" in capsys.readouterr().err


def test_a_turn_reads_its_conversation_once_and_renders_its_prompt_once(qwen2, tmp_path):
    engine = engine_for(qwen2, tmp_path / "chat.db")
    session = engine.new_session("once", system_prompt="the sun")
    chat(engine, session, "hello the world", max_tokens=4)
    reads, renders = [], []
    store, template = engine._store, engine._model.chat_template
    path, render = store.path, template.render
    store.path = lambda head: reads.append(head) or path(head)

    def counted(messages, **options):
        renders.append(options["add_generation_prompt"])
        return render(messages, **options)

    template.render = counted
    chat(engine, store.get_session(session.id), "and then", max_tokens=4)
    assert len(reads) == 1  # the conversation, from SQLite
    # the prompt; then the conversation with its reply as it is kept for the next resume (its digest and ids)
    assert renders == [True, False]


def test_a_tools_answer_goes_below_the_reply_that_called_it_once_that_reply_is_stored(qwen2, tmp_path):
    engine = engine_for(qwen2, tmp_path / "chat.db")
    session = engine.new_session("tools")
    engine.reply(session, "what is the weather", sampling=GREEDY, max_tokens=6)
    answered = engine.answer_tool(session, '{"weather": "sun"}')  # (the reply is still being written)
    path = ChatStore(tmp_path / "chat.db").path(answered.head_id)
    assert [m.role for m in path] == ["user", "assistant", "tool"] and path[
        -1
    ].content == '{"weather": "sun"}'


def test_corrupt_missing_or_foreign_kv_is_recomputed(qwen2, tiny_model_paths, tmp_path):
    db = tmp_path / "chat.db"
    first = engine_for(qwen2, db)
    session = first.new_session("x")
    chat(first, session, "hello the world " * 8)
    session = first._store.get_session(session.id)
    expected, _ = chat(engine_for(qwen2, db), first._store.fork_session(session.id), "then")

    conn = sqlite3.connect(db)
    n_blocks = conn.execute("SELECT COUNT(*) FROM kv_blocks").fetchone()[0]
    assert n_blocks >= 3
    # one flipped byte in the middle of the second block's data
    key, data = conn.execute("SELECT key, data FROM kv_blocks ORDER BY rowid LIMIT 1 OFFSET 1").fetchone()
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0x40
    conn.execute("UPDATE kv_blocks SET data = ? WHERE key = ?", (bytes(bad), key))
    conn.commit()
    fresh = engine_for(qwen2, db)
    info = fresh.resume(session)
    assert 0 < info.restored < info.tokens
    assert conn.execute("SELECT COUNT(*) FROM kv_blocks WHERE key = ?", (key,)).fetchone()[0] == 0
    reply, _ = chat(fresh, fresh._store.fork_session(session.id), "then")
    assert reply == expected

    conn.execute("DELETE FROM kv_blocks")
    conn.execute("DELETE FROM session_tails")
    conn.commit()
    nothing = engine_for(qwen2, db)
    info = nothing.resume(session)
    assert info.restored == 0
    assert chat(nothing, nothing._store.fork_session(session.id), "then")[0] == expected

    other = engine_for(tiny_model_paths["qwen3"], db)  # same vocabulary, other model: other fingerprint
    info = other.resume(session)
    assert info.restored == 0


def test_a_reply_stopped_during_its_prefill_stores_what_was_read(qwen2, tmp_path):
    """Esc during a long prompt: the snapshot keeps the batches already read and computes nothing more;
    the next reply picks up from there and matches a conversation that was never stopped."""
    engine = engine_for(qwen2, tmp_path / "chat.db")
    engine._model.prefill_batch = 8
    session = engine.new_session("stopped")
    # Esc as the first batch is reported: the scheduler hears the cancel before its next batch
    job = engine.reply(
        session,
        "hello the world and the sun " * 4,
        sampling=GREEDY,
        on_event=lambda e: e.kind == "prefill" and e.job.cancel(),
    )
    job.wait()
    stopped = job.text()
    assert stopped == ""
    stored = engine._store.path(engine._store.get_session(session.id).head_id)
    assert [m.role for m in stored] == ["user", "assistant"] and stored[-1].stats[
        "stop_reason"
    ] == "cancelled"
    engine.resume(engine._store.get_session(session.id))
    assert engine._cache.seq(session.id).n_tokens == 8  # the one batch read before the stop, not all of it
    info = engine_for(qwen2, tmp_path / "chat.db").resume(engine._store.get_session(session.id))
    assert info.restored == 8  # and that is what was stored
    after, stats = chat(engine, engine._store.get_session(session.id), "and then")
    assert stats.prefilled_tokens < stats.prompt_tokens

    other = engine_for(qwen2, tmp_path / "other.db")  # the same conversation, never stopped
    twin = other.new_session("twin")
    other._store.add_message(twin.id, "user", "hello the world and the sun " * 4)
    other._store.add_message(twin.id, "assistant", "")
    assert chat(other, other._store.get_session(twin.id), "and then")[0] == after


def test_fork_is_quick_and_adds_at_most_one_block(qwen2, tmp_path):
    db = tmp_path / "chat.db"
    engine = engine_for(qwen2, db)
    session = engine.new_session("x")
    chat(engine, session, "hello the world " * 4)
    session = engine._store.get_session(session.id)
    conn = sqlite3.connect(db)

    def stored():
        return conn.execute(
            "SELECT (SELECT COUNT(*) FROM kv_blocks), (SELECT COUNT(*) FROM session_tails)"
        ).fetchone()

    blocks, tails = stored()
    fork = engine.fork(session)
    assert stored() == (blocks, tails + 1)  # no block copied; the fork shares the tail record
    again = engine_for(qwen2, db)
    info = again.resume(again._store.get_session(fork.id))
    assert info.restored == info.tokens


def test_regenerate_and_edit_make_sibling_branches(qwen2, tmp_path):
    engine = engine_for(qwen2, tmp_path / "chat.db")
    session = engine.new_session("x")
    chat(engine, session, "hello the world")
    session = engine._store.get_session(session.id)
    original = engine._store.path(session.head_id)
    made, job = engine.regenerate(
        session, n=3, sampling=SamplingParams(temperature=5.0, seed=1), max_tokens=6
    )
    job.wait()
    assert len(made) == len(job.result) == 3
    for i, (branch, saved) in enumerate(zip(made, job.result, strict=True)):
        assert saved.session.id == branch.id
        text = job.text(i)
        path = engine._store.path(saved.session.head_id)
        assert path[0].id == original[0].id  # the same user message
        assert path[1].id != original[1].id and path[1].content == text  # a sibling reply
    assert engine._store.path(engine._store.get_session(session.id).head_id) == original  # untouched
    branch, job = engine.edit(session, original[0].id, "the water")
    job.wait()
    path = engine._store.path(engine._store.get_session(branch.id).head_id)
    assert [m.content for m in path][0] == "the water" and path[0].parent_id is None
    assert len(engine._store.list_sessions()) == 5


def test_an_earlier_reply_regenerates_beside_itself_and_an_empty_edit_makes_no_branch(qwen2, tmp_path):
    engine = engine_for(qwen2, tmp_path / "chat.db")
    session = engine.new_session("x")
    chat(engine, session, "hello the world", max_tokens=4)
    chat(engine, session, "and then", max_tokens=4)
    session = engine._store.get_session(session.id)
    first_question, first_reply = engine._store.path(session.head_id)[:2]
    (branch,), job = engine.regenerate(session, reply_id=first_reply.id, max_tokens=4, sampling=GREEDY)
    job.wait()
    path = engine._store.path(engine._store.get_session(branch.id).head_id)
    assert path[0].id == first_question.id
    assert len(path) == 2  # the later turn is not in it
    with pytest.raises(ValueError, match="empty"):
        engine.edit(session, first_question.id, "  ")
    with pytest.raises(ValueError, match="only a user message"):
        engine.edit(session, first_reply.id, "hello")
    assert len(engine._store.list_sessions()) == 2  # the session and the regenerated branch, nothing else


def test_delete_waits_for_the_turn_being_made_and_lets_go_of_its_kv(qwen2, tmp_path):
    import threading

    engine = engine_for(qwen2, tmp_path / "chat.db")
    session = engine.new_session("doomed")
    writing, go_on, deleted = threading.Event(), threading.Event(), threading.Event()

    def hold(event):  # the reply is held after its first piece, until the delete has been asked for
        if event.kind == "text" and not writing.is_set():
            writing.set()
            go_on.wait(60)

    job = engine.reply(session, "hello the world", sampling=GREEDY, max_tokens=6, on_event=hold)
    writing.wait(60)
    deleter = threading.Thread(target=lambda: engine.delete(session.id) and deleted.set())
    deleter.start()
    assert not deleted.wait(0.2) and engine._store.get_session(session.id)  # it waits for the turn
    go_on.set()
    deleter.join(60)
    assert job.error is None and job.result.session.id == session.id  # the turn was stored, then deleted
    assert deleted.is_set() and engine._store.list_sessions() == [] and engine._cache.seq(session.id) is None


def test_the_sessions_service_works_before_a_model_and_through_the_engine_once_one_is_built(qwen2, tmp_path):
    from llama_chat.app.chat.build import EngineOptions, open_engine
    from llama_chat.app.chat.sessions import Sessions

    db = tmp_path / "chat.db"
    first = engine_for(qwen2, db)
    session = first.new_session("Weather report")
    chat(first, session, "hello the world", max_tokens=4)
    first.close()

    sessions = Sessions(db)  # no model: every verb of the tree works
    session, messages = sessions.read(session.id[:5])
    assert [m.role for m in messages] == ["user", "assistant"]
    assert [(s.id, m.id) for s, m in sessions.search("world")] == [(session.id, messages[0].id)]
    assert sessions.rename(session.id, "  Rain   tomorrow ").title == "Rain tomorrow"
    before = sessions.fork(session, before=messages[0].id, title="again")
    assert before.head_id is None and before.title == "again" and before.forked_from == session.id
    exported = tmp_path / "rain.llamachat"
    sessions.export(session.id, exported)
    imported = sessions.get(sessions.import_file(exported).session_ids[0])
    assert [m.content for m in sessions.messages(imported)] == [m.content for m in messages]
    assert sessions.delete(before.id) == 0  # its messages are the original's

    engine = open_engine(EngineOptions(model=str(qwen2), sessions=sessions))  # the same chats, on a model
    try:
        engine.resume(session)
        fork = sessions.fork(session)
        assert engine._cache.seq(fork.id) is not None  # the engine shares the parent's KV in RAM
        assert sessions.delete(fork.id) == 0 and engine._cache.seq(fork.id) is None  # and lets it go
        assert {s.id for s in sessions.list()} == {session.id, imported.id}
    finally:
        engine.close()
        sessions.close()


def test_a_conversation_that_outgrew_the_window_resumes_as_its_text_computes(qwen2, tmp_path):
    """Old turns dropped by context shift leave KV that still saw them: it is not the KV of the stored
    conversation and must not come back as if it were (in a new process, or to another server)."""
    db = tmp_path / "chat.db"
    first = engine_for(qwen2, db)
    session = first.new_session("long")
    for i in range(4):  # the third turn no longer fits: the first is dropped
        chat(
            first,
            first._store.get_session(session.id),
            f"question {i} " + "hello the world " * 3,
            max_tokens=20,
        )
    assert first._cache.seq(session.id).private  # shifted
    session = first._store.get_session(session.id)
    again = engine_for(qwen2, db)
    info = again.resume(session)
    resumed = again._cache.seq(session.id)
    assert info.restored > 0  # the blocks before the dropped turns still come back
    # the codec's rounding (about 2 %), not KV that attended to dropped turns (about 40 %)
    assert_kv_is_the_texts(again, session, resumed)


def assert_kv_is_the_texts(engine, session, resumed) -> None:
    """The KV a session resumed with is the KV its stored text computes, up to the codec's rounding.
    (None at all is right too where a kill came between a turn's messages and its KV: it is computed.)"""
    if resumed.n_tokens == 0:
        return
    computed = engine._model.new_sequence(engine.n_ctx, private=True)  # all of it computed from the text
    engine._model.forward(engine._cache.stored_conversation(session)[1], computed)
    k, v = resumed.gather(0, resumed.n_tokens)
    k_text, v_text = computed.gather(0, resumed.n_tokens)
    assert np.linalg.norm(k - k_text) < 0.05 * np.linalg.norm(k_text)
    assert np.linalg.norm(v - v_text) < 0.05 * np.linalg.norm(v_text)


CHILD = """
import sys
from llama_chat.app.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run_cli(args, env, stdout=subprocess.DEVNULL):
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, *args], env=env, stdout=stdout, stderr=subprocess.PIPE
    )


def test_killing_the_process_at_random_moments_loses_nothing_completed(qwen2, tmp_path):
    db = tmp_path / "chat.db"
    env = {**os.environ}
    base = ["--db", str(db), "--model", str(qwen2)]
    engine = engine_for(qwen2, db, block_size=64)
    sessions = [engine.new_session(f"s{i}") for i in range(2)]
    rng = random.Random(0)
    completed = []
    for i in range(9):
        s = sessions[i % 2]
        text = f"question number {i} " + "hello the world " * rng.randint(1, 12)
        ask = [*base, "ask", "--session", s.id, "--temp", "0", "--max-tokens", "40", text]
        proc = run_cli(ask, env, stdout=subprocess.PIPE)
        if i % 3:  # every third run finishes (in both sessions), however busy the machine is
            proc.stdout.read(1)  # the reply has begun: it is killed while written, stored or snapshotted
            time.sleep(rng.uniform(0, 0.25))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        proc.communicate()
        if proc.returncode == 0:
            completed.append((s.id, text))
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert 3 <= len(completed) < 9  # some runs were killed, some finished
    for _, text in completed:
        found = conn.execute(
            "SELECT id FROM messages WHERE role = 'user' AND content = ?", (text,)
        ).fetchall()
        assert found, text
        replies = conn.execute(
            "SELECT COUNT(*) FROM messages WHERE parent_id = ? AND role = 'assistant'", found[0]
        )
        assert replies.fetchone()[0] == 1, text
    unanswered = conn.execute(  # a killed run stores nothing: its question and reply go in together
        "SELECT COUNT(*) FROM messages q WHERE role = 'user' "
        "AND NOT EXISTS (SELECT 1 FROM messages a WHERE a.parent_id = q.id)"
    )
    assert unanswered.fetchone()[0] == 0
    fresh = engine_for(qwen2, db, block_size=64)
    for s in sessions:
        session = fresh._store.get_session(s.id)
        info = fresh.resume(session)
        resumed = fresh._cache.seq(session.id)
        assert info.tokens > 0 and session.head_id is not None  # what was stored opens
        # The KV that survived the kills is the KV of the stored text, up to the codec's rounding. (Not
        # compared as greedy replies: on the tiny random model the codec's rounding meets near-ties.)
        assert_kv_is_the_texts(fresh, session, resumed)
        reply, _ = chat(fresh, session, "still there?", max_tokens=3)  # and the session goes on
        path = fresh._store.path(fresh._store.get_session(s.id).head_id)
        assert [(m.role, m.content) for m in path[-2:]] == [("user", "still there?"), ("assistant", reply)]


def test_two_processes_writing_different_sessions_lose_nothing(qwen2, tmp_path):
    db = tmp_path / "chat.db"
    engine = engine_for(qwen2, db, block_size=64)
    a, b = engine.new_session("a"), engine.new_session("b")
    base = ["--db", str(db), "--model", str(qwen2)]
    for round_ in range(2):
        procs = [
            run_cli(
                [
                    *base,
                    "ask",
                    "--session",
                    s.id,
                    "--temp",
                    "0",
                    "--max-tokens",
                    "20",
                    f"round {round_} for {s.title}",
                ],
                os.environ,
            )
            for s in (a, b)
        ]
        for p in procs:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, err.decode()
    store = ChatStore(db)
    for s in (a, b):
        path = store.path(store.get_session(s.id).head_id)
        assert [m.content for m in path if m.role == "user"] == [f"round {r} for {s.title}" for r in range(2)]
        assert [m.role for m in path] == ["user", "assistant"] * 2


def test_a_conversation_longer_than_the_window_shifts_instead_of_recomputing(qwen2, tmp_path):
    engine = engine_for(qwen2, tmp_path / "chat.db")  # the tiny model's window is 256 tokens
    session = engine.new_session("long", system_prompt="be brief")
    shifted = False
    for i in range(12):
        _, stats = chat(engine, session, f"turn {i}: hello the world", max_tokens=8)
        assert stats.prompt_tokens <= 256 - 8
        seq = engine._cache.seq(session.id)
        if seq.private:  # old turns were dropped and the kept KV moved back
            shifted = True
            assert stats.prefilled_tokens < stats.prompt_tokens // 2
    assert shifted
    messages = engine._cache.messages(engine._store.get_session(session.id))
    assert len(messages) == 1 + 2 * 12  # every turn is still stored, only the window moved
