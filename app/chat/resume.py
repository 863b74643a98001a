"""What bringing a session's KV back tells: how much came back and from where (ResumeInfo, with the
remote tier's part, RemoteRead), and what a verify of imported KV found (VerifyResult)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RemoteRead:
    """What the remote tier did for one prompt: the rule's choice, and the tokens it read."""

    choice: str = "local"  # "fetch" or "compute"; "local": RAM and SQLite held every full block
    tokens: int = 0
    seconds: float = 0.0  # the time it took, round trip and checks
    tail: tuple[bytes | None, tuple[int, ...]] | None = None  # the tail it read: its parent's key, its tokens


@dataclass
class ResumeInfo:
    tokens: int  # tokens of the conversation so far
    restored: int  # of those, how many came back without computing (RAM, stored blocks, tail)
    seconds: float
    remote: int = 0  # of those, how many were read from the remote tier
    remote_read: RemoteRead | None = None  # what the remote tier did (None: there is none)

    def describe(self) -> str:
        remote = f" ({self.remote:,} from the remote tier)" if self.remote else ""
        return f"{self.restored:,} of {self.tokens:,} tokens restored{remote} in {self.seconds * 1000:.0f} ms"


@dataclass
class VerifyResult:
    imported: bool  # whether the session read imported KV (else there was nothing to verify)
    matched: int = 0  # imported blocks equal to their recomputed KV, now shared
    differed: int = 0  # imported blocks that were not: replaced by the recomputed KV

    def describe(self) -> str:
        if not self.imported:
            return "nothing to verify: its KV was computed here"
        text = f"{self.matched} imported KV block(s) matched the recomputed KV and are now shared"
        if self.differed:
            text += f"; {self.differed} did not (altered or made by another program) and were replaced"
        return text
