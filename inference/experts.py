"""A mixture of experts (qwen3moe, gpt-oss): a router picks k of a layer's expert FFNs for each token, and
the token's FFN output is their outputs weighted as the router says (llama.cpp's build_moe_ffn).

Each expert's matrices are packed as matrices of their own (weights.py), so the kernels take an
expert as they take any matrix. Decode reads only the chosen experts' weights; a prompt's rows are
grouped by expert, so each chosen expert's weights are read once a step for all the rows routed to it.
A row's output adds its experts' shares in the order of their numbers, whatever else is in the step,
so its bits do not depend on the batch (as the dense FFN's do not).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from . import expert_products, kernels
from .expert_products import ExpertMatrices

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
    router_bias: np.ndarray | None = None  # [n_expert] (gpt-oss)
    gate_up_bias: np.ndarray | None = None  # [n_expert, 2·n_ff_exp], gate's then up's (gpt-oss)
    down_bias: np.ndarray | None = None  # [n_expert, d]

    def biases(self, expert: int) -> dict:
        """The expert's biases, as gated_ffn takes them (none where the model has none)."""
        if self.gate_up_bias is None:
            return {}
        return {"gate_up_bias": self.gate_up_bias[expert], "down_bias": self.down_bias[expert]}

    def grouped_for(self, rows: int) -> tuple[ExpertMatrices, ExpertMatrices] | None:
        """`grouped` for a step of `rows` rows; a block format's experts (MXFP4) only where the kernels
        take the step's products (kernels.kernels_take): past that, each expert's product of many
        rows goes to BLAS on its own."""
        in_blocks = self.grouped is not None and self.grouped[0].values.ndim == 4
        return None if in_blocks and not kernels.kernels_take(rows) else self.grouped

    @cached_property
    def grouped(self) -> tuple[ExpertMatrices, ExpertMatrices] | None:
        """The experts' gate_up and down matrices as one compiled call multiplies them all (None where
        they are not packed alike: then one expert at a time)."""
        gate_up, down = expert_products.matrices_of(self.gate_up), expert_products.matrices_of(self.down)
        return None if gate_up is None or down is None else (gate_up, down)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def route(logits: np.ndarray, k: int, normalize: bool, gating: str = "softmax") -> tuple[np.ndarray, ...]:
    """The router's choice for each row of logits [T, n_expert]: the k experts of the highest logits
    [T, k], best first, and their weights [T, k]. "softmax" gating: their probabilities of a softmax over
    all experts, divided by their sum where `normalize`; "softmax_weight": a softmax over the k logits."""
    if gating == "softmax_weight":
        chosen = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
        return chosen, softmax(np.take_along_axis(logits, chosen, axis=-1))
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, chosen, axis=-1)
    if normalize:
        weights /= np.maximum(weights.sum(axis=-1, keepdims=True), WEIGHTS_SUM_FLOOR)
    return chosen, weights


Ffn = Callable[..., np.ndarray]  # (rows, gate_up, down, **biases) → [rows, d]
Unit = Callable[[np.ndarray], np.ndarray]  # gate and up side by side [rows, 2·n_ff] → [rows, n_ff]


def mixture(
    x: np.ndarray, experts: Experts, k: int, gating: str, normalize: bool, ffn: Ffn, unit: Unit
) -> np.ndarray:
    """x [T, d] → Σ over each row's k chosen experts of weight · ffn(row, gate_up, down), [T, d]; `unit`
    is ffn's gated unit, for the experts multiplied together (grouped)."""
    logits = kernels.matmul(x, experts.router)
    if experts.router_bias is not None:
        logits += experts.router_bias
    chosen, weights = route(logits, k, normalize, gating)
    if experts.grouped_for(len(x)) is not None:
        return grouped(x, experts, chosen, weights, unit)
    out = np.zeros_like(x)
    for e in np.unique(chosen):  # in order of the experts' numbers
        rows, slots = np.nonzero(chosen == e)
        share = ffn(x[rows], experts.gate_up[e], experts.down[e], **experts.biases(e))
        out[rows] += share * weights[rows, slots][:, None]
    return out


def grouped(
    x: np.ndarray, experts: Experts, chosen: np.ndarray, weights: np.ndarray, unit: Unit
) -> np.ndarray:
    """mixture's sum with every chosen expert's products in one compiled call for gate_up and one for down
    (expert_products.py): the rows routed to each expert are a segment of one array, in the order of the
    experts' numbers, and each row's shares are added in that order, as mixture adds them."""
    plan = expert_products.Layout(chosen, len(experts.gate_up))
    xs = expert_products.gather_rows(x, plan.rows, plan.at, plan.n_rows)
    gate_up_w, down_w = experts.grouped
    gate_up = expert_products.grouped_product(xs, plan, gate_up_w)
    if experts.gate_up_bias is not None:
        gate_up[plan.at] += experts.gate_up_bias[chosen[plan.rows, plan.slots]]
    shares = expert_products.grouped_product(unit(gate_up), plan, down_w)
    if experts.down_bias is not None:
        shares[plan.at] += experts.down_bias[chosen[plan.rows, plan.slots]]
    out = np.zeros_like(x)
    expert_products.add_shares(out, shares, plan.rows, plan.at, weights[plan.rows, plan.slots])
    return out
