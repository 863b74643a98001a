"""The TUI's tools around the chat, driven through Pilot on a tiny model: copy, settings, model, search,
export and import, keys, the palette, help, themes, the config file and the command line."""

from __future__ import annotations

import re
from pathlib import Path

from textual.geometry import Region
from textual.widgets import Input, TextArea

from llama_chat.app.cli import main
from llama_chat.app.config import UserConfig
from llama_chat.app.tui import ChatApp
from llama_chat.app.tui.dialogs import HelpScreen, SettingsScreen, TextScreen
from llama_chat.app.tui.sidebar import SessionTree
from llama_chat.app.tui.widgets import ChatInput, MessageView
from llama_chat.storage import ChatStore
from tiny_models import write_tiny_model
from tui_pilot import aio, idle, notices, roles_and_text, say, stored_path, tree_labels, until, views

# -- copy, settings, model, search -----------------------------------------------------------------

CODE_REPLY = "Two ways:\n\n```python\nprint('one')\n```\n\nand\n\n```sh\necho two\n```\n"


def stored_conversation(tmp_path, reply=CODE_REPLY, title="code"):
    store = ChatStore(tmp_path / "chat.db")
    session = store.create_session(title)
    store.add_message(session.id, "user", "show me code")
    store.add_message(session.id, "assistant", reply)
    return store, session


@aio
async def test_copy_a_message_and_its_code_blocks(open_chat, tmp_path):
    stored_conversation(tmp_path)
    async with open_chat() as pilot:
        app = pilot.app
        await pilot.press("up")
        assert isinstance(app.focused, MessageView) and app.focused.role == "assistant"
        await pilot.press("c")
        assert app.clipboard == CODE_REPLY
        await pilot.press("y")
        assert app.clipboard == "print('one')\n"
        await pilot.press("y")
        assert app.clipboard == "echo two\n"


@aio
async def test_settings_store_a_system_prompt_and_sampling_per_session(open_chat):
    async with open_chat() as pilot:
        app = pilot.app
        await say(pilot, "hello the world")
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, SettingsScreen)
        app.screen.query_one("#system-prompt", TextArea).load_text("Answer in one word.")
        app.screen.query_one("#temperature", Input).value = "0.5"
        app.screen.query_one("#top_k", Input).value = "7"
        app.screen.query_one("#max_tokens", Input).value = "5"
        await pilot.press("ctrl+s")
        await idle(pilot)
        session = app.sessions.get(app.chat.session.id)
        assert session.system_prompt == "Answer in one word."
        assert session.sampling["temperature"] == 0.5 and session.sampling["top_k"] == 7
        assert app.chat.query_one(".system-prompt").content == "system: Answer in one word."
        await say(pilot, "and then")
        assert app.sessions.message(app.chat.session.head_id).stats["generated_tokens"] <= 5


@aio
async def test_a_new_chat_shows_its_system_prompt_above_the_first_message_at_once(open_chat):
    async with open_chat(system_prompt="Answer in one word.") as pilot:
        app = pilot.app
        await say(pilot, "hello the world")
        lines = [w for w in app.chat.conversation.children if "system-line" in w.classes]
        assert [w.content for w in lines] == ["system: Answer in one word."]
        assert app.chat.conversation.children[0] is lines[0]  # above the first message, as on reopening


@aio
async def test_settings_show_the_models_recommended_sampling_and_keep_it_a_default(open_chat, tmp_path):
    keys = {"general.sampling.top_k": 20, "general.sampling.top_p": 0.8}
    model = write_tiny_model(tmp_path / "recommends.gguf", "qwen2", metadata=keys)
    async with open_chat(model=model) as pilot:  # config.toml: temperature 0 for new chats
        app = pilot.app
        await say(pilot, "hello the world")
        await pilot.press("ctrl+s")
        fields = {
            key: app.screen.query_one(f"#{key}", Input).value for key in ("temperature", "top_k", "top_p")
        }
        assert fields == {"temperature": "0", "top_k": "20", "top_p": "0.8"}  # the user's config wins
        assert "recommended in recommends.gguf" in str(app.screen.query_one("#defaults").content)
        app.screen.query_one("#top_p", Input).value = "0.5"
        await pilot.press("ctrl+s")
        await idle(pilot)
        # what was changed is the session's; what was left is the model's default, not copied in
        assert app.sessions.get(app.chat.session.id).sampling == {"temperature": 0, "top_p": 0.5}


