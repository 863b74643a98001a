"""The KV block codec: exact or bounded round trips, sizes, and refusal of damaged bytes."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import tracemalloc
import warnings

import codec_reference as reference
import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llama_chat.storage.codec import (
    AUTO,
    AUTO_ROTATED,
    PLANNED_CODECS,
    STORED_CODECS,
    CorruptBlockError,
    KVPlan,
    block_plan,
    checksum,
    compile_kernels,
    decode_kv,
    encode_kv,
    kv_matches,
)
from llama_chat.storage.codec_formats import rotated

HEADER = struct.Struct("<4sBB4I")  # the documented header: magic, version, codec id, 4 dims
SHAPES = [(2, 2, 64, 64), (1, 1, 1, 16), (3, 2, 37, 64), (2, 1, 5, 256), (1, 3, 33, 16), (2, 2, 64, 256)]


def realistic_kv(shape, seed=0):
    """Normal keys and values, plus a few key channels with a large bias and spread, as real keys have."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal(shape).astype(np.float32)
    v = (0.5 * rng.standard_normal(shape)).astype(np.float32)
    head_dim = shape[-1]
    for c in rng.choice(head_dim, size=max(1, head_dim // 16), replace=False):
        k[..., c] = 40 + 8 * k[..., c]
    return k, v


def grouped(x, axis):
    """x with `axis` moved last and cut into groups of 32 (the last one ragged) -> per-element (min, max)."""
    x = np.moveaxis(x, axis, -1)
    lo, hi = np.empty_like(x), np.empty_like(x)
    for start in range(0, x.shape[-1], 32):
        g = x[..., start : start + 32]
        lo[..., start : start + 32] = g.min(axis=-1, keepdims=True)
        hi[..., start : start + 32] = g.max(axis=-1, keepdims=True)
    return np.moveaxis(lo, -1, axis), np.moveaxis(hi, -1, axis)


def q8_bound(x, axis):
    """Symmetric int8: step = max|x| / 127 (float16 scale rounded up), error <= step / 2."""
    lo, hi = grouped(x, axis)
    amax = np.maximum(np.abs(lo), np.abs(hi)).astype(np.float64)
    step = amax / 127 * (1 + 2**-10) + 2**-24
    return step / 2 + amax * 2**-22


def asymmetric_bound(x, axis, bits):
    """Asymmetric: step = (max - min) / (2**bits - 1) (min rounded down, scale up, to float16),
    error <= step / 2."""
    lo, hi = (a.astype(np.float64) for a in grouped(x, axis))
    step = ((hi - lo) + np.abs(lo) * 2**-10 + 2**-24) / (2**bits - 1) * (1 + 2**-10) + 2**-24
    return step / 2 + np.maximum(np.abs(lo), np.abs(hi)) * 2**-22


def some_plan(shape) -> KVPlan:
    """A plan giving the layers and heads of a block every precision in turn, keys and values apart."""
    bits = (4, 6, 8, 16)
    n_layer, n_head = shape[:2]
    k = tuple(tuple(bits[(2 * layer + h) % 4] for h in range(n_head)) for layer in range(n_layer))
    v = tuple(tuple(bits[(2 * layer + h + 1) % 4] for h in range(n_head)) for layer in range(n_layer))
    return KVPlan(k, v)


def encode(k, v, codec):
    """encode_kv, with some_plan for the planned codecs (auto, auto-h)."""
    return encode_kv(k, v, codec, some_plan(k.shape) if codec in PLANNED_CODECS else None)


def assert_decodes_to_arrays_or_refuses(data):
    try:
        k, v = decode_kv(data)
    except CorruptBlockError as e:
        assert "\n" not in str(e)
        return
    assert k.dtype == v.dtype == np.float32 and k.shape == v.shape and k.ndim == 4


# -- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_f32_round_trip_is_bit_exact(shape):
    k, v = realistic_kv(shape)
    k.flat[:4] = [np.nan, np.inf, -0.0, 1e-40]  # even NaN, infinities, signed zero and subnormals
    k2, v2 = decode_kv(encode_kv(k, v, "f32"))
    assert k2.view(np.uint32).tolist() == k.view(np.uint32).tolist()
    assert v2.view(np.uint32).tolist() == v.view(np.uint32).tolist()


@pytest.mark.parametrize("codec", STORED_CODECS)
@pytest.mark.parametrize("shape", SHAPES)
def test_decoded_arrays_are_float32_c_contiguous_of_the_original_shape(codec, shape):
    k, v = realistic_kv(shape)
    for a in decode_kv(encode(k, v, codec)):
        assert a.shape == shape and a.dtype == np.float32 and a.flags.c_contiguous


@pytest.mark.parametrize("codec", STORED_CODECS)
def test_views_into_a_larger_arena_encode_like_copies(codec):
    arena_k, arena_v = realistic_kv((2, 2, 300, 64))
    k, v = arena_k[:, :, 100:164], arena_v[:, :, 100:164]  # what the block pool hands over
    assert encode(k, v, codec) == encode(k.copy(), v.copy(), codec)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])  # the live cache's types (kv_cache.CACHE_TYPES)
