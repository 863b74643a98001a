"""A mixture of experts (qwen3moe): a router picks k of a layer's expert FFNs for each token, and the
token's FFN output is their outputs weighted as the router says (llama.cpp's build_moe_ffn).

Each expert's matrices are packed as matrices of their own (weights.py), so the kernels take an
expert as they take any matrix. Decode reads only the chosen experts' weights; a prompt's rows are
grouped by expert, so each chosen expert's weights are read once a step for all the rows routed to it.
A row's output adds its experts' shares in the order of their numbers, whatever else is in the step,
so its bits do not depend on the batch (as the dense FFN's do not).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from . import kernels

if TYPE_CHECKING:
    from .quants import PackedMatrix, StackedMatrix

F32 = np.float32
# llama.cpp keeps the sum of the chosen weights above the smallest normal float16 before dividing by it
WEIGHTS_SUM_FLOOR = F32(6.103515625e-5)


@dataclass(frozen=True)
class Experts:
    """One layer's router and experts, as the kernels read them."""

    router: PackedMatrix  # ffn_gate_inp [n_expert, d]
    gate_up: tuple[PackedMatrix | StackedMatrix, ...]  # each expert's gate and up fused [2·n_ff_exp, d]
    down: tuple[PackedMatrix | StackedMatrix, ...]  # each expert's [d, n_ff_exp]


def route(logits: np.ndarray, k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """The router's choice for each row of logits [T, n_expert]: the k experts of the highest softmax
    probability [T, k], best first, and their weights [T, k] (those probabilities, divided by their sum
    where `normalize`)."""
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, chosen, axis=-1)
    if normalize:
        weights /= np.maximum(weights.sum(axis=-1, keepdims=True), WEIGHTS_SUM_FLOOR)
    return chosen, weights


Ffn = Callable[[np.ndarray, object, object], np.ndarray]  # (rows, gate_up, down) → [rows, d]


def mixture(x: np.ndarray, experts: Experts, k: int, normalize: bool, ffn: Ffn) -> np.ndarray:
    """x [T, d] → Σ over each row's k chosen experts of weight · ffn(row, gate_up, down), [T, d]."""
    chosen, weights = route(kernels.matmul(x, experts.router), k, normalize)
    out = np.zeros_like(x)
    for e in np.unique(chosen):  # in order of the experts' numbers
        rows, slots = np.nonzero(chosen == e)
        out[rows] += ffn(x[rows], experts.gate_up[e], experts.down[e]) * weights[rows, slots][:, None]
    return out
