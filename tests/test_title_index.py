"""The index of the chats' titles: what the sidebar's filter finds, kept in step with every change of a
title, and built when a database from before it is opened."""

from __future__ import annotations

import sqlite3

import pytest

from llama_chat.storage import SCHEMA_VERSION, ChatStore, db, repair, search


@pytest.fixture
def store(tmp_path):
    return ChatStore(tmp_path / "chat.db")


def titled(store, text, **page):
    return [s.title for s in store.list_sessions(titled=text, **page)]


def in_step(store) -> bool:
    """FTS5's own check of the index against the titles it was built from."""
    try:
        store.db.conn.execute("INSERT INTO titles_fts (titles_fts, rank) VALUES ('integrity-check', 1)")
    except sqlite3.DatabaseError:
        return False
    return True


def test_a_title_is_found_by_any_part_of_its_words_in_any_case(store):
    for title in ("Ärger mit dem Drucker", "Conversation about plans", "A plan for Monday", 'say "hi" ok'):
        store.create_session(title)
    assert titled(store, "versat") == ["Conversation about plans"]  # inside a word, as before the index
    assert titled(store, "PLAN") == ["A plan for Monday", "Conversation about plans"]  # newest first
    assert titled(store, "plan mon") == ["A plan for Monday"]  # every word
    assert titled(store, "a plan") == ["A plan for Monday", "Conversation about plans"]  # "a": no trigram
    assert titled(store, "rger druck") == ["Ärger mit dem Drucker"]
    assert titled(store, '"hi"') == ['say "hi" ok']  # quotes are letters, not FTS5's syntax
    assert titled(store, "plan NOT monday") == titled(store, "plans NEAR") == []  # no operators
    assert titled(store, "PLAN", limit=1, offset=1) == ["Conversation about plans"]


def test_a_word_in_many_titles_is_found_newest_first_page_by_page(store, monkeypatch):
    monkeypatch.setattr(search, "TITLE_CANDIDATES", 2)  # more titles hold it than the index hands over
    for i in range(6):
        store.create_session(f"notes {i}" if i % 2 else f"other {i}")
    assert titled(store, "note") == ["notes 5", "notes 3", "notes 1"]
    assert titled(store, "notes", limit=2, offset=1) == ["notes 3", "notes 1"]


def test_renaming_forking_and_deleting_keep_the_index_in_step(store):
    first = store.create_session("alpha plans")
    store.add_message(first.id, "user", "hello")
    store.rename_session(first.id, "beta notes")
    assert titled(store, "alpha") == [] and titled(store, "beta") == ["beta notes"]
    store.update_session(first.id, title="gamma notes", system_prompt="be brief")
    fork = store.fork_session(first.id)
    assert titled(store, "gamma") == [fork.title, "gamma notes"]
    store.delete_session(first.id)
    assert titled(store, "gamma") == [fork.title]
    assert in_step(store)


def as_before_the_index(path):
    """The database as llama-chat wrote it before titles had an index."""
    conn = sqlite3.connect(path)
    for trigger in ("sessions_ai", "sessions_ad", "sessions_au"):
        conn.execute(f"DROP TRIGGER {trigger}")
    conn.execute("DROP TABLE titles_fts")
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION - 1}")
    conn.commit()
    conn.close()


def test_a_database_from_before_the_index_is_indexed_on_opening_telling_its_progress(tmp_path, monkeypatch):
    path = tmp_path / "chat.db"
    store = ChatStore(path)
    for title in ("trip to Lisbon", "tax return", "Lisbon again"):
        store.create_session(title)
    store.close()
    as_before_the_index(path)
    monkeypatch.setattr(db, "INDEX_BATCH", 2)
    told = []
    store = ChatStore(path, progress=lambda label, done, total: told.append((label, done, total)))
    assert store.db.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert titled(store, "lisbon") == ["Lisbon again", "trip to Lisbon"]
    assert [(done, total) for _, done, total in told] == [(2, 3), (3, 3)]
    store.create_session("Lisbon, the third time")
    assert len(titled(store, "lisbon")) == 3 and in_step(store)


def test_an_upgrade_stopped_half_way_leaves_the_database_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / "chat.db"
    store = ChatStore(path)
    for i in range(5):
        store.create_session(f"chat {i}")
    store.close()
    as_before_the_index(path)
    before = path.read_bytes()
    monkeypatch.setattr(db, "INDEX_BATCH", 2)

    def interrupted(label, done, total):
        if done > 2:
            raise KeyboardInterrupt  # Ctrl+C during the upgrade

    with pytest.raises(KeyboardInterrupt):
        ChatStore(path, progress=interrupted)
    assert path.read_bytes() == before
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION - 1
    assert not conn.execute("SELECT 1 FROM sqlite_master WHERE name LIKE 'titles_fts%'").fetchall()
    conn.close()
    assert titled(ChatStore(path), "chat 3") == ["chat 3"]  # the next start upgrades it


@pytest.mark.parametrize("sqlite3_command", [True, False], ids=["recover", "row by row"])
def test_a_recovered_database_finds_its_titles(tmp_path, monkeypatch, sqlite3_command):
    store = ChatStore(tmp_path / "chat.db")
    for title in ("trip to Lisbon", "tax return", "Lisbon again"):
        store.create_session(title)
    store.close()
    if not sqlite3_command:
        monkeypatch.setattr(repair.shutil, "which", lambda name: None)
    elif repair.shutil.which("sqlite3") is None:
        pytest.skip("no sqlite3 command here")
    repair.recover(tmp_path / "chat.db", tmp_path / "recovered.db")
    recovered = ChatStore(tmp_path / "recovered.db")
    assert titled(recovered, "lisbon") == ["Lisbon again", "trip to Lisbon"] and in_step(recovered)
