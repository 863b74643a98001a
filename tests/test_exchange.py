"""Session export and import files: round trips that resume without prefill, bad files that change nothing."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import sqlite3
import struct
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llama_chat.app.bench.stored import measure_exchange
from llama_chat.app.chat.engine import ChatEngine
from llama_chat.app.chat.jobs import stream_text
from llama_chat.app.cli import main
from llama_chat.inference import GenerationStats, SamplingParams, load_model
from llama_chat.storage import ChatStore
from llama_chat.storage.codec import encode_kv
from llama_chat.storage.exchange import (
    MAGIC,
    ExchangeError,
    export_session,
    import_session,
    read_session_file,
)

GREEDY = SamplingParams(temperature=0)
PROBE = "tell me more"  # the next user turn; the tiny model answers it with a non-empty greedy reply
# The documented layout, written out here so that a change to the format breaks a test:
# header (magic, version u16, manifest size u32, data size u64), zstd manifest, data, blake2b-256 digest.
HEADER = struct.Struct("<14sHIQ")
DIGEST = 32


def engine_for(path, db) -> ChatEngine:
    """A fresh model object and store: what a new process sees."""
    return ChatEngine(load_model(path, block_size=8), ChatStore(db))


def chat(engine, session, text, max_tokens=6):
    stats = GenerationStats()
    reply = "".join(
        stream_text(engine.reply(session, text, sampling=GREEDY, max_tokens=max_tokens, stats=stats))
    )
    return reply, stats


def run(*args) -> tuple[int, str, str]:
    """The command line in this process: exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


def unpack(data: bytes) -> tuple[dict, bytes]:
    """(manifest, data section) of a well-formed file."""
    _, _, manifest_size, data_size = HEADER.unpack_from(data)
    manifest = json.loads(
        zstandard.ZstdDecompressor().decompress(data[HEADER.size : HEADER.size + manifest_size])
    )
    start = HEADER.size + manifest_size
    return manifest, data[start : start + data_size]


def pack(manifest: dict | bytes, data: bytes, version=1, manifest_size=None, data_size=None) -> bytes:
    """A file with a valid digest around whatever it is given: checks past the digest must catch lies."""
    if isinstance(manifest, dict):
        manifest = json.dumps(manifest).encode()
    packed = zstandard.ZstdCompressor(write_checksum=True).compress(manifest)
    header = HEADER.pack(
        MAGIC,
        version,
        len(packed) if manifest_size is None else manifest_size,
        len(data) if data_size is None else data_size,
    )
    body = header + packed + data
    return body + hashlib.blake2b(body, digest_size=DIGEST).digest()


