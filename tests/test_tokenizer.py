"""Tokenizer tests: llama.cpp's own vocab test vectors, ids recorded from llama.cpp, streaming, errors."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from conftest import vocab_metadata
from llama_chat.inference.errors import ModelError
from llama_chat.inference.tokenizer import Tokenizer, load_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
VOCAB_DIR = FIXTURES / "vocab"
LLAMACPP_DIR = FIXTURES / "llamacpp"
VOCABS = ("qwen2", "llama-bpe", "llama-spm")
BPE_VOCABS = ("qwen2", "llama-bpe")
QWEN = "qwen2.5-coder-0.5b-instruct-q4_k_m"
GEMMA = "gemma-3-270m-q4_k_m"
CORPUS = json.loads((LLAMACPP_DIR / "public_corpus.json").read_text(encoding="utf-8"))
REFERENCE = json.loads((LLAMACPP_DIR / "reference.json").read_text(encoding="utf-8"))
CHAT_REFERENCE = json.loads((LLAMACPP_DIR / "chat_reference.json").read_text(encoding="utf-8"))
NON_ASCII_CORPUS = [text for text in CORPUS if not text.isascii()]


def _short(text: str) -> str:
    return ascii(text[:24])


@functools.cache
def vocab_tokenizer(name: str) -> Tokenizer:
    """A tokenizer from one of llama.cpp's vocab-only test files (read once per session), made as
    load_tokenizer makes it."""
    return Tokenizer.from_metadata(vocab_metadata(name))


def _vocab_cases():
    for name in VOCABS:
        base = VOCAB_DIR / f"ggml-vocab-{name}.gguf"
        # newline="" keeps the test strings byte-exact (no newline translation).
        with open(f"{base}.inp", encoding="utf-8", newline="") as f:
            texts = f.read().split("\n__ggml_vocab_test__\n")[:-1]  # the file ends with a separator
        with open(f"{base}.out", encoding="utf-8", newline="") as f:
            lines = f.read().split("\n")
        for i, text in enumerate(texts):
            expected = [int(x) for x in lines[i].split()]
            yield pytest.param(name, text, expected, id=f"{name}-{i:02d}-{_short(text)}")


@pytest.mark.parametrize("name,text,expected", list(_vocab_cases()))
def test_llamacpp_vocab_test_vectors(name, text, expected):
    assert vocab_tokenizer(name).encode(text, add_bos=False, special=False) == expected


@pytest.mark.parametrize("name", BPE_VOCABS)
@pytest.mark.parametrize("text", CORPUS, ids=_short)
def test_bpe_round_trip(name, text):
    tok = vocab_tokenizer(name)
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text, special=True)) == text


def test_vocab_special_ids():
    qwen2, llama_bpe, llama_spm = (vocab_tokenizer(name) for name in VOCABS)
    assert (qwen2.bos_id, qwen2.eos_id, qwen2.add_bos) == (151643, 151643, False)
    assert {151643, 151645} <= qwen2.end_of_generation_ids  # <|endoftext|>, <|im_end|>
    assert (llama_bpe.bos_id, llama_bpe.eos_id, llama_bpe.add_bos) == (128000, 128001, True)
    assert llama_bpe.end_of_generation_ids == {128001, 128009}  # <|end_of_text|>, <|eot_id|>
    assert (llama_spm.bos_id, llama_spm.eos_id, llama_spm.add_bos) == (1, 2, True)
    assert llama_spm.end_of_generation_ids == {2}
    assert llama_spm.n_vocab == 32000


def test_encode_add_bos_and_special_tokens():
    tok = vocab_tokenizer("llama-bpe")
    plain = tok.encode("Hello")
    assert tok.encode("Hello", add_bos=True) == [tok.bos_id] + plain
    assert tok.encode("<|eot_id|>Hello", special=True) == [128009] + plain
    assert 128009 not in tok.encode("<|eot_id|>Hello")
    assert tok.encode("") == [] and tok.encode("", add_bos=True) == [tok.bos_id]


@pytest.mark.parametrize("name", BPE_VOCABS)
def test_long_words_merge_like_short_ones(name):
    """Long words take a priority-queue path; it must pick exactly the merges the simple loop picks."""
    bpe = vocab_tokenizer(name)._algo
    for word in ("=" * 300, "ACGT" * 40, "Ġ" * 45, "supercalifragilistic" * 5):
        assert bpe._merge_long(word) == bpe._merge_short(word)
    assert vocab_tokenizer(name).decode(vocab_tokenizer(name).encode("=" * 5000)) == "=" * 5000


def test_load_tokenizer_missing_file_is_a_model_error(tmp_path):
    with pytest.raises(ModelError):
        load_tokenizer(tmp_path / "nope.gguf")


def test_token_bytes():
    qwen2, spm = vocab_tokenizer("qwen2"), vocab_tokenizer("llama-spm")
    assert qwen2.token_bytes(qwen2.encode(" ")[0]) == b" "  # 'Ġ' is the GPT-2 stand-in for a space
    assert qwen2.token_bytes(151645) == b"<|im_end|>"
    assert spm.token_bytes(spm.encode("Hello")[0]) == b" Hello"  # '▁Hello'
    assert spm.token_bytes(3 + 0x0A) == b"\n"  # <0x0A>
    assert spm.token_bytes(1) == b"<s>"


def test_spm_decode_drops_only_the_added_space_prefix():
    tok = vocab_tokenizer("llama-spm")
    for text in ("Hello world", " Hello world", "  two", ""):
        assert tok.decode(tok.encode(text)) == text
    assert tok.decode([1] + tok.encode("Hello")) == "<s> Hello"  # like llama.cpp, BOS keeps the space


# --- streaming ---


def _stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    decoder = tok.stream_decoder()
    return [decoder.feed(i) for i in ids] + [decoder.flush()]


@pytest.mark.parametrize("name", VOCABS)
@pytest.mark.parametrize("text", NON_ASCII_CORPUS, ids=_short)
def test_stream_decoder_emits_whole_characters(name, text):
    tok = vocab_tokenizer(name)
    ids = tok.encode(text)
    pieces = _stream(tok, ids)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == tok.decode(ids) == text


def test_stream_decoder_holds_partial_characters():
    tok = vocab_tokenizer("llama-spm")
    ids = tok.encode("🦙")  # not in this vocab: '▁' then the four UTF-8 bytes as <0xNN> tokens
    assert ids[1:] == [3 + b for b in "🦙".encode()]
    assert _stream(tok, ids) == ["", "", "", "", "🦙", ""]


def test_stream_decoder_flush_replaces_an_incomplete_character():
    tok = vocab_tokenizer("llama-spm")
    decoder = tok.stream_decoder()
    assert decoder.feed(3 + 0xF0) == "" and decoder.feed(3 + 0x9F) == ""
    assert decoder.flush() == "\ufffd"


# --- hand-built vocabularies: algorithm details and errors ---


def _bpe_meta(**changes) -> dict:
    tokens = list("abdehlorw") + ["Ġ", "he", "ll", "llo", "hello", "Ġw", "<|end|>"]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * (len(tokens) - 1) + [3],
        "tokenizer.ggml.merges": ["h e", "l l", "ll o", "he llo", "Ġ w"],
        "tokenizer.ggml.eos_token_id": len(tokens) - 1,
    }
    meta.update(changes)
    return {k: v for k, v in meta.items() if v is not None}


def _ids(meta: dict, pieces: list[str]) -> list[int]:
    tokens = meta["tokenizer.ggml.tokens"]
    return [tokens.index(p) for p in pieces]


def test_tiny_bpe_merges_by_rank():
    meta = _bpe_meta()
    tok = Tokenizer.from_metadata(meta)
    assert tok.encode("hello world") == _ids(meta, ["hello", "Ġw", "o", "r", "l", "d"])
    assert tok.decode(tok.encode("hello world")) == "hello world"
    assert tok.add_bos is False and tok.end_of_generation_ids == {len(meta["tokenizer.ggml.tokens"]) - 1}


def test_a_repeated_merge_keeps_its_first_rank():
    """As llama.cpp: "h e" ranks before "e l", whatever its second listing says."""
    meta = _bpe_meta(**{"tokenizer.ggml.merges": ["h e", "e l", "h e"]})
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], "el"]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], 1]
    assert Tokenizer.from_metadata(meta).encode("hel") == _ids(meta, ["he", "l"])


def test_a_duplicate_token_is_a_model_error_naming_both_ids():
    meta = _bpe_meta()
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], "he"]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], 1]
    with pytest.raises(ModelError, match=r"'he' has ids 10 and 16"):
        Tokenizer.from_metadata(meta)


def test_missing_pre_tokenizer_means_default():
    default = Tokenizer.from_metadata(_bpe_meta(**{"tokenizer.ggml.pre": "default"}))
    missing = Tokenizer.from_metadata(_bpe_meta(**{"tokenizer.ggml.pre": None}))
    for text in ("hello world", "he'll do 1234 $$ <<"):
        assert missing.encode(text) == default.encode(text)


def test_unknown_pre_tokenizer_is_a_model_error():
    with pytest.raises(ModelError) as err:
        Tokenizer.from_metadata(_bpe_meta(**{"tokenizer.ggml.pre": "no-such-pretokenizer"}))
    assert "no-such-pretokenizer" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("model", ["t5", "no-such-model"])
def test_unknown_tokenizer_model_is_a_model_error(model):
    with pytest.raises(ModelError) as err:
        Tokenizer.from_metadata(_bpe_meta(**{"tokenizer.ggml.model": model}))
    assert model in str(err.value) and "\n" not in str(err.value)


def test_missing_vocab_is_a_model_error():
    with pytest.raises(ModelError):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "llama"})


def _spm(scores: dict[str, float]) -> tuple[Tokenizer, list[str]]:
    tokens = ["<unk>", "<s>", "</s>", "▁", "a", "b", "<0x63>", *scores]
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 7 + list(scores.values()),
        "tokenizer.ggml.token_type": [2, 3, 3, 1, 1, 1, 6] + [1] * len(scores),
        "tokenizer.ggml.add_space_prefix": False,
    }
    return Tokenizer.from_metadata(meta), tokens


def test_spm_merges_highest_score_then_left_most():
    tok, tokens = _spm({"ab": -1.0, "ba": -1.0})
    assert tok.encode("aba") == [tokens.index("ab"), tokens.index("a")]  # a tie: the left pair wins
    tok, tokens = _spm({"ab": -2.0, "ba": -1.0})
    assert tok.encode("aba") == [tokens.index("a"), tokens.index("ba")]


def test_spm_byte_fallback_and_unknown():
    tok, tokens = _spm({})
    assert tok.encode("c") == [tokens.index("<0x63>")]
    assert tok.encode("a d") == [tokens.index("a"), tokens.index("▁"), tokens.index("<unk>")]
    assert tok.decode(tok.encode("c")) == "c"


# --- the real models, against ids recorded from llama.cpp ---


@pytest.fixture(scope="module")
def qwen_tokenizer(qwen_model_path):
    return load_tokenizer(qwen_model_path)


@pytest.fixture(scope="module")
def gemma_tokenizer(gemma_model_path):
    return load_tokenizer(gemma_model_path)


REAL_TOKENIZERS = {QWEN: "qwen_tokenizer", GEMMA: "gemma_tokenizer"}


def _reference_cases():
    for model in (QWEN, GEMMA):
        for i, case in enumerate(REFERENCE[model]["tokenize"]):
            yield pytest.param(model, case, id=f"{model.split('-')[0]}-{i:02d}-{_short(case['text'])}")


@pytest.mark.real_model
@pytest.mark.parametrize("model,case", list(_reference_cases()))
def test_matches_llamacpp_reference_ids(request, model, case):
    tok = request.getfixturevalue(REAL_TOKENIZERS[model])
    assert tok.encode(case["text"], special=False) == case["ids"]
    assert tok.encode(case["text"], special=True) == case["ids_special"]


@pytest.mark.real_model
@pytest.mark.parametrize("model", [QWEN, GEMMA])
@pytest.mark.parametrize("text", CORPUS, ids=_short)
def test_real_model_round_trip_and_streaming(request, model, text):
    tok = request.getfixturevalue(REAL_TOKENIZERS[model])
    for special in (False, True):
        ids = tok.encode(text, special=special)
        assert tok.decode(ids) == text
        pieces = _stream(tok, ids)
        assert all("\ufffd" not in piece for piece in pieces)
        assert "".join(pieces) == text


@pytest.mark.real_model
@pytest.mark.parametrize("case", CHAT_REFERENCE["greedy"].values(), ids=CHAT_REFERENCE["greedy"].keys())
def test_qwen_chat_prompt_ids_match_llamacpp(qwen_tokenizer, case):
    assert CHAT_REFERENCE["model"] == QWEN
    assert qwen_tokenizer.encode(case["prompt"], special=True) == case["prompt_ids"]
    assert qwen_tokenizer.decode(case["greedy_ids"]) == case["greedy_text"]


@pytest.mark.real_model
def test_real_model_special_ids(qwen_tokenizer, gemma_tokenizer):
    qwen = qwen_tokenizer
    assert (qwen.bos_id, qwen.eos_id, qwen.add_bos) == (151643, 151645, False)
    # <|endoftext|>, <|im_end|> and, as llama.cpp does, <|fim_pad|>, <|repo_name|>, <|file_sep|>
    assert {151643, 151645, 151662, 151663, 151664} <= qwen.end_of_generation_ids
    assert qwen.encode("<tool_call>") == [151657]  # user-defined tokens are split out even without special
    gemma = gemma_tokenizer
    assert (gemma.bos_id, gemma.eos_id, gemma.add_bos) == (2, 1, True)
    assert {1, 106} <= gemma.end_of_generation_ids  # <eos>, <end_of_turn>
    assert gemma.n_vocab == 262144