@pytest.mark.parametrize("codec", STORED_CODECS)
def test_a_block_decodes_into_a_view_of_a_larger_arena_as_into_new_arrays(codec, dtype):
    """As a resumed block is decoded: straight into its slot of the KV arena, a float16 one holding
    the decoded values rounded once (as float16 rounds: to nearest even)."""
    k, v = realistic_kv((3, 2, 64, 64))
    data = encode(k, v, codec)
    arena = np.full((2, 3, 2, 200, 64), np.nan, dtype)
    out = arena[0, :, :, 70:134], arena[1, :, :, 70:134]
    assert decode_kv(data, out) is out
    for got, want in zip(out, decode_kv(data), strict=True):
        assert np.array_equal(got, want.astype(dtype))
    assert np.isnan(arena[:, :, :, :70]).all() and np.isnan(arena[:, :, :, 134:]).all()  # nothing else


def test_a_block_of_another_shape_than_its_destination_is_refused():
    data = encode_kv(*realistic_kv((3, 2, 64, 64)), "q6")
    with pytest.raises(CorruptBlockError, match="shape"):
        decode_kv(data, (np.empty((3, 2, 32, 64), np.float32), np.empty((3, 2, 32, 64), np.float32)))


def test_decode_accepts_any_bytes_like_object():
    data = encode_kv(*realistic_kv((1, 2, 3, 16)), "q4")
    expected = decode_kv(data)[0]
    for blob in (bytearray(data), memoryview(data)):
        assert np.array_equal(decode_kv(blob)[0], expected)


@pytest.mark.parametrize("shape", SHAPES)
def test_f16_error_is_half_a_float16_step(shape):
    k, v = realistic_kv(shape)
    for x, y in zip((k, v), decode_kv(encode_kv(k, v, "f16"))):
        assert np.all(np.abs(y - x) <= np.abs(x) * 2**-11 + 2**-25)


@pytest.mark.parametrize("shape", SHAPES)
def test_q8_error_is_half_a_step_keys_per_channel_values_per_token(shape):
    k, v = realistic_kv(shape)
    k2, v2 = decode_kv(encode_kv(k, v, "q8"))
    # keys grouped along tokens (one channel at a time), values along head_dim (one token at a time)
    assert np.all(np.abs(k2 - k) <= q8_bound(k, axis=2))
    assert np.all(np.abs(v2 - v) <= q8_bound(v, axis=3))


@pytest.mark.parametrize("codec, bits", [("q4", 4), ("q6", 6)])
@pytest.mark.parametrize("shape", SHAPES)
def test_q4_and_q6_error_is_half_a_step_of_each_groups_range(shape, codec, bits):
    k, v = realistic_kv(shape)
    k2, v2 = decode_kv(encode_kv(k, v, codec))
    assert np.all(np.abs(k2 - k) <= asymmetric_bound(k, axis=2, bits=bits))
    assert np.all(np.abs(v2 - v) <= asymmetric_bound(v, axis=3, bits=bits))


@pytest.mark.parametrize("shape", SHAPES)
def test_auto_stores_each_heads_keys_and_values_at_the_bits_its_plan_gives(shape):
    k, v = realistic_kv(shape)
    plan = some_plan(shape)
    k2, v2 = decode_kv(encode_kv(k, v, AUTO, plan))
    for layer in range(shape[0]):
        for head in range(shape[1]):
            for x, y, bits, axis in (
                (k, k2, plan.k_bits[layer][head], 0),  # keys per channel (along tokens)
                (v, v2, plan.v_bits[layer][head], 1),  # values per token (along head_dim)
            ):
                x, y = x[layer, head], y[layer, head]
                if bits == 16:
                    bound = np.abs(x) * 2**-11 + 2**-25
                else:
                    bound = asymmetric_bound(x, axis=axis, bits=bits)
                assert np.all(np.abs(y - x) <= bound), (layer, head, bits)


