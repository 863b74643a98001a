"""SQLite storage: sessions, the message tree and KV blocks (quantized, compressed), export/import."""

from .db import SCHEMA_VERSION, StoreError, open_database
from .store import ChatStore, Message, Session

__all__ = ["SCHEMA_VERSION", "ChatStore", "Message", "Session", "StoreError", "open_database"]