@aio
async def test_settings_refuse_bad_values(open_chat):
    async with open_chat() as pilot:
        app = pilot.app
        await pilot.press("ctrl+s")
        app.screen.query_one("#top_p", Input).value = "3"
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, SettingsScreen)  # still open, with the reason
        assert "top_p" in str(app.screen.query_one("#error").content)


@aio
async def test_choose_another_model(open_chat, tiny_model_paths):
    async with open_chat() as pilot:
        app = pilot.app
        await say(pilot, "hello the world")
        await pilot.press("ctrl+l")
        app.screen.query_one("#path", Input).value = str(tiny_model_paths["llama"])
        app.screen.query_one("#path", Input).focus()
        await pilot.press("enter")
        await until(pilot, lambda: app.chat.engine.model_info.name == "tiny-llama", what="the new model")
        await idle(pilot)
        assert app.chat.status.fields["model"] == "tiny-llama"
        assert UserConfig.load(app.config.path).model == str(tiny_model_paths["llama"])  # opens next time
        await say(pilot, "and then")  # the conversation goes on with the new model
        assert len(stored_path(app)) == 4


@aio
async def test_a_missing_model_file_is_one_line_in_the_app(open_chat, qwen2, tmp_path):
    async with open_chat() as pilot:
        app = pilot.app
        await pilot.press("ctrl+l")
        app.screen.query_one("#path", Input).value = str(tmp_path / "nothing.gguf")
        app.screen.query_one("#path", Input).focus()
        await pilot.press("enter")
        await idle(pilot)
        assert app.chat.engine.model_info.name == "tiny-qwen2"  # the loaded model stays
        assert any("no such file" in n for n in notices(app))


@aio
async def test_search_finds_titles_and_message_text(open_chat, tmp_path):
    store = ChatStore(tmp_path / "chat.db")
    for title, text in [("Apples", "red fruit"), ("Weather", "rain tomorrow"), ("Boats", "sailing in rain")]:
        s = store.create_session(title)
        store.add_message(s.id, "user", text)
    async with open_chat() as pilot:
        app = pilot.app
        await pilot.press("ctrl+f", *"rain")
        await until(pilot, lambda: "Apples" not in str(tree_labels(app)), what="the search")
        roots = [label for depth, label in tree_labels(app) if depth == 0]
        assert roots == ["● Boats", "Weather"]  # the open chat is marked
        await pilot.press("enter")  # to the results
        tree = app.chat.query_one(SessionTree)
        weather = next(n for n in tree.root.children if str(n.label) == "Weather")
        tree.move_cursor(weather)
        await pilot.press("enter")
        await until(pilot, lambda: app.chat.session.title == "Weather", what="the switch")
        await pilot.press("ctrl+f", *["backspace"] * 4)
        await until(pilot, lambda: len(tree_labels(app)) == 3, what="the whole list")


LONG_TITLE = "Planning the garden for next spring"  # longer than the sidebar is wide


def conversation_with_forks(tmp_path):
    """A conversation of two exchanges, forked at its head and after its first reply."""
    store = ChatStore(tmp_path / "chat.db")
    session = store.create_session(LONG_TITLE)
    for question, answer in [("tomatoes in rain", "first answer"), ("and the roses", "second answer")]:
        store.add_message(session.id, "user", question)
        store.add_message(session.id, "assistant", answer)
    session = store.get_session(session.id)
    first_reply = store.path(session.head_id)[1].id
    store.fork_session(session.id, None)
    store.fork_session(session.id, first_reply)
    return store, session


