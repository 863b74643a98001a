"""llama.cpp's byte-level BPE tokenizer (llm_tokenizer_bpe): the pre-tokenizer regexes named by
tokenizer.ggml.pre, the GPT-2 byte <-> unicode mapping, and the merges."""

from __future__ import annotations

import heapq
from collections.abc import Callable

import regex

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
    "gpt2": "gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert "
    "jina-v1-en jina-v2-code roberta-bpe mpt olmo jais trillion granite-docling exaone4",
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
PRE_TYPES = {name: kind for kind, names in _PRE_NAMES.items() for name in names.split()}
_IGNORE_MERGES = frozenset((_LLAMA3_NAMES + " tekken minicpm5").split())  # a whole-word token wins
ADD_BOS = frozenset((_LLAMA3_NAMES + " tekken").split())
NO_BOS = frozenset(("glm4", "chatglm-bpe"))


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
CHAR_TO_BYTE = {c: b for b, c in enumerate(_BYTE_TO_CHAR)}
# Decode UTF-8 bytes as latin-1 (one char per byte), then translate each to its GPT-2 stand-in.
_BYTE_ENCODE_TABLE = str.maketrans({chr(b): c for b, c in enumerate(_BYTE_TO_CHAR)})


def _byte_encode(word: str) -> str:
    return word.encode("utf-8", "surrogatepass").decode("latin-1").translate(_BYTE_ENCODE_TABLE)


# --- the merges --------------------------------------------------------------------------------------


class BPE:
    """llm_tokenizer_bpe: regex pre-split, then merges per word, lowest rank (then left-most) first."""

    def __init__(self, token_to_id: dict[str, int], merges: list[str], pre: str):
        self.ignore_merges = pre in _IGNORE_MERGES
        self.pretokenizer = _Pretokenizer(_PRE_REGEXES[PRE_TYPES[pre]])
        self.token_to_id = token_to_id
        # Ranks by the merge's own text "left right", looked up as left + " " + right: llama.cpp splits
        # a merge at its first space after the first character, and the symbols of a word never hold
        # a space (its bytes are mapped to printable stand-ins first), so both find the same merges;
        # this dict is built in a tenth of the time a dict of 150k (left, right) tuples took. Built
        # from the last merge to the first: llama.cpp keeps the first rank of a repeated merge.
        self.ranks: dict[str, int] = dict(zip(reversed(merges), range(len(merges) - 1, -1, -1)))
        self.cache: dict[str, tuple[int, ...]] = {}

    def tokenize(self, text: str, out: list[int], limit: int | None = None) -> None:
        """Append text's tokens to `out`, word by word; stop once it holds more than `limit`."""
        cache = self.cache
        for word in self.pretokenizer.split(text):
            if limit is not None and len(out) > limit:
                return
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
                rank = ranks.get(parts[i] + " " + parts[i + 1])
                if rank is not None and (best_rank is None or rank < best_rank):
                    best_rank, best = rank, i
            if best < 0:
                break
            parts[best : best + 2] = [parts[best] + parts[best + 1]]
        return parts

    def _merge_long(self, word: str) -> list[str]:
        """The same merges with llama.cpp's priority queue, O(n log n) for long words."""
        ranks = self.ranks
        return merge_symbols(list(word), lambda left, right: ranks.get(left + " " + right))


def merge_symbols(syms: list[str], priority: Callable[[str, str], float | None]) -> list[str]:
    """Merge adjacent symbols, the pair of lowest priority first (the left-most on ties), until no pair
    has one (priority None): llama.cpp's queue of candidate pairs over a linked list of symbols, as both
    its BPE (priority: the merge's rank) and SPM (minus the merged token's score) tokenizers run it."""
    n = len(syms)  # a merged-away symbol becomes ""
    if n == 0:
        return []
    prev = list(range(-1, n - 1))
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    heap: list[tuple[float, int, int, str]] = []

    def add_pair(left: int, right: int) -> None:
        if left >= 0 and right >= 0:
            rank = priority(syms[left], syms[right])
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
