"""The full-screen chat (Textual): the app, its chat screen, the conversation, the sidebar, dialogs,
widgets."""

from .app import ChatApp, cmd_tui

__all__ = ["ChatApp", "cmd_tui"]
