"""A loaded model: config, weights, tokenizer and chat template behind one small object."""

from __future__ import annotations

import os

import numpy as np

from .catalog import Progress, resolve_model
from .chat_template import ChatTemplate
from .kv_cache import KVCache
from .model import forward
from .tokenizer import Tokenizer
from .weights import Config, prepare


class Model:
    def __init__(self, prepared):
        self.path = prepared.path
        self.config: Config = prepared.config
        self.weights = prepared.weights
        self.metadata = prepared.metadata
        self.fingerprint: str = prepared.fingerprint
        self.name: str = prepared.metadata.get("general.name") or self.path.stem
        self.tokenizer = Tokenizer.from_metadata(prepared.metadata)
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

    def new_cache(self, n_ctx: int = 4096) -> KVCache:
        return KVCache(self.config, n_ctx)

    def forward(self, tokens, cache: KVCache, all_logits: bool = False) -> np.ndarray:
        """Append tokens to the cache; logits of the last new token ([1, n_vocab]) or of all of them."""
        return forward(tokens, self.weights, self.config, cache, all_logits)

    def logits(self, ids) -> np.ndarray:
        """Teacher forcing from a fresh cache: logits [len(ids), n_vocab], float32."""
        return self.forward(ids, self.new_cache(max(len(ids), 1)), all_logits=True)

    def __repr__(self) -> str:
        return f"Model({self.name!r}, arch={self.config.arch}, layers={self.config.n_layer})"


def load_model(name_or_path: str | os.PathLike | None = None, progress: Progress | None = None) -> Model:
    """Load a model by short name (None: the default model) or by the path of a GGUF file."""
    path = resolve_model(name_or_path, progress)
    return Model(prepare(path, progress))
