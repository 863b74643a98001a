"""The conversation store: schema versions, sessions, the message tree, search, block bookkeeping."""

from __future__ import annotations

import json
import sqlite3

import pytest

from llama_chat.app.cli import main
from llama_chat.storage import SCHEMA_VERSION, ChatStore, StoreError
from llama_chat.storage.records import StoredBlock, StoredTail


@pytest.fixture
def store(tmp_path):
    return ChatStore(tmp_path / "chat.db")


def conversation(store, turns=2, title="chat"):
    s = store.create_session(title, system_prompt="be brief")
    for i in range(turns):
        store.add_message(s.id, "user", f"question {i}")
        store.add_message(s.id, "assistant", f"answer {i}")
    return store.get_session(s.id)


def test_a_new_database_has_the_schema_and_pragmas(tmp_path):
    store = ChatStore(tmp_path / "new" / "chat.db")
    conn = store.db.conn
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"models", "messages", "sessions", "kv_blocks", "session_tails", "titles_fts"} <= tables


def test_a_database_from_a_newer_version_is_refused_and_left_untouched(tmp_path, capsys):
    path = tmp_path / "future.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE future (x)")
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 5}")
    conn.commit()
    conn.close()
    before = path.read_bytes()
    with pytest.raises(StoreError, match="written by a newer llama-chat"):
        ChatStore(path)
    assert main(["--db", str(path), "sessions", "list"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("llama-chat: error: ") and "newer llama-chat" in err and "\n" not in err
    assert path.read_bytes() == before
    assert not (tmp_path / "future.db-wal").exists()


def test_a_file_that_is_not_a_database_is_one_clear_line(tmp_path, capsys):
    path = tmp_path / "notes.txt"
    path.write_text("just some notes, not SQLite " * 100)
    assert main(["--db", str(path), "sessions", "list"]) == 2
    assert "not a llama-chat database" in capsys.readouterr().err
    assert path.read_text().startswith("just some notes")


def test_messages_form_a_tree_and_sessions_point_into_it(store):
    s = conversation(store)
    path = store.path(s.head_id)
    assert [m.role for m in path] == ["user", "assistant"] * 2
    assert [m.content for m in path][-1] == "answer 1"
    assert path[0].parent_id is None and all(b.parent_id == a.id for a, b in zip(path, path[1:]))


def test_fork_shares_messages_and_diverges(store):
    s = conversation(store)
    at = store.path(s.head_id)[1].id  # after the first answer
    fork = store.fork_session(s.id, at)
    assert fork.forked_from == s.id and fork.head_id == at
    store.add_message(fork.id, "user", "a different question")
    assert [m.content for m in store.path(store.get_session(fork.id).head_id)] == [
        "question 0",
        "answer 0",
        "a different question",
    ]
    assert store.path(store.get_session(s.id).head_id)[-1].content == "answer 1"  # the parent is unchanged
    with pytest.raises(StoreError, match="not in session"):
        store.fork_session(s.id, 10_000)


def test_sessions_by_unique_prefix(store):
    a = store.create_session("a")
    assert store.get_session(a.id[:6]).id == a.id
    with pytest.raises(StoreError, match="unknown session 'zz'"):
        store.get_session("zz")
    with pytest.raises(StoreError, match="unknown session"):
        store.get_session("'; DROP TABLE sessions; --")


def test_delete_keeps_messages_other_sessions_reach(store):
    s = conversation(store)
    fork = store.fork_session(s.id, store.path(s.head_id)[1].id)
    store.add_message(fork.id, "user", "fork only")
    removed = store.delete_session(s.id)
    assert removed == 2  # question 1 and answer 1; the first two belong to the fork too
    assert [m.content for m in store.path(store.get_session(fork.id).head_id)] == [
        "question 0",
        "answer 0",
        "fork only",
    ]
    with pytest.raises(StoreError):
        store.get_session(s.id)


def test_search_finds_the_session_of_a_message(store):
    s = conversation(store, title="first")
    other = store.create_session("second")
    store.add_message(other.id, "user", "tell me about zstandard compression")
    hits = store.search("zstandard")
    assert [(h[0].id, h[1].content) for h in hits] == [(other.id, "tell me about zstandard compression")]
    assert store.search("question")[0][0].id == s.id
    assert store.search('"unbalanced') == []  # quotes in the query are not an error


def test_search_finds_words_as_they_are_typed(store):
    """The sidebar searches at each key: the words so far find the messages whose words begin so."""
    conversation(store, title="first")
    other = store.create_session("second")
    store.add_message(other.id, "user", "rain tomorrow, then sailing")
    for typed in ("ra", "rai", "rain", "rain to", "sail rain"):
        assert [h[0].id for h in store.search(typed)] == [other.id], typed
    assert store.search("ain") == []  # the start of a word, not anywhere in it


def test_search_finds_each_session_that_reaches_a_hit_newest_first(store):
    s = conversation(store, title="first")
    asked = store.path(s.head_id)[0]  # "question 0"
    fork = store.fork_session(s.id, at_message=asked.id)
    store.add_message(fork.id, "assistant", "a question answered on the fork")
    hits = [(session.id, message.content) for session, message in store.search("question")]
    # the fork's own message is the newest; the first question is reached by both, the newest session first
    assert hits[0] == (fork.id, "a question answered on the fork")
    assert (fork.id, "question 0") in hits and (s.id, "question 0") in hits
    assert hits.index((fork.id, "question 0")) < hits.index((s.id, "question 0"))
    assert (s.id, "question 1") in hits and (fork.id, "question 1") not in hits


def test_search_reads_the_same_rows_however_many_sessions_there_are(store):
    """Its cost is that of its hits: not one read of each session's path, as it once made."""

    def statements(query: str) -> int:
        seen = []
        store.db.conn.set_trace_callback(seen.append)
        try:
            assert store.search(query)
        finally:
            store.db.conn.set_trace_callback(None)
        return len([sql for sql in seen if not sql.startswith("--")])  # (not FTS5's own, which vary)

    store.add_message(conversation(store, title="about zstandard").id, "user", "zstandard levels")
    few = statements("zstandard")
    for i in range(30):
        conversation(store, title=f"other {i}")
    assert statements("zstandard") == few


def test_sessions_come_in_pages_newest_first(store, capsys):
    made = [conversation(store, turns=1, title=f"chat {i}").id for i in range(7)]
    newest_first = made[::-1]
    pages = [[s.id for s in store.list_sessions(limit=3, offset=at)] for at in (0, 3, 6)]
    assert pages == [newest_first[:3], newest_first[3:6], newest_first[6:]]
    assert [s.id for s in store.list_sessions()] == newest_first
    db = ["--db", str(store.db_path)]
    assert main([*db, "sessions", "list", "--limit", "2", "--offset", "1"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert [row.split()[0] for row in rows] == newest_first[1:3]
    with pytest.raises(SystemExit) as exit:
        main([*db, "sessions", "list", "--limit", "0"])
    assert exit.value.code == 2 and "--limit: must be 1 or more" in capsys.readouterr().err


def test_sessions_listed_by_who_made_them_and_by_words_of_their_title(store):
    mine = conversation(store, turns=1, title="Notes on 100% of the_plan")
    api = store.create_session("API chat about the plan", origin="api")
    other = conversation(store, turns=1, title="groceries")
    assert [s.id for s in store.list_sessions(origin="api")] == [api.id]
    assert [s.id for s in store.list_sessions(origin="api", other_origins=True)] == [other.id, mine.id]
    assert [s.id for s in store.list_sessions(titled="PLAN")] == [api.id, mine.id]
    assert [s.id for s in store.list_sessions(titled="plan notes")] == [mine.id]
    assert [s.id for s in store.list_sessions(titled="100%")] == [mine.id]  # % and _ are letters here
    assert store.list_sessions(titled="s_o") == store.list_sessions(titled="0%o") == []  # not wildcards


def test_snapshot_bookkeeping_and_gc(store):
    s = conversation(store)
    blocks = [StoredBlock(bytes([i]) * 16, 64, "q8", b"x" * 1000, "c") for i in range(3)]
    tail = StoredTail(blocks[-1].key, [1, 2, 3], "q8", b"t" * 50, "c")
    store.kv.save_snapshot(s.id, "fp", [b.key for b in blocks], blocks, tail, 195)
    assert store.get_session(s.id).n_tokens == 195
    assert store.kv.stored_keys([b.key for b in blocks] + [b"nope"]) == {b.key for b in blocks}
    assert store.kv.load_tail(s.id, "fp").tokens == [1, 2, 3]
    assert store.kv.load_tail(s.id, "other model") is None
    assert store.kv.load_block(blocks[0].key, "other model") is None
    fork = store.fork_session(s.id)
    assert store.kv.load_tail(fork.id, "fp").tokens == [1, 2, 3]  # a fork at the head shares the tail
    # a newer snapshot that needs only the first block leaves two for gc
    store.kv.save_snapshot(s.id, "fp", [blocks[0].key], [], None, 64)
    store.delete_session(fork.id)
    result = store.kv.gc()
    assert result["blocks_removed"] == 2 and result["blocks"] == 1
    assert store.kv.gc(budget_bytes=0)["blocks"] == 0  # over budget even needed blocks go (recomputed later)


def test_sessions_cli(store, capsys, tmp_path):
    s = conversation(store, title="about caches")
    db = ["--db", str(store.db_path)]
    assert main([*db, "sessions", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed[0]["id"] == s.id and {"id", "title", "forked_from", "head", "updated", "n_tokens"} <= set(
        listed[0]
    )
    assert main([*db, "sessions", "fork", s.id[:5]]) == 0
    fork_id = capsys.readouterr().out.strip()
    assert main([*db, "sessions", "rename", fork_id, "renamed"]) == 0
    assert main([*db, "sessions", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed[0]["id"] == fork_id and listed[0]["forked_from"] == s.id and listed[0]["title"] == "renamed"
    assert main([*db, "sessions", "show", fork_id]) == 0
    assert "answer 1" in capsys.readouterr().out
    assert main([*db, "sessions", "search", "question"]) == 0
    found = capsys.readouterr().out
    assert "question 0" in found and "question 1" in found
    assert main([*db, "sessions", "rm", fork_id]) == 0
    capsys.readouterr()
    assert main([*db, "sessions", "show", "abcdef"]) == 2
    assert "unknown session 'abcdef'" in capsys.readouterr().err
