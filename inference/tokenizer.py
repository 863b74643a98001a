"""llama.cpp's SPM and byte-level BPE tokenizers, re-implemented exactly from GGUF metadata."""

from __future__ import annotations

import codecs
import heapq
import os
from typing import Any

import regex

from .errors import ModelError
from .gguf_file import open_gguf, read_metadata

# GGUF token types (tokenizer.ggml.token_type): 0 undefined, 1 normal, 2 unknown, 3 control,
# 4 user-defined, 5 unused, 6 byte.
_TYPE_NORMAL = 1

# llama.cpp's token attributes (bit flags); the type array only seeds them, load-time rules amend them.
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_LSTRIP = 1 << 7
ATTR_RSTRIP = 1 << 8

_TYPE_TO_ATTR = {
    1: ATTR_NORMAL, 2: ATTR_UNKNOWN, 3: ATTR_CONTROL, 4: ATTR_USER_DEFINED, 5: ATTR_UNUSED, 6: ATTR_BYTE,
}  # fmt: skip

# llama.cpp's isspace() in the "C" locale, used when stripping around lstrip/rstrip special tokens.
_C_SPACE = " \t\n\v\f\r"

# Unicode's private-use code points: no tokenizer gives them a meaning, so they can stand in for text.
_PRIVATE_USE = (*range(0xE000, 0xF900), *range(0xF0000, 0xFFFFE))


class ControlTextShield:
    """Control-token text (``<|im_start|>``) inside message contents, hidden behind private-use
    characters while a chat template renders, so that only the template's own markup becomes control
    tokens and a message cannot forge a turn. encode(..., shield=) turns the hidden text back into
    text, tokenized as llama.cpp tokenizes with parse_special off.

    Each hidden token text gets a private-use character found in none of the messages, so what the
    user wrote comes back exactly; the template sees no control text in contents (nor their length).
    """

    def __init__(self, control_texts: list[str], taken: set[str]):
        free = (chr(c) for c in _PRIVATE_USE if chr(c) not in taken)
        self._placeholder = dict(zip(control_texts, free, strict=False))
        if len(self._placeholder) < len(control_texts):
            raise ModelError(
                "a message uses every private-use character; it cannot be told from the template"
            )
        self._text = {ord(ch): text for text, ch in self._placeholder.items()}
        # longest first, as llama.cpp cuts special tokens out of a text
        alternatives = sorted(control_texts, key=len, reverse=True)
        self._pattern = regex.compile("|".join(map(regex.escape, alternatives))) if alternatives else None

    def hide(self, text: str) -> str:
        if self._pattern is None:
            return text
        return self._pattern.sub(lambda m: self._placeholder[m.group()], text)

    def hides_in(self, text: str) -> bool:
        return bool(self._text) and any(ch in text for ch in self._placeholder.values())

    def reveal(self, text: str) -> str:
        return text.translate(self._text)


