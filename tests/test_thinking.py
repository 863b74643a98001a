"""A reply's thinking told apart from its answer: the splitter on text streams (`<think>` and harmony's
analysis channel), each real template's format, and a tiny Qwen3 (its real template) replying with
thinking through the chat engine: shown apart, stored apart, left out of the next turn as the template
leaves it, its KV the template's rendering; the thinking switch reaches the template."""

from __future__ import annotations

import sqlite3
import time

import openai
import pytest
from textual.widgets import Collapsible, Input, Static

from llama_chat.app.chat.engine import ChatEngine
from llama_chat.app.chat.jobs import State
from llama_chat.app.chat.sessions import Sessions
from llama_chat.app.cli import main
from llama_chat.inference import (
    ChatTemplate,
    GenerationStats,
    SamplingParams,
    chat_prompt_ids,
    constrain,
    load_model,
)
from llama_chat.inference.prompt import prompt_text
from llama_chat.inference.thinking import (
    HARMONY,
    THINK_TAGS,
    ThinkingSplitter,
    split_thinking,
    thinking_format,
)
from llama_chat.storage import ChatStore, Message
from served import Served
from tiny_models import TEMPLATES
from tui_pilot import aio, idle, say, views

QWEN3_TEMPLATE = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
GREEDY = SamplingParams(temperature=0)
THOUGHT = "I weigh the words.\nThen I answer."
ANSWER = "Hello there"
REPLY = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"  # as Qwen3 writes a reply


def streamed(fmt, text: str, size: int, opened: bool = False) -> tuple[str, str]:
    """(thinking, answer) of `text` fed `size` characters at a time."""
    splitter = ThinkingSplitter(fmt, opened)
    pieces = []
    for i in range(0, len(text), size):
        pieces += splitter.feed(text[i : i + size])
    pieces += splitter.finish()
    return "".join(p.text for p in pieces if p.thinking), "".join(p.text for p in pieces if not p.thinking)


CASES = [
    (THINK_TAGS, REPLY, False, (THOUGHT, ANSWER)),
    (THINK_TAGS, "\n<think>\n\n</think>\n\nHi", False, ("", "Hi")),  # Qwen3's empty thinking
    (THINK_TAGS, "Plain <think> is no thinking here", False, ("", "Plain <think> is no thinking here")),
    (THINK_TAGS, "\n\nHi", False, ("", "\n\nHi")),  # the answer keeps what it wrote
    (THINK_TAGS, f"{THOUGHT}\n</think>\n\n{ANSWER}", True, (THOUGHT, ANSWER)),  # R1: the prompt opened it
    (THINK_TAGS, "<think>\nCut short by the token li", False, ("Cut short by the token li", "")),
    (THINK_TAGS, "<think>\nwhere </thin is no end</think>Hi", False, ("where </thin is no end", "Hi")),
    (THINK_TAGS, "<thi", False, ("", "<thi")),
    (
        HARMONY,
        "<|channel|>analysis<|message|>Think hard.<|end|><|start|>assistant<|channel|>final<|message|>Answer",
        False,
        ("Think hard.", "Answer"),
    ),
    (HARMONY, "<|channel|>final<|message|>Answer", False, ("", "Answer")),
    (
        HARMONY,
        "<|channel|>analysis<|message|>A<|end|><|start|>assistant<|channel|>analysis<|message|>B<|end|>"
        "<|start|>assistant<|channel|>final<|message|>C",
        False,
        ("A\n\nB", "C"),
    ),
    (  # a tool call after the thinking stays as written, for the harmony tool format to read
        HARMONY,
        "<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.f <|constrain|>json<|message|>{"x": 1}',
        False,
        (
            "Call it.",
            '<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"x": 1}',
        ),
    ),
]


@pytest.mark.parametrize(("fmt", "text", "opened", "expected"), CASES)
def test_thinking_and_answer_come_apart_however_the_text_streams(fmt, text, opened, expected):
    assert split_thinking(fmt, text, opened) == expected
    for size in (1, 2, 3, 7, len(text)):
        assert streamed(fmt, text, size, opened) == expected


