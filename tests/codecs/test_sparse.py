"""sparse: lossless dense path, precomputed top-k, delta indices, int64 path, validation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowdiff_store.codecs import decode, encode, encode_sparse, sparse_entries
from lowdiff_store.errors import CodecError, Reason
from lowdiff_store.format.dtypes import STORAGE_DTYPE, f32_to_bf16

from .profile import examples

TAGS = sorted(STORAGE_DTYPE)


def sparse_bits(rng: np.random.Generator, tag: str, shape: tuple[int, ...]) -> np.ndarray:
    """Random bit patterns with about 80% all-zero elements."""
    dt = STORAGE_DTYPE[tag]
    n = int(np.prod(shape))
    raw = rng.integers(0, 256, size=(n, dt.itemsize), dtype=np.uint8)
    if tag == "BOOL":
        raw %= 2
    raw[rng.random(n) < 0.8] = 0
    return raw.reshape(-1).view(dt).reshape(shape)


def parts(enc) -> list[np.ndarray]:
    out = []
    for p in enc.parts:
        a = p.data.copy()
        a.setflags(write=False)
        out.append(a)
    return out


@pytest.mark.parametrize("tag", TAGS)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (7, 9), (3, 0, 2), (2, 3, 4)])
@pytest.mark.parametrize("delta", [True, False])
def test_dense_round_trip_is_bit_exact(tag: str, shape: tuple[int, ...], delta: bool) -> None:
    a = sparse_bits(np.random.default_rng(5), tag, shape)
    enc = encode("sparse", a, tag, delta=delta)
    width = STORAGE_DTYPE[tag].itemsize
    nz = int(np.count_nonzero(a.reshape(-1).view(np.uint8).reshape(a.size, width).any(axis=1)))
    assert enc.params == {"count": nz, "index_dtype": "I32", "delta": delta}
    out = decode("sparse", enc.params, parts(enc), tag, shape)
    assert out.dtype == a.dtype
    assert out.shape == a.shape
    assert out.tobytes() == a.tobytes()


def test_negative_zero_and_nan_payloads_are_kept() -> None:
    bits = np.array([0, 0x80000000, 0, 0x7FC00123, 0], np.uint32)
    enc = encode("sparse", bits.view(np.float32), "F32")
    assert enc.params["count"] == 2
    out = decode("sparse", enc.params, parts(enc), "F32", (5,))
    assert out.view(np.uint32).tolist() == bits.tolist()


def test_delta_indices_are_first_plus_gaps() -> None:
    a = np.zeros(20, np.int16)
    a[[2, 3, 9, 19]] = [5, -6, 7, -8]
    enc = encode("sparse", a, "I16")
    assert enc.parts[0].data.tolist() == [2, 1, 6, 10]
    assert enc.parts[0].dtype == "I32"
    assert enc.parts[1].data.tolist() == [5, -6, 7, -8]
    # The bytes of format_spec/codecs.md, "Worked examples".
    assert enc.params == {"count": 4, "index_dtype": "I32", "delta": True}
    assert enc.parts[0].data.tobytes() == bytes.fromhex("0200000001000000060000000a000000")
    assert enc.parts[1].data.tobytes() == bytes.fromhex("0500faff0700f8ff")
    flat = encode("sparse", a, "I16", delta=False)
    assert flat.parts[0].data.tolist() == [2, 3, 9, 19]
    for e in (enc, flat):
        assert decode("sparse", e.params, parts(e), "I16", (20,)).tolist() == a.tolist()


def test_encode_sparse_sorts_for_delta_and_permutes_values() -> None:
    idx = np.array([9, 0, 4], np.int64)
    vals = np.array([1.5, 2.5, 3.5], np.float32)
    enc = encode_sparse(idx, vals, 10, "F32")
    assert enc.params == {"count": 3, "index_dtype": "I32", "delta": True}
    assert enc.parts[0].data.tolist() == [0, 4, 5]
    assert enc.parts[1].data.tolist() == [2.5, 3.5, 1.5]
    out = decode("sparse", enc.params, parts(enc), "F32", (2, 5))
    assert out.reshape(-1).tolist() == [2.5, 0, 0, 0, 3.5, 0, 0, 0, 0, 1.5]
    got_idx, got_vals = sparse_entries(enc.params, parts(enc), 10)
    assert got_idx.dtype == np.int64
    assert got_idx.tolist() == [0, 4, 9]
    assert got_vals.tolist() == [2.5, 3.5, 1.5]


def test_encode_sparse_without_delta_keeps_order_and_does_not_copy_int32() -> None:
    idx = np.array([7, 1, 3], np.int32)
    vals = np.array([1, 2, 3], np.int8)
    enc = encode_sparse(idx, vals, 8, "I8", delta=False)
    assert np.shares_memory(enc.parts[0].data, idx)
    assert np.shares_memory(enc.parts[1].data, vals)
    assert enc.parts[0].data.tolist() == [7, 1, 3]
    got_idx, got_vals = sparse_entries(enc.params, parts(enc), 8)
    assert got_idx.tolist() == [7, 1, 3]
    assert got_vals.tolist() == [1, 2, 3]
    assert decode("sparse", enc.params, parts(enc), "I8", (8,)).tolist() == [0, 2, 0, 3, 0, 0, 0, 1]


def test_encode_sparse_of_bf16_values() -> None:
    vals = f32_to_bf16(np.array([1.0, -2.0], np.float32))
    enc = encode_sparse(np.array([3, 1]), vals, 4, "BF16")
    out = decode("sparse", enc.params, parts(enc), "BF16", (4,))
    assert out.tolist() == [0, int(vals[1]), 0, int(vals[0])]


def test_int64_index_path_without_densifying() -> None:
    numel = 2**40  # densifying even as bool would need a terabyte
    idx = np.array([2**40 - 1, 5, 2**33], np.int64)
    vals = np.array([1.0, 2.0, 3.0], np.float64)
    for delta in (True, False):
        enc = encode_sparse(idx, vals, numel, "F64", delta=delta)
        assert enc.params["index_dtype"] == "I64"
        assert enc.parts[0].dtype == "I64"
        got_idx, got_vals = sparse_entries(enc.params, parts(enc), numel)
        order = np.argsort(got_idx)
        assert got_idx[order].tolist() == [5, 2**33, 2**40 - 1]
        assert got_vals[order].tolist() == [2.0, 3.0, 1.0]


def test_index_width_switches_at_int32_max() -> None:
    one = np.array([0]), np.array([1], np.uint8)
    assert encode_sparse(*one, 2**31 - 1, "U8").params["index_dtype"] == "I32"
    assert encode_sparse(*one, 2**31, "U8").params["index_dtype"] == "I64"


def test_top_k_keeps_the_largest_magnitudes() -> None:
    a = np.array([0.5, -4.0, 3.0, -0.25, 2.0, 0.0], np.float32)
    enc = encode("sparse", a, "F32", k=3)
    assert enc.params["count"] == 3
    out = decode("sparse", enc.params, parts(enc), "F32", (6,))
    assert out.tolist() == [0.0, -4.0, 3.0, 0.0, 2.0, 0.0]
    assert encode("sparse", a, "F32", k=0).params["count"] == 0
    ints = np.array([-128, 5, 127, -3], np.int8)
    e = encode("sparse", ints, "I8", k=2)
    assert decode("sparse", e.params, parts(e), "I8", (4,)).tolist() == [-128, 0, 127, 0]


def test_top_k_bf16_ranks_by_value() -> None:
    a = f32_to_bf16(np.array([1.0, -8.0, 2.0], np.float32))
    enc = encode("sparse", a, "BF16", k=1)
    assert sparse_entries(enc.params, parts(enc), 3)[0].tolist() == [1]


@pytest.mark.parametrize("k", [-1, 7, 2.0, True])
def test_bad_k(k: object) -> None:
    with pytest.raises(CodecError) as ei:
        encode("sparse", np.ones(6, np.float32), "F32", k=k)
    assert ei.value.reason is Reason.BAD_CODEC_PARAMS


def test_top_k_of_f8_is_refused() -> None:
    with pytest.raises(CodecError) as ei:
        encode("sparse", np.ones(4, np.uint8), "F8_E4M3", k=1)
    assert ei.value.reason is Reason.BAD_DTYPE


@pytest.mark.parametrize("delta", [True, False])
def test_encode_sparse_rejects_duplicates_and_out_of_range(delta: bool) -> None:
    vals = np.ones(3, np.float32)
    for idx in ([1, 4, 1], [0, 10, 2], [-1, 2, 3]):
        with pytest.raises(CodecError) as ei:
            encode_sparse(np.array(idx), vals, 10, "F32", delta=delta)
        assert ei.value.reason is Reason.BAD_CODEC_PARAMS


def test_encode_sparse_argument_errors() -> None:
    with pytest.raises(CodecError) as ei:
        encode_sparse(np.array([0, 1]), np.ones(3, np.float32), 10, "F32")
    assert ei.value.reason is Reason.INVALID_ARGUMENT
    with pytest.raises(CodecError) as ei:
        encode_sparse(np.array([0.0]), np.ones(1, np.float32), 10, "F32")
    assert ei.value.reason is Reason.BAD_DTYPE
    with pytest.raises(CodecError) as ei:
        encode_sparse(np.array([0]), np.ones(1, np.float64), 10, "F32")
    assert ei.value.reason is Reason.BAD_DTYPE
    with pytest.raises(CodecError) as ei:
        encode_sparse(np.array([0]), np.ones(1, np.float32), -1, "F32")
    assert ei.value.reason is Reason.INVALID_ARGUMENT
    with pytest.raises(CodecError) as ei:
        encode_sparse(np.array([0]), np.ones(1, np.float32), 4, "F32", delta=1)  # type: ignore[arg-type]
    assert ei.value.reason is Reason.BAD_CODEC_PARAMS


def stored(
    idx: list[int], itype: type = np.int32, vals: list[float] | None = None, delta: bool = True
) -> tuple[dict, list[np.ndarray]]:
    v = np.array(vals if vals is not None else [1.0] * len(idx), np.float32)
    tag = "I32" if itype is np.int32 else "I64"
    return {"count": len(idx), "index_dtype": tag, "delta": delta}, [np.array(idx, itype), v]


@pytest.mark.parametrize(
    ("idx", "delta"),
    [
        ([1, 1, 2], False),  # duplicate
        ([3, 1, 3], False),  # duplicate, unsorted
        ([2, 0], True),  # gap 0: duplicate
        ([2, -1], True),  # negative gap
        ([-1, 2], True),  # negative first
        ([-1], False),
        ([10], False),  # == numel
        ([9, 1], True),  # 9 + 1 == numel
        ([5, 5], True),
    ],
)
def test_decode_rejects_bad_indices(idx: list[int], delta: bool) -> None:
    params, ps = stored(idx, delta=delta)
    for call in (
        lambda: decode("sparse", params, ps, "F32", (10,)),
        lambda: sparse_entries(params, ps, 10),
    ):
        with pytest.raises(CodecError) as ei:
            call()
        assert ei.value.reason is Reason.BAD_CODEC_PARAMS


def test_decode_accepts_unsorted_unique_indices_without_delta() -> None:
    params, ps = stored([4, 0, 2], vals=[1.0, 2.0, 3.0], delta=False)
    assert decode("sparse", params, ps, "F32", (5,)).tolist() == [2.0, 0, 3.0, 0, 1.0]


def test_decode_rejects_int64_delta_sum_that_wraps() -> None:
    numel = 2**62
    big = numel - 1
    # The true sums leave [0, numel) and the int64 sum wraps back into range.
    gaps = [big, big, big, big, 10]
    params, ps = stored(gaps, np.int64)
    with pytest.raises(CodecError) as ei:
        sparse_entries(params, ps, numel)
    assert ei.value.reason is Reason.BAD_CODEC_PARAMS
    wrapped = np.cumsum(np.array(gaps, np.int64))
    assert 0 <= wrapped[-1] < numel  # the naive last-element check would have passed


def test_decode_params_validation() -> None:
    params, ps = stored([1, 2])
    for bad in (
        {**params, "count": 3},
        {**params, "count": -1},
        {**params, "count": 11},
        {**params, "count": True},
        {**params, "index_dtype": "I16"},
        {**params, "delta": 1},
        {"count": 2, "index_dtype": "I32"},
        {**params, "extra": 0},
    ):
        with pytest.raises(CodecError) as ei:
            decode("sparse", bad, ps, "F32", (10,))
        reason = Reason.DECODE_SIZE_MISMATCH if bad.get("count") == 3 else Reason.BAD_CODEC_PARAMS
        assert ei.value.reason is reason, bad


def test_decode_part_dtype_and_size_validation() -> None:
    params, (i, v) = stored([1, 2])
    with pytest.raises(CodecError) as ei:
        decode("sparse", params, [i.astype(np.int64), v], "F32", (10,))
    assert ei.value.reason is Reason.BAD_DTYPE
    with pytest.raises(CodecError) as ei:
        decode("sparse", params, [i, v[:1]], "F32", (10,))
    assert ei.value.reason is Reason.DECODE_SIZE_MISMATCH
    with pytest.raises(CodecError) as ei:
        decode("sparse", params, [i], "F32", (10,))
    assert ei.value.reason is Reason.BAD_CODEC_PARAMS
    with pytest.raises(CodecError) as ei:
        sparse_entries(params, [i, v.astype(">f4")], 10)
    assert ei.value.reason is Reason.BAD_DTYPE
    with pytest.raises(CodecError) as ei:
        sparse_entries(params, [i, v[:1]], 10)
    assert ei.value.reason is Reason.DECODE_SIZE_MISMATCH
    with pytest.raises(CodecError) as ei:
        sparse_entries(params, [i, v], -3)
    assert ei.value.reason is Reason.INVALID_ARGUMENT


def test_bool_values_must_be_0_or_1() -> None:
    params = {"count": 1, "index_dtype": "I32", "delta": True}
    ps = [np.array([0], np.int32), np.array([3], np.uint8).view(np.bool_)]
    with pytest.raises(CodecError) as ei:
        decode("sparse", params, ps, "BOOL", (2,))
    assert ei.value.reason is Reason.BAD_CODEC_PARAMS


@settings(max_examples=examples(60), deadline=None)
@given(
    numel=st.integers(0, 300),
    data=st.data(),
    delta=st.booleans(),
)
def test_encode_sparse_round_trip_property(numel: int, data: st.DataObject, delta: bool) -> None:
    idx = data.draw(st.lists(st.integers(0, max(numel - 1, 0)), unique=True, max_size=numel))
    vals = np.arange(1, len(idx) + 1, dtype=np.int64)
    enc = encode_sparse(np.array(idx, np.int64), vals, numel, "I64", delta=delta)
    dense = decode("sparse", enc.params, parts(enc), "I64", (numel,))
    expected = np.zeros(numel, np.int64)
    expected[idx] = vals
    assert dense.tolist() == expected.tolist()
    got_idx, got_vals = sparse_entries(enc.params, parts(enc), numel)
    assert sorted(zip(got_idx.tolist(), got_vals.tolist())) == sorted(zip(idx, vals.tolist()))