@aio
async def test_the_original_and_its_forks_are_told_apart_in_the_sidebar(open_chat, tmp_path):
    store, original = conversation_with_forks(tmp_path)
    async with open_chat() as pilot:
        app = pilot.app
        labels = [(depth, label.removeprefix("● ")) for depth, label in tree_labels(app)]
        assert labels == [(0, LONG_TITLE), (1, "(fork) · after msg 4"), (1, "(fork) · after msg 2")]


@aio
async def test_search_lists_a_message_forks_share_once_and_opens_it_scrolled_to(open_chat, tmp_path):
    store, original = conversation_with_forks(tmp_path)
    for i in range(30):  # more conversation than the screen holds, after the message searched for
        store.add_message(original.id, "user", f"question {i}\n\nwith a second paragraph")
        store.add_message(original.id, "assistant", f"answer {i}\n\nalso long")
    other = store.create_session("Something else")
    store.add_message(other.id, "user", "hello")
    async with open_chat() as pilot:
        app = pilot.app
        assert app.chat.session.id == other.id
        tree = app.chat.query_one(SessionTree)
        tree.move_cursor(tree.root.children[-1].children[-1])  # browsed the sidebar before searching
        await pilot.press("ctrl+f", *"tomatoes")
        await until(pilot, lambda: "Something else" not in str(tree_labels(app)), what="the search")
        labels = tree_labels(app)
        hits = [label for _, label in labels if "tomatoes in rain" in label]
        assert hits == ["user: tomatoes in rain"]  # once, though three sessions reach it
        assert labels[0] == (0, LONG_TITLE) and labels[1] == (1, "user: tomatoes in rain")
        await pilot.press("enter")  # to the results
        assert tree.cursor_line == 0  # from the first, not where the sidebar was left
        await pilot.press("down", "enter")  # the hit
        await until(pilot, lambda: app.chat.session.id == original.id, what="the switch")
        await idle(pilot)
        hit = views(app)[0]
        assert hit.content == "tomatoes in rain" and app.focused is hit
        conversation = app.chat.conversation
        top, bottom = conversation.scroll_y, conversation.scroll_y + conversation.size.height
        assert top <= hit.virtual_region.y < bottom  # on screen, not left at the end


@aio
async def test_titles_are_one_line_with_single_spaces(open_chat):
    async with open_chat() as pilot:
        app = pilot.app
        await say(pilot, "a message   whose title is cut right after a word boundary here")
        assert app.chat.session.title == "a message whose title is cut right after a word…"
        await pilot.press("f2")
        app.screen.query_one(Input).value = "  Spaced   out  title "
        await pilot.press("enter")
        await idle(pilot)
        assert app.sessions.get(app.chat.session.id).title == "Spaced out title"
        assert tree_labels(app) == [(0, "● Spaced out title")]


@aio
async def test_export_and_import_a_chat(open_chat, tmp_path):
    async with open_chat() as pilot:
        app = pilot.app
        await say(pilot, "hello the world")
        original = app.chat.session
        await pilot.press("f3")
        await pilot.pause()
        assert isinstance(app.screen, TextScreen) and app.screen.query_one(Input).value.endswith(".llamachat")
        # not the current directory (a checkout, maybe): ~/Downloads, else the data folder (no Downloads here)
        downloads = Path.home() / "Downloads"
        folder = downloads if downloads.is_dir() else tmp_path / "data" / "llama-chat" / "exports"
        assert Path(app.screen.query_one(Input).value).parent == folder
        exported = tmp_path / "out" / "hello.llamachat"
        exported.parent.mkdir()
        app.screen.query_one(Input).value = str(exported)
        await pilot.press("enter")
        await idle(pilot)
        assert exported.exists()
        await pilot.press("f3")
        await pilot.pause()
        app.screen.query_one(Input).value = str(tmp_path / "out" / "hello.md")
        await pilot.press("enter")
        await idle(pilot)
        assert "hello the world" in (tmp_path / "out" / "hello.md").read_text()

        await pilot.press("f4")
        await pilot.pause()
        app.screen.query_one(Input).value = str(exported)
        await pilot.press("enter")
        await until(pilot, lambda: app.chat.session.id != original.id, what="the imported chat")
        await idle(pilot)
        assert stored_path(app) == stored_path(app, original.id) and roles_and_text(app) == stored_path(app)
        assert len(app.sessions.list()) == 2
        await until(pilot, lambda: "resumed" in app.chat.status.fields, what="the resume line")
        restored = app.chat.status.fields["resumed"]  # its KV came with it: nothing recomputed
        assert re.fullmatch(r"[1-9][\d,]* tokens restored in \d+ ms", restored), restored

        await pilot.press("f4")
        await pilot.pause()
        app.screen.query_one(Input).value = str(tmp_path / "out" / "hello.md")  # not a session file
        await pilot.press("enter")
        await idle(pilot)
        assert any("hello.md" in n for n in notices(app))
        assert len(app.sessions.list()) == 2