def test_nothing_that_may_be_a_marker_goes_out_early_and_nothing_is_held_longer():
    splitter = ThinkingSplitter(THINK_TAGS)
    assert splitter.feed("<thi") == []
    assert [(p.text, p.thinking) for p in splitter.feed("nk>\nA thought")] == [("A thought", True)]
    assert splitter.feed("\n</thi") == []  # the end, or more thinking
    assert [(p.text, p.thinking) for p in splitter.feed("nk>\n\nThe answer")] == [("The answer", False)]


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("Qwen-Qwen3-0.6B.jinja", THINK_TAGS),
        ("Qwen-QwQ-32B.jinja", THINK_TAGS),
        ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", THINK_TAGS),
        ("openai-gpt-oss-120b.jinja", HARMONY),
        ("Qwen-Qwen2.5-7B-Instruct.jinja", None),
        ("meta-llama-Llama-3.1-8B-Instruct.jinja", None),
        ("HuggingFaceTB-SmolLM3-3B.jinja", THINK_TAGS),
        ("ibm-granite-granite-4.0.jinja", None),
        ("allenai-OLMo-2-0425-1B-SFT.jinja", None),
    ],
)
def test_each_template_says_which_thinking_its_model_writes(name, fmt):
    assert thinking_format(ChatTemplate((TEMPLATES / name).read_text())) is fmt


