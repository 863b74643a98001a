"""A model's KV plan: the fewest bits for each layer's and KV head's keys and values that keep the
model's next-token distribution within an error budget, measured once on the model's own KV.

Heads differ: on the default model 4-bit keys of layer 22's second head move the next-token
distribution 400x as much as layer 0's (Qwen2.5's huge key biases of its first and last layers cost
nothing here: keys are quantized per channel above a minimum, which absorbs a bias). So each head's
keys, and its values, are put through the codec alone at 4 bits, on the model's KV of a small built-in text,
and the KL divergence this causes on the text's last tokens is measured; 6, 8 and 16 bits are measured where
the plan may give them, or estimated (the KL of a small error grows with its square: 4x the step, 16x the KL).
The bits then go, one step at a time, where they buy the most KL per bit, until the sum is within the budget;
the whole plan is measured at the end, and the budget tightened if the sum was optimistic.

The plan is kept in the user's cache (`kv_plans/<model fingerprint>.json`, a few hundred bytes):
measured at a model's first use, read at every later one. Each block stores the plan it was written
under, so a new plan never makes a stored block unreadable.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from llama_chat.inference.catalog import cache_dir

from .codec import AUTO, PLAN_BITS, KVPlan, decode_kv, encode_kv

PLAN_FORMAT = 1
# Mean KL divergence (nats) of the next-token distribution over the calibration text's last tokens
# that the whole plan may cause. Greedy replies flip on near ties, so the budget is well below where
# the mean KL looks harmless: benchmarks/kv_quality.py found q6 (~1.6e-4 mean KL on its texts) off on
# 2 of 11 of the default model's continuations, q8 (~6e-5) on none.
BUDGET_KL = 5e-5
EVAL_TOKENS = 24  # the text's last tokens, fed after its KV, where the KL is measured
BLOCK = 64  # tokens per stored block: groups of scales never straddle two blocks

# Prose, code and a chat turn: the kinds of text a conversation holds (~400 tokens).
CALIBRATION_TEXT = """The harbour was quiet in the early morning. Fishing boats rocked against the stone
quay, their ropes creaking, while gulls argued over scraps near the market hall. Maria unlocked the
café at six, as she had done for twenty years, and set out the chairs facing the sea.

def merge_intervals(intervals):
    \"\"\"Merge overlapping [start, end] intervals; the result is sorted by start.\"\"\"
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged

User: Can you explain what this function returns for [[1, 3], [2, 6], [8, 10]]?
Assistant: It returns [[1, 6], [8, 10]]: the first two intervals overlap, since 2 lies inside
[1, 3], so they merge into [1, 6]; [8, 10] touches neither and stays as it is.
{"order": 1042, "items": [{"sku": "A-17", "qty": 2, "price": 9.5}], "paid": true}
When the last customer had gone, Maria counted the till, wiped the counters and walked home along
the sea wall, where the tide was coming in and the lamps were being lit one by one."""

Progress = Callable[[str, int, int], None]


def plan_path(fingerprint: str, codec: str = AUTO) -> Path:
    """auto's plans kept their first name; each other planned codec measures its own."""
    return (
        cache_dir() / "kv_plans" / (f"{fingerprint}.json" if codec == AUTO else f"{fingerprint}.{codec}.json")
    )


def model_plan(model, progress: Progress | None = None, codec: str = AUTO) -> KVPlan:
    """The model's plan for a planned codec (auto, auto-h): from the cache, else measured and cached
    (once: 2-6 minutes for the default model on 2 busy cores, ~300 short forward passes)."""
    path = plan_path(model.fingerprint, codec)
    plan = read_plan(path, model.config.n_layer, model.config.n_head_kv)
    if plan is None:
        plan, report = measure_plan(model, progress=progress, codec=codec)
        write_plan(path, plan, report)
    return plan


