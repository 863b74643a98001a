"""The KV codec's quantized formats in plain NumPy: the readable reference that storage/codec_kernels.py's
compiled loops must agree with, byte for byte (test_codec.py). It is the codec as first written, one
array operation per step; only the framing (header, zstd, shuffled scales) is the product's own."""

from __future__ import annotations

import numpy as np

from llama_chat.storage.codec import block_bytes
from llama_chat.storage.codec_formats import (
    F16,
    F16_MAX,
    GROUP,
    f16_ceil,
    f16_floor,
    n_groups,
    packed_size,
    shuffle,
    unshuffle,
)


def encode(k: np.ndarray, v: np.ndarray, codec: str) -> bytes:
    """encode_kv for q8, q6 and q4."""
    keys = np.ascontiguousarray(k.transpose(0, 1, 3, 2))  # channel-major: grouped along tokens
    if codec == "q8":
        qk, sk = quantize_q8(keys)
        qv, sv = quantize_q8(v)
        dk = np.diff(qk.view(np.uint8), axis=-1, prepend=np.uint8(0))  # each channel's token-to-token step
        streams = [dk, qv, shuffle(np.concatenate([sk.ravel(), sv.ravel()]))]
    else:
        bits = 6 if codec == "q6" else 4
        pack = pack_sixes if codec == "q6" else pack_nibbles
        qk, sk, mk = quantize_asymmetric(keys, bits)
        qv, sv, mv = quantize_asymmetric(v, bits)
        streams = [pack(qk), pack(qv), shuffle(np.concatenate([sk, sv, mk, mv], axis=None))]
    return block_bytes(codec, k.shape, streams)


def decode(payload: memoryview, codec: str, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """k, v of a q8, q6 or q4 payload (the frame's content after its header)."""
    n_layer, n_head, n_tokens, head_dim = shape
    n = n_layer * n_head * n_tokens * head_dim
    gk, gv = n_groups(shape)
    cshape = (n_layer, n_head, head_dim, n_tokens)
    if codec == "q8":
        qk = np.cumsum(np.frombuffer(payload, np.uint8, n).reshape(cshape), axis=-1, dtype=np.uint8).view(
            np.int8
        )
        qv = np.frombuffer(payload, np.int8, n, offset=n).reshape(shape)
        scales = unshuffle(payload[2 * n :], F16)
        k = dequantize(qk, scales[:gk].reshape(*cshape[:3], -1))
        v = dequantize(qv, scales[gk:].reshape(*shape[:3], -1))
    else:
        size = packed_size(6 if codec == "q6" else 4, n)
        unpack = unpack_sixes if codec == "q6" else unpack_nibbles
        qk = unpack(np.frombuffer(payload, np.uint8, size), n).reshape(cshape)
        qv = unpack(np.frombuffer(payload, np.uint8, size, offset=size), n).reshape(shape)
        sk, sv, mk, mv = np.split(unshuffle(payload[2 * size :], F16), [gk, gk + gv, 2 * gk + gv])
        k = dequantize(qk, sk.reshape(*cshape[:3], -1), mk.reshape(*cshape[:3], -1))
        v = dequantize(qv, sv.reshape(*shape[:3], -1), mv.reshape(*shape[:3], -1))
    return np.ascontiguousarray(k.transpose(0, 1, 3, 2)), v


def groups(x: np.ndarray) -> np.ndarray:
    """[..., n] -> [..., ceil(n/32), 32]; a ragged last group is padded by repeating its last value,
    which leaves the group's min and max unchanged."""
    pad = -x.shape[-1] % GROUP
    if pad:
        x = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], mode="edge")
    return x.reshape(*x.shape[:-1], -1, GROUP)


def ungroup(q: np.ndarray, n: int) -> np.ndarray:
    return q.reshape(*q.shape[:-2], -1)[..., :n]


def ranges(g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each group's min and max, a zero's sign not kept (as the compiled loop stores them)."""
    return g.min(axis=-1, keepdims=True) + np.float32(0), g.max(axis=-1, keepdims=True) + np.float32(0)


def quantize_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8, groups of 32 along the last axis; the float16 scale rounded up."""
    g = groups(x)
    lo, hi = ranges(g)
    scale = f16_ceil(np.minimum(np.maximum(np.abs(lo), np.abs(hi)) / np.float32(127), F16_MAX))
    s = scale.astype(np.float32)
    q = np.rint(g / np.where(s > 0, s, np.float32(1))).clip(-127, 127).astype(np.int8)
    return ungroup(q, x.shape[-1]), scale[..., 0]


def quantize_asymmetric(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x ~= min + q * scale, q in 0..2**bits - 1, groups of 32; min rounded down, scale up."""
    top = np.float32(2**bits - 1)
    g = groups(x)
    lo, hi = ranges(g)
    mn = f16_floor(np.clip(lo, -F16_MAX, F16_MAX))
    m = mn.astype(np.float32)
    scale = f16_ceil(np.minimum((hi - m) / top, F16_MAX))
    s = scale.astype(np.float32)
    q = np.rint((g - m) / np.where(s > 0, s, np.float32(1))).clip(0, top).astype(np.uint8)
    return ungroup(q, x.shape[-1]), scale[..., 0], mn[..., 0]


def pack_sixes(q: np.ndarray) -> np.ndarray:
    """Four 6-bit codes in three bytes, the first in the lowest bits."""
    flat = q.ravel().astype(np.uint32)
    flat = np.pad(flat, (0, -flat.size % 4))
    word = flat[0::4] | (flat[1::4] << 6) | (flat[2::4] << 12) | (flat[3::4] << 18)
    return word.astype("<u4").view(np.uint8).reshape(-1, 4)[:, :3].copy()


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    flat = q.ravel()
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    return flat[0::2] | (flat[1::2] << 4)


def unpack_sixes(packed: np.ndarray, n: int) -> np.ndarray:
    b = packed.reshape(-1, 3).astype(np.uint32)
    word = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
    q = np.empty((word.size, 4), np.uint8)
    for i in range(4):
        q[:, i] = (word >> (6 * i)) & 63
    return q.ravel()[:n]


def unpack_nibbles(packed: np.ndarray, n: int) -> np.ndarray:
    q = np.empty(2 * packed.size, np.uint8)
    q[0::2] = packed & 15
    q[1::2] = packed >> 4
    return q[:n]


def dequantize(q: np.ndarray, scales: np.ndarray, mins: np.ndarray | None = None) -> np.ndarray:
    """q [..., n] with per-group scales (and mins) [..., groups] -> float32 [..., n]."""
    n = q.shape[-1]
    x = q.astype(np.float32) * np.repeat(scales.astype(np.float32), GROUP, axis=-1)[..., :n]
    if mins is not None:
        x += np.repeat(mins.astype(np.float32), GROUP, axis=-1)[..., :n]
    return x


def hadamard(x: np.ndarray) -> np.ndarray:
    """x [..., D] through the normalised Walsh-Hadamard transform in pieces of the largest power of two
    dividing D (auto-h's values), as float32: butterflies of stride 1, 2, 4, ..., then 1/sqrt(piece)."""
    d = x.shape[-1]
    block = d & -d
    y = np.array(x, np.float32).reshape(-1, d // block, block)
    h = 1
    while h < block:
        pairs = y.reshape(*y.shape[:2], block // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = np.stack([a + b, a - b], axis=-2).reshape(y.shape)
        h *= 2
    return (y * np.float32(1.0 / np.sqrt(np.float64(block)))).reshape(x.shape)