# -- keys, palette, help, themes -------------------------------------------------------------------


@aio
async def test_help_lists_every_key_with_its_id(open_chat):
    async with open_chat(keymap={"fork": "ctrl+k"}, wait=False) as pilot:
        app = pilot.app
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        text = "\n".join(f"{k} {d} {i}" for _, rows in app.screen.sections for k, d, i in rows)
        for needle in ["ctrl+k Fork fork", "enter Send send", "ctrl+j, shift+enter New line newline"]:
            assert needle in text
        for needle in ["e Edit edit_message", "c Copy copy_message", "y Copy code copy_code"]:
            assert needle in text
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


@aio
async def test_help_shows_the_whole_config_path_on_a_narrow_terminal(open_chat, qwen2, tmp_path):
    deep = (
        tmp_path / "a-long-home-directory" / "with-nested-folders" / "config" / "llama-chat" / "config.toml"
    )
    app = ChatApp(tmp_path / "chat.db", model=str(qwen2), config=UserConfig(path=deep))
    async with open_chat(app=app, wait=False, size=(80, 24)) as pilot:
        await pilot.press("f1")
        assert app.screen.query_one(".dialog").region.right <= 80  # the box fits: nothing cut at the right
        hint = next(w for w in app.screen.query(".hint") if "keymap" in str(w.content))
        lines = hint.render_lines(Region(0, 0, hint.size.width, hint.size.height))
        assert str(deep) in "".join(line.text.strip() for line in lines)  # folded, every character there


@aio
async def test_the_sidebar_hides_by_itself_on_a_narrow_terminal_and_ctrl_b_toggles_it(open_chat):
    async with open_chat(size=(80, 24)) as pilot:
        app = pilot.app
        sidebar = app.chat.sidebar
        assert not sidebar.display and app.chat.query_one("#chat").region.width == 80  # the chat has it all
        await pilot.press("ctrl+b")
        assert sidebar.display
        await pilot.press("ctrl+b")
        assert not sidebar.display
        await pilot.press("ctrl+f")  # searching shows it
        assert sidebar.display and sidebar.search.has_focus
        await pilot.press("ctrl+b")  # and hiding it gives the focus back to the message box
        assert not sidebar.display and app.focused is app.chat.query_one(ChatInput)
    async with open_chat(size=(110, 24)) as pilot:
        assert pilot.app.chat.sidebar.display
        await pilot.press("f1")
        text = "\n".join(f"{k} {d} {i}" for _, rows in pilot.app.screen.sections for k, d, i in rows)
        assert "ctrl+b Sidebar toggle_sidebar" in text
        await pilot.press("escape", "ctrl+b")
        assert not pilot.app.chat.sidebar.display


@aio
async def test_a_notice_leaves_the_message_box_free(tmp_path, qwen2):
    from tui_pilot import chat_app, ready, released

    app = chat_app(tmp_path, qwen2)
    async with app.run_test(size=(100, 30), notifications=True) as pilot:  # (Pilot shows none by default)
        await ready(pilot)
        await say(pilot, "hello the world")
        await pilot.press("ctrl+o")  # a fork says where it went
        await until(pilot, lambda: list(app.screen.query("Toast")), what="the notice")
        await pilot.pause(0.5)  # (it slides in)
        box = app.chat.query_one(ChatInput).region
        assert all(not toast.region.overlaps(box) for toast in app.screen.query("Toast"))
        await pilot.press(*"typed")
        assert app.chat.query_one(ChatInput).text == "typed"
    released(app)


