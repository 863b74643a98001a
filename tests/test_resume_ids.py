"""The token ids a session keeps of its conversation, so that a resume need not tokenize it again: used
only when they were made from the same text, model and tokenizer; made again otherwise."""

from __future__ import annotations

import sqlite3

import pytest
from test_sessions import chat, engine_for

from llama_chat.storage import SCHEMA_VERSION, ChatStore


@pytest.fixture
def qwen2(tiny_model_paths):
    return tiny_model_paths["qwen2"]


def talked(path, db):
    """A session of two turns, stored (its KV and its kept ids) by one process."""
    first = engine_for(path, db)
    session = first.new_session("kept", system_prompt="the sun")
    chat(first, session, "hello the world " * 3, max_tokens=6)
    chat(first, first._store.get_session(session.id), "and then", max_tokens=6)
    return first, first._store.get_session(session.id)


def made_now(engine, session):
    """The conversation's ids as tokenizing its stored text makes them."""
    return engine._cache.stored_ids(engine._cache.messages(session))


def test_a_resume_takes_the_kept_ids_and_replies_as_the_live_session(qwen2, tmp_path):
    db = tmp_path / "chat.db"
    first, session = talked(qwen2, db)

    again = engine_for(qwen2, db)
    _, ids, kept = again._cache.stored_conversation(session)
    assert kept and ids == made_now(again, session)
    info = again.resume(session)
    assert info.restored == info.tokens == len(ids)
    live_reply, _ = chat(first, first.fork(session), "is it", max_tokens=6)
    resumed_reply, _ = chat(again, again.fork(session), "is it", max_tokens=6)
    assert resumed_reply == live_reply


def test_kept_ids_of_edited_text_another_model_or_damaged_are_made_again(qwen2, tiny_model_paths, tmp_path):
    db = tmp_path / "chat.db"
    _, session = talked(qwen2, db)
    conn = sqlite3.connect(db)

    # the user's first message edited in the database itself: its kept ids no longer stand for the text
    conn.execute(
        "UPDATE messages SET content = 'goodbye the moon' WHERE role = 'user' AND content LIKE 'hello%'"
    )
    conn.commit()
    edited = engine_for(qwen2, db)
    _, ids, kept = edited._cache.stored_conversation(session)
    assert not kept and ids == made_now(edited, session)
    assert edited.resume(session).tokens == len(ids)
    # and the reply is the one a database that never kept any ids gives
    reply, _ = chat(edited, edited.fork(session), "is it", max_tokens=6)
    conn.execute("DELETE FROM session_token_ids")
    conn.commit()
    never = engine_for(qwen2, db)
    assert chat(never, never.fork(session), "is it", max_tokens=6)[0] == reply

    _, session = talked(qwen2, tmp_path / "other.db")
    other = engine_for(tiny_model_paths["qwen3"], tmp_path / "other.db")  # same vocabulary, other model
    _, ids, kept = other._cache.stored_conversation(session)
    assert not kept and ids == made_now(other, session)

    # one flipped bit in the kept ids: never read as the conversation's tokens
    conn = sqlite3.connect(tmp_path / "other.db")
    (blob,) = conn.execute("SELECT ids FROM session_token_ids").fetchone()
    conn.execute("UPDATE session_token_ids SET ids = ?", (bytes([blob[0] ^ 1]) + blob[1:],))
    conn.commit()
    damaged = engine_for(qwen2, tmp_path / "other.db")
    _, ids, kept = damaged._cache.stored_conversation(session)
    assert not kept and ids == made_now(damaged, session)


def test_a_database_of_the_schema_before_kept_ids_is_upgraded_and_resumes(qwen2, tmp_path):
    db = tmp_path / "chat.db"
    first, session = talked(qwen2, db)
    live_reply, _ = chat(first, first.fork(session), "is it", max_tokens=6)
    first._store.close()
    conn = sqlite3.connect(db)  # as the version before kept ids left it
    conn.execute("DROP TABLE session_token_ids")
    conn.execute("ALTER TABLE messages DROP COLUMN reasoning")  # (step 8 made it)
    conn.execute("PRAGMA user_version = 5")  # (step 6 made session_token_ids)
    conn.commit()
    conn.close()

    upgraded = engine_for(qwen2, db)
    assert upgraded._store.db.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    _, ids, kept = upgraded._cache.stored_conversation(session)
    assert not kept and ids == made_now(upgraded, session)
    info = upgraded.resume(session)
    assert info.restored == info.tokens  # its KV comes back as before
    assert chat(upgraded, upgraded.fork(session), "is it", max_tokens=6)[0] == live_reply
    # the next reply's snapshot keeps the ids
    chat(upgraded, upgraded._store.get_session(session.id), "go on", max_tokens=4)
    assert engine_for(qwen2, db)._cache.stored_conversation(upgraded._store.get_session(session.id))[2]
    assert ChatStore(db).db.conn.execute("SELECT COUNT(*) FROM session_token_ids").fetchone()[0] >= 1


def test_kept_ids_of_another_encoding_are_made_again(qwen2, tmp_path):
    _, session = talked(qwen2, tmp_path / "chat.db")
    again = engine_for(qwen2, tmp_path / "chat.db")
    assert again._cache.stored_conversation(session)[2]  # kept, under this tokenizer's encoding
    again._model.tokenizer.encoding_version += 1  # a later tokenizer, which encodes some text otherwise
    _, ids, kept = again._cache.stored_conversation(session)
    assert not kept and ids == made_now(again, session)
