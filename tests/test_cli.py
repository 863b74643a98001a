"""The command line as users type it: global options before or after the command, flags from the one
definition of the settings, one line for a bad value."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from llama_chat.app.chat.settings import REPLY_SETTINGS
from llama_chat.app.cli import build_parser, main
from llama_chat.storage import ChatStore


@pytest.fixture
def qwen2(tiny_model_paths):
    return tiny_model_paths["qwen2"]


def test_global_options_work_after_the_command_too(qwen2, tmp_path, capsys):
    db = tmp_path / "after.db"
    ask = ["ask", "--model", str(qwen2), "--db", str(db), "--cache-ram", "64", "--no-lookup"]
    assert main([*ask, "--new-session", "--temp", "0", "--max-tokens", "3", "hello the world"]) == 0
    (session,) = ChatStore(db).list_sessions()
    assert session.title == "hello the world"
    capsys.readouterr()
    assert main(["sessions", "list", "--json", "--db", str(db)]) == 0
    assert [s["id"] for s in json.loads(capsys.readouterr().out)] == [session.id]
    assert main(["sessions", "--db", str(db), "show", session.id[:6]]) == 0
    assert "hello the world" in capsys.readouterr().out


def test_cache_type_chooses_the_live_kv_cache_of_the_model_a_command_opens(qwen2, tmp_path):
    from llama_chat.app.commands import open_model

    parser = build_parser()
    for given, cache_type, dtype in (([], "f16", "float16"), (["--cache-type", "f32"], "f32", "float32")):
        args = parser.parse_args(["--model", str(qwen2), *given, "sessions", "list"])
        model = open_model(args)
        k, v = model.new_sequence(8).gather(0, 0)
        assert k.dtype == v.dtype == dtype and model.pool.cache_type == cache_type


def test_no_mmap_reads_the_weights_of_the_model_a_command_opens_into_memory(qwen2):
    from test_packed_file import from_the_file

    from llama_chat.app.commands import open_model

    parser = build_parser()
    for given, mapped in (([], True), (["--no-mmap"], False), (["sessions", "list", "--no-mmap"], False)):
        words = ["--model", str(qwen2), *given] + ([] if "sessions" in given else ["sessions", "list"])
        matrices = open_model(parser.parse_args(words)).weights.matrices()
        assert {from_the_file(m.values) for m in matrices} == {mapped}


def test_activations_choose_what_the_products_of_the_model_a_command_opens_take(tiny_model_paths, capsys):
    from llama_chat.app.commands import open_model

    gemma = str(tiny_model_paths["gemma3"])  # (its output matrix is Q8_0: one that takes bytes)
    parser = build_parser()
    chosen = (
        ([], "q8", "q8"),
        (["--activations", "f32"], "f32", "f32"),
        (["--activations", "mixed"], "mixed", "q8"),  # bytes only for the output matrix
    )
    for given, activations, output_takes in chosen:
        model = open_model(parser.parse_args(["--model", gemma, *given, "sessions", "list"]))
        assert model.weights.activations == activations and model.weights.output.activations == output_takes
    with pytest.raises(SystemExit) as exit:
        parser.parse_args(["--activations", "q4", "sessions", "list"])
    assert exit.value.code == 2
    assert "argument --activations: invalid choice: 'q4'" in capsys.readouterr().err


# In a fresh process: once a command's model is loaded and its compile-later thread is done, a long
# reply's attention, a long prompt's bytes and a snapshot's codec compile nothing more, the crossover to
# BLAS is measured, and the attention kernel was made ready for the model's cache type only.
AFTER_LOAD = """
import sys, threading
import numpy as np
from llama_chat.app.chat.build import load_chat_model
from llama_chat.inference import activations, kernels
from llama_chat.storage import codec_kernels
from llama_chat.storage.codec import KVPlan, decode_kv, encode_kv
model = load_chat_model(sys.argv[1], cache_type=sys.argv[2])
(later,) = [t for t in threading.enumerate() if t.name == "compile-later"]
later.join()
kinds = (kernels._one_token_attention, activations._quantize_in_parallel, *codec_kernels.COMPILED)
count = lambda: [len(k.signatures) for k in kinds]
ready = count()
kv = np.zeros((1, 2, 64), model.new_sequence(8).gather(0, 0)[0].dtype)  # the live cache's type
kernels.one_token_attention(np.zeros((1, 1, 64), np.float32), kv, kv, [(0, 2)])
kernels.quantize_rows(np.zeros((128, 1024), np.float32))  # a long prompt's rows: on the threads
x = np.random.default_rng(0).standard_normal((2, 2, 40, 64)).astype(np.float32)
decode_kv(encode_kv(x, x, "q8", KVPlan(((8, 8), (8, 8)), ((8, 8), (8, 8)))))
print(ready == count(), ready[0], not isinstance(kernels.blas_from, kernels.MeasuredLater), count())
"""


@pytest.mark.parametrize("cache_type", ["f16", "f32"])
def test_after_a_load_the_kernels_it_left_to_a_thread_are_ready(qwen2, cache_type):
    args = [str(qwen2), cache_type]
    out = subprocess.run(
        [sys.executable, "-c", AFTER_LOAD, *args], capture_output=True, text=True, check=True
    )
    assert out.stdout.startswith("True 1 True "), out.stdout


def test_a_reply_while_the_load_makes_the_rest_ready_is_the_reply_once_all_is(qwen2, monkeypatch):
    """The first reply may come while the load's compile-later thread still compiles, or measures where
    BLAS takes long prompts from: a long prompt that comes first waits for that measurement, whoever
    makes it, and takes the way measured. So a reply is the same during and after."""
    import threading

    from llama_chat.app.chat.build import load_chat_model
    from llama_chat.inference import (
        GenerationStats,
        SamplingParams,
        blas_crossover,
        chat_prompt_ids,
        generate,
        kernels,
    )

    monkeypatch.setattr(blas_crossover, "measured_blas_from", lambda: 33)  # BLAS from 33 rows, on any machine
    monkeypatch.setattr(kernels, "blas_from", kernels.blas_from)  # (this machine's again after the test)
    model = load_chat_model(str(qwen2))
    ids = chat_prompt_ids(model, [{"role": "user", "content": "the sun and the water " * 12}])
    assert len(ids) > 33

    def greedy() -> list[int]:
        stats = GenerationStats()
        "".join(generate(model, ids, sampling=SamplingParams(temperature=0), max_tokens=12, stats=stats))
        return stats.token_ids

    during = greedy()
    for thread in threading.enumerate():
        if thread.name == "compile-later":
            thread.join()
    assert greedy() == during


def test_an_option_before_the_command_is_kept_when_not_given_again(tmp_path):
    parser = build_parser()
    args = parser.parse_args(["--db", str(tmp_path / "a.db"), "--cache-ram", "64", "sessions", "list"])
    assert (args.db, args.cache_ram) == (tmp_path / "a.db", 64)
    args = parser.parse_args(
        ["--db", str(tmp_path / "a.db"), "sessions", "list", "--db", str(tmp_path / "b.db")]
    )
    assert args.db == tmp_path / "b.db"  # the later one wins, as for any repeated option
    args = parser.parse_args(["ask", "hi"])
    assert (args.db, args.model, args.threads, args.no_lookup) == (None, None, None, False)


COMMANDS = [
    ["models"],
    ["ask", "x"],
    ["chat"],
    ["tui"],
    ["tokenize", "x"],
    ["bench"],
    ["export", "x"],
    ["import", "f"],
    *[["sessions", *a] for a in (["list"], ["show", "x"], ["fork", "x"], ["rename", "x", "y"], ["rm", "x"])],
    *[["sessions", *a] for a in (["search", "x"], ["check"], ["verify", "x"], ["gc"])],
]


def test_each_command_is_dispatched_to_a_handler_of_its_own():
    parser = build_parser()
    handlers = [parser.parse_args(argv).handler for argv in COMMANDS]
    assert all(callable(h) for h in handlers)
    assert len(set(handlers)) == len(COMMANDS)


def test_every_reply_setting_is_a_flag_and_one_not_given_is_not_set():
    given = build_parser().parse_args(
        ["ask", "x", "--temp", "0.5", "--top-k", "7", "--seed", "3", "--max-tokens", "9"]
    )
    assert {s.key: getattr(given, s.key) for s in REPLY_SETTINGS} == {
        "temperature": 0.5,
        "top_k": 7,
        "top_p": None,
        "min_p": None,
        "repeat_penalty": None,
        "seed": 3,
        "max_tokens": 9,
        "thinking": None,
        "reasoning_effort": None,
    }


@pytest.mark.parametrize(
    ("flag", "value", "complaint"),
    [
        ("--top-p", "3", "top_p must be between 0 and 1, not 3.0"),
        ("--temp", "-1", "temperature must be between 0 and 100, not -1.0"),
        ("--temp", "inf", "temperature must be between 0 and 100, not inf"),
        ("--repeat-penalty", "0", "repeat_penalty must be more than 0 and at most 100, not 0.0"),
        ("--top-k", "1.5", "top_k must be an integer, not '1.5'"),
        ("--max-tokens", "0", "max_tokens must be 1 or more, not 0"),
        ("--thinking", "maybe", "thinking must be one of on, off, not 'maybe'"),
        ("--reasoning-effort", "max", "reasoning_effort must be one of low, medium, high, not 'max'"),
        ("--block-size", "0", "must be 1 or more"),
        ("--kv-codec", "q3", "invalid choice: 'q3'"),
    ],
)
def test_a_bad_setting_is_one_line_naming_the_flag(tmp_path, capsys, flag, value, complaint):
    with pytest.raises(SystemExit) as exit:
        main(["--db", str(tmp_path / "x.db"), "ask", flag, value, "hi"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: {complaint}" in err.splitlines()[-1] and "Traceback" not in err
    assert not (tmp_path / "x.db").exists()  # nothing was opened, let alone stored


def test_threads_given_after_the_command_reach_the_kernels(qwen2, tmp_path):
    """--threads is read before NumPy and numba load (they read it once, when they load)."""
    code = (
        "import sys; from llama_chat.app.cli import main; main(sys.argv[1:]); "
        "import numba; print(numba.config.NUMBA_NUM_THREADS)"
    )
    args = ["tokenize", "--model", str(qwen2), "--threads", "1", "hello"]
    run = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    ids, threads = run.stdout.strip().splitlines()
    assert json.loads(ids) and threads == "1"


def test_a_session_keeps_its_longest_reply_on_the_command_line(qwen2, tmp_path, capsys):
    """A max_tokens stored with a session (the app's settings screen) holds for `ask --session` too,
    unless --max-tokens says otherwise for that reply."""
    db = tmp_path / "chat.db"
    store = ChatStore(db)
    session = store.create_session("short", sampling={"temperature": 0, "max_tokens": 2})
    base = ["--db", str(db), "--model", str(qwen2), "ask", "--session", session.id]
    assert main([*base, "hello the world"]) == 0
    assert main([*base, "--max-tokens", "5", "and then"]) == 0
    replies = [m for m in store.path(store.get_session(session.id).head_id) if m.role == "assistant"]
    assert [m.stats["generated_tokens"] for m in replies] == [2, 5]
    assert [m.stats["stop_reason"] for m in replies] == ["length", "length"]


def test_bench_times_stored_sessions_and_then_stopped_replies_on_one_loaded_model(qwen2, tmp_path):
    """`llama-chat bench` measures resume/fork/export on a store, then Esc on another store: a model's
    block pool reads from one store, so the second measurement must not take over the first's model."""
    from llama_chat.app.bench.stored import measure_sessions, measure_stop
    from llama_chat.inference import load_model

    model = load_model(qwen2, cache_ram_mb=64)
    sessions = measure_sessions(model, "the quick brown fox " * 3, tmp_path)
    assert sessions["restored"] == sessions["tokens"]  # the fresh process resumed it all from the store
    assert 0 < sessions["fork_added_bytes"] <= sessions["stored_block_bytes"]  # its tail, not a block
    assert sessions["exchange"]["kv"] == "imported"
    measure_stop(model, "the quick brown fox", tmp_path, 150)
    stopped = ChatStore(tmp_path / "stop.db")
    replies = sorted((s.title, stopped.path(s.head_id)[-1].role) for s in stopped.list_sessions())
    assert replies == [("stop", "assistant")] + [("stop (regenerated)", "assistant")] * 3  # each stored


# -- titles ------------------------------------------------------------------------------------------


def test_titles_say_what_a_chat_is_about_and_where_it_came_from(qwen2, tmp_path, capsys, monkeypatch):
    db = tmp_path / "chat.db"
    base = ["--db", str(db), "--model", str(qwen2)]
    question = "How do I read a CSV file in Python and sum one column of it quickly?"
    assert main([*base, "ask", "--new-session", "--temp", "0", "--max-tokens", "3", question]) == 0
    store = ChatStore(db)
    (first,) = store.list_sessions()
    assert first.title == "How do I read a CSV file in Python and sum one…"  # cut between words

    fork = store.fork_session(first.id, store.path(first.head_id)[0].id)  # before message 1
    store.set_head(fork.id, None)
    assert store.get_session(fork.id).title == first.title + " (fork)"
    assert (
        main([*base, "ask", "--session", fork.id, "--temp", "0", "--max-tokens", "3", "Reverse a string."])
        == 0
    )
    assert store.get_session(fork.id).title == "Reverse a string."  # its first own message names it
    again = store.fork_session(store.fork_session(fork.id, None, "Reverse a string. (regenerated)").id)
    assert again.title == "Reverse a string. (fork)"  # marks do not stack

    lines = iter(["hello the world", "and then"])

    def typed(prompt=""):
        line = next(lines, None)
        if line is None:
            raise EOFError  # Ctrl+D
        return line

    monkeypatch.setattr("builtins.input", typed)
    assert main([*base, "chat", "--temp", "0", "--max-tokens", "3"]) == 0
    chat = store.list_sessions()[0]
    assert chat.title == "hello the world"  # not "Terminal chat", nor renamed by its second line

    export = tmp_path / "first.llamachat"
    assert main(["--db", str(db), "export", first.id, "-o", str(export)]) == 0
    assert main(["--db", str(db), "import", str(export)]) == 0
    imported = store.get_session(capsys.readouterr().out.split()[-1])
    assert imported.title == first.title + " (imported)"


# -- what `sessions …` prints ------------------------------------------------------------------------


def test_sessions_list_show_search_and_fork_read_as_a_person_expects(qwen2, tmp_path, capsys):
    db = tmp_path / "chat.db"
    store = ChatStore(db)
    other = store.create_session("another chat")
    store.add_message(other.id, "user", "unrelated")  # (message ids are the database's, not the chat's)
    session = store.create_session("code")
    store.add_message(session.id, "user", "show me code")
    store.add_message(
        session.id, "assistant", "Here:\n\n```python\nprint('one')\n```\n", stats={"stop_reason": "stop"}
    )
    store.add_message(session.id, "user", "and more")
    store.add_message(session.id, "assistant", "```python\nprint(", stats={"stop_reason": "cancelled"})
    cli = ["sessions", "--db", str(db)]

    assert main([*cli, "list"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.split() == ["ID", "UPDATED", "TOKENS", "TITLE"] and len(rows) == 2

    assert main([*cli, "show", session.id]) == 0
    shown = capsys.readouterr().out
    assert "  [1] user: show me code" in shown and "  [3] user: and more" in shown
    assert shown.rstrip().endswith("print( [stopped]")  # a reply stopped by Esc or Ctrl+C says so

    assert main([*cli, "search", "one"]) == 0
    (line,) = capsys.readouterr().out.splitlines()  # one line a match, however many lines the message has
    assert line.startswith(f"{session.id}  code  [2] assistant: ") and "```" not in line

    assert main([*cli, "search", "nomatch"]) == 1
    assert capsys.readouterr().err.strip() == "nothing found for 'nomatch'"

    assert main([*cli, "fork", session.id, "--at", "2"]) == 0  # the number `show` gives
    fork = store.get_session(capsys.readouterr().out.strip())
    assert [m.content for m in store.path(fork.head_id)][-1].startswith("Here:")
    assert main([*cli, "fork", session.id, "--at", "9"]) == 2
    assert "has messages 1 to 4, not 9" in capsys.readouterr().err


def test_a_one_token_reply_reports_no_made_up_speed(qwen2, tmp_path, capsys):
    assert (
        main(["--db", str(tmp_path / "c.db"), "--model", str(qwen2), "ask", "--max-tokens", "1", "hi"]) == 0
    )
    err = capsys.readouterr().err
    assert "1 generated;" in err and "0.0 tok/s" not in err
    assert not (tmp_path / "c.db").exists()  # a question without a session stores nothing


def test_reading_chats_loads_neither_the_model_code_nor_the_app(tmp_path):
    """`sessions list`, `show` and `search` cost what they read: numba's kernels, Textual, Rich, the
    server's libraries and the KV files' codecs (seconds of imports) load only with the commands that
    use them."""
    store = ChatStore(tmp_path / "chat.db")
    session = store.create_session("kept")
    store.add_message(session.id, "user", "hello there")
    store.close()
    heavy = ("numba", "textual", "rich", "redis", "jinja2", "gguf", "llguidance", "mcp", "starlette")
    heavy += ("zstandard", "llama_chat.storage.exchange", "llama_chat.storage.codec")
    script = (
        "import sys; from llama_chat.app.cli import main; main(sys.argv[1:]); "
        f"print([m for m in {heavy} if m in sys.modules])"
    )
    for command in (["list"], ["show", session.id], ["search", "hello"]):
        args = [sys.executable, "-c", script, "--db", str(tmp_path / "chat.db"), "sessions", *command]
        out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
        assert session.id in out and out.splitlines()[-1] == "[]", command
