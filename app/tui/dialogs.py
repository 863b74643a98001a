"""The chat's dialogs: confirm, text entry, session settings, model choice, alternatives, help."""

from __future__ import annotations

from rich import box
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, Static, TextArea
from textual.widgets.option_list import Option

from ..chat.settings import DEFAULT_SAMPLING, REPLY_SETTINGS, SamplingDefaults, SettingError
from .path_input import PathInput

CANCEL = Binding("escape", "cancel", "Cancel", id="dialog_cancel")


class Dialog(ModalScreen):
    """A modal box with a title; Escape cancels (dismisses with None)."""

    BINDINGS = [CANCEL]

    def __init__(self, title: str):
        super().__init__()
        self.dialog_title = title

    def action_cancel(self) -> None:
        self.dismiss(None)


class ConfirmScreen(Dialog):
    BINDINGS = [
        Binding("y", "answer(True)", "Yes", id="dialog_yes"),
        Binding("n", "answer(False)", "No", id="dialog_no"),
    ]

    def __init__(self, title: str, question: str, yes: str = "Yes"):
        super().__init__(title)
        self.question, self.yes = question, yes

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.dialog_title, classes="dialog-title", markup=False)
            yield Label(self.question, markup=False)
            with Horizontal(classes="buttons"):
                yield Button(self.yes, variant="error", id="yes")
                yield Button("Cancel", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)

    def action_cancel(self) -> None:
        self.dismiss(False)


class TextScreen(Dialog):
    """One line (Enter saves) or several (Ctrl+S saves); dismisses with the text, or None. A `path`:
    one line completed as it is typed (path_input.py)."""

    BINDINGS = [Binding("ctrl+s", "save", "Save", id="dialog_save", priority=True)]

    def __init__(
        self, title: str, text: str = "", multiline: bool = False, hint: str = "", path: bool = False
    ):
        super().__init__(title)
        self.text, self.multiline, self.hint, self.path = text, multiline, hint, path

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.dialog_title, classes="dialog-title", markup=False)
            if self.multiline:
                yield TextArea(self.text, soft_wrap=True, id="text")
            elif self.path:
                yield PathInput(self.text, id="text")
            else:
                yield Input(self.text, id="text")
            yield Label(
                self.hint or ("Ctrl+S saves, Esc cancels" if self.multiline else "Enter saves, Esc cancels"),
                classes="hint",
            )

    def on_mount(self) -> None:
        field = self.query_one("#text")
        field.focus()
        if isinstance(field, TextArea):
            field.move_cursor(field.document.end)

    def on_input_submitted(self) -> None:
        self.action_save()

    def action_save(self) -> None:
        field = self.query_one("#text")
        self.dismiss(field.text if isinstance(field, TextArea) else field.value)


class SettingsScreen(Dialog):
    """Title, system prompt and sampling of one session; dismisses with {title, system_prompt, sampling}."""

    BINDINGS = [Binding("ctrl+s", "save", "Save", id="dialog_save", priority=True)]

    def __init__(
        self,
        title: str,
        system_prompt: str | None,
        sampling: dict,
        max_tokens: int,
        defaults: SamplingDefaults = DEFAULT_SAMPLING,
    ):
        super().__init__("Chat settings")
        self.session_title, self.system_prompt = title, system_prompt or ""
        self.defaults = defaults.values | {"max_tokens": max_tokens}
        self.defaults_source = defaults.source
        self.sampling = sampling
        self.values = self.defaults | {key: value for key, value in sampling.items() if value is not None}

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog wide"):
            yield Label(self.dialog_title, classes="dialog-title")
            yield Label("Title")
            yield Input(self.session_title, id="title", compact=True)
            yield Label("System prompt", classes="field-label")
            yield TextArea(self.system_prompt, soft_wrap=True, id="system-prompt")
            with Grid(id="sampling"):
                for setting in REPLY_SETTINGS:
                    value = self.values.get(setting.key)
                    yield Label(setting.label)
                    yield Input(
                        "" if value is None else str(value),
                        type={int: "integer", float: "number"}.get(setting.kind, "text"),
                        placeholder=" / ".join(setting.choices),
                        id=setting.key,
                        compact=True,
                    )
            yield Label(
                f"Unset values are the model's defaults: {self.defaults_source}",
                id="defaults",
                classes="hint",
                markup=False,
            )
            yield Label("", id="error", classes="error", markup=False)  # it quotes what was typed
            yield Label("Ctrl+S saves, Esc cancels", classes="hint")

    def on_mount(self) -> None:
        self.query_one("#system-prompt").focus()

    def on_input_submitted(self) -> None:
        self.action_save()

    def action_save(self) -> None:
        sampling = {}
        try:
            for setting in REPLY_SETTINGS:  # max_tokens too: kept with the session, the engine ignores it
                text = self.query_one(f"#{setting.key}", Input).value.strip()
                value = setting.parse(text) if text else None
                # a default left as it is stays a default: it follows the model of the reply
                if value is not None and (
                    value != self.defaults.get(setting.key) or setting.key in self.sampling
                ):
                    sampling[setting.key] = value
        except SettingError as e:
            self.query_one("#error", Label).update(str(e))
            return
        self.dismiss(
            {
                "title": self.query_one("#title", Input).value.strip() or self.session_title,
                "system_prompt": self.query_one("#system-prompt", TextArea).text.strip() or None,
                "sampling": sampling,
            }
        )


