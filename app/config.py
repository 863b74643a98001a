"""The TUI's settings: config.toml (model, theme, keymap, defaults for new chats), themes, remembered
state."""

from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

from textual.keys import KEY_ALIASES, REPLACED_KEYS, Keys, key_to_character
from textual.theme import Theme

from .chat.mcp_tools import ToolError, server_configs
from .chat.settings import MAX_TOKENS, N_CTX, REPLY_MAX_TOKENS, SAMPLING, SettingError, checked

DEFAULT_THEME = "llama-dark"
# themes/ sits beside app/ in a checkout, and beside llama_chat/app/ once installed
BUILTIN_THEMES = Path(__file__).resolve().parent.parent / "themes"
THEME_KEYS = {f.name for f in fields(Theme)}
MODIFIERS = {"ctrl", "shift", "alt", "meta", "super", "hyper"}
# Keys Textual names rather than spells as a character ("f2", "escape", "newline"); "<any>" and the like are
# placeholders of its own, not keys.
NAMED_KEYS = {k.value for k in Keys if "+" not in k.value and not k.value.startswith("<")}
NAMED_KEYS |= {a for aliases in KEY_ALIASES.values() for a in aliases if "+" not in a}

EXAMPLE = f"""\
# llama-chat settings. Every key is optional.
# model = "qwen2.5-coder-0.5b-instruct-q4_k_m"   # a known name or the path of a .gguf file
# theme = {'"' + DEFAULT_THEME + '"':<39}# set from the app too (command palette: Theme)
# max_tokens = {MAX_TOKENS:<34}# longest reply
# n_ctx = {N_CTX:<39}# context window in tokens
# system_prompt = "You are a concise assistant." # for new chats ("" for none; unset: the model's)
#
# [sampling]                                     # for new chats
# temperature = 0.7
#
# [keymap]                                       # binding id = keys (F1 lists the ids)
# fork = "ctrl+k"
#
# [mcp_servers.weather]                          # MCP tools for `chat` (docs/tools.md)
# command = "python"
# args = ["weather_server.py"]
"""


def is_key(key: str) -> bool:
    """Whether Textual can report this key: modifiers, then a named key or a character by itself or by
    name ("ctrl+k", "f2", "shift+enter", "question_mark", "é")."""
    *modifiers, base = key.strip().split("+")
    if not base or not set(modifiers) <= MODIFIERS:
        return False
    return base in NAMED_KEYS or key_to_character(REPLACED_KEYS.get(base, base)) is not None


class ConfigError(Exception):
    """A config or theme file a user wrote that cannot be used; the message names the file."""


def config_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "llama-chat"


def export_dir() -> Path:
    """Where exports go unless told: ~/Downloads where there is one, else llama-chat's folder in the
    user's data directory (made when needed) — never the current directory, which may be a checkout."""
    downloads = Path.home() / "Downloads"
    if downloads.is_dir():
        return downloads
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "llama-chat" / "exports"


def state_path() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "llama-chat" / "state.json"


