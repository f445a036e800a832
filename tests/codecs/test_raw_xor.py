"""raw and xor: bit-exact round trips for every dtype, zero-copy raw, read-only parts."""

from __future__ import annotations

import numpy as np
import pytest

from lowdiff_store.codecs import decode, encode
from lowdiff_store.errors import CodecError, Reason
from lowdiff_store.format.dtypes import STORAGE_DTYPE

TAGS = sorted(STORAGE_DTYPE)
SHAPES = [(), (0,), (1,), (3, 5), (2, 0, 3), (4, 3, 2)]


def random_bits(rng: np.random.Generator, tag: str, shape: tuple[int, ...]) -> np.ndarray:
    """Arbitrary bit patterns of ``tag`` (NaN payloads, infinities, -0.0, subnormals)."""
    dt = STORAGE_DTYPE[tag]
    n = int(np.prod(shape)) * dt.itemsize
    raw = rng.integers(0, 256, size=n, dtype=np.uint8)
    if tag == "BOOL":
        raw %= 2
    return raw.view(dt).reshape(shape)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def readonly(a: np.ndarray) -> np.ndarray:
    a = a.copy()
    a.setflags(write=False)
    return a


@pytest.mark.parametrize("tag", TAGS)
@pytest.mark.parametrize("shape", SHAPES)
def test_raw_round_trip_is_bit_exact(tag: str, shape: tuple[int, ...]) -> None:
    a = random_bits(np.random.default_rng(1), tag, shape)
    enc = encode("raw", a, tag)
    assert enc.codec == "raw"
    assert enc.params == {}
    (part,) = enc.parts
    assert part.dtype == tag
    assert part.data.shape == (a.size,)
    out = decode("raw", enc.params, [readonly(part.data)], tag, shape)
    assert same_bits(out, a)


def test_raw_nan_payloads_survive() -> None:
    bits = np.array([0x7FC00001, 0xFFC12345, 0x7F800001, 0x80000000], np.uint32)
    a = bits.view(np.float32)
    out = decode("raw", {}, [encode("raw", a, "F32").parts[0].data], "F32", (4,))
    assert out.view(np.uint32).tolist() == bits.tolist()


def test_raw_decode_is_a_zero_copy_view_of_the_part() -> None:
    part = readonly(np.arange(12, dtype=np.float32))
    out = decode("raw", {}, [part], "F32", (3, 4))
    assert np.shares_memory(out, part)
    assert not out.flags.writeable
    assert out[2, 3] == 11.0


def test_raw_encode_of_contiguous_array_is_a_view() -> None:
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    assert np.shares_memory(encode("raw", a, "I32").parts[0].data, a)


def test_raw_encode_of_strided_array_is_c_order() -> None:
    a = np.arange(12, dtype=np.int16).reshape(3, 4).T
    enc = encode("raw", a, "I16")
    assert enc.parts[0].data.tolist() == a.reshape(-1).tolist()
    assert same_bits(decode("raw", {}, [enc.parts[0].data], "I16", (4, 3)), a)


def test_raw_decode_from_mmap(tmp_path) -> None:
    a = random_bits(np.random.default_rng(2), "BF16", (64, 3))
    path = tmp_path / "part.bin"
    path.write_bytes(a.tobytes())
    mm = np.memmap(path, dtype=np.uint16, mode="r")
    out = decode("raw", {}, [mm], "BF16", (64, 3))
    assert same_bits(np.asarray(out), a)
    assert np.shares_memory(out, mm)


def test_raw_decode_takes_uint8_bytes_of_a_part() -> None:
    a = np.linspace(-1, 1, 10, dtype=np.float64)
    out = decode("raw", {}, [readonly(a.view(np.uint8))], "F64", (10,))
    assert same_bits(out, a)


def test_raw_decode_copies_misaligned_bytes() -> None:
    a = np.arange(5, dtype=np.float32)
    buf = np.zeros(a.nbytes + 1, np.uint8)
    buf[1:] = a.view(np.uint8)
    out = decode("raw", {}, [buf[1:]], "F32", (5,))
    assert out.flags.aligned
    assert out.tolist() == a.tolist()


def test_raw_bool_rejects_bytes_other_than_0_and_1() -> None:
    part = np.array([0, 1, 2], np.uint8)
    with pytest.raises(CodecError) as ei:
        decode("raw", {}, [part], "BOOL", (3,))
    assert ei.value.reason is Reason.BAD_CODEC_PARAMS


@pytest.mark.parametrize("tag", TAGS)
@pytest.mark.parametrize("shape", SHAPES)
def test_xor_round_trip_is_bit_exact(tag: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(3)
    a, ref = random_bits(rng, tag, shape), random_bits(rng, tag, shape)
    enc = encode("xor", a, tag, ref=ref)
    (part,) = enc.parts
    width = STORAGE_DTYPE[tag].itemsize
    assert part.dtype == {1: "U8", 2: "U16", 4: "U32", 8: "U64"}[width]
    out = decode("xor", enc.params, [readonly(part.data)], tag, shape, ref=readonly(ref))
    assert same_bits(out, a)
    assert out.flags.c_contiguous


def test_xor_part_is_the_xor_of_bit_patterns() -> None:
    a = np.array([1.0, -0.0, np.nan], np.float32)
    ref = np.array([1.0, 0.0, 2.0], np.float32)
    bits = encode("xor", a, "F32", ref=ref).parts[0].data
    assert bits.tolist() == [0, 0x80000000, 0x7FC00000 ^ 0x40000000]


def test_xor_against_a_strided_ref() -> None:
    rng = np.random.default_rng(4)
    ref = random_bits(rng, "F16", (6, 4)).T
    a = random_bits(rng, "F16", (4, 6))
    enc = encode("xor", a, "F16", ref=ref)
    assert same_bits(decode("xor", {}, [enc.parts[0].data], "F16", (4, 6), ref=ref), a)


def test_xor_needs_ref() -> None:
    a = np.zeros(3, np.float32)
    with pytest.raises(CodecError) as ei:
        encode("xor", a, "F32")
    assert ei.value.reason is Reason.INVALID_ARGUMENT
    with pytest.raises(CodecError) as ei:
        decode("xor", {}, [np.zeros(3, np.uint32)], "F32", (3,))
    assert ei.value.reason is Reason.INVALID_ARGUMENT


def test_xor_ref_must_match_shape_and_dtype() -> None:
    part = np.zeros(3, np.uint32)
    with pytest.raises(CodecError) as ei:
        decode("xor", {}, [part], "F32", (3,), ref=np.zeros(4, np.float32))
    assert ei.value.reason is Reason.INVALID_ARGUMENT
    with pytest.raises(CodecError) as ei:
        decode("xor", {}, [part], "F32", (3,), ref=np.zeros(3, np.int32))
    assert ei.value.reason is Reason.BAD_DTYPE


def test_xor_bool_result_must_be_0_or_1() -> None:
    ref = np.array([True, False])
    with pytest.raises(CodecError) as ei:
        decode("xor", {}, [np.array([0, 2], np.uint8)], "BOOL", (2,), ref=ref)
    assert ei.value.reason is Reason.BAD_CODEC_PARAMS