def test_an_auto_block_says_its_plan_and_reads_without_one():
    """A block written under one plan reads under any: it carries its own."""
    k, v = realistic_kv((3, 2, 64, 64))
    plan = some_plan(k.shape)
    data = encode_kv(k, v, AUTO, plan)
    assert block_plan(data) == plan
    assert block_plan(encode_kv(k, v, "q6")) is None
    assert kv_matches(data, k, v) and not kv_matches(data, v, k)


def test_a_block_is_compared_with_a_float16_cache_without_overflow():
    """`sessions verify` compares imported blocks with the live cache, float16 by default: the sum of
    squares of a real model's keys overflows float16, which once made any block match it."""
    shape = (24, 2, 64, 64)  # the default model's layers and KV heads, a block of 64 tokens
    k, v = realistic_kv(shape)
    forged_k, forged_v = realistic_kv(shape, seed=1)
    data = encode_kv(k, 4 * v, "q8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # RuntimeWarning: overflow encountered in dot
        assert kv_matches(data, k.astype(np.float16), (4 * v).astype(np.float16))
        assert not kv_matches(data, forged_k.astype(np.float16), (4 * forged_v).astype(np.float16))


def test_an_auto_block_with_fewer_bits_is_smaller():
    k, v = realistic_kv((3, 2, 64, 64))
    sizes = [len(encode_kv(k, v, AUTO, KVPlan.uniform(3, 2, bits))) for bits in (4, 6, 8, 16)]
    assert sizes == sorted(sizes) and sizes[0] < 0.8 * sizes[1]
    assert abs(sizes[1] - len(encode_kv(k, v, "q6"))) < 0.05 * sizes[1]  # 6 bits everywhere: about q6


@pytest.mark.parametrize(
    "plan",
    [None, KVPlan.uniform(3, 2, 6), KVPlan.uniform(2, 1, 6)],
    ids=["no plan", "another shape", "fewer heads"],
)
def test_auto_refuses_a_missing_plan_or_one_of_another_shape(plan):
    with pytest.raises(ValueError, match="plan"):
        encode_kv(*realistic_kv((2, 2, 8, 16)), AUTO, plan)


def rotated_bound(v, bits):
    """auto-h's values: rounded as asymmetric_bound says in the rotated space, and the rotation keeps
    lengths, so each token's error vector is at most as long as that bound's."""
    bound = asymmetric_bound(reference.hadamard(v), axis=-1, bits=bits)
    return np.sqrt((bound**2).sum(axis=-1)) * (1 + 2**-10) + 2**-20


@pytest.mark.parametrize("shape", SHAPES)
def test_auto_h_rotates_values_and_stores_keys_as_auto_does(shape):
    k, v = realistic_kv(shape)
    plan = some_plan(shape)
    k_auto, v_auto = decode_kv(encode_kv(k, v, AUTO, plan))
    k2, v2 = decode_kv(encode_kv(k, v, AUTO_ROTATED, plan))
    assert np.array_equal(k2, k_auto)
    for layer in range(shape[0]):
        for head in range(shape[1]):
            bits, x, y = plan.v_bits[layer][head], v[layer, head], v2[layer, head]
            if bits == 16:
                assert np.array_equal(y, v_auto[layer, head])
            else:
                error = np.sqrt(((y.astype(np.float64) - x) ** 2).sum(axis=-1))
                assert np.all(error <= rotated_bound(x, bits)), (layer, head, bits)


def test_an_outlier_value_channel_blurs_rotated_values_far_less():
    """Values are grouped per token: a channel 40x the others sets its group's step; rotated, its size is
    spread over all 64 channels and 4-bit values err ~2.5x less."""
    rng = np.random.default_rng(0)
    k, v = rng.standard_normal((2, 2, 2, 64, 64), dtype=np.float32)
    v[..., 9] *= 40
    plan = KVPlan.uniform(2, 2, 4)
    errors = [np.linalg.norm(decode_kv(encode_kv(k, v, c, plan))[1] - v) for c in (AUTO, AUTO_ROTATED)]
    assert errors[1] < errors[0] / 2


@pytest.mark.parametrize("head_dim", [1, 16, 64, 96, 256])
def test_the_compiled_rotation_is_the_normalised_hadamard_transform_and_its_own_inverse(head_dim):
    x = np.random.default_rng(1).standard_normal((3, 5, head_dim)).astype(np.float32)
    got = rotated(x)
    assert np.array_equal(got, reference.hadamard(x))  # the same float32 operations: the same bits
    block = head_dim & -head_dim
    sylvester = np.ones((1, 1))
    while len(sylvester) < block:
        sylvester = np.block([[sylvester, sylvester], [sylvester, -sylvester]])
    pieces = x.reshape(3, 5, -1, block).astype(np.float64) @ sylvester / np.sqrt(block)
    assert np.allclose(got, pieces.reshape(x.shape), atol=1e-5)
    assert np.allclose(rotated(got), x, atol=1e-5)


@pytest.mark.parametrize("rows", [((5,),), ((4,), (4, 4)), ()])
def test_a_plan_of_unknown_bits_or_ragged_rows_is_refused(rows):
    with pytest.raises(ValueError):
        KVPlan(rows, rows)


@pytest.mark.parametrize("codec", ["q8", "q4"])
def test_an_outlier_key_channel_does_not_blur_the_others(codec):
    rng = np.random.default_rng(0)
    k, v = rng.standard_normal((2, 2, 2, 64, 64), dtype=np.float32)
    k[..., 5] = 300 * np.sign(k[..., 5])  # one huge channel
    k2, _ = decode_kv(encode_kv(k, v, codec))
    others = np.delete(np.abs(k2 - k), 5, axis=-1)
    assert others.max() < (0.05 if codec == "q8" else 0.5)  # grouped per token they'd err by ~1.2 / ~20


def test_q4_keeps_the_small_variations_of_a_biased_key_channel():
    """Asymmetric q4 spends its 16 levels on a group's range, not on +-max (which would err by ~3.6 here)."""
    rng = np.random.default_rng(0)
    k, v = rng.standard_normal((2, 1, 1, 64, 64), dtype=np.float32)
    k[..., 0] = 50 + 0.5 * k[..., 0]
    k2, _ = decode_kv(encode_kv(k, v, "q4"))
    assert np.abs(k2[..., 0] - k[..., 0]).max() < 0.25


@pytest.mark.parametrize("codec", STORED_CODECS)
def test_zeros_survive_exactly(codec):
    zeros = np.zeros((2, 1, 37, 16), np.float32)
    k, v = decode_kv(encode(zeros, zeros, codec))
    assert not k.any() and not v.any()


@pytest.mark.parametrize("codec", ["f16", "q8", "q4", AUTO, AUTO_ROTATED])
def test_huge_values_saturate_instead_of_turning_into_inf_or_nan(codec):
    k, v = realistic_kv((1, 2, 40, 64))
    k[0, 0, 3, :] = 1e9
    v[0, 1, :, 7] = -1e9
    k2, v2 = decode_kv(encode(k, v, codec))
    assert np.isfinite(k2).all() and np.isfinite(v2).all()
    assert k2[0, 0, 3, 0] > 6e4 and v2[0, 1, 0, 7] < -6e4


@pytest.mark.parametrize("codec", ["q8", "q4", AUTO, AUTO_ROTATED])
def test_quantized_codecs_refuse_non_finite_values(codec):
    k, v = realistic_kv((1, 1, 4, 32))
    k[0, 0, 1, 1] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        encode(k, v, codec)


# -- sizes ---------------------------------------------------------------------------------------


def test_sizes_shrink_in_codec_order_on_realistic_data():
    k, v = realistic_kv((24, 2, 64, 64))
    sizes = [len(encode_kv(k, v, codec)) for codec in ("f32", "f16", "q8", "q4")]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 4
    raw_f16 = k.nbytes  # k and v as plain float16
    assert sizes[2] < 0.6 * raw_f16 and sizes[3] < 0.4 * raw_f16


def test_checksum_changes_with_any_flipped_byte():
    data = encode_kv(*realistic_kv((1, 1, 3, 16)), "q8")
    assert checksum(data) == checksum(bytes(data))
    assert checksum(data + b"\0") != checksum(data)
    for i in range(0, len(data), 7):
        flipped = bytearray(data)
        flipped[i] ^= 0x01
        assert checksum(bytes(flipped)) != checksum(data)


# -- blocks stored before ----------------------------------------------------------------------


def stored_v1_kv():
    """The KV tests/kv_blocks_v1.json's blocks were written from, and the plan of its auto block."""
    shape = (2, 2, 3, 8)
    n = int(np.prod(shape))
    k = (np.sin(np.arange(n) * 0.7) * 4 + 20).astype(np.float32).reshape(shape)
    v = np.cos(np.arange(n) * 1.3).astype(np.float32).reshape(shape)
    return k, v, KVPlan(((4, 6), (8, 16)), ((16, 8), (6, 4)))


@pytest.mark.parametrize("codec", STORED_CODECS)
def test_blocks_stored_in_format_version_1_read_as_they_did(codec, pytestconfig):
    """Databases and export files keep blocks for good: one of each codec, as an earlier llama-chat
    wrote it, decodes to what the same KV encodes to now (and f32 to the KV itself)."""
    stored = json.loads((pytestconfig.rootpath / "tests" / "kv_blocks_v1.json").read_text())["blocks"]
    k, v, plan = stored_v1_kv()
    old = decode_kv(bytes.fromhex(stored[codec]))
    for a, b in zip(old, decode_kv(encode_kv(k, v, codec, plan)), strict=True):
        assert np.array_equal(a, b)
    if codec == "f32":
        assert np.array_equal(old[0], k) and np.array_equal(old[1], v)


# -- bad input to encode -------------------------------------------------------------------------


def test_encode_refuses_an_unknown_codec_with_a_plain_value_error():
    k, v = realistic_kv((1, 1, 2, 16))
    with pytest.raises(ValueError, match="unknown KV codec") as e:
        encode_kv(k, v, "q2")
    assert not isinstance(e.value, CorruptBlockError)


@pytest.mark.parametrize(
    "k_shape, v_shape", [((1, 1, 2, 16), (1, 1, 3, 16)), ((2, 16), (2, 16)), ((1, 1, 0, 16), (1, 1, 0, 16))]
)
def test_encode_refuses_mismatched_flat_or_empty_arrays(k_shape, v_shape):
    with pytest.raises(ValueError):
        encode_kv(np.zeros(k_shape, np.float32), np.zeros(v_shape, np.float32), "f32")


# -- damaged bytes -------------------------------------------------------------------------------


@pytest.fixture(params=STORED_CODECS)
def block(request):
    """A small odd-shaped block, its encoding and what that decodes to."""
    k, v = realistic_kv((2, 1, 37, 16), seed=1)
    data = encode(k, v, request.param)
    return data, decode_kv(data)


@pytest.mark.parametrize("data", [b"", b"L", b"LCKV", HEADER.pack(b"LCKV", 1, 1, 1, 1, 1, 16)])
def test_empty_and_header_only_input_is_corrupt(data):
    with pytest.raises(CorruptBlockError):
        decode_kv(data)


def test_every_truncation_is_corrupt(block):
    data, _ = block
    for cut in range(len(data)):
        with pytest.raises(CorruptBlockError):
            decode_kv(data[:cut])


def test_truncating_a_full_size_block_is_corrupt():
    data = encode_kv(*realistic_kv((24, 2, 64, 64)), "q8")
    for cut in np.linspace(0, len(data) - 1, 60).astype(int):
        with pytest.raises(CorruptBlockError):
            decode_kv(data[:cut])


def test_every_header_byte_flip_is_corrupt(block):
    data, _ = block
    for i in range(HEADER.size):
        for mask in (0x01, 0x02, 0x10, 0x80, 0xFF):
            damaged = bytearray(data)
            damaged[i] ^= mask
            with pytest.raises(CorruptBlockError):
                decode_kv(bytes(damaged))


@pytest.mark.parametrize(
    "change",
    [
        lambda d: (d[0], d[1], d[2] + 1, d[3]),  # one token more
        lambda d: (d[0], d[1], d[2] - 1, d[3]),  # one token fewer
        lambda d: (d[0] * 2, d[1], d[2], d[3]),  # twice the layers
        lambda d: (d[0], d[1], d[2], d[3] // 2),  # half the head_dim
        lambda d: (d[1], d[0], d[2], d[3]),  # layers and heads swapped: same size
        lambda d: (d[0], d[1], d[3], d[2]),  # tokens and head_dim swapped: same size
        lambda d: (d[0], d[1], 0, d[3]),  # no tokens
        lambda d: (2**31, 2**31, d[2], d[3]),  # absurd
    ],
)
def test_a_header_declaring_another_shape_is_corrupt(block, change):
    data, _ = block
    magic, version, codec_id, *dims = HEADER.unpack_from(data)
    with pytest.raises(CorruptBlockError):
        decode_kv(HEADER.pack(magic, version, codec_id, *change(dims)) + data[HEADER.size :])


def test_a_header_naming_another_codec_is_corrupt(block):
    data, _ = block
    magic, version, codec_id, *dims = HEADER.unpack_from(data)
    for other in range(256):
        if other != codec_id:
            with pytest.raises(CorruptBlockError):
                decode_kv(HEADER.pack(magic, version, other, *dims) + data[HEADER.size :])


def test_extra_bytes_after_the_block_are_corrupt(block):
    data, _ = block
    for extra in (b"\0", b"junk", data):
        with pytest.raises(CorruptBlockError):
            decode_kv(data + extra)


def test_a_flipped_payload_byte_never_decodes_to_different_numbers(block):
    """zstd's frame checksum catches payload damage; the few harmless flips (e.g. an unused bit of
    the frame header) decode to exactly the original. The stored checksum always tells."""
    data, (k, v) = block
    for i in range(HEADER.size, len(data)):
        for mask in (0x01, 0x80):
            damaged = bytearray(data)
            damaged[i] ^= mask
            assert checksum(bytes(damaged)) != checksum(data)
            try:
                k2, v2 = decode_kv(bytes(damaged))
            except CorruptBlockError:
                continue
            assert k2.view(np.uint32).tolist() == k.view(np.uint32).tolist()
            assert v2.view(np.uint32).tolist() == v.view(np.uint32).tolist()


def test_random_bytes_are_corrupt():
    rng = np.random.default_rng(7)
    for n in (1, 21, 22, 23, 100, 5000):
        with pytest.raises(CorruptBlockError):
            decode_kv(rng.bytes(n))
        with pytest.raises(CorruptBlockError):
            decode_kv(b"LCKV\x01\x03" + rng.bytes(n))


def zstd_runs(content_size: int | None, n_blocks: int) -> bytes:
    """A hand-made zstd frame of n_blocks runs of 128 KiB zeros (a decompression bomb), declaring
    content_size (or no size), never finished."""
    if content_size is None:
        descriptor = bytes([0x04, 0x58])  # checksum flag; window 2 MiB; no content size
    else:
        descriptor = bytes([0xC4, 0x58]) + struct.pack("<Q", content_size)  # + 8-byte content size
    rle_block = (0b010 | (2**17 << 3)).to_bytes(3, "little") + b"\0"
    return b"\x28\xb5\x2f\xfd" + descriptor + rle_block * n_blocks


def peak_memory_of_decoding(data) -> int:
    tracemalloc.start()
    try:
        with pytest.raises(CorruptBlockError):
            decode_kv(data)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_frame_claiming_a_huge_size_allocates_only_what_it_holds():
    """The header and the zstd frame both claim 512 MiB (the largest block allowed); it holds 8 MiB."""
    n_tokens, head_dim = 2**20, 64
    header = HEADER.pack(b"LCKV", 1, 1, 1, 1, n_tokens, head_dim)  # f32
    frame = zstd_runs(HEADER.size + 8 * n_tokens * head_dim, 64)
    assert peak_memory_of_decoding(header + frame) < 64 * 2**20


@pytest.mark.parametrize("content_size", [None, 2**29])
def test_a_frame_larger_than_its_header_implies_is_refused_before_decompressing(content_size):
    header = HEADER.pack(b"LCKV", 1, 1, 1, 1, 1, 16)  # f32, a 150-byte payload
    assert peak_memory_of_decoding(header + zstd_runs(content_size, 64)) < 2**20


# -- fuzzing -------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_decode_or_raise_corrupt_block_error(data):
    assert_decodes_to_arrays_or_refuses(data)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(STORED_CODECS),
    st.tuples(*[st.integers(0, 2**32 - 1)] * 4) | st.tuples(*[st.integers(0, 70)] * 4),
    st.binary(max_size=200),
)
def test_a_valid_looking_header_with_arbitrary_payload_raises_corrupt_block_error(codec, dims, payload):
    codec_id = {"f32": 1, "f16": 2, "q8": 3, "q4": 4, "q6": 5, "auto": 6, "auto-h": 7}[codec]
    assert_decodes_to_arrays_or_refuses(HEADER.pack(b"LCKV", 1, codec_id, *dims) + payload)


_ORIGINALS = {codec: encode(*realistic_kv((2, 2, 40, 32), seed=3), codec) for codec in STORED_CODECS}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(STORED_CODECS),
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=4),
    st.none() | st.integers(0, 10**6),
)
def test_damaged_blocks_decode_or_raise_within_the_memory_bound(codec, edits, cut):
    damaged = bytearray(_ORIGINALS[codec])
    for pos, byte in edits:
        damaged[pos % len(damaged)] = byte
    if cut is not None:
        damaged = damaged[: cut % len(damaged)]
    damaged = bytes(damaged)
    tracemalloc.start()
    try:
        assert_decodes_to_arrays_or_refuses(damaged)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # the frame holds what the original declared, whatever a damaged header claims
    assert peak < 8 * (2 * 2 * 40 * 32 * 2 * 4) + 2**20