@dataclass
class UserConfig:
    path: Path
    model: str | None = None
    theme: str = DEFAULT_THEME
    max_tokens: int = MAX_TOKENS
    n_ctx: int = N_CTX
    system_prompt: str | None = None
    sampling: dict = field(default_factory=dict)
    keymap: dict[str, str] = field(default_factory=dict)
    mcp_servers: dict = field(default_factory=dict)  # [mcp_servers.NAME] tables: app/chat/mcp_tools.py
    problems: list[str] = field(default_factory=list)  # settings left out, a line each, for the app to show

    def __post_init__(self) -> None:
        # A binding to a key no terminal sends would make its action unreachable: keep the default instead.
        self.keymap = dict(self.keymap)
        for binding, keys in list(self.keymap.items()):
            bad = [k.strip() for k in keys.split(",") if not is_key(k)]
            if bad:
                del self.keymap[binding]
                self.problems.append(
                    f"{self.path}: [keymap] {binding}: {bad[0]!r} is not a key; its default key stays"
                )

    @classmethod
    def load(cls, path: Path | None = None) -> UserConfig:
        path = path or config_dir() / "config.toml"
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        except (tomllib.TOMLDecodeError, OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: {e}") from None
        types = {"model": str, "theme": str, "max_tokens": int, "n_ctx": int, "system_prompt": str}
        types |= {"sampling": dict, "keymap": dict, "mcp_servers": dict}
        for key, value in data.items():
            if key not in types:
                raise ConfigError(f"{path}: unknown setting '{key}' (known: {', '.join(types)})")
            if not isinstance(value, types[key]) or isinstance(value, bool):
                raise ConfigError(f"{path}: '{key}' must be a {types[key].__name__}, not {value!r}")
        try:
            data["sampling"] = checked(data.get("sampling", {}), SAMPLING)
        except SettingError as e:
            raise ConfigError(f"{path}: [sampling] {e}") from None
        try:
            REPLY_MAX_TOKENS.check(data.get("max_tokens", MAX_TOKENS))
        except SettingError as e:
            raise ConfigError(f"{path}: {e}") from None
        try:
            server_configs(data.get("mcp_servers", {}))
        except ToolError as e:
            raise ConfigError(f"{path}: {e}") from None
        if not all(isinstance(v, str) for v in data.get("keymap", {}).values()):
            raise ConfigError(f'{path}: [keymap] values must be key strings such as "ctrl+k"')
        return cls(path=path, **data)

    def save_setting(self, key: str, value: str) -> None:
        """Set one top-level key in the file; tomlkit keeps everything else as the user wrote it."""
        import tomlkit  # (only where a setting is saved: not before the app's window)
        import tomlkit.exceptions

        setattr(self, key, value)
        text = self.path.read_text(encoding="utf-8") if self.path.exists() else EXAMPLE
        try:
            document = tomlkit.parse(text)
        except tomlkit.exceptions.ParseError as e:  # changed by hand since it was loaded
            raise ConfigError(f"{self.path}: {e}") from None
        document[key] = value  # top-level: before the first [table], a comment on its line kept
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(tomlkit.dumps(document), encoding="utf-8")


def load_theme(path: Path) -> Theme:
    """A Textual theme from a TOML file whose keys are Theme's fields (name, primary, background, …)."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: {e}") from None
    unknown = set(data) - THEME_KEYS
    if unknown:
        raise ConfigError(f"{path}: unknown theme key(s) {', '.join(sorted(unknown))}")
    if "name" not in data or "primary" not in data:
        raise ConfigError(f"{path}: a theme needs at least 'name' and 'primary'")
    try:
        return Theme(**data)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path}: {e}") from None


def load_themes() -> tuple[list[Theme], list[str]]:
    """The built-in themes, then the user's (config dir, themes/*.toml); and a line per bad file."""
    themes, problems = [], []
    for folder in (BUILTIN_THEMES, config_dir() / "themes"):
        for path in sorted(folder.glob("*.toml")) if folder.is_dir() else []:
            try:
                themes.append(load_theme(path))
            except ConfigError as e:
                problems.append(str(e))
    return themes, problems


class State:
    """What the app remembers between runs that is not a setting: the open session of each database,
    the sidebar's width."""

    def __init__(self, path: Path | None = None):
        self.path = path or state_path()
        try:
            self.data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            self.data = {}  # a lost or damaged state file only costs which session opens first
        if not isinstance(self.data, dict):
            self.data = {}

    def last_session(self, db: Path) -> str | None:
        return self.data.get("last_session", {}).get(str(Path(db).resolve()))

    def remember_session(self, db: Path, session_id: str | None) -> None:
        self.data.setdefault("last_session", {})[str(Path(db).resolve())] = session_id
        self.save()

    def sidebar_width(self) -> int | None:
        width = self.data.get("sidebar_width")
        return width if isinstance(width, int) and not isinstance(width, bool) and width > 0 else None

    def remember_sidebar_width(self, width: int) -> None:
        self.data["sidebar_width"] = width
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1), encoding="utf-8")
        tmp.replace(self.path)