# --- pre-tokenizer regexes ------------------------------------------------------------------------
#
# llama.cpp runs each list entry over the pieces the previous entry produced, keeping the text between
# matches as pieces too. Some entries use hand-written splitters (GPT-2, LLaMA-3) and the rest std::regex
# over a "collapsed" text in which every non-ASCII code point stands for its Unicode category. Its
# category tables were generated with this same `regex` package, so `\p{L}`, `\p{N}` and `\s` here give
# the same classes; the differences that remain are handled where they occur:
#  - llama.cpp's collapsed `\p{S}` forgets '~', so `\p{S}` is written `[\p{S}--~]` (needs regex.V1);
#  - std::regex's `$` only matches at the very end, which is `\Z` here;
#  - regexes without `\p{..}` run on a text whose non-ASCII whitespace became '\v' (std::wregex's `\s`
#    is ASCII-only), see _Pretokenizer.

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
# llama.cpp's custom GPT-2 splitter behaves like this regex plus a final `\s+` alternative.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_DEEPSEEK_V3 = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The letter classes are llama.cpp's rewrite of \p{Lu}/\p{Ll}: "a letter that is not ASCII a-z / A-Z".
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS + "?"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS + "?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Written as escapes: several of these code points change under Unicode normalization.
_DEEPSEEK_LLM_LETTERS = (
    r"A-Za-z\u00B5\u00C0-\u00D6\u00D8-\u00F6\u00F8-\u01BA\u01BC-\u01BF\u01C4-\u0293\u0295-\u02AF\u0370-\u0373"
    r"\u0376\u0377\u037B-\u037D\u037F\u0386\u0388-\u038A\u038C\u038E-\u03A1\u03A3-\u03F5\u03F7-\u0481\u048A-\u052F"
    r"\u0531-\u0556\u10A0-\u10C5\u13A0-\u13F5\u13F8-\u13FD\u1C90-\u1CBA\u1CBD-\u1CBF\u1D00-\u1D2B\u1D6B-\u1D77"
    r"\u1D79-\u1D9A\u1E00-\u1F15\u1F18-\u1F1D\u1F20-\u1F45\u1F48-\u1F4D\u1F50-\u1F57\u1F59\u1F5B\u1F5D"
    r"\u1F5F-\u1F7D\u1F80-\u1FB4\u1FB6-\u1FBC\u1FBE\u1FC2-\u1FC4\u1FC6-\u1FCC\u1FD0-\u1FD3\u1FD6-\u1FDB"
    r"\u1FE0-\u1FEC\u1FF2-\u1FF4\u1FF6-\u1FFC\u2102\u2107\u210A-\u2113\u2115\u2119-\u211D\u2124\u2126\u2128"
    r"\u212A-\u212D\u212F-\u2134\u2139\u213C-\u213F\u2145-\u2149\u214E\u2183\u2184\u2C00-\u2C7B\u2C7E-\u2CE4"
    r"\u2CEB-\u2CEE\u2CF2\u2CF3\uA640-\uA66D\uA680-\uA69B\uA722-\uA76F\uA771-\uA787\uA78B-\uA78E\uAB70-\uABBF"
    r"\uFB00-\uFB06\uFB13-\uFB17\uFF21-\uFF3A\uFF41-\uFF5A\U00010400-\U0001044F\U000104B0-\U000104D3"
    r"\U000104D8-\U000104FB\U00010C80-\U00010CB2\U00010CC0-\U00010CF2\U000118A0-\U000118DF\U0001E900-\U0001E943"
)
_CJK_HANGUL = r"[\u4E00-\u9FA5\u0800-\u4E00\uAC00-\uD7FF]+"
_BLOOM = r" ?[^(\s|.,!?\u2026\u3002\uFF0C\u3001\u0964\u06D4\u060C)]+"

_PRE_REGEXES: dict[str, list[str]] = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
    "gpt2": [_GPT2],
    "llama3": [_LLAMA3],
    "qwen2": [_QWEN2],
    "qwen35": [_QWEN35],
    "starcoder": [r"\p{N}", _GPT2],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"],
    "deepseek-llm": [
        r"[\r\n]",
        r"\s?[" + _DEEPSEEK_LLM_LETTERS + r"]+",
        r"\s?[!-/:-~\uFF01-\uFF0F\uFF1A-\uFF5E\u2018-\u201F\u3000-\u3002]+",
        r"\s+\Z",
        _CJK_HANGUL,
        r"\p{N}+",
    ],
    "deepseek-coder": [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}"],
    "deepseek-v3": [r"\p{N}{1,3}", r"[\u4E00-\u9FA5\u3040-\u309F\u30A0-\u30FF]+", _DEEPSEEK_V3],
    "bloom": [_BLOOM],
    "viking": [_BLOOM, r"\p{N}"],
    "tekken": [_TEKKEN],
    "gpt4o": [_GPT4O],
    "seed-coder": [
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
    ],
    "bailingmoe": [
        r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
    ],
    "ufakzeka": [r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "exaone-moe": [
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+"
    ],
    "minicpm5": [
        r"\p{N}{1,3}",
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+",
    ],
}