def read_plan(path: Path, n_layer: int, n_head: int) -> KVPlan | None:
    """A cached plan of this shape; None when there is none or it is damaged or of another shape."""
    try:
        data = json.loads(path.read_text())
        if data.get("format") != PLAN_FORMAT:
            return None
        plan = KVPlan(_rows(data["k_bits"]), _rows(data["v_bits"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return plan if plan.shape == (n_layer, n_head) else None


def _rows(table) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(b) for b in row) for row in table)


def write_plan(path: Path, plan: KVPlan, report: dict) -> None:
    """Write atomically (a temporary file renamed into place); a cache that cannot be written only
    means measuring again next time."""
    data = {"format": PLAN_FORMAT, "k_bits": plan.k_bits, "v_bits": plan.v_bits, **report}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


# -- measuring -------------------------------------------------------------------------------------


class Calibration:
    """The model's exact KV of the calibration text, and the next-token distributions it gives on the
    text's last tokens; kl() says how far a changed KV moves them."""

    def __init__(self, model, codec: str = AUTO, text: str = CALIBRATION_TEXT, n_eval: int = EVAL_TOKENS):
        tok = model.tokenizer
        ids = tok.encode(text, add_bos=tok.add_bos)[: model.config.n_ctx_train]
        self.model, self.codec = model, codec
        self.context, self.fed = ids[:-n_eval], ids[-n_eval:]
        seq = model.new_sequence(len(ids))
        try:
            model.forward(self.context, seq)
            self.k, self.v = seq.gather(0, len(self.context))  # [L, H, T, D] copies
        finally:
            seq.free()
        self.reference = self._log_probs(self.k, self.v)

    def _log_probs(self, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        # private: this KV is not the prefix's, never shared nor taken from the pool
        seq = self.model.new_sequence(len(self.context) + len(self.fed), private=True)
        try:
            seq.append_kv(self.context, k, v)
            logits = self.model.forward(self.fed, seq, all_logits=True).astype(np.float64)
        finally:
            seq.free()
        logits -= logits.max(axis=-1, keepdims=True)
        return logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))

    def kl(self, k: np.ndarray, v: np.ndarray) -> float:
        """Mean KL divergence (nats) of the next-token distributions with this KV from the exact ones."""
        q = self._log_probs(k, v)
        p = self.reference
        return float((np.exp(p) * (p - q)).sum(axis=-1).mean())

    def stored(self, plan: KVPlan) -> tuple[np.ndarray, np.ndarray]:
        """The KV as a block of this codec and plan decodes it, block by block as stored."""
        k, v = np.empty_like(self.k), np.empty_like(self.v)
        for s in range(0, k.shape[2], BLOCK):
            k[:, :, s : s + BLOCK], v[:, :, s : s + BLOCK] = decode_kv(
                encode_kv(self.k[:, :, s : s + BLOCK], self.v[:, :, s : s + BLOCK], self.codec, plan)
            )
        return k, v

    def unit_kl(self, layer: int, head: int, is_key: bool, bits: int) -> float:
        """The KL when only one head's keys (or values) are stored at `bits`, everything else exact."""
        x = self.k if is_key else self.v
        one = x[layer : layer + 1, head : head + 1]
        plan = KVPlan.uniform(1, 1, bits)
        rounded = np.empty_like(one)
        for s in range(0, one.shape[2], BLOCK):
            piece = one[:, :, s : s + BLOCK]
            stored = decode_kv(encode_kv(piece, piece, self.codec, plan))
            rounded[:, :, s : s + BLOCK] = stored[0 if is_key else 1]
        changed = x.copy()
        changed[layer, head] = rounded[0, 0]
        return self.kl(changed, self.v) if is_key else self.kl(self.k, changed)


def _step_ratio(low: int, high: int) -> float:
    """How much the KL of rounding shrinks from `low` to `high` bits: the square of the step's ratio."""
    return ((2**low - 1) / (2**high - 1)) ** 2