def test_the_codecs_loops_are_made_ready_with_progress_that_moves():
    """Front ends call compile_kernels as the model loads: the first start compiles (and says so), later
    ones load from numba's cache."""
    seen = []
    compile_kernels(lambda label, done, total: seen.append((label, done, total)))
    assert [done for _, done, _ in seen] == [0, 1, 2, 3, 4, 5]  # q8, q6, q4, auto, auto-h
    assert all("KV codec" in label and total == 5 for label, _, total in seen)
    again = []
    compile_kernels(lambda label, done, total: again.append(label))
    assert set(again) == {"loading the KV codec"}  # compiled once, then read from numba's cache


# In a fresh process (this module encodes blocks as it is imported): after compile_kernels, blocks as the
# pool holds them (strided views of its arena) and tails (copies), of every codec, compile nothing more.
AFTER_COMPILE = """
import numpy as np
from llama_chat.storage import codec_kernels
from llama_chat.storage.codec import KVPlan, compile_kernels, decode_kv, encode_kv
compile_kernels()
count = lambda: {k.__name__: len(k.signatures) for k in codec_kernels.COMPILED}
ready = count()
k = np.random.default_rng(0).standard_normal((3, 2, 80, 64)).astype(np.float32)
plan = KVPlan(((4, 6), (8, 16), (6, 8)), ((16, 8), (6, 4), (4, 4)))
for codec in ("q8", "q6", "q4", "auto", "auto-h"):
    decode_kv(encode_kv(k[:, :, 8:72], k[:, :, 8:72], codec, plan))
    data = encode_kv(k[:, :, :37].copy(), k[:, :, :37].copy(), codec, plan)
    decode_kv(data)
    decode_kv(data, (k[:, :, 40:77], k[:, :, 41:78]))  # into the arena, as a resume decodes
print(ready == count(), ready, count())
"""