def test_a_prompt_that_opens_the_thinking_starts_the_reply_inside_it():
    asked = [{"role": "user", "content": "Hi"}]
    r1 = ChatTemplate((TEMPLATES / "llama-cpp-deepseek-r1.jinja").read_text(), bos_token="<s>")
    distill = ChatTemplate((TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text())
    qwen3 = ChatTemplate(QWEN3_TEMPLATE)
    gpt_oss = ChatTemplate((TEMPLATES / "openai-gpt-oss-120b.jinja").read_text())
    assert THINK_TAGS.opened_by(r1.render(asked))  # it writes "<think>\n" itself
    assert THINK_TAGS.opened_by(distill.render(asked, enable_thinking=True))
    assert not THINK_TAGS.opened_by(distill.render(asked))  # "<think>\n</think>": closed, no thinking
    assert not THINK_TAGS.opened_by(qwen3.render(asked))
    assert not THINK_TAGS.opened_by(qwen3.render(asked, enable_thinking=False))  # "<think>\n\n</think>\n\n"
    assert not HARMONY.opened_by(gpt_oss.render(asked))


def test_qwen3s_template_keeps_the_last_replys_thinking_as_written_and_drops_it_after():
    """A reply stored apart renders back as the model wrote it while it is the last turn (so its KV is
    kept as computed), and without its thinking once the user writes again."""
    template = ChatTemplate(QWEN3_TEMPLATE)
    asked = [{"role": "user", "content": "Hi"}]
    thinking, answer = split_thinking(THINK_TAGS, REPLY)
    replied = [*asked, {"role": "assistant", "content": answer, "reasoning_content": thinking}]
    assert (
        template.render(replied, add_generation_prompt=False)
        == template.render(asked) + REPLY + "<|im_end|>\n"
    )
    later = template.render([*replied, {"role": "user", "content": "And?"}])
    assert ANSWER in later and THOUGHT not in later and "<think>" not in later


# -- through the chat engine, on the tiny Qwen3 with its real template ----------------------------------


def forced(tokenizer, text: str) -> str:
    """A grammar that makes a model write `text` as its tokenizer cuts it (a tiny random model never
    thinks): every token is the model's own sampled step, only its choice is forced."""
    ids = tokenizer.encode(text, special=True)
    return constrain.check_grammar(
        tokenizer, constrain.lark_grammar("start: " + " ".join(f"<[{i}]>" for i in ids))
    )


@pytest.fixture
def engine(tiny_model_paths, tmp_path):
    return ChatEngine(load_model(tiny_model_paths["qwen3"], block_size=8), ChatStore(tmp_path / "chat.db"))


def test_a_thinking_reply_streams_and_is_stored_apart_and_its_kv_is_the_templates_rendering(
    engine, forward_passes
):
    session = engine.new_session("think", system_prompt="")
    stats = GenerationStats()
    job = engine.reply(
        session,
        "Hi",
        sampling=GREEDY,
        grammar=forced(engine.model_info.tokenizer, REPLY),
        max_tokens=80,
        stats=stats,
    )
    events = [(e.kind, e.text) for e in job.events() if e.kind in ("text", "thinking")]
    assert job.state is State.DONE and stats.stop_reason == "eog"
    kinds = [kind for kind, _ in events]
    assert kinds == sorted(kinds, key=lambda kind: kind != "thinking")  # the thinking first, as written
    assert "".join(t for kind, t in events if kind == "thinking") == job.thinking() == THOUGHT
    assert "".join(t for kind, t in events if kind == "text") == job.text() == ANSWER

    session = engine._store.get_session(job.result.session.id)
    (_, reply) = engine._store.path(session.head_id)
    assert (reply.content, reply.reasoning) == (ANSWER, THOUGHT)
    # the conversation as stored renders back to the tokens the reply wrote: its KV snapshot computed
    # only the end of the turn after them ("<|im_end|>", "\n")
    ids = engine._cache.stored_conversation(session)[1]
    assert len(ids) == stats.prompt_tokens + len(stats.token_ids) + 2
    assert forward_passes[-1] == 2

    # a new process resumes it all from the store: nothing computed
    again = ChatEngine(load_model(engine.model_info.path, block_size=8), ChatStore(engine._store.db_path))
    info = again.resume(session)
    assert info.restored == info.tokens == len(ids)

    # the next turn's prompt leaves the thinking out, as Qwen3's template does: the KV is kept up to
    # the reply, and computed from there
    asked = [*again._cache.messages(session), {"role": "user", "content": "And?"}]
    assert asked[-2]["reasoning_content"] == THOUGHT
    text = prompt_text(again._model, asked)
    assert ANSWER in text and THOUGHT not in text
    kept = next(i for i, (a, b) in enumerate(zip(ids, chat_prompt_ids(again._model, asked))) if a != b)
    stats = GenerationStats()
    again.reply(session, "And?", sampling=GREEDY, max_tokens=2, stats=stats).wait()
    assert stats.prefilled_tokens == stats.prompt_tokens - kept


def test_a_reply_without_thinking_is_all_answer(engine):
    session = engine.new_session("plain", system_prompt="")
    job = engine.reply(
        session, "Hi", sampling=GREEDY, grammar=forced(engine.model_info.tokenizer, ANSWER), max_tokens=20
    )
    assert "thinking" not in {e.kind for e in job.events()} and job.text() == ANSWER
    (_, reply) = engine._store.path(engine._store.get_session(job.result.session.id).head_id)
    assert (reply.content, reply.reasoning) == (ANSWER, None)


def test_the_thinking_switch_reaches_the_template(engine):
    """thinking off: Qwen3's template closes an empty thinking in the prompt (its /no_think)."""
    empty = len(engine.model_info.tokenizer.encode("<think>\n\n</think>\n\n", special=True))
    sizes = {}
    for switch in ("on", "off"):
        session = engine.new_session(switch, system_prompt="", sampling={"thinking": switch})
        stats = GenerationStats()
        engine.reply(session, "Hi", sampling=GREEDY, max_tokens=2, stats=stats).wait()
        sizes[switch] = stats.prompt_tokens
    assert sizes["off"] - sizes["on"] == empty


# -- the command line ---------------------------------------------------------------------------------


@pytest.fixture
def thinks(monkeypatch):
    """`ask` replies with REPLY: its grammar (the --json flags' hook) forces the tiny model's choice."""
    from llama_chat.app import commands

    monkeypatch.setattr(commands, "reply_grammar", lambda args, tokenizer: forced(tokenizer, REPLY))


def test_ask_shows_the_thinking_on_stderr_only_when_asked(tiny_model_paths, tmp_path, thinks, capsys):
    ask = ["ask", "--model", str(tiny_model_paths["qwen3"]), "--temp", "0", "--max-tokens", "80", "Hi"]
    assert main(ask) == 0
    out, err = capsys.readouterr()
    assert out == ANSWER + "\n" and THOUGHT not in err
    assert main([*ask, "--show-thinking"]) == 0
    out, err = capsys.readouterr()
    assert out == ANSWER + "\n" and err.startswith(THOUGHT + "\n")

    db = ["--db", str(tmp_path / "chat.db")]
    assert main([*ask, *db, "--new-session", "--thinking", "off"]) == 0
    (session,) = ChatStore(tmp_path / "chat.db").list_sessions()
    (_, reply) = ChatStore(tmp_path / "chat.db").path(session.head_id)
    assert (reply.content, reply.reasoning, session.sampling["thinking"]) == (ANSWER, THOUGHT, "off")


# -- the app ------------------------------------------------------------------------------------------


@aio
async def test_the_app_shows_a_replys_thinking_folded_as_it_streams_and_t_unfolds_it(
    open_chat, tiny_model_paths, monkeypatch
):
    reply = ChatEngine.reply

    def thinking_reply(engine, to, text=None, **options):
        return reply(engine, to, text, grammar=forced(engine.model_info.tokenizer, REPLY), **options)

    monkeypatch.setattr(ChatEngine, "reply", thinking_reply)
    async with open_chat(model=tiny_model_paths["qwen3"], max_tokens=80) as pilot:
        await say(pilot, "Hi")
        view = views(pilot.app)[-1]
        fold = view.query_one(".thinking", Collapsible)
        assert (view.content, view.thinking, fold.query_one(".thinking-text", Static).content) == (
            ANSWER,
            THOUGHT,
            THOUGHT,
        )
        assert fold.collapsed and not fold.query_one(Collapsible.Contents).display  # folded: not shown
        view.focus()
        await pilot.press("t")
        assert not fold.collapsed and fold.query_one(Collapsible.Contents).display
        await pilot.press("t")
        assert fold.collapsed
        (_, stored) = pilot.app.sessions.read(pilot.app.chat.session.id)[1]
        assert (stored.content, stored.reasoning) == (ANSWER, THOUGHT)


@aio
async def test_a_stored_reply_opens_with_its_thinking_folded(open_chat, tiny_model_paths, tmp_path):
    thinking_chat(ChatStore(tmp_path / "chat.db"))
    async with open_chat(model=tiny_model_paths["qwen3"]) as pilot:
        asked, answered = views(pilot.app)
        assert not asked.query(".thinking") and answered.content == ANSWER
        fold = answered.query_one(".thinking", Collapsible)
        assert fold.collapsed and fold.query_one(".thinking-text", Static).content == THOUGHT
        asked.focus()
        await pilot.pause()
        assert "t" not in pilot.app.screen.active_bindings  # on the footer of a reply that thought only
        answered.focus()
        await pilot.pause()
        assert "t" in pilot.app.screen.active_bindings


def thinking_chat(store: ChatStore) -> None:
    """A stored chat whose reply thought first."""
    session = store.create_session("A reply that thought")
    now = time.time()
    turn = [
        Message(0, None, "user", "Hi", None, now, None),
        Message(0, None, "assistant", ANSWER, None, now, None, THOUGHT),
    ]
    store.append_turn(session.id, None, turn)


# -- the server -----------------------------------------------------------------------------------------


@pytest.fixture
def served_qwen3(tmp_path, tiny_model_paths, monkeypatch):
    """A server on the tiny Qwen3 whose replies think (their grammar forces REPLY), and its client."""
    from llama_chat.app.serve import completions

    monkeypatch.setattr(
        completions, "_grammar", lambda engine, req, fmt, ids: forced(engine.model_info.tokenizer, REPLY)
    )
    s = Served(tmp_path / "chat.db", tiny_model_paths["qwen3"]).wait_ready()
    yield s
    s.stop()


def ask(s: Served, **options):
    return s.client.chat.completions.create(
        model="tiny-qwen3", messages=[{"role": "user", "content": "Hi"}], max_tokens=80, **options
    )


def test_the_server_gives_the_thinking_as_reasoning_content_whole_and_streamed(served_qwen3):
    s = served_qwen3
    message = ask(s).choices[0].message
    assert (message.content, message.reasoning_content) == (ANSWER, THOUGHT)  # llama.cpp's field

    thinking, answer, finish = "", "", None
    for chunk in ask(s, stream=True):
        for choice in chunk.choices:
            thinking += getattr(choice.delta, "reasoning_content", None) or ""
            answer += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert (thinking, answer, finish) == (THOUGHT, ANSWER, "stop")

    api_session = s.state.sessions.list()[0]
    (_, reply) = s.state.sessions.messages(api_session)
    assert (reply.content, reply.reasoning) == (ANSWER, THOUGHT)


def test_the_server_takes_the_thinking_switches_and_refuses_what_they_are_not(served_qwen3):
    s = served_qwen3
    on = ask(s).usage.prompt_tokens
    off = ask(s, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).usage.prompt_tokens
    assert off - on == len(s.model.tokenizer.encode("<think>\n\n</think>\n\n", special=True))
    assert ask(s, extra_body={"reasoning_effort": "low"}).choices[0].message.content == ANSWER
    for body, param in (
        ({"reasoning_effort": "max"}, "reasoning_effort"),
        ({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs.enable_thinking"),
        ({"chat_template_kwargs": {"tools_in_user_message": True}}, "chat_template_kwargs"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            ask(s, extra_body=body)
        assert refused.value.status_code == 400 and refused.value.body["param"] == param


# -- kept with the message ------------------------------------------------------------------------------


def test_a_database_of_the_version_before_opens_with_its_messages_and_no_thinking(tmp_path):
    path = tmp_path / "chat.db"
    store = ChatStore(path)
    session = store.create_session("before")
    store.add_message(session.id, "user", "Hi")
    store.close()
    old = sqlite3.connect(path)  # as the version before wrote it: no thinking column
    old.execute("ALTER TABLE messages DROP COLUMN reasoning")
    old.execute("PRAGMA user_version = 7")  # (step 8 made it)
    old.commit()
    old.close()
    store = ChatStore(path)
    (message,) = store.path(store.get_session(session.id).head_id)
    assert (message.content, message.reasoning) == ("Hi", None)


def test_the_thinking_travels_in_an_export_and_shows_folded_in_a_transcript(tmp_path):
    sessions = Sessions(tmp_path / "chat.db")
    thinking_chat(sessions.store)
    (session,) = sessions.list()
    sessions.export(session.id, tmp_path / "chat.llamachat", with_kv=False)
    other = Sessions(tmp_path / "other.db")
    (imported,) = other.import_file(tmp_path / "chat.llamachat", model_fingerprint="none").session_ids
    (_, reply) = other.messages(other.get(imported))
    assert (reply.content, reply.reasoning) == (ANSWER, THOUGHT)

    transcript = sessions.transcript(session.id)
    folded = "<details><summary>Thinking</summary>\n\n> I weigh the words.\n> Then I answer.\n\n</details>"
    assert folded in transcript and transcript.index(folded) < transcript.index(ANSWER)


@aio
async def test_the_settings_screen_switches_a_chats_thinking(open_chat, tiny_model_paths):
    async with open_chat(model=tiny_model_paths["qwen3"]) as pilot:
        app = pilot.app
        await say(pilot, "Hi")
        await pilot.press("ctrl+s")
        assert app.screen.query_one("#thinking", Input).placeholder == "on / off"
        app.screen.query_one("#thinking", Input).value = "maybe"
        await pilot.press("ctrl+s")
        assert "thinking must be one of on, off" in str(app.screen.query_one("#error").content)
        app.screen.query_one("#thinking", Input).value = "off"
        await pilot.press("ctrl+s")
        await idle(pilot)
        assert app.sessions.get(app.chat.session.id).sampling["thinking"] == "off"
