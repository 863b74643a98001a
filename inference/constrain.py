"""Constrained decoding: a grammar (a JSON schema, any JSON object, a Lark grammar) turned into a mask
over the next token, with llguidance (what llama.cpp, vLLM and SGLang use), so a reply always parses.

A grammar is compiled once against the model's vocabulary (grammar_for / json_schema_grammar: a
GrammarError names what is wrong); each reply then walks it with its own Constraint, which masks the
logits before sampling and is told every token drawn.
"""

from __future__ import annotations

import json
import weakref

import llguidance
import numpy as np

from .errors import ModelError
from .schema_bounds import loops_for_ever
from .tokenizer import ATTR_CONTROL, ATTR_UNKNOWN, Tokenizer

# "Any JSON object", as llama.cpp and vLLM read response_format {"type": "json_object"}.
JSON_OBJECT_SCHEMA = {"type": "object"}
# JSON's whitespace, bounded: enough for pretty-printing a few levels deep, and a model cannot fill
# its whole reply with newlines between two tokens that the schema requires.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,20}"
# llguidance's own limits on a grammar's size and the work per token keep a hostile schema bounded;
# log level 0: its warnings would go to stderr, a user sees what matters as a GrammarError.
_LOG_LEVEL = 0


class GrammarError(ModelError):
    """A grammar or schema that cannot be used: one line naming the problem."""


class _Vocabulary:
    """Our tokenizer as llguidance's TokenizerWrapper reads it: every token's bytes as decoding writes
    them, control tokens marked special (llguidance then never matches them as text), the end ids."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.n_vocab)]
        self.special_token_ids = [
            i for i in range(tokenizer.n_vocab) if tokenizer.attrs(i) & (ATTR_CONTROL | ATTR_UNKNOWN)
        ]
        ends = sorted(tokenizer.end_of_generation_ids)
        self.eos_token_id = ends[0] if ends else tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id

    def __call__(self, text: bytes) -> list[int]:
        # llguidance tokenizes grammar literals with this (an optimisation); text never holds control tokens
        return self._tokenizer.encode(text.decode("utf-8", "replace"), add_bos=False)


_LL_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of `tokenizer`, built once per tokenizer (about a second for 150k tokens)."""
    ll = _LL_TOKENIZERS.get(tokenizer)
    if ll is None:
        ends = sorted(tokenizer.end_of_generation_ids) or None
        ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tokenizer)), eos_token=ends)
        _LL_TOKENIZERS[tokenizer] = ll
    return ll


def json_schema_grammar(schema) -> str:
    """The grammar of replies that are JSON documents valid under `schema` (a dict, or JSON text)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as e:  # (nested past Python's recursion limit)
            raise GrammarError(f"the JSON schema is not JSON: {_one_line(e)}") from None
    if not isinstance(schema, dict | bool):
        raise GrammarError(f"a JSON schema must be an object, not {type(schema).__name__}")
    if loops_for_ever(schema):
        raise GrammarError(
            "the JSON schema's '$ref's loop: no JSON document of finite length is valid under it"
        )
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, {"whitespace_pattern": JSON_WHITESPACE})
    except (ValueError, TypeError) as e:
        raise GrammarError(f"the JSON schema cannot be used: {_one_line(e)}") from None


def lark_grammar(lark: str) -> str:
    """A Lark grammar (llguidance's dialect: `%json {schema}` embeds a JSON schema)."""
    return llguidance.LLMatcher.grammar_from_lark(lark)


def check_grammar(tokenizer: Tokenizer, grammar: str) -> str:
    """`grammar`, once llguidance compiled it against this vocabulary; else GrammarError with its reason."""
    error = llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer(tokenizer))
    if error:
        raise GrammarError(f"the grammar does not compile: {_one_line(error)}")
    return grammar


class Constraint:
    """One reply's walk through a grammar: mask() the logits of the next token, accept() the token drawn."""

    def __init__(self, tokenizer: Tokenizer, grammar: str):
        ll = ll_tokenizer(tokenizer)
        self._matcher = llguidance.LLMatcher(ll, grammar, log_level=_LOG_LEVEL)
        if self._matcher.is_error():
            raise GrammarError(f"the grammar does not compile: {_one_line(self._matcher.get_error())}")
        self._n_vocab = ll.vocab_size
        self._bits = np.zeros((self._n_vocab + 31) // 32, dtype=np.int32)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of `logits` where every token the grammar does not allow next is -inf (rows past the
        vocabulary, which some models' output layers have, too)."""
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)  # off the GIL
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self._n_vocab].astype(bool)
        out = np.full(logits.shape, -np.inf, dtype=np.float32)
        n = min(self._n_vocab, logits.size)
        out[:n] = np.where(allowed[:n], logits[:n], np.float32(-np.inf))
        return out

    def accept(self, token: int) -> bool:
        """Move past `token`; False if the grammar did not allow it (the reply must end)."""
        return self._matcher.consume_token(token)

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more than the end of the reply."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error() if self._matcher.is_error() else ""


def _one_line(e) -> str:
    return " ".join(str(e).split())[:300]