def folder_bytes(folder: Path) -> dict[str, bytes]:
    """Every file of the database's folder (the database, its WAL and shared memory if any)."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def conversation(store: ChatStore, session_id: str) -> list[tuple]:
    session = store.get_session(session_id)
    return [(m.role, m.content, m.token_ids, m.stats) for m in store.path(session.head_id)]


@pytest.fixture(scope="module")
def source(tmp_path_factory, tiny_model_paths):
    """A stored two-turn session on the tiny qwen2 model, its export file, and its next greedy reply."""
    folder = tmp_path_factory.mktemp("exchange")
    model = tiny_model_paths["qwen2"]
    with pytest.MonkeyPatch.context() as mp:  # module scope: isolate the cache by hand
        mp.setenv("XDG_CACHE_HOME", str(folder / "cache"))
        engine = engine_for(model, folder / "source.db")
        session = engine.new_session("a chat", system_prompt="the sun", sampling={"temperature": 0.0})
        chat(engine, session, "hello the world " * 2)
        chat(engine, session, "and then")
        session = engine._store.get_session(session.id)
        file = folder / "chat.llamachat"
        export_session(engine._store, session.id, file)
        expected, _ = chat(engine, engine.fork(session), PROBE)
        engine._store.close()
    assert expected
    return SimpleNamespace(
        model=model,
        db=folder / "source.db",
        session=session,
        file=file,
        data=file.read_bytes(),
        reply=expected,
    )


# -- round trips -------------------------------------------------------------------------------------


def test_a_session_imported_in_a_fresh_process_resumes_with_no_prefill(source, tmp_path):
    db = tmp_path / "empty" / "chat.db"
    out = subprocess.run(
        [sys.executable, "-m", "llama_chat", "--db", db, "--model", source.model, "import", source.file],
        capture_output=True,
        text=True,
        env=os.environ.copy(),
    )
    assert out.returncode == 0, out.stderr
    new_id = out.stdout.strip()
    assert len(new_id) == 12 and new_id != source.session.id
    assert "imported 'a chat'" in out.stderr and "saved model state" in out.stderr

    engine = engine_for(source.model, db)
    session = engine._store.get_session(new_id)
    assert (session.title, session.system_prompt, session.sampling) == (
        "a chat (imported)",  # not to be taken for its original
        "the sun",
        {"temperature": 0.0},
    )
    original = ChatStore(source.db)
    assert conversation(engine._store, new_id) == conversation(original, source.session.id)
    info = engine.resume(session)
    assert info.tokens > 3 * 8 and info.restored == info.tokens  # every imported token back, none computed
    reply, stats = chat(engine, session, PROBE)
    assert reply == source.reply
    assert stats.prefilled_tokens == stats.prompt_tokens - info.tokens  # only the new turn was computed


def test_export_and_import_on_the_command_line(source, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    db = tmp_path / "copy.db"
    shutil.copy(source.db, db)
    code, out, err = run("--db", db, "export", source.session.id[:6])
    assert code == 0, err
    written = Path(out.strip())
    assert written.name == f"a-chat-{source.session.id}.llamachat" and written.read_bytes().startswith(MAGIC)
    assert written.parent == tmp_path / "data" / "llama-chat" / "exports"  # not the current directory
    (tmp_path / "home" / "Downloads").mkdir(parents=True)
    code, out, err = run("--db", db, "export", source.session.id)
    assert Path(out.strip()) == tmp_path / "home" / "Downloads" / written.name  # where there is one
    assert "1 session(s), 4 message(s)" in err and "KV block(s)" in err

    code, out, err = run("--db", tmp_path / "other.db", "--model", source.model, "import", written)
    assert code == 0, err
    assert ChatStore(tmp_path / "other.db").get_session(out.strip()).title == "a chat (imported)"

    (tmp_path / "exports").mkdir()
    code, out, _ = run("--db", db, "export", source.session.id, "-o", tmp_path / "exports")
    assert (
        code == 0 and Path(out.strip()) == tmp_path / "exports" / written.name
    )  # a folder gets the usual name
    again = tmp_path / "exports" / written.name
    again.write_text("mine")
    code, out, err = run("--db", db, "export", source.session.id, "-o", again)
    assert (
        code == 2
        and out == ""
        and err == f"llama-chat: error: {again}: already exists; --force overwrites it\n"
    )
    assert again.read_text() == "mine"
    code, out, err = run("--db", db, "export", source.session.id, "-o", again, "--force")
    assert code == 0 and again.read_bytes().startswith(MAGIC)
    code, out, err = run("--db", db, "export", source.session.id, "-o", "-")
    assert code == 2 and out == "" and "binary" in err


def test_importing_never_overwrites_and_keeps_the_files_blocks_apart(source, tmp_path):
    db = tmp_path / "copy.db"
    shutil.copy(source.db, db)
    store = ChatStore(db)
    before = conversation(store, source.session.id)
    n_blocks = store.db.conn.execute("SELECT COUNT(*) FROM kv_blocks").fetchone()[0]
    fingerprint = source.session.model_fingerprint
    first = import_session(store, source.file, model_fingerprint=fingerprint)
    second = import_session(store, source.file, model_fingerprint=fingerprint)
    ids = {source.session.id, first.session_ids[0], second.session_ids[0]}
    assert len(ids) == 3  # two new sessions, the original untouched
    # each import's blocks live in a namespace of its own, even those equal to blocks stored here
    added = len(store.kv.block_keys(source.session.id))
    assert first.kv == "imported" and first.blocks_added == second.blocks_added == added
    assert added and "saved model state" in first.describe() and "sessions verify" in first.describe()
    assert store.db.conn.execute("SELECT COUNT(*) FROM kv_blocks").fetchone()[0] == n_blocks + 2 * added
    assert conversation(store, source.session.id) == before
    assert conversation(store, first.session_ids[0]) == before == conversation(store, second.session_ids[0])


def test_without_kv_the_file_is_small_and_the_first_reply_computes_it(source, tmp_path):
    out = tmp_path / "text-only.llamachat"
    assert run("--db", source.db, "export", source.session.id, "--no-kv", "-o", out)[0] == 0
    assert out.stat().st_size * 5 < len(source.data)
    assert not read_session_file(out).has_kv
    code, new_id, err = run("--db", tmp_path / "chat.db", "--model", source.model, "import", out)
    assert code == 0 and "holds no KV" in err
    engine = engine_for(source.model, tmp_path / "chat.db")
    session = engine._store.get_session(new_id.strip())
    assert engine.resume(session).restored == 0
    assert chat(engine, session, PROBE)[0] == source.reply  # the messages are the truth


def test_another_or_a_missing_model_gets_the_messages_and_recomputes_the_kv(
    source, tiny_model_paths, tmp_path
):
    db = tmp_path / "chat.db"
    code, new_id, err = run("--db", db, "--model", tiny_model_paths["llama"], "import", source.file)
    assert code == 0 and "recomputed on first use" in err
    code, _, err = run("--db", db, "--model", tmp_path / "gone.gguf", "import", source.file)
    assert code == 0 and "recomputed on first use" in err and "gone.gguf: no such file" in err
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT COUNT(*) FROM kv_blocks").fetchone()[0] == 0
    assert conn.execute("SELECT COUNT(*) FROM session_tails").fetchone()[0] == 0
    engine = engine_for(source.model, db)
    session = engine._store.get_session(new_id.strip())
    assert session.n_tokens == 0 and len(engine._store.path(session.head_id)) == 4
    assert chat(engine, session, PROBE)[0] == source.reply


def test_the_codec_option_re_encodes_the_kv(source, tmp_path):
    sizes = {}
    for codec in ("f32", "q4"):
        out = tmp_path / f"{codec}.llamachat"
        assert run("--db", source.db, "export", source.session.id, "--codec", codec, "-o", out)[0] == 0
        sizes[codec] = out.stat().st_size
        file = read_session_file(out)
        assert {b.codec for _, b in file.blocks} == {codec} and {t.codec for t in file.tails.values()} == {
            codec
        }
    assert sizes["q4"] * 2 < sizes["f32"]
    engine = engine_for(source.model, tmp_path / "chat.db")
    result = import_session(
        engine._store, tmp_path / "q4.llamachat", model_fingerprint=engine.model_info.fingerprint
    )
    info = engine.resume(engine._store.get_session(result.session_ids[0]))
    assert info.restored == info.tokens > 0
    code, _, err = run("--db", source.db, "export", source.session.id, "--codec", "q3", "-o", tmp_path / "x")
    assert code == 2 and "unknown KV codec 'q3'" in err and not (tmp_path / "x").exists()


def test_a_tree_export_brings_every_branch_and_each_block_once(tiny_model_paths, tmp_path):
    model = tiny_model_paths["qwen2"]
    engine = engine_for(model, tmp_path / "a.db")
    session = engine.new_session("tree")
    chat(engine, session, "hello the world " * 2)
    session = engine._store.get_session(session.id)
    engine.regenerate(session, max_tokens=6)[1].wait()
    edited, job = engine.edit(session, engine._store.path(session.head_id)[0].id, "hello there", max_tokens=6)
    job.wait()
    sessions = {s.id: s for s in engine._store.list_sessions()}
    assert len(sessions) == 3

    out = tmp_path / "tree.llamachat"
    summary = export_session(engine._store, session.id, out, tree=True)
    file = read_session_file(out)
    assert summary.sessions == len(file.sessions) == 3 and file.sessions[0].id == session.id
    all_keys = [k for keys in file.block_lists.values() for k in keys]
    assert len(file.blocks) == len(set(all_keys)) < len(all_keys)  # shared blocks travel once
    assert (
        len(
            read_session_file(
                export_session(engine._store, session.id, tmp_path / "b.llamachat").path
            ).sessions
        )
        == 1
    )

    fresh = engine_for(model, tmp_path / "b.db")
    result = import_session(fresh._store, out, model_fingerprint=fresh.model_info.fingerprint)
    assert len(result.session_ids) == 3
    new_ids = dict(zip([s.id for s in file.sessions], result.session_ids))
    for old_id, new_id in new_ids.items():
        assert conversation(fresh._store, new_id) == conversation(engine._store, old_id)
        forked_from = fresh._store.get_session(new_id).forked_from
        assert forked_from == new_ids.get(sessions[old_id].forked_from)
        info = fresh.resume(fresh._store.get_session(new_id))
        assert info.restored == info.tokens
    roots = fresh._store.db.conn.execute("SELECT COUNT(*) FROM messages WHERE parent_id IS NULL")
    roots = roots.fetchone()[0]
    assert roots == 2  # the edited first message is a root of its own, as it was


def test_a_markdown_transcript_is_for_people(source, tmp_path):
    code, out, err = run("--db", source.db, "export", source.session.id, "--markdown", "-o", "-")
    assert code == 0, err
    _, front, body = out.split("---\n", 2)
    yaml = pytest.importorskip("yaml")
    meta = yaml.safe_load(front)
    assert meta["title"] == "a chat" and meta["session"] == source.session.id
    assert meta["model"] == source.session.model_name and meta["sampling"] == {"temperature": 0.0}
    assert meta["system_prompt"] == "the sun" and meta["messages"] == 4
    store = ChatStore(source.db)
    position = 0
    for m in store.path(source.session.head_id):
        position = body.index(m.content, position)  # every message, in order
    assert body.count("## User") == 2 and body.count("## Assistant") == 2

    code, out, _ = run("--db", source.db, "export", source.session.id, "--markdown", "-o", tmp_path / "t.md")
    assert code == 0 and (tmp_path / "t.md").read_text().startswith('---\ntitle: "a chat"')
    code, _, err = run("--db", source.db, "export", source.session.id, "--markdown", "--tree")
    assert code == 2 and "--tree" in err


def test_a_markdown_transcript_goes_to_stdout_unless_a_file_is_named(source, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run("--db", source.db, "export", source.session.id, "--markdown")
    assert code == 0, err
    assert out.startswith('---\ntitle: "a chat"') and list(tmp_path.iterdir()) == []  # no file left behind


def test_a_stopped_reply_is_marked_and_its_code_block_closed_in_the_transcript(tmp_path):
    from markdown_it import MarkdownIt

    store = ChatStore(tmp_path / "chat.db")
    session = store.create_session("code")
    store.add_message(session.id, "user", "show me code")
    stopped = {"stop_reason": "cancelled", "generated_tokens": 9}
    store.add_message(session.id, "assistant", "Here:\n\n```python\ndef add(a, b):\n    ret", stats=stopped)
    store.add_message(session.id, "user", "go on")
    store.add_message(session.id, "assistant", "~~~\n```\n~~~\ndone", stats={"stop_reason": "eog"})
    code, out, err = run("--db", tmp_path / "chat.db", "export", session.id, "--markdown")
    assert code == 0, err
    tokens = MarkdownIt().parse(out.split("---\n", 2)[2])
    headings = [tokens[i + 1].content for i, t in enumerate(tokens) if t.type == "heading_open"]
    assert headings == ["code", "User", "Assistant (stopped)", "User", "Assistant"]  # none swallowed as code
    code_blocks = [t.content for t in tokens if t.type == "fence"]
    assert code_blocks == ["def add(a, b):\n    ret\n", "```\n"]  # a closed block is left as it was


def test_the_file_layout_is_as_documented(source):
    data = source.data
    magic, version, manifest_size, data_size = HEADER.unpack_from(data)
    assert (magic, version) == (MAGIC, 1)
    assert len(data) == HEADER.size + manifest_size + data_size + DIGEST
    assert hashlib.blake2b(data[:-DIGEST], digest_size=DIGEST).digest() == data[-DIGEST:]
    manifest, section = unpack(data)
    assert manifest["format"] == "llama-chat-session" and manifest["version"] == 1
    assert manifest["model"]["fingerprint"] == source.session.model_fingerprint
    assert {"messages", "sessions", "blocks"} <= set(manifest)
    sizes = [b["size"] for b in manifest["blocks"]] + [
        s["tail"]["size"] for s in manifest["sessions"] if s["tail"]
    ]
    assert sum(sizes) == len(section)
    first_key = bytes.fromhex(manifest["blocks"][0]["key"])
    stored = ChatStore(source.db).kv.load_block(first_key, source.session.model_fingerprint)
    assert section[: sizes[0]] == stored.data  # blocks travel as stored, not re-encoded


def test_measure_exchange_reports_times_and_sizes(source, tmp_path):
    db = tmp_path / "copy.db"
    shutil.copy(source.db, db)
    result = measure_exchange(ChatStore(db), source.session.id, tmp_path)
    assert result["kv"] == "imported" and result["tokens"] == source.session.n_tokens
    (exported,) = tmp_path.glob(f"*{source.session.id}*")
    assert result["file_bytes"] == exported.stat().st_size  # the file it wrote, as written
    assert result["size_ratio"] == result["file_bytes"] / result["stored_bytes"]
    (imported,) = ChatStore(tmp_path / "imported.db").list_sessions()
    assert imported.n_tokens == source.session.n_tokens  # the import it timed happened
    assert {"export_ms", "import_ms"} <= set(result)  # how fast: `llama-chat bench`, not asserted here


# -- bad files -----------------------------------------------------------------------------------------


@pytest.fixture
def target(source, tmp_path):
    """A database holding one imported session, closed: any change to its files would show."""
    folder = tmp_path / "target"
    folder.mkdir()
    store = ChatStore(folder / "chat.db")
    import_session(store, source.file, model_fingerprint=source.session.model_fingerprint)
    store.close()
    return folder


def import_fails(source, target: Path, data: bytes, where: Path) -> str:
    """Import `data` through the command line: one error line, exit 2, the database's files unchanged."""
    where.write_bytes(data)
    before = folder_bytes(target)
    code, out, err = run("--db", target / "chat.db", "--model", source.model, "import", where)
    assert code == 2, err
    assert out == "" and err.startswith("llama-chat: error: ") and err.count("\n") == 1, err
    assert str(where) in err
    assert folder_bytes(target) == before
    return err