class ModelScreen(Dialog):
    """Pick a known model or give the path of a .gguf file; dismisses with the name or path."""

    def __init__(self, models: list[tuple[str, str]], current: str | None):
        super().__init__("Model")
        self.models, self.current = models, current

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog wide"):
            yield Label(self.dialog_title, classes="dialog-title")
            yield Label(f"Now: {self.current or 'none loaded'}", markup=False)
            yield OptionList(*[Option(Text(f"{name}  ({state})"), id=name) for name, state in self.models])
            yield Label("or the path of a .gguf file:")
            yield Input(placeholder="/path/to/model.gguf", id="path")
            yield Label("Enter loads, Esc cancels", classes="hint")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.value.strip():
            self.dismiss(event.value.strip())


class AlternativesScreen(Dialog):
    """The replies of "regenerate ×3", each in its own branch; dismisses with the session id picked."""

    BINDINGS = [Binding(str(i), f"pick({i - 1})", str(i), id=f"pick_{i}", show=False) for i in (1, 2, 3)]
    # Textual focuses it once the screen is up (a query in on_mount could run too soon)
    AUTO_FOCUS = "OptionList"

    def __init__(self, alternatives: list[tuple[str, str]]):
        super().__init__("Three alternatives, each in its own branch")
        self.alternatives = alternatives  # (session id, text)

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog wide"):
            yield Label(self.dialog_title, classes="dialog-title")
            options = []
            for i, (sid, text) in enumerate(self.alternatives, 1):
                options += [None] if options else []  # a rule between alternatives
                options.append(Option(Text(f"{i}. ", style="bold") + Text(text.strip() or "(empty)"), id=sid))
            yield OptionList(*options)
            yield Label(
                "Enter or 1–3 opens that branch; Esc stays here (all three are in the sidebar)",
                classes="hint",
            )

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def action_pick(self, i: int) -> None:
        if i < len(self.alternatives):
            self.dismiss(self.alternatives[i][0])


class HelpScreen(Dialog):
    """Every key, with the binding id a keymap in config.toml uses to change it."""

    BINDINGS = [Binding("f1,q", "cancel", "Close", id="help_close")]

    def __init__(self, sections: list[tuple[str, list[tuple[str, str, str]]]], config_path: str):
        super().__init__("Keys")
        self.sections, self.config_path = sections, config_path

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog wide tall"):
            yield Label(self.dialog_title, classes="dialog-title")
            for heading, rows in self.sections:
                table = Table(box=box.SIMPLE_HEAD, expand=True, title=heading, title_justify="left")
                table.add_column("key", ratio=3, style="bold")
                table.add_column("does", ratio=4)
                table.add_column("binding id", ratio=3, style="dim")
                for keys, what, binding_id in rows:
                    table.add_row(keys, what, binding_id)
                yield Static(table)
            yield Label(
                "Every action is also in the command palette (Ctrl+P). Keys change in the [keymap] "
                f'table of\n{self.config_path}\nwith lines such as  fork = "ctrl+k"',
                classes="hint",
                markup=False,
            )
            yield Label("Esc, F1 or q closes", classes="hint")
