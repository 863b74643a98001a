"""llama-chat: a terminal chat app for local LLMs, with a NumPy inference core."""

__version__ = "0.1.0"
