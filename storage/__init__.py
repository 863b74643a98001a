"""SQLite storage: sessions, the message tree and KV blocks."""