# tokenizer.ggml.pre values per regex list, and the flags llama_vocab::impl::load sets for some of them.
_LLAMA3_NAMES = "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano"
_PRE_NAMES = {
    "default": "default",
    "llama3": _LLAMA3_NAMES + " dbrx smaug-bpe glm4 chatglm-bpe",
    "deepseek-llm": "deepseek-llm",
    "deepseek-coder": "deepseek-coder",
    "deepseek-v3": "deepseek-v3 hunyuan-dense joyai-llm hy_v4",
    "falcon": "falcon",
    "starcoder": "starcoder refact command-r smollm codeshell exaone minerva-7b mellum2",
    "gpt2": "gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert jina-v1-en "
    "jina-v2-code roberta-bpe mpt olmo jais trillion granite-docling exaone4",
    "qwen2": "qwen2 deepseek-r1-qwen kormo f2llmv2 stablelm2 hunyuan solar-open megrez grok-2",
    "qwen35": "qwen35",
    "bloom": "poro-chat bloom gpt3-finnish",
    "viking": "viking",
    "tekken": "tekken",
    "gpt4o": "gpt-4o llama4 kanana2 talkie minimax-m2",
    "seed-coder": "seed-coder",
    "bailingmoe": "bailingmoe bailingmoe2 llada-moe",
    "ufakzeka": "ufakzeka",
    "exaone-moe": "exaone-moe",
    "minicpm5": "minicpm5",
}
_PRE_TYPES = {name: kind for kind, names in _PRE_NAMES.items() for name in names.split()}
_IGNORE_MERGES = frozenset((_LLAMA3_NAMES + " tekken minicpm5").split())  # a whole-word token wins
_ADD_BOS = frozenset((_LLAMA3_NAMES + " tekken").split())
_NO_BOS = frozenset(("glm4", "chatglm-bpe"))


def _compile(pattern: str) -> tuple[regex.Pattern, bool]:
    """Compile one llama.cpp pre-tokenizer regex; the flag says whether it runs on whitespace-folded text."""
    uses_categories = r"\p{" in pattern
    flags = 0
    if r"\p{S}" in pattern:
        pattern = pattern.replace(r"\p{S}", r"[\p{S}--~]")
        flags = regex.V1
    return regex.compile(pattern, flags), not uses_categories


def _fold_whitespace(text: str) -> str:
    """Non-ASCII whitespace -> '\\v', as llama.cpp does before running std::wregex (same length)."""
    if text.isascii():
        return text
    return _NON_ASCII_SPACE.sub("\v", text)


_NON_ASCII_SPACE = regex.compile(r"[\s--[\x00-\x7f]]", regex.V1)


class _Pretokenizer:
    def __init__(self, patterns: list[str]):
        self.regexes = [_compile(p) for p in patterns]

    def split(self, text: str) -> list[str]:
        pieces = [text]
        for rx, on_folded in self.regexes:
            out = []
            for piece in pieces:
                subject = _fold_whitespace(piece) if on_folded else piece
                pos = 0
                for m in rx.finditer(subject):
                    start, end = m.span()
                    if start > pos:
                        out.append(piece[pos:start])
                    if end > start:
                        out.append(piece[start:end])
                    pos = end
                if pos < len(piece):
                    out.append(piece[pos:])
            pieces = out
        return pieces


# --- GPT-2 byte <-> unicode mapping ------------------------------------------------------------------


def _bytes_to_unicode() -> list[str]:
    printable = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return [table[b] for b in range(256)]


_BYTE_TO_CHAR = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in enumerate(_BYTE_TO_CHAR)}
# Decode UTF-8 bytes as latin-1 (one char per byte), then translate each to its GPT-2 stand-in.
_BYTE_ENCODE_TABLE = str.maketrans({chr(b): c for b, c in enumerate(_BYTE_TO_CHAR)})


def _byte_encode(word: str) -> str:
    return word.encode("utf-8", "surrogatepass").decode("latin-1").translate(_BYTE_ENCODE_TABLE)


# --- the two tokenizer algorithms --------------------------------------------------------------------