def replace_block(manifest: dict, section: bytes, index: int, new: bytes) -> bytes:
    """The data section with block `index` replaced, and its manifest entry made to match."""
    sizes = [b["size"] for b in manifest["blocks"]]
    start = sum(sizes[:index])
    manifest["blocks"][index]["size"] = len(new)
    manifest["blocks"][index]["checksum"] = hashlib.blake2b(new, digest_size=16).hexdigest()
    return section[:start] + new + section[start + sizes[index] :]


def _tamper(case: str, data: bytes, source) -> bytes:
    manifest, section = unpack(data)
    if case == "newer version":
        return pack(manifest, section, version=2)
    if case == "huge data size":
        return pack(manifest, section, data_size=2**62)
    if case == "huge manifest size":
        return pack(manifest, section, manifest_size=2**31)
    if case == "sizes lie":
        manifest["blocks"][0]["size"] += 7
        return pack(manifest, section)
    if case == "sizes shifted":
        manifest["blocks"][0]["size"] += 5
        manifest["blocks"][1]["size"] -= 5
        return pack(manifest, section)
    if case == "manifest bomb":
        return pack(b'{"format": "' + b" " * (65 << 20) + b'"}', section)
    if case == "block bomb":
        zeros = np.zeros(
            (2, 2, 8, 2048), np.float32
        )  # a tiny model's 8-token block, claiming 2048-wide heads
        manifest["blocks"][0]["codec"] = "f32"
        return pack(manifest, replace_block(manifest, section, 0, encode_kv(zeros, zeros, "f32")))
    if case == "mislabelled codec":
        manifest["blocks"][0]["codec"] = "q4" if manifest["blocks"][0]["codec"] != "q4" else "q8"
        return pack(manifest, section)
    if case == "children first":
        manifest["messages"].reverse()
        return pack(manifest, section)
    if case == "not JSON":
        return pack(b"not json at all", section)
    if case == "another format":
        manifest["format"] = "other-tool"
        return pack(manifest, section)
    raise AssertionError(case)