def allocate(estimates: dict[tuple, dict[int, float]], budget: float) -> dict[tuple, int]:
    """Bits per unit: all start at the fewest, then the step that removes the most estimated KL per
    added bit is taken, again and again, until the estimated sum is within the budget (or every unit
    is at the most bits)."""
    bits = {u: PLAN_BITS[0] for u in estimates}
    total = sum(estimates[u][b] for u, b in bits.items())
    while total > budget:
        best, gain = None, -1.0
        for u, b in bits.items():
            if b == PLAN_BITS[-1]:
                continue
            nxt = PLAN_BITS[PLAN_BITS.index(b) + 1]
            g = (estimates[u][b] - estimates[u][nxt]) / (nxt - b)
            if g > gain:
                best, gain = u, g
        if best is None:
            break
        nxt = PLAN_BITS[PLAN_BITS.index(bits[best]) + 1]
        total += estimates[best][nxt] - estimates[best][bits[best]]
        bits[best] = nxt
    return bits


def estimates(measured: dict[tuple, dict[int, float]]) -> dict[tuple, dict[int, float]]:
    """Every unit's KL at every bits: measured where it was, else from the most bits measured below it."""
    out = {}
    for u, kl in measured.items():
        out[u] = {}
        for b in PLAN_BITS:
            below = max(m for m in kl if m <= b)
            out[u][b] = kl[b] if b in kl else kl[below] * _step_ratio(below, b)
    return out


def plan_of(bits: dict[tuple, int], n_layer: int, n_head: int) -> KVPlan:
    """The plan of allocate()'s bits per (is_key, layer, head)."""
    return KVPlan(*(_table(bits, is_key, n_layer, n_head) for is_key in (True, False)))


def measure_plan(
    model, budget: float = BUDGET_KL, progress: Progress | None = None, codec: str = AUTO
) -> tuple[KVPlan, dict]:
    """Measure the model's plan for a planned codec (see the module's docstring). Returns it and what was
    measured."""
    cal = Calibration(model, codec)
    L, H = cal.k.shape[:2]
    units = [(is_key, layer, head) for is_key in (True, False) for layer in range(L) for head in range(H)]
    label = "measuring the KV precision of each layer (first use of this model only)"
    measured: dict[tuple, dict[int, float]] = {u: {} for u in units}

    done, total = 0, len(units)
    for u in units:
        measured[u][4] = max(cal.unit_kl(u[1], u[2], u[0], 4), 0.0)
        done += 1
        if progress:
            progress(label, done, total)
    # Where the plan would give more bits, the estimate from 4 bits is measured: rounding that breaks
    # a head at 4 bits is far outside where the KL grows as the error's square.
    for _ in range(2):
        bits = allocate(estimates(measured), budget)
        todo = [(u, b) for u, b in bits.items() if b < 16 and b not in measured[u]]
        todo += [(u, 6) for u, b in bits.items() if b > 6 and 6 not in measured[u]]
        for i, (u, b) in enumerate(todo):
            measured[u][b] = max(cal.unit_kl(u[1], u[2], u[0], b), 0.0)
            if progress:
                progress(label, i + 1, len(todo))
    target = budget
    for _ in range(4):
        plan = plan_of(allocate(estimates(measured), target), L, H)
        whole = cal.kl(*cal.stored(plan))
        if whole <= budget:
            break
        target *= 0.7 * budget / whole  # the sum was optimistic: aim lower by as much
    report = {
        "budget_kl": budget,
        "calibration_kl": whole,
        "bits_per_value": plan.bits_per_value(),
        # what was measured, per head's keys (k<layer>.<head>) or values (v...), per bits
        "unit_kl": {f"{'k' if u[0] else 'v'}{u[1]}.{u[2]}": measured[u] for u in units},
    }
    return plan, report


def _table(bits: dict[tuple, int], is_key: bool, n_layer: int, n_head: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(bits[(is_key, layer, head)] for head in range(n_head)) for layer in range(n_layer))
