"""llama.cpp's SentencePiece tokenizer (llm_tokenizer_spm): adjacent symbols merged into the
highest-scoring vocabulary entry, left-most on ties, with byte fallback (byte-level BPE is in bpe.py)."""

from __future__ import annotations

from .bpe import merge_symbols


class SPM:
    """llm_tokenizer_spm: merge adjacent symbols into the highest-scoring vocab entry, left-most on ties."""

    def __init__(self, token_to_id: dict[str, int], scores: list[float], unk_id: int | None):
        self.token_to_id = token_to_id
        self.scores = scores
        self.unk_id = unk_id
        self.byte_ids: list[int | None] = []
        for b in range(256):
            tid = token_to_id.get(f"<0x{b:02X}>")
            if tid is None:  # llama.cpp falls back to the byte itself as a token
                tid = token_to_id.get(chr(b)) if b < 0x80 else None
            self.byte_ids.append(tid)

    def tokenize(self, text: str, out: list[int], limit: int | None = None) -> None:
        """`limit` is not used: merges run over the whole text (its length in bytes bounds the work)."""
        vocab, scores = self.token_to_id, self.scores

        def priority(left: str, right: str) -> float | None:
            tid = vocab.get(left + right)
            return None if tid is None else -scores[tid]

        for sym in merge_symbols(list(text), priority):
            tid = vocab.get(sym)
            if tid is not None:
                out.append(tid)
                continue
            # Only single characters can be missing (merges always form vocab entries): byte fallback.
            for b in sym.encode("utf-8", "surrogatepass"):
                tid = self.byte_ids[b]
                if tid is None:
                    tid = self.unk_id
                if tid is not None:
                    out.append(tid)
