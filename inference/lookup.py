"""Prompt lookup: guess the next few tokens of a reply by finding where its last few tokens appeared
before in the conversation, and taking what followed them there (llama.cpp's `--lookup`, vLLM's n-gram
speculation). A reply that repeats or edits code from the prompt is full of such runs. The model then
checks the guess in one batched pass (weights read once for all rows) and keeps what it would have
produced itself, so the text is exactly that of plain decoding."""

from __future__ import annotations

from collections.abc import Sequence

NGRAMS = (3, 2)  # the longest match first; a single token repeats too often to predict much
# with the token being decoded, 8 rows: two of the kernels' 4-row steps, ~1.6-1.9x one row's time
MAX_DRAFT = 7


class PromptLookup:
    """An index from each n-gram of the context to where its latest continuation starts."""

    def __init__(self, tokens: Sequence[int]):
        self.tokens: list[int] = []
        self.index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in NGRAMS}
        self.draft_len = 4  # grows while guesses are taken whole, shrinks when they are not
        for t in tokens:
            self.push(t)

    def push(self, token: int) -> None:
        """Append a token; the n-grams ending just before it now point at it."""
        end = len(self.tokens)
        for n in NGRAMS:
            if end >= n:
                self.index[n][tuple(self.tokens[end - n : end])] = end
        self.tokens.append(int(token))

    def propose(self) -> list[int]:
        """Up to draft_len tokens that followed the latest earlier occurrence of the context's last n-gram."""
        for n in NGRAMS:
            if len(self.tokens) < n:
                continue
            start = self.index[n].get(tuple(self.tokens[-n:]))
            if start is not None:
                return self.tokens[start : start + self.draft_len]
        return []

    def taken(self, drafted: int, accepted: int) -> None:
        """How the last guess fared: longer guesses after a whole one was right, shorter after a miss."""
        if drafted and accepted == drafted:
            self.draft_len = min(self.draft_len * 2, MAX_DRAFT)
        elif drafted:
            self.draft_len = max(1, accepted + 1)