def test_after_compile_kernels_no_block_waits_on_the_compiler():
    out = subprocess.run(
        [sys.executable, "-c", AFTER_COMPILE], capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith("True"), out


@pytest.mark.parametrize("codec", ["q8", "q6", "q4"])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_compiled_codec_writes_and_reads_the_readable_references_bytes(codec, shape):
    """codec_kernels.py against tests/codec_reference.py (the same formats in plain NumPy): the same
    bytes from the same KV (signed zeros and an arena's strided view included), the same KV back."""
    k, v = realistic_kv(shape, seed=3)
    k[..., 0, : min(3, shape[3])] = 0.0
    k[..., -1, :] = -0.0
    v[..., 1:3] = -0.0
    arena = np.zeros((*shape[:2], shape[2] + 5, shape[3]), np.float32)
    arena[:, :, 2 : 2 + shape[2]] = k
    data = encode_kv(arena[:, :, 2 : 2 + shape[2]], v, codec)  # a block as the pool holds it
    assert data == reference.encode(k, v, codec)
    payload = memoryview(zstandard.ZstdDecompressor().decompress(data[HEADER.size :]))[HEADER.size :]
    for got, want in zip(decode_kv(data), reference.decode(payload, codec, shape), strict=True):
        assert np.array_equal(got, want)