class _BPE:
    """llm_tokenizer_bpe: regex pre-split, then merges per word, lowest rank (then left-most) first."""

    def __init__(self, vocab: _Vocab, merges: list[str], pre: str):
        self.ignore_merges = pre in _IGNORE_MERGES
        self.pretokenizer = _Pretokenizer(_PRE_REGEXES[_PRE_TYPES[pre]])
        self.token_to_id = vocab.token_to_id
        self.ranks: dict[tuple[str, str], int] = {}
        for rank, merge in enumerate(merges):
            pos = merge.find(" ", 1)
            pair = (merge[:pos], merge[pos + 1 :]) if pos >= 0 else ("", "")
            self.ranks.setdefault(pair, rank)  # llama.cpp keeps the first rank of a repeated merge
        self.cache: dict[str, tuple[int, ...]] = {}

    def tokenize(self, text: str, out: list[int]) -> None:
        cache = self.cache
        for word in self.pretokenizer.split(text):
            ids = cache.get(word)
            if ids is None:
                ids = self._word(_byte_encode(word))
                if len(cache) < 200_000:
                    cache[word] = ids
            out.extend(ids)

    def _word(self, word: str) -> tuple[int, ...]:
        vocab = self.token_to_id
        if self.ignore_merges and word in vocab:
            return (vocab[word],)
        parts = self._merge_long(word) if len(word) > 32 else self._merge_short(word)
        ids = []
        for part in parts:
            tid = vocab.get(part)
            if tid is not None:
                ids.append(tid)
                continue
            # Never happens with a consistent vocab; llama.cpp then looks up each raw byte as a token.
            for b in part.encode("utf-8"):
                tid = vocab.get(chr(b)) if b < 0x80 else None
                if tid is not None:
                    ids.append(tid)
        return tuple(ids)

    def _merge_short(self, word: str) -> list[str]:
        """Merge the lowest-ranked adjacent pair (the left-most on ties) until none is left: O(n^2)."""
        parts = list(word)
        ranks = self.ranks
        while len(parts) > 1:
            best_rank = None
            best = -1
            for i in range(len(parts) - 1):
                rank = ranks.get((parts[i], parts[i + 1]))
                if rank is not None and (best_rank is None or rank < best_rank):
                    best_rank, best = rank, i
            if best < 0:
                break
            parts[best : best + 2] = [parts[best] + parts[best + 1]]
        return parts

    def _merge_long(self, word: str) -> list[str]:
        """The same merges with llama.cpp's priority queue, O(n log n) for long words."""
        ranks = self.ranks
        syms = list(word)  # a merged-away symbol becomes ""
        n = len(syms)
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        heap: list[tuple[int, int, int, str]] = []

        def add_pair(left: int, right: int) -> None:
            if left >= 0 and right >= 0:
                rank = ranks.get((syms[left], syms[right]))
                if rank is not None:
                    heapq.heappush(heap, (rank, left, right, syms[left] + syms[right]))

        for i in range(1, n):
            add_pair(i - 1, i)
        while heap:
            _, left, right, merged = heapq.heappop(heap)
            if not syms[left] or not syms[right] or syms[left] + syms[right] != merged:
                continue  # stale: one side was merged since this pair was queued
            syms[left] = merged
            syms[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            add_pair(prev[left], left)
            add_pair(left, nxt[left])
        return [s for s in syms if s]


class _SPM:
    """llm_tokenizer_spm: merge adjacent symbols into the highest-scoring vocab entry, left-most on ties."""

    def __init__(self, vocab: _Vocab):
        self.token_to_id = vocab.token_to_id
        self.scores = vocab.scores
        self.unk_id = vocab.unk_id
        self.byte_ids: list[int | None] = []
        for b in range(256):
            tid = vocab.token_to_id.get(f"<0x{b:02X}>")
            if tid is None:  # llama.cpp falls back to the byte itself as a token
                tid = vocab.token_to_id.get(chr(b)) if b < 0x80 else None
            self.byte_ids.append(tid)

    def tokenize(self, text: str, out: list[int]) -> None:
        n = len(text)
        if n == 0:
            return
        vocab, scores = self.token_to_id, self.scores
        syms = list(text)  # a merged-away symbol becomes ""
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        heap: list[tuple[float, int, int, int]] = []

        def try_add(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            merged = syms[left] + syms[right]
            tid = vocab.get(merged)
            if tid is not None:
                heapq.heappush(heap, (-scores[tid], left, right, len(merged)))

        for i in range(1, n):
            try_add(i - 1, i)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            lsym, rsym = syms[left], syms[right]
            if not lsym or not rsym or len(lsym) + len(rsym) != size:
                continue  # stale: one side was merged since this pair was queued
            syms[left] = lsym + rsym
            syms[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            try_add(prev[left], left)
            try_add(left, nxt[left])

        i = 0
        while i != -1:
            sym = syms[i]
            tid = vocab.get(sym)
            if tid is not None:
                out.append(tid)
            else:
                # Only single characters can be missing (merges always form vocab entries): byte fallback.
                for b in sym.encode("utf-8", "surrogatepass"):
                    tid = self.byte_ids[b]
                    if tid is None:
                        tid = self.unk_id
                    if tid is not None:
                        out.append(tid)
            i = nxt[i]


# --- vocabulary --------------------------------------------------------------------------------------


class _Vocab:
    """Token texts, scores and attributes after llama.cpp's load-time rules."""

    def __init__(self, tokens: list[str], token_to_id: dict[str, int], scores: list[float], attrs: list[int],
                 unk_id: int | None):  # fmt: skip
        self.tokens = tokens
        self.token_to_id = token_to_id
        self.scores = scores
        self.attrs = attrs
        self.unk_id = unk_id


# Special tokens llama.cpp finds by their text when the metadata does not name them.
_FOUND_BY_TEXT = {
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
            "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>"),
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}  # fmt: skip
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
))  # fmt: skip
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss


def _key(meta: dict[str, Any], name: str, default: Any = None) -> Any:
    return meta.get("tokenizer.ggml." + name, default)


def _apply_text_rules(tokens: list[str], token_to_id: dict[str, int], attrs: list[int], ids: dict) -> set:
    """llama.cpp's load-time rules that find EOT/EOM/FIM and end-of-generation tokens by their text.

    Such tokens become control tokens (attrs and ids are amended in place); returns the end-of-generation ids.
    """

    def first_present(texts):
        found = [token_to_id[t] for t in texts if t in token_to_id]
        # llama.cpp takes whichever its hash map yields first; the lowest id is our stable choice.
        return min(found) if found else None

    for name, texts in _FOUND_BY_TEXT.items():
        if ids.get(name) is None:
            ids[name] = first_present(texts)
            if ids[name] is not None:
                attrs[ids[name]] |= ATTR_CONTROL
    eog = {ids[k] for k in ("fim_pad", "fim_rep", "fim_sep") if ids[k] is not None}
    for text in _EOG_TEXTS:
        tid = token_to_id.get(text)
        if tid is not None:
            eog.add(tid)
            attrs[tid] |= ATTR_CONTROL
    for text in _ALWAYS_RENDERED:
        if text in token_to_id:
            attrs[token_to_id[text]] = ATTR_USER_DEFINED
    eog.update(ids[k] for k in ("eos", "eot", "eom") if ids[k] is not None)

    texts = {tokens[i]: i for i in eog}
    has_call = "<|call|>" in texts or "<|calls|>" in texts
    if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
        # o200k_harmony / solar-open: "<|end|>" ends a message, not the generation.
        eog.discard(texts["<|end|>"])
        attrs[texts["<|end|>"]] = ATTR_USER_DEFINED
    if "<|tool_response>" in texts and "</s>" in texts:  # gemma4 / paddleocr
        eog.discard(texts["</s>"])
        attrs[texts["</s>"]] = ATTR_NORMAL
    return eog


def _apply_name_rules(meta: dict[str, Any], pre: str, token_to_id: dict[str, int], attrs: list[int]) -> None:
    """llama.cpp's per-model lstrip/rstrip attributes for special tokens (chosen by model name)."""
    name = str(meta.get("general.name", "")).lower()
    arch = str(meta.get("general.architecture", ""))
    if any(p in pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
        a in arch for a in ("nomic-bert-moe", "jina-bert-v3")
    ):
        if "<mask>" in token_to_id:
            attrs[token_to_id["<mask>"]] |= ATTR_LSTRIP
    elif "phi-3" in name or "phi3" in name:
        for i, a in enumerate(attrs):
            if a & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN):
                attrs[i] |= ATTR_RSTRIP
        for text, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
            if text in token_to_id:
                tid = token_to_id[text]
                attrs[tid] = attrs[tid] | ATTR_RSTRIP if on else attrs[tid] & ~ATTR_RSTRIP
    elif "modern-bert" in name and "[MASK]" in token_to_id:
        attrs[token_to_id["[MASK]"]] |= ATTR_LSTRIP


