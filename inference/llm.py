"""A loaded model: config, weights, tokenizer and chat template behind one small object."""

from __future__ import annotations

import os

import numpy as np

from . import model as forward_pass
from .catalog import Progress, resolve_model
from .chat_template import ChatTemplate
from .kv_cache import DEFAULT_BLOCK_SIZE, DEFAULT_CACHE_RAM_MB, BlockPool, KVSequence
from .model import context_shift, decode_batch, forward, verify_draft, verify_rows
from .tokenizer import Tokenizer
from .weights import Config, prepare


class Model:
    def __init__(
        self,
        prepared,
        cache_ram_mb: float = DEFAULT_CACHE_RAM_MB,
        block_size: int = DEFAULT_BLOCK_SIZE,
        prompt_lookup: bool = True,
    ):
        self.path = prepared.path
        self.prompt_lookup = prompt_lookup  # generate()'s default: guess runs from the conversation
        self.config: Config = prepared.config
        self.weights = prepared.weights
        self.metadata = prepared.metadata
        self.fingerprint: str = prepared.fingerprint
        self.name: str = prepared.metadata.get("general.name") or self.path.stem
        self.tokenizer = Tokenizer.from_metadata(prepared.metadata)
        # KV of every sequence of this model lives in one pool, so equal prefixes are computed once
        self.pool = BlockPool(self.config, self.fingerprint, block_size, cache_ram_mb)
        source = prepared.metadata.get("tokenizer.chat_template")
        self.has_chat_template = source is not None
        self.chat_template = ChatTemplate(
            source,
            bos_token=self._token_text(self.tokenizer.bos_id),
            eos_token=self._token_text(self.tokenizer.eos_id),
            name=f"chat template of {self.path.name}",
        )

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self.tokenizer.token_bytes(token_id).decode("utf-8", "replace")

    @property
    def prefill_batch(self) -> int:
        """Prompt tokens per forward pass."""
        return forward_pass.PREFILL_BATCH

    def new_sequence(self, n_ctx: int = 4096) -> KVSequence:
        """An empty sequence in the model's block pool; `free()` it when done."""
        return self.pool.new_sequence(min(n_ctx, self.config.n_ctx_train))

    def forward(self, tokens, seq: KVSequence, all_logits: bool = False) -> np.ndarray:
        """Append tokens to a sequence; logits of the last new token ([1, n_vocab]) or of all of them."""
        return forward(tokens, self.weights, self.config, seq, all_logits)

    def verify_draft(self, tokens: list[int], seq: KVSequence) -> np.ndarray:
        """Logits of each of a few tokens after the sequence, each row as decoding it alone would give;
        their KV is written, not taken: commit the accepted ones, then truncate (see model.verify_draft)."""
        return verify_draft(tokens, self.weights, self.config, seq)

    def verify_rows(self, batch: list[tuple[KVSequence, list[int]]]) -> list[np.ndarray]:
        """verify_draft for several sequences in as few passes as keep every row as decoded alone."""
        return verify_rows(batch, self.weights, self.config)

    def decode_batch(self, tokens: list[int], seqs: list[KVSequence]) -> np.ndarray:
        """One token for each sequence, in one pass; logits [len(seqs), n_vocab]."""
        return decode_batch(tokens, self.weights, self.config, seqs)

    def context_shift(self, seq: KVSequence, keep: int, drop: int) -> None:
        """Drop `drop` tokens after the first `keep`, re-rotating the keys of the rest (no recompute)."""
        context_shift(seq, keep, drop, self.weights, self.config)

    def logits(self, ids) -> np.ndarray:
        """Teacher forcing from a fresh sequence: logits [len(ids), n_vocab], float32."""
        seq = self.new_sequence(max(len(ids), 1))
        try:
            return self.forward(ids, seq, all_logits=True)
        finally:
            seq.free()

    def __repr__(self) -> str:
        return f"Model({self.name!r}, arch={self.config.arch}, layers={self.config.n_layer})"


def load_model(
    name_or_path: str | os.PathLike | None = None,
    progress: Progress | None = None,
    cache_ram_mb: float = DEFAULT_CACHE_RAM_MB,
    block_size: int = DEFAULT_BLOCK_SIZE,
    prompt_lookup: bool = True,
) -> Model:
    """Load a model by short name (None: the default model) or by the path of a GGUF file.

    `cache_ram_mb` bounds the KV block pool; `block_size` is the tokens per KV block; `prompt_lookup`
    is whether replies guess runs of tokens from the conversation (the text is the same either way)."""
    path = resolve_model(name_or_path, progress)
    return Model(prepare(path, progress), cache_ram_mb, block_size, prompt_lookup)
