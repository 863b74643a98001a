"""A chat's title: as it is stored, as a message names it, and when a message should."""

from __future__ import annotations

from llama_chat.storage.fragments import brief
from llama_chat.storage.store import Session

NEW_CHAT = "New chat"  # the title of a chat until its first message names it
TITLE_CHARS = 48  # a title made from a message is cut to this


def session_title(text: str) -> str:
    """A title as it is stored: one line, single spaces, none at either end."""
    return " ".join(text.split())


def title_from_text(text: str, limit: int = TITLE_CHARS) -> str:
    """A chat's title from a message: one line, cut after its last whole word that fits, with "…"."""
    title = session_title(brief(text))  # an attached file by its name
    if len(title) <= limit:
        return title or NEW_CHAT
    cut = title[: limit - 1]
    if title[limit - 1] != " " and " " in cut:  # else it ends on a whole word, or is one long word
        cut = cut.rsplit(" ", 1)[0]
    words = cut
    return words.rstrip(" ,.;:-") + "…"


def named_by(session: Session, user_text: str | None) -> str | None:
    """The title a session takes from a message of its own: a new chat's first message, and a fork's
    (or an edit's) first own message, while its title only says what it was forked from."""
    if user_text is None or not user_text.strip():
        return None
    placeholder = session.title == NEW_CHAT or session.title.endswith((" (fork)", " (edited)"))
    return title_from_text(user_text) if placeholder else None
