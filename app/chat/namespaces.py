"""Whose KV a request reads and makes: the namespace of a tenant's blocks (vLLM's cache_salt), and
which sessions' KV may travel to the remote tier (what this server computed, never an import's)."""

from __future__ import annotations

import hashlib
import json

from llama_chat.storage.store import Session


def kv_salt(tenant: str | None, cache_key: str | None = None) -> bytes | None:
    """The KV namespace of a tenant's requests (vLLM's cache_salt), narrowed by a prompt_cache_key: no
    block, in RAM, stored or in the remote tier, is shared across two, so no cached_tokens tell of
    another's prompts. None, without either: the blocks every session shares."""
    if tenant is None and cache_key is None:
        return None
    return hashlib.sha256(json.dumps(["llama-chat kv salt", tenant, cache_key]).encode()).digest()[:16]


def computed_here(session: Session) -> bool:
    """Whether a session's KV is of the shared namespace or of its tenant's own: blocks this server's
    model computes, which the remote tier may carry (in that namespace). An imported session's are in
    a namespace of the import's own until verified, and never leave this server."""
    return session.kv_namespace in (None, kv_salt(session.tenant))
