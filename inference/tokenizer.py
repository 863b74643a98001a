"""llama.cpp's SPM and byte-level BPE tokenizers (their merges in spm.py and bpe.py), re-implemented
exactly from GGUF metadata: vocabulary, special tokens, encoding with control text kept apart, decoding."""

from __future__ import annotations

import codecs
import os
from typing import Any

from .bpe import ADD_BOS, BPE, CHAR_TO_BYTE, NO_BOS, PRE_TYPES
from .control_text import ControlTextShield
from .errors import ModelError, TooManyTokens
from .gguf_file import open_gguf, read_metadata
from .spm import SPM

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


def _raise_duplicate(tokens: list[str]) -> None:
    first: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if first.setdefault(t, i) != i:
            raise ModelError(f"duplicate token in the vocabulary: {t!r} has ids {first[t]} and {i}")


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


def _longest_token(tokens: list[str], attrs: list[int], is_spm: bool) -> int:
    """The most bytes of text one token stands for when text is tokenized (or more: a byte token's
    "<0x0A>" counts six): 128 in Qwen2.5's vocabulary (a run of spaces), 48 in Gemma 3's."""

    def size(text: str, attr: int) -> int:
        if attr & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN):
            return len(text.encode("utf-8", "surrogatepass"))  # cut out of the text as written
        if is_spm:
            return len(text.replace("▁", " ").encode("utf-8", "surrogatepass"))  # "▁" stands for a space
        return len(text)  # byte-level BPE: one stand-in character per byte

    return max(size(t, a) for t, a in zip(tokens, attrs, strict=True))


class Tokenizer:
    """Text <-> token ids exactly as llama.cpp does it for this vocab (SPM or byte-level BPE).

    decode() renders control and user-defined tokens as their text (llama.cpp's detokenize with
    special=True, remove_special=False) and, like llama.cpp, drops the one leading space the vocab's
    space prefix adds to the first token; it does not apply llama.cpp's optional "clean spaces" pass,
    so decode(encode(text)) == text for byte-level BPE vocabs.
    """

    # What encode() makes of a text, as a version: token ids kept from an earlier encoding (the chat
    # layer's session cache keeps a conversation's) are used only under the version that made them.
    # Raise it with any change that gives other ids for some text (here, in bpe.py or control_text.py).
    encoding_version = 1

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
            if pre not in PRE_TYPES:
                raise ModelError(f"unsupported pre-tokenizer '{pre}' (tokenizer.ggml.pre)")
            add_bos = pre in ADD_BOS
            ids = {"bos": None if pre in NO_BOS else 11, "eos": 11, "unk": None}
            add_space_prefix = False
        self.add_space_prefix = bool(_key(meta, "add_space_prefix", add_space_prefix))
        ids = {k: (v if v is not None and v < n_vocab else None) for k, v in ids.items()}
        for name in ("bos", "eos", "eot", "eom", "unk", "fim_pad", "fim_rep", "fim_sep"):
            value = _key(meta, ("unknown" if name == "unk" else name) + "_token_id")
            if value is not None and 0 <= int(value) < n_vocab:
                ids[name] = int(value)
        add_bos = _key(meta, "add_bos_token", add_bos)

        token_to_id = dict(zip(tokens, range(n_vocab)))
        if len(token_to_id) < n_vocab:
            _raise_duplicate(tokens)
        eog = _apply_text_rules(tokens, token_to_id, attrs, ids)
        _apply_name_rules(meta, pre, token_to_id, attrs)

        self.n_vocab = n_vocab
        self.bos_id: int | None = ids["bos"]
        self.eos_id: int | None = ids["eos"]
        self.add_bos = bool(add_bos)
        self.end_of_generation_ids: frozenset[int] = frozenset(eog)
        self._vocab = _Vocab(tokens, token_to_id, scores, attrs, ids["unk"])
        merges = [] if self.is_spm else _key(meta, "merges") or []
        self._algo = SPM(token_to_id, scores, ids["unk"]) if self.is_spm else BPE(token_to_id, merges, pre)
        # Tokens split out before the tokenizer runs, longest first (llama.cpp's cache_special_tokens).
        special = [i for i, a in enumerate(attrs) if a & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN)]
        special.sort(key=lambda i: (-len(tokens[i].encode("utf-8", "surrogatepass")), i))
        self._special_all = special
        self._special_user = [i for i in special if not attrs[i] & (ATTR_CONTROL | ATTR_UNKNOWN)]
        self._control_texts = [tokens[i] for i in special if attrs[i] & (ATTR_CONTROL | ATTR_UNKNOWN)]
        self._pieces: dict[int, bytes] = {}
        # A text of more than limit * bytes_per_token bytes makes more than `limit` tokens: refused
        # before it is tokenized (encode). None where a token swallows the spaces beside it
        # (lstrip/rstrip): those bytes make no token, and only tokenizing can tell.
        strips = any(a & (ATTR_LSTRIP | ATTR_RSTRIP) for a in attrs)
        self.bytes_per_token: int | None = None if strips else _longest_token(tokens, attrs, self.is_spm)

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        return cls(meta)

    # --- encoding ---

    def control_text_shield(self, outside: Any) -> ControlTextShield:
        """A shield for this vocabulary's control-token text in every string of `outside` (what a chat
        template is given: messages, tools), for encode()."""
        return ControlTextShield(self._control_texts, outside)

    def check_length(self, texts: list[str], limit: int | None) -> None:
        """TooManyTokens where `texts` have more bytes than `limit` tokens stand for (each at most this
        vocabulary's longest token), found out without tokenizing them."""
        if limit is not None and self.bytes_per_token is not None:
            size = sum(len(t) if t.isascii() else len(t.encode("utf-8", "surrogatepass")) for t in texts)
            if size > limit * self.bytes_per_token:
                raise TooManyTokens(limit)

    def encode(
        self,
        text: str,
        add_bos: bool = False,
        special: bool = False,
        shield: ControlTextShield | None = None,
        limit: int | None = None,
    ) -> list[int]:
        """Token ids for text; add_bos prepends BOS, special=True turns control-token text into its id;
        text a `shield` hid comes back as text, tokenized as with special=False. With a `limit`, a text
        that makes more tokens raises TooManyTokens as soon as that is known: by its length in bytes
        before any work, or once the tokens made pass it (byte-level BPE stops there; SentencePiece
        finishes the piece of text it is on)."""
        self.check_length([text], limit)
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
            self._algo.tokenize(frag, out, limit)
            prev_special = False
            if limit is not None and len(out) > limit:
                raise TooManyTokens(limit)
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

    def attrs(self, id: int) -> int:
        """Token `id`'s ATTR_* flags (control, user-defined, byte, ...)."""
        return self._vocab.attrs[id]

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
                b = CHAR_TO_BYTE.get(ch)
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

    def stream_decoder(self, starts_text: bool = True) -> StreamDecoder:
        return StreamDecoder(self, starts_text)


class StreamDecoder:
    """Incremental decode: each feed() returns only whole characters; the concatenation equals decode()."""

    def __init__(self, tokenizer: Tokenizer, starts_text: bool = True):
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._first = starts_text

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