@aio
async def test_api_chats_are_marked_and_f6_hides_them_and_down_goes_from_search_to_results(open_chat, tmp_path):
    store = ChatStore(tmp_path / "chat.db")
    api = store.create_session("Name a prime.", origin="api")
    store.add_message(api.id, "user", "Name a prime.")
    mine = store.create_session("my own chat")  # the newest: it opens
    store.add_message(mine.id, "user", "a prime please")
    async with open_chat() as pilot:
        app = pilot.app
        assert (0, "Name a prime. · API") in tree_labels(app)
        await pilot.press("f6")
        await until(pilot, lambda: len(tree_labels(app)) == 1, what="the API chat to go")
        assert [label for _, label in tree_labels(app)] == ["● my own chat"]
        await pilot.press("ctrl+f", *"prime")
        await until(pilot, lambda: any("user:" in label for _, label in tree_labels(app)), what="the results")
        assert not any("API" in label for _, label in tree_labels(app))  # nor in search results
        await pilot.press("down")  # from the search box to the results, as Tab does
        assert isinstance(app.focused, SessionTree)
        await pilot.press("escape", "f6")
        await until(pilot, lambda: len(tree_labels(app)) >= 2, what="the API chat back")


@aio
async def test_every_action_is_in_the_command_palette(open_chat):
    async with open_chat() as pilot:
        app = pilot.app
        titles = {c.title for c in app.get_system_commands(app.chat)}
        wanted = {"New", "Fork", "Regenerate", "Regenerate ×3", "Edit", "Stop reply", "Rename chat"}
        wanted |= {"Delete chat", "Settings", "Choose model", "Search chats", "Copy", "Copy code"}
        wanted |= {"Export chat", "Import chat", "Help", "Theme", "Quit", "Sidebar", "API chats"}
        assert wanted <= titles
        await say(pilot, "hello the world")
        parent = app.chat.session.id
        await pilot.press("ctrl+p", *"Fork")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await until(pilot, lambda: app.chat.session.id != parent, what="the fork")
        await idle(pilot)
        await pilot.press("ctrl+p", *"Copy")  # a message's action: on the last message, none selected
        await pilot.pause(0.3)
        await pilot.press("enter")
        await until(pilot, lambda: app.clipboard, what="the copy")
        assert app.clipboard == views(app)[-1].content != ""


@aio
async def test_every_binding_has_an_id_and_a_keymap_remaps_it(open_chat):
    from llama_chat.app.tui import app, chat_screen, dialogs, sidebar, widgets

    classes = [
        app.ChatApp,
        chat_screen.ChatScreen,
        widgets.ChatInput,
        widgets.MessageView,
        sidebar.SessionTree,
    ]
    classes += [dialogs.Dialog, dialogs.ConfirmScreen, dialogs.TextScreen, dialogs.SettingsScreen]
    classes += [dialogs.AlternativesScreen, dialogs.HelpScreen]
    assert all(b.id for cls in classes for b in cls.BINDINGS)
    async with open_chat(keymap={"fork": "ctrl+k"}) as pilot:
        app = pilot.app
        await say(pilot, "hello the world")
        parent = app.chat.session.id
        await pilot.press("ctrl+o")  # no longer the fork key
        await idle(pilot)
        assert app.chat.session.id == parent
        await pilot.press("ctrl+k")
        await until(pilot, lambda: app.chat.session.id != parent, what="the fork")