class Tokenizer:
    """Text <-> token ids exactly as llama.cpp does it for this vocab (SPM or byte-level BPE).

    decode() renders control and user-defined tokens as their text (llama.cpp's detokenize with
    special=True, remove_special=False) and, like llama.cpp, drops the one leading space the vocab's
    space prefix adds to the first token; it does not apply llama.cpp's optional "clean spaces" pass,
    so decode(encode(text)) == text for byte-level BPE vocabs.
    """

    def __init__(self, meta: dict[str, Any]):
        model = _key(meta, "model")
        if model is None:
            raise ModelError("no tokenizer in the model metadata (tokenizer.ggml.model is missing)")
        if model not in ("llama", "gpt2"):
            raise ModelError(f"unsupported tokenizer model '{model}' (only 'llama' SPM and 'gpt2' BPE are)")
        tokens = _key(meta, "tokens")
        if not tokens:
            raise ModelError("no tokenizer vocab in the model metadata (tokenizer.ggml.tokens is missing)")
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        n_vocab = len(tokens)
        scores = [float(s) for s in _key(meta, "scores", [])] or [0.0] * n_vocab
        types = _key(meta, "token_type") or [_TYPE_NORMAL] * n_vocab
        if len(scores) < n_vocab or len(types) < n_vocab:
            raise ModelError("tokenizer metadata is inconsistent (fewer scores or token types than tokens)")
        attrs = [_TYPE_TO_ATTR.get(t, 0) for t in types[:n_vocab]]

        self.is_spm = model == "llama"
        pre = _key(meta, "pre") or "default"
        if self.is_spm:
            # llama.cpp ignores tokenizer.ggml.pre for SPM vocabs.
            ids = {"bos": 1, "eos": 2, "unk": 0}
            add_bos, add_space_prefix = True, True
        else:
            if pre not in _PRE_TYPES:
                raise ModelError(f"unsupported pre-tokenizer '{pre}' (tokenizer.ggml.pre)")
            add_bos = pre in _ADD_BOS
            ids = {"bos": None if pre in _NO_BOS else 11, "eos": 11, "unk": None}
            add_space_prefix = False
        self.add_space_prefix = bool(_key(meta, "add_space_prefix", add_space_prefix))
        ids = {k: (v if v is not None and v < n_vocab else None) for k, v in ids.items()}
        for name in ("bos", "eos", "eot", "eom", "unk", "fim_pad", "fim_rep", "fim_sep"):
            value = _key(meta, ("unknown" if name == "unk" else name) + "_token_id")
            if value is not None and 0 <= int(value) < n_vocab:
                ids[name] = int(value)
        add_bos = _key(meta, "add_bos_token", add_bos)

        token_to_id: dict[str, int] = {}
        for i, t in enumerate(tokens):
            if token_to_id.setdefault(t, i) != i:
                raise ModelError(f"duplicate token in the vocabulary: {t!r} has ids {token_to_id[t]} and {i}")
        eog = _apply_text_rules(tokens, token_to_id, attrs, ids)
        _apply_name_rules(meta, pre, token_to_id, attrs)

        self.n_vocab = n_vocab
        self.bos_id: int | None = ids["bos"]
        self.eos_id: int | None = ids["eos"]
        self.add_bos = bool(add_bos)
        self.end_of_generation_ids: frozenset[int] = frozenset(eog)
        self._vocab = _Vocab(tokens, token_to_id, scores, attrs, ids["unk"])
        self._algo = _SPM(self._vocab) if self.is_spm else _BPE(self._vocab, _key(meta, "merges") or [], pre)
        # Tokens split out before the tokenizer runs, longest first (llama.cpp's cache_special_tokens).
        special = [i for i, a in enumerate(attrs) if a & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN)]
        special.sort(key=lambda i: (-len(tokens[i].encode("utf-8", "surrogatepass")), i))
        self._special_all = special
        self._special_user = [i for i in special if not attrs[i] & (ATTR_CONTROL | ATTR_UNKNOWN)]
        self._control_texts = [tokens[i] for i in special if attrs[i] & (ATTR_CONTROL | ATTR_UNKNOWN)]
        self._pieces: dict[int, bytes] = {}

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        return cls(meta)

    # --- encoding ---

    def control_text_shield(self, texts: list[str]) -> ControlTextShield:
        """A shield for the control-token text found in `texts` (message contents), for encode()."""
        joined = "\n".join(texts)
        present = [t for t in self._control_texts if t in joined]
        return ControlTextShield(present, set(joined) if present else set())

    def encode(
        self, text: str, add_bos: bool = False, special: bool = False, shield: ControlTextShield | None = None
    ) -> list[int]:
        """Token ids for text; add_bos prepends BOS, special=True turns control-token text into its id;
        text a `shield` hid comes back as text, tokenized as with special=False."""
        out: list[int] = []
        if add_bos:
            if self.bos_id is None:
                raise ModelError("this vocabulary has no BOS token")
            out.append(self.bos_id)
        if not text:
            return out
        prev_special = True  # SPM adds the space prefix at the start and after each special token
        for frag in self._partition(text, special, shield):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if self.is_spm:
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                frag = frag.replace(" ", "▁")
            self._algo.tokenize(frag, out)
            prev_special = False
        return out

    def _partition(
        self, text: str, special: bool, shield: ControlTextShield | None = None
    ) -> list[str | int]:
        """llama.cpp's tokenizer_st_partition: cut special tokens out of the text, longest token first.

        User-defined tokens are always cut out; control and unknown ones only when special is set, and
        never from text a shield hid (revealed here, in the fragment it sits in).
        """
        if shield is not None:
            parts: list[str | int] = []
            for frag in self._partition(text, special):
                hidden = isinstance(frag, str) and shield.hides_in(frag)
                parts += self._partition(shield.reveal(frag), False) if hidden else [frag]
            return parts
        tokens, attrs = self._vocab.tokens, self._vocab.attrs
        frags: list[str | int] = [text]
        for tid in self._special_all if special else self._special_user:
            tok = tokens[tid]
            if tok not in text:
                continue
            attr = attrs[tid]
            out: list[str | int] = []
            for frag in frags:
                if isinstance(frag, int) or tok not in frag:
                    out.append(frag)
                    continue
                start = 0
                while True:
                    hit = frag.find(tok, start)
                    if hit < 0:
                        break
                    left = frag[start:hit]
                    if attr & ATTR_LSTRIP:
                        left = left.rstrip(_C_SPACE)
                    if left:
                        out.append(left)
                    out.append(tid)
                    start = hit + len(tok)
                    if attr & ATTR_RSTRIP:
                        while start < len(frag) and frag[start] in _C_SPACE:
                            start += 1
                if start < len(frag):
                    out.append(frag[start:])
            frags = out
        return frags

    # --- decoding ---

    def token_bytes(self, id: int) -> bytes:
        """The bytes token `id` contributes to the output text (llama.cpp's token_to_piece, special=True)."""
        piece = self._pieces.get(id)
        if piece is None:
            piece = self._piece(id)
            self._pieces[id] = piece
        return piece

    def _piece(self, id: int) -> bytes:
        if not 0 <= id < self.n_vocab:
            raise ValueError(f"token id {id} is out of range (vocab size {self.n_vocab})")
        text, attr = self._vocab.tokens[id], self._vocab.attrs[id]
        if attr & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED):
            return text.encode("utf-8", "surrogatepass")
        if attr & ATTR_NORMAL:
            if self.is_spm:
                return text.replace("▁", " ").encode("utf-8", "surrogatepass")
            out = bytearray()
            for ch in text:
                b = _CHAR_TO_BYTE.get(ch)
                if b is not None:
                    out.append(b)
                else:  # what llama_decode_text writes for a char outside the byte map
                    hex_utf8 = ch.encode("utf-8", "surrogatepass").hex()
                    out += f"[UNK_BYTE_0x{hex_utf8}{text}]".encode("utf-8", "surrogatepass")
            return bytes(out)
        if attr & ATTR_BYTE:
            return bytes([int(text[3:5], 16)])
        return b""  # unused / undefined tokens render as nothing

    def _first_piece(self, id: int) -> bytes:
        piece = self.token_bytes(id)
        if self.add_space_prefix and piece.startswith(b" "):
            piece = piece[1:]
        return piece

    def decode(self, ids: list[int]) -> str:
        """The text of ids; invalid UTF-8 becomes U+FFFD."""
        if not ids:
            return ""
        data = self._first_piece(ids[0]) + b"".join(self.token_bytes(i) for i in ids[1:])
        return data.decode("utf-8", "replace")

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Incremental decode: each feed() returns only whole characters; the concatenation equals decode()."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._first = True

    def feed(self, id: int) -> str:
        if self._first:
            self._first = False
            piece = self._tokenizer._first_piece(id)
        else:
            piece = self._tokenizer.token_bytes(id)
        return self._utf8.decode(piece)

    def flush(self) -> str:
        """Whatever bytes are still held, an incomplete character becoming U+FFFD."""
        return self._utf8.decode(b"", final=True)


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a GGUF file (a full model or a vocab-only file)."""
    return Tokenizer.from_metadata(read_metadata(open_gguf(path)))