BAD_FILES = {
    # name: (how the file is made from a good one, what the error line says)
    "empty": (lambda d, s: b"", "empty file"),
    "truncated": (lambda d, s: d[: len(d) // 2], "truncated"),
    "truncated header": (lambda d, s: d[:20], "truncated"),
    "one byte flipped": (lambda d, s: d[:300] + bytes([d[300] ^ 0x10]) + d[301:], "checksum mismatch"),
    "trailing bytes": (lambda d, s: d + b"\n", "more than its header declares"),
    "random bytes": (lambda d, s: np.random.default_rng(1).bytes(5000), "not a llama-chat session file"),
    "a SQLite database": (lambda d, s: s.db.read_bytes(), "not a llama-chat session file"),
    "a GGUF model": (lambda d, s: Path(s.model).read_bytes(), "not a llama-chat session file"),
    "a zstd frame": (lambda d, s: zstandard.compress(b"{}" * 100), "not a llama-chat session file"),
    "newer version": (
        lambda d, s: _tamper("newer version", d, s),
        "format version 2 is not supported (written by a newer",
    ),
    "huge data size": (lambda d, s: _tamper("huge data size", d, s), "over the limit"),
    "huge manifest size": (lambda d, s: _tamper("huge manifest size", d, s), "over the limit"),
    "sizes lie": (lambda d, s: _tamper("sizes lie", d, s), "entries add up to"),
    "sizes shifted": (lambda d, s: _tamper("sizes shifted", d, s), "fails its checksum"),
    "manifest bomb": (lambda d, s: _tamper("manifest bomb", d, s), "the manifest declares"),
    "block bomb": (lambda d, s: _tamper("block bomb", d, s), "would decode to"),
    "mislabelled codec": (lambda d, s: _tamper("mislabelled codec", d, s), "KV block"),
    "children first": (lambda d, s: _tamper("children first", d, s), "not a message before it"),
    "not JSON": (lambda d, s: _tamper("not JSON", d, s), "not JSON"),
    "another format": (lambda d, s: _tamper("another format", d, s), "not a llama-chat-session manifest"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_a_bad_file_is_one_clear_line_and_changes_nothing(case, source, target, tmp_path):
    make, message = BAD_FILES[case]
    err = import_fails(source, target, make(source.data, source), tmp_path / "bad.llamachat")
    assert message in err


def test_a_missing_file_or_a_folder_is_one_clear_line(source, target, tmp_path):
    for path, message in [(tmp_path / "nope.llamachat", "no such file"), (tmp_path, "is a directory")]:
        code, _, err = run("--db", target / "chat.db", "import", path)
        assert code == 2 and message in err and err.count("\n") == 1


def test_a_failure_while_writing_rolls_everything_back(source, target, monkeypatch):
    store = ChatStore(target / "chat.db")
    before = list(store.db.conn.iterdump())

    def fail(*args):
        raise RuntimeError("disk on fire")

    # the messages are written by then; the session ids are drawn next
    monkeypatch.setattr("llama_chat.storage.store.secrets.token_hex", fail)
    with pytest.raises(RuntimeError):
        import_session(store, source.file, model_fingerprint=source.session.model_fingerprint)
    assert list(store.db.conn.iterdump()) == before


def test_a_file_that_lies_cannot_be_imported_by_the_library_either(source, tmp_path):
    bad = tmp_path / "bad.llamachat"
    bad.write_bytes(_tamper("sizes lie", source.data, source))
    with pytest.raises(ExchangeError, match="entries add up to"):
        read_session_file(bad)


# -- fuzzing: any damage ends in one line and an untouched database -------------------------------------

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(data=st.data())
def test_fuzz_truncated_at_any_byte(source, target, tmp_path, data):
    cut = data.draw(st.integers(0, len(source.data) - 1))
    import_fails(source, target, source.data[:cut], tmp_path / "cut.llamachat")


@FUZZ
@given(data=st.data())
def test_fuzz_any_byte_flipped(source, target, tmp_path, data):
    i = data.draw(st.integers(0, len(source.data) - 1))
    flip = data.draw(st.integers(1, 255))
    bad = bytearray(source.data)
    bad[i] ^= flip
    import_fails(source, target, bytes(bad), tmp_path / "flipped.llamachat")


@FUZZ
@given(junk=st.binary(max_size=2000), with_magic=st.booleans())
def test_fuzz_random_bytes(source, target, tmp_path, junk, with_magic):
    import_fails(source, target, (MAGIC if with_magic else b"") + junk, tmp_path / "junk.llamachat")


@FUZZ
@given(
    version=st.integers(0, 2**16 - 1),
    manifest_size=st.integers(0, 2**32 - 1),
    data_size=st.integers(0, 2**64 - 1),
)
def test_fuzz_a_header_that_lies_about_sizes(source, target, tmp_path, version, manifest_size, data_size):
    manifest, section = unpack(source.data)
    packed_size = HEADER.unpack_from(source.data)[2]
    if (version, manifest_size, data_size) == (1, packed_size, len(section)):
        return
    bad = pack(manifest, section, version=version, manifest_size=manifest_size, data_size=data_size)
    import_fails(source, target, bad, tmp_path / "header.llamachat")


@FUZZ
@given(data=st.data())
def test_fuzz_a_manifest_that_lies_about_sizes(source, target, tmp_path, data):
    manifest, section = unpack(source.data)
    entries = manifest["blocks"] + [s["tail"] for s in manifest["sessions"] if s["tail"]]
    sizes = data.draw(st.lists(st.integers(-10, 2**40), min_size=len(entries), max_size=len(entries)))
    if sizes == [e["size"] for e in entries]:
        return
    for entry, size in zip(entries, sizes):
        entry["size"] = size
    import_fails(source, target, pack(manifest, section), tmp_path / "sizes.llamachat")


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)


def json_paths(value, prefix=()):
    if prefix:
        yield prefix
    children = (
        value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    )
    for key, child in children:
        yield from json_paths(child, (*prefix, key))


@FUZZ
@given(data=st.data())
def test_fuzz_any_manifest_value_changed_never_breaks_anything(source, target, tmp_path, data):
    """With a valid digest around it, a changed value either imports or fails cleanly, never half-way."""
    manifest, section = unpack(source.data)
    path = data.draw(st.sampled_from(list(json_paths(manifest))))
    parent = manifest
    for key in path[:-1]:
        parent = parent[key]
    if data.draw(st.booleans()) and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = data.draw(JSON)
    where = tmp_path / "changed.llamachat"
    where.write_bytes(pack(manifest, section))
    before = folder_bytes(target)
    code, out, err = run("--db", target / "chat.db", "--model", source.model, "import", where)
    assert code in (0, 2) and err.count("\n") >= 1
    if code == 2:
        assert out == "" and err.startswith("llama-chat: error: ") and err.count("\n") == 1, err
        assert folder_bytes(target) == before
    else:
        store = ChatStore(target / "chat.db")
        for new_id in out.split():
            store.path(store.get_session(new_id).head_id)  # what came in is readable
        store.close()


# -- the default model -----------------------------------------------------------------------------------


@pytest.mark.real_model
def test_on_the_default_model_an_imported_session_replies_as_the_live_one(qwen_model_path, tmp_path):
    from conftest import real_cache
    from llama_chat.inference import Model
    from llama_chat.inference.weights import prepare

    def fresh_model() -> Model:
        with real_cache():
            return Model(prepare(qwen_model_path))

    live = ChatEngine(fresh_model(), ChatStore(tmp_path / "live.db"))
    session = live.new_session("t", system_prompt="You are a concise coding assistant.")
    chat(live, session, "Write a Python function that reverses a string.", max_tokens=48)
    session = live._store.get_session(session.id)
    sizes = measure_exchange(live._store, session.id, tmp_path)  # exports, then imports into imported.db
    assert sizes["file_bytes"] <= 1.05 * sizes["stored_bytes"]

    imported = ChatEngine(fresh_model(), ChatStore(tmp_path / "imported.db"))
    (copy,) = imported._store.list_sessions()
    info = imported.resume(copy)
    assert info.restored == info.tokens > 64
    expected, _ = chat(live, live.fork(session), "Now add type hints.", max_tokens=48)
    reply, stats = chat(imported, copy, "Now add type hints.", max_tokens=48)
    assert reply == expected
    assert stats.prefilled_tokens == stats.prompt_tokens - info.tokens
