"""The kernels a model takes, made ready before its first reply: each signature compiled (a first start)
or loaded from numba's cache, on a tiny example matrix, with progress told after each. What only a
prompt past KERNEL_ROWS rows takes (where float inputs meet BLAS, the crossover measured by
blas_crossover.py and the tiles BLAS takes; quantizing on the threads) is made ready after the load."""

from __future__ import annotations

import time
from functools import partial

import gguf
import numpy as np

from . import blas_crossover, kernels
from .formats import KINDS, OWN_BITS, kind_taken, kinds_of
from .jit import in_cache
from .quants import zero_matrix

F32 = np.float32
Q = gguf.GGMLQuantizationType


def compile_kernels(
    progress=None, matrices=None, activations: str = kernels.DEFAULT_ACTIVATIONS, inputs=None, own=OWN_BITS
) -> float:
    """Compile (first start) or load from the cache (later starts) the kernels that the model's
    `matrices` take (each a format, or the set of formats joined in one; None: every kind, and the
    attention of every cache type) with its `activations` (kernels.ACTIVATIONS), so that no first reply
    waits on the compiler: each signature once, on a tiny example, progress told after each. `inputs`:
    what each of `matrices` takes as inputs, "f32" or "q8" (activations.inputs_of); None: `activations`
    for all; `own`: the formats the model keeps in their own bits (formats.own_bits). What only a prompt
    past KERNEL_ROWS rows takes (the crossover to BLAS, quantizing on the
    threads) is left to compile_long_prompts, and a model's attention kernel to compile_attention:
    nothing before KERNEL_ATTENTION_FROM cached positions calls it. Returns the seconds it took."""
    t0 = time.perf_counter()
    steps, float_kinds = _compile_steps(matrices, activations, inputs, own)
    cached = all(in_cache(k) for k in kernels.COMPILED)
    label = "loading compiled kernels" if cached else "compiling kernels (first start only)"
    for i, (what, compile_one) in enumerate(steps):
        if progress:
            progress(f"{label}: {what}", i, len(steps))
        compile_one()
    if progress:
        progress(label, len(steps), len(steps))
    if float_kinds:  # (every product taking bytes: the kernels at any size, no crossover to BLAS)
        kernels.use_blas_from(kernels.MeasuredLater(partial(_measured_with_tiles, float_kinds)))
    return time.perf_counter() - t0


def compile_long_prompts(activations: str) -> None:
    """What only a prompt past KERNEL_ROWS rows takes, made ready after a load on a thread of its own
    (app/chat/build.compile_later), or by the first such prompt, which comes sooner: the crossover to
    BLAS measured where some product takes float32 inputs (and the tiles compiled), quantize_rows'
    loop over the threads where some takes bytes."""
    kernels.known_blas_from()
    if activations != "f32":
        kernels.compile_quantize(in_parallel=True)


def _measured_with_tiles(kinds: list[tuple[str, Q]]) -> int | None:
    """measured_blas_from, and where BLAS takes long prompts the tiles of these kinds compiled."""
    n = blas_crossover.measured_blas_from()
    if n is not None:
        for _, qtype in kinds:
            _multiply_example(qtype, kernels.tile_product)
    return n


def _parts(formats, own=OWN_BITS) -> list[set]:
    """The formats of each part that pack makes of a matrix of these formats (None: one of each kind)."""
    if formats is None:
        return [{qtype} for qtype in KINDS]
    formats = {formats} if isinstance(formats, Q) else set(formats)
    kept = formats & set(own)
    if kept and len(kinds_of(formats, own)) > 1:  # each format in its own bits a part of its own
        return [{qtype} for qtype in kept] + ([formats - kept] if formats - kept else [])
    return [formats]


def _kinds(matrices) -> list[tuple[str, Q]]:
    """The kinds of packed matrix among `matrices` (each a format or a set of formats joined in one
    matrix; None: every kind), each with its example format."""
    if matrices is None:
        return [(kind, qtype) for qtype, kind in KINDS.items()]
    found = set().union(*(kinds_of({m} if isinstance(m, Q) else set(m)) for m in matrices))
    return [(kind, qtype) for qtype, kind in KINDS.items() if kind in found]


def _compile_steps(matrices, activations: str, inputs=None, own=OWN_BITS) -> tuple[list, list[tuple[str, Q]]]:
    """The steps that compile what `matrices` take, and the kinds among them with float32 inputs. A kind
    whose matrices all take bytes needs no float32 kernel ("mixed" without `inputs`: either, for all).
    The unpacking loops are not among them: they compile where a model is packed, its first start."""
    entries = [None] if matrices is None else matrices
    takes = [activations] * len(entries) if inputs is None else inputs
    float_kinds, byte_kinds = set(), set()
    for formats, taken in zip(entries, takes, strict=True):
        for part in _parts(formats, own):
            bytes_too = taken != "f32" and kernels.takes_bytes(zero_matrix(part, activations="q8", own=own))
            if bytes_too:
                byte_kinds.add(kind_taken(part, "q8", own))
            if not bytes_too or taken == "mixed" or matrices is None:
                float_kinds.add(kind_taken(part, "f32", own))
    floats = [(what, qtype) for what, qtype in _kinds(None) if what in float_kinds]
    steps = [(what, partial(_multiply_example, qtype)) for what, qtype in floats]
    if byte_kinds:
        steps += [("inputs as bytes", kernels.compile_quantize)]
        steps += [
            (f"{what}, inputs as bytes", partial(_multiply_example, qtype, activations="q8"))
            for what, qtype in _kinds(None)
            if what in byte_kinds
        ]
    # every prompt's rows attend at once (a float16 cache, the default's: a float32 one's a reply's first
    # prompt compiles, unless compile_attention on its thread has by then)
    steps += [("attention of several rows", partial(compile_rows_attention, np.float16))]
    if matrices is None:
        steps += [("attention", partial(compile_attention, dtype)) for dtype in (np.float16, F32)]
    return steps, floats


def compile_attention(dtype) -> None:
    """One token's attention over a cache of this element type (kv_arena.CACHE_TYPES), and several
    rows', compiled or loaded from the cache: 2-6 s of a first start, so a model's load leaves it to a
    thread of its own (app/chat/build.py), or to the first reply past KERNEL_ATTENTION_FROM cached
    positions."""
    kv = np.zeros((1, 2, 64), dtype)
    kernels.one_token_attention(np.zeros((1, 1, 64), F32), kv, kv, [(0, 2)])
    compile_rows_attention(dtype)


def compile_rows_attention(dtype) -> None:
    """Several rows' attention (a prompt's, a turn's) over a cache of this element type: every first
    reply's prompt takes it."""
    kv = np.zeros((1, 2, 64), dtype)
    kernels.rows_attention(np.zeros((2, 1, 1, 64), F32), kv, kv, [(0, 2)], [0, 0], [1, 2])


def _multiply_example(qtype: Q, product=kernels.kernel_product, activations: str = "f32") -> None:
    """One row (its own kernel, unless left to compile_later_rows) and a pass of ROWS rows."""
    for rows in (1, kernels.ROWS):
        product(np.zeros((rows, 256), F32), zero_matrix(qtype, activations=activations))
