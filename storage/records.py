"""The records the chat store reads and writes: sessions, messages, stored KV blocks and tails."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

# What a title says a session is besides its conversation; one at most, the newest (no "(fork) (edited)")
TITLE_MARKS = ("(fork)", "(regenerated)", "(edited)", "(imported)")


API_ORIGIN = "api"  # sessions.origin of the conversations `llama-chat serve` keeps

def marked_title(title: str, mark: str) -> str:
    """`title` with `mark` (one of TITLE_MARKS) after it, in place of the mark it had."""
    return f"{unmarked_title(title)} {mark}"


def unmarked_title(title: str) -> str:
    """`title` without the marks at its end."""
    while any(title.endswith(" " + m) for m in TITLE_MARKS):
        title = title.rsplit(" ", 1)[0]
    return title


@dataclass
class Session:
    id: str
    title: str
    head_id: int | None
    model_fingerprint: str | None
    model_name: str | None
    system_prompt: str | None
    sampling: dict
    forked_from: str | None
    n_tokens: int
    created: float
    updated: float
    # The namespace of the KV blocks it reads and makes (vLLM's cache_salt): an import's own, until
    # `sessions verify` recomputes them; None: the blocks computed here, shared by every session.
    # Forks inherit it.
    kv_namespace: bytes | None = None
    origin: str | None = None  # who made it: None, a person; "api", a client of `llama-chat serve`
    tenant: str | None = None  # whose it is: None, the machine's owner's; else a tenant of the server's

    @classmethod
    def from_row(cls, row: dict) -> Session:
        return cls(
            id=row["id"],
            title=row["title"],
            head_id=row["head_id"],
            model_fingerprint=row["model_fingerprint"],
            model_name=row["model_name"],
            system_prompt=row["system_prompt"],
            sampling=json.loads(row["sampling"] or "{}"),
            forked_from=row["forked_from"],
            n_tokens=row["n_tokens"],
            created=row["created"],
            updated=row["updated"],
            kv_namespace=row.get("kv_namespace"),
            origin=row.get("origin"),
            tenant=row.get("tenant"),
        )

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "title": self.title,
            "forked_from": self.forked_from,
            "head": self.head_id,
            "updated": self.updated,
            "created": self.created,
            "n_tokens": self.n_tokens,
            "model": self.model_name,
            "system_prompt": self.system_prompt,
            "sampling": self.sampling,
            "kv_verified": self.kv_namespace is None,
            "origin": self.origin,
        }


@dataclass
class Message:
    id: int
    parent_id: int | None
    role: str
    content: str
    token_ids: list[int] | None
    created: float
    stats: dict | None
    reasoning: str | None = None  # a reply's thinking, apart from its answer (`content`)

    @classmethod
    def from_row(cls, row: dict) -> Message:
        ids = None if row["token_ids"] is None else np.frombuffer(row["token_ids"], dtype=np.int32).tolist()
        return cls(
            row["id"],
            row["parent_id"],
            row["role"],
            row["content"],
            ids,
            row["created"],
            json.loads(row["stats"]) if row["stats"] else None,
            row.get("reasoning"),
        )

    @property
    def stopped(self) -> bool:
        """A reply the user stopped (Esc, Ctrl+C) before it ended by itself."""
        return self.role == "assistant" and (self.stats or {}).get("stop_reason") == "cancelled"


@dataclass
class StoredBlock:
    key: bytes
    n_tokens: int
    codec: str
    data: bytes
    checksum: str
    tokens: list[int] = field(default_factory=list)  # its token ids, checked on every hit (none: no hit)


@dataclass
class StoredTail:
    parent_key: bytes | None
    tokens: list[int]
    codec: str
    data: bytes
    checksum: str
