"""What a load balancer hashes a conversation on, so that each of its turns reaches the server whose
RAM holds its KV (deploy/haproxy.cfg reads it).

A stored session has its id (the path's `/v1/sessions/ID`, the `X-Session-Id` header). A conversation
sent whole (OpenAI's way) has no id; its key is its `prompt_cache_key`, else its `user`, else a digest
of its opening (the messages up to its first user message), which every later turn repeats. The
server returns it as `X-Conversation-Key`; the client, or a proxy before the balancer, sends it back.
A balancer cannot take it from the body: HAProxy reads a JSON body only as far as its buffer (16 KB
by default), and clients send `messages` before the other fields.
"""

from __future__ import annotations

import hashlib
import json

CONVERSATION_KEY = "X-Conversation-Key"


def conversation_key(messages: list[dict], prompt_cache_key: str | None, user: object = None) -> str:
    """The key of a conversation sent whole: 32 hex digits, the same for every turn of it. Anyone may
    compute it (a proxy, a client before its first turn): SHA-256 of the JSON of ["prompt_cache_key",
    key], ["user", user] or ["opening", [role, content]...]."""
    if prompt_cache_key is not None:
        basis = ["prompt_cache_key", prompt_cache_key]
    elif isinstance(user, str) and user:
        basis = ["user", user]
    else:
        basis = ["opening", [[m["role"], m["content"]] for m in opening(messages)]]
    return hashlib.sha256(json.dumps(basis, ensure_ascii=False).encode()).hexdigest()[:32]


def opening(messages: list[dict]) -> list[dict]:
    """The messages up to and including the first user message (all of them if there is none)."""
    for i, message in enumerate(messages):
        if message["role"] == "user":
            return messages[: i + 1]
    return messages
