"""A loaded model: config, weights, tokenizer and chat template behind one small object."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from . import forward
from .catalog import (
    DEFAULT_MODEL,
    KNOWN_MODELS,
    KnownModel,
    Progress,
    assembled_model_at,
    has_packages,
    model_path,
    remove_assembled,
    resolve_model,
)
from .chat_template import ChatTemplate
from .config import ModelConfig
from .kernels import DEFAULT_ACTIVATIONS, KERNEL_ROWS
from .kv_arena import DEFAULT_CACHE_TYPE
from .kv_cache import DEFAULT_BLOCK_SIZE, DEFAULT_CACHE_RAM_MB, BlockPool, BlockSource, KVSequence
from .packed_file import holds_model
from .tokenizer import Tokenizer
from .weights import prepare

# Tokens of a prompt per forward pass: bounds the activations and attention scores a pass holds, and
# how long a cancel or another reply's next token waits.
DEFAULT_PREFILL_BATCH = 512


class Model:
    def __init__(
        self,
        prepared,
        cache_ram_mb: float = DEFAULT_CACHE_RAM_MB,
        block_size: int = DEFAULT_BLOCK_SIZE,
        prompt_lookup: bool = True,
        prefill_batch: int = DEFAULT_PREFILL_BATCH,
        source: BlockSource | None = None,
        cache_type: str = DEFAULT_CACHE_TYPE,
    ):
        if prefill_batch < 1:
            raise ValueError(f"prefill_batch must be at least 1, not {prefill_batch}")
        self.path = prepared.path
        self.prompt_lookup = prompt_lookup  # generate()'s default: guess runs from the conversation
        self.prefill_batch = prefill_batch
        self.config: ModelConfig = prepared.config
        self.weights: forward.Weights = prepared.weights
        self.metadata = prepared.metadata
        self.fingerprint: str = prepared.fingerprint
        self.name: str = prepared.metadata.get("general.name") or self.path.stem
        self.tokenizer = Tokenizer.from_metadata(prepared.metadata)
        # KV of every sequence of this model lives in one pool, so equal prefixes are computed once
        self.pool = BlockPool(self.config, self.fingerprint, block_size, cache_ram_mb, source, cache_type)
        template = prepared.metadata.get("tokenizer.chat_template")
        self.has_chat_template = template is not None
        self.chat_template = ChatTemplate(
            template,
            bos_token=self._token_text(self.tokenizer.bos_id),
            eos_token=self._token_text(self.tokenizer.eos_id),
            name=f"chat template of {self.path.name}",
        )

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self.tokenizer.token_bytes(token_id).decode("utf-8", "replace")

    def new_sequence(
        self, n_ctx: int = 4096, private: bool = False, namespace: bytes | None = None
    ) -> KVSequence:
        """An empty sequence in the model's block pool (see BlockPool.new_sequence); `free()` it when done."""
        return self.pool.new_sequence(min(n_ctx, self.config.n_ctx_train), private, namespace)

    def step(
        self, batch: list[tuple[KVSequence, Sequence[int]]], all_logits: bool = False
    ) -> list[np.ndarray]:
        """One forward pass over new tokens of several sequences at once — a batch of one's prompt (at
        most `prefill_batch` tokens) beside the next token of others: the weights are read once for all.
        Each sequence takes its tokens. Returns, in batch order, the logits of each sequence's last new
        token [n_vocab] (all_logits: of every new token, [n, n_vocab])."""
        logits = forward.step(batch, self.weights, self.config, all_logits)
        if not all_logits:
            return list(logits)
        ends = np.cumsum([len(tokens) for _, tokens in batch])
        return np.split(logits, ends[:-1])

    def prefill(
        self, tokens: Sequence[int], seq: KVSequence, all_logits: bool = False
    ) -> Iterator[tuple[int, np.ndarray]]:
        """Run tokens after what the sequence holds, one forward pass of at most `prefill_batch` tokens
        at a time (the one place a long prompt is cut). After each pass yields (tokens done, logits of
        the pass's last token [n_vocab], or all_logits: of each of its tokens [n, n_vocab]). Stopping
        between two passes leaves the sequence holding the passes done."""
        forward.check_room(seq, len(tokens))  # refused before any pass runs
        done = 0
        while done < len(tokens):
            piece = self.next_piece(tokens, done)
            done += len(piece)
            yield done, self.step([(seq, piece)], all_logits)[0]

    def next_piece(self, tokens: Sequence[int], done: int) -> Sequence[int]:
        """The prompt's piece after its first `done` tokens that one pass computes: where prefilling it
        alone cuts it, whatever else shares the pass, so that its KV and logits get the same bits."""
        return tokens[done : done + self.prefill_batch]

    def warm_up(self) -> None:
        """One decode pass and one prefill pass on a throwaway sequence, as llama.cpp's server does before
        it says it is ready: every weight page is read in and the thread pools and buffers exist, so the
        first client's first token does not pay for them."""
        seq = self.new_sequence(2 * KERNEL_ROWS + 2)
        try:
            bos = self.tokenizer.bos_id if self.tokenizer.bos_id is not None else 0
            self.step([(seq, [bos])])
            self.step([(seq, [bos] * (KERNEL_ROWS + 1))])
        finally:
            seq.free()

    def check_room(self, seq: KVSequence, n_new: int) -> None:
        """ContextFullError unless n_new more tokens fit in the sequence's context window."""
        forward.check_room(seq, n_new)

    def forward(self, tokens: Sequence[int], seq: KVSequence, all_logits: bool = False) -> np.ndarray:
        """Append tokens to a sequence; logits of the last new token ([1, n_vocab]) or of all of them."""
        if len(tokens) == 0:
            raise ValueError("forward needs at least one token")
        passes = [logits for _, logits in self.prefill(tokens, seq, all_logits)]
        return np.concatenate(passes) if all_logits else passes[-1][None]

    def verify_draft(self, tokens: list[int], seq: KVSequence) -> np.ndarray:
        """Logits [n, n_vocab] of a few tokens after the sequence (its next token and a guessed run after
        it), each row exactly as decoding that token alone would give (same kernels per row, attention
        row by row). Their KV is written but not taken: the caller commits the rows it accepts
        (`seq.commit(tokens[:m])`), then `seq.truncate(seq.n_tokens)` gives back the rest."""
        return self.verify_rows([(seq, tokens)])[0]

    def verify_rows(self, batch: list[tuple[KVSequence, Sequence[int]]]) -> list[np.ndarray]:
        """verify_draft for several sequences at once: logits [n_i, n_vocab] per sequence, each row as
        decoding its token alone computes it. Passes hold at most kernels.KERNEL_ROWS rows, the most the
        decode kernels take (more would go to BLAS, whose rounding depends on the batch), so what one
        conversation gets never depends on what else is being decoded."""
        out: list[np.ndarray] = []
        group: list[tuple[KVSequence, Sequence[int]]] = []

        def run() -> None:
            logits = forward.step(
                group, self.weights, self.config, all_logits=True, commit=False, attention_rows=1
            )
            out.extend(np.split(logits, np.cumsum([len(t) for _, t in group])[:-1]))
            group.clear()

        for seq, tokens in batch:
            if group and sum(len(t) for _, t in group) + len(tokens) > KERNEL_ROWS:
                run()
            group.append((seq, tokens))
        if group:
            run()
        return out

    def read_and_verify(
        self, reads: list[tuple[KVSequence, Sequence[int]]], checks: list[tuple[KVSequence, Sequence[int]]]
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """step() of prompts' pieces and verify_rows() of replies' rows in one pass, the weights read
        once for both: the last row's logits per piece [n_vocab], every row's per check [n_i, n_vocab].
        Only where the kernels take the whole pass (kernels.kernels_take) does each row keep the bits
        it gets in its own pass."""
        first, rows = forward.read_and_verify(reads, checks, self.weights, self.config)
        ends = np.cumsum([len(t) for _, t in checks])[:-1]
        return list(first), np.split(rows, ends) if checks else []

    def decode_batch(self, tokens: list[int], seqs: list[KVSequence]) -> np.ndarray:
        """One new token for each of several sequences (of any lengths, related or not), in one pass:
        one [n, d] @ W per weight, not n. Logits [len(seqs), n_vocab]; up to kernels.KERNEL_ROWS
        sequences, each row has the bits decoding its sequence alone would give (see model.step)."""
        batch = [(s, [t]) for s, t in zip(seqs, tokens, strict=True)]
        return forward.step(batch, self.weights, self.config)

    def context_shift(self, seq: KVSequence, keep: int, drop: int) -> None:
        """Drop `drop` tokens after the first `keep`, re-rotating the keys of the rest (no recompute)."""
        forward.context_shift(seq, keep, drop, self.weights, self.config)

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
    prefill_batch: int = DEFAULT_PREFILL_BATCH,
    source: BlockSource | None = None,
    cache_type: str = DEFAULT_CACHE_TYPE,
    activations: str = DEFAULT_ACTIVATIONS,
    n_ctx: int | None = None,
    use_mmap: bool = True,
) -> Model:
    """Load a model by short name (None: the default model) or by the path of a GGUF file.

    `cache_ram_mb` bounds the KV block pool; `block_size` is the tokens per KV block; `prompt_lookup`
    is whether replies guess runs of tokens from the conversation (the text is the same either way);
    `prefill_batch` is the tokens of a prompt per forward pass; `source` is where the pool looks for
    KV blocks it does not hold (see kv_cache.BlockSource; or attach one later: model.pool.attach_source);
    `cache_type` the live KV cache's element type (kv_cache.CACHE_TYPES: "f16" or "f32");
    `activations` what the matrix products take their inputs as (kernels.ACTIVATIONS: "f32" exactly,
    "q8", the default, quantized to bytes as llama.cpp, or "mixed": bytes only where they come from a
    norm; KV of each is kept apart, by the fingerprint); `n_ctx` the context its sequences are
    given (--ctx): where a model's RoPE depends on it (phi3's LongRoPE), as llama.cpp decides by its
    context (config.with_context); None: as the GGUF reads; `use_mmap` False (--no-mmap, as llama.cpp's)
    reads the packed matrices into the process's own memory instead of mapping them: a longer start,
    memory no other process shares, a faster decode where the page cache reads slower (packed_file.py)."""
    known = KNOWN_MODELS.get(DEFAULT_MODEL if name_or_path is None else str(name_or_path))
    # An assembled file a start by name neither assembles nor packs from stays, as does one loaded by its
    # path: it was asked for itself (catalog.resolve_model: a benchmark, llama.cpp); one a start by name
    # assembles or packs from is removed once its packed file is whole.
    asked_for = known is not None and model_path(known).exists() and holds_model(model_path(known))
    path = locate_model(name_or_path, progress)
    prepared = prepare(path, progress, activations=activations, n_ctx=n_ctx, use_mmap=use_mmap)
    if known is not None and not asked_for and holds_model(path) and has_packages(known):
        remove_assembled(known)
    return Model(prepared, cache_ram_mb, block_size, prompt_lookup, prefill_batch, source, cache_type)


def locate_model(name_or_path: str | os.PathLike | None = None, progress: Progress | None = None) -> Path:
    """The path of the GGUF a start loads (catalog.resolve_model); for a catalog model whose packed file
    holds all a start reads (packed_file.holds_model), without assembling it: the path then names no file."""
    known = _catalog_model(name_or_path)
    if known is not None and holds_model(model_path(known)):
        return model_path(known)
    return resolve_model(name_or_path, progress)


def _catalog_model(name_or_path: str | os.PathLike | None) -> KnownModel | None:
    """The catalog's model a name or its assembled file's path names, if any."""
    name = DEFAULT_MODEL if name_or_path is None else str(name_or_path)
    return KNOWN_MODELS.get(name) or assembled_model_at(name)