@aio
async def test_themes_from_files_and_the_choice_persists(open_chat, qwen2, tmp_path):
    user_themes = tmp_path / "config" / "llama-chat" / "themes"
    user_themes.mkdir(parents=True)
    (user_themes / "mine.toml").write_text('name = "mine"\nprimary = "#00FF00"\ndark = true\n')
    (user_themes / "broken.toml").write_text('name = "broken"\nprimry = "#00FF00"\n')
    config_file = tmp_path / "config" / "llama-chat" / "config.toml"
    config_file.write_text("# my settings\nmax_tokens = 8\n\n[sampling]\ntemperature = 0\n")
    app = ChatApp(tmp_path / "chat.db", model=str(qwen2))
    async with open_chat(app=app, wait=False) as pilot:
        assert {"llama-dark", "llama-light", "llama-amber", "mine"} <= set(app.available_themes)
        assert "broken" not in app.available_themes
        assert app.theme == "llama-dark"
        assert any("primry" in n for n in notices(app))  # the bad file is named
        app.theme = "llama-light"
        await pilot.pause()
    text = config_file.read_text()
    assert 'theme = "llama-light"' in text and "# my settings" in text and "temperature = 0" in text
    assert UserConfig.load().theme == "llama-light" and UserConfig.load().sampling == {"temperature": 0}
    again = ChatApp(tmp_path / "chat.db", model=str(qwen2))
    async with open_chat(app=again, wait=False):
        assert again.theme == "llama-light"


def test_titles_given_on_the_command_line_are_one_line_with_single_spaces(tmp_path, capsys):
    store = ChatStore(tmp_path / "chat.db")
    session = store.create_session("x")
    store.add_message(session.id, "user", "hello")
    db = ["--db", str(tmp_path / "chat.db")]
    assert main([*db, "sessions", "rename", session.id, " Spaced   out\ttitle "]) == 0
    assert main([*db, "sessions", "fork", session.id, "--title", "a  fork "]) == 0
    assert [s.title for s in ChatStore(tmp_path / "chat.db").list_sessions()] == [
        "a fork",
        "Spaced out title",
    ]


HAND_WRITTEN = '''# my settings
"model" = "qwen2.5-coder-0.5b-instruct-q4_k_m"   # the one I like
max_tokens   =  8
system_prompt = """
theme = "is not a setting here"
"""

[sampling]
temperature = 0  # greedy
'''


def test_saving_a_setting_keeps_the_file_as_the_user_wrote_it(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text(HAND_WRITTEN)
    config = UserConfig.load(path)
    config.save_setting("theme", "llama-light")
    config.save_setting("model", "gemma-3-270m-q4_k_m")
    expected = HAND_WRITTEN.replace("qwen2.5-coder-0.5b-instruct-q4_k_m", "gemma-3-270m-q4_k_m")
    expected = expected.replace('"""\n\n[sampling]', '"""\ntheme = "llama-light"\n\n[sampling]')
    assert path.read_text() == expected  # one key changed in place, one added before the first table
    again = UserConfig.load(path)
    assert (again.model, again.theme) == ("gemma-3-270m-q4_k_m", "llama-light")
    assert again.system_prompt == 'theme = "is not a setting here"\n'


# -- the command line ------------------------------------------------------------------------------


def test_the_command_line_refuses_bad_input_in_one_line(tmp_path, capsys, qwen2):
    db = ["--db", str(tmp_path / "chat.db")]
    assert main([*db, "--model", str(tmp_path / "missing.gguf")]) == 2
    assert main([*db, "--model", str(qwen2), "tui", "--session", "abcdef"]) == 2
    config = tmp_path / "config" / "llama-chat" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text("theme = \n")
    assert main([*db, "--model", str(qwen2)]) == 2
    config.write_text('colour = "red"\n')
    assert main([*db, "--model", str(qwen2)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 4 and all(line.startswith("llama-chat: error: ") for line in lines)
    assert "missing.gguf: no such file" in lines[0] and "unknown session 'abcdef'" in lines[1]
    assert "config.toml" in lines[2] and "unknown setting 'colour'" in lines[3]


@aio
async def test_a_theme_is_found_by_its_short_name_too(open_chat):
    async with open_chat(theme="amber", wait=False) as pilot:
        assert pilot.app.theme == "llama-amber"
        assert not any("unknown theme" in n for n in notices(pilot.app))
