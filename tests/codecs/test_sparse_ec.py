"""sparse_ec: entropy-coded sparse indices (Golomb-Rice or Elias-Fano), narrowed values."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowdiff_store.codecs import decode, encode, encode_sparse, sparse_entries
from lowdiff_store.errors import CodecError, Reason
from lowdiff_store.format.dtypes import STORAGE_DTYPE

from .hostile import all_hostile, parts_of, ro
from .profile import examples

TAGS = sorted(STORAGE_DTYPE)


def test_worked_example() -> None:
    """format_spec/codecs.md, "Worked examples": indices 2, 3, 9, 19 of 20."""
    idx = np.array([2, 3, 9, 19])
    vals = np.array([0.5, -1.0, 2.0, 0.1], np.float32)
    rice = encode_sparse(idx, vals, 20, "F32", coding="rice")
    assert rice.codec == "sparse_ec"
    assert rice.params == {"count": 4, "coding": "rice", "shift": 1, "hbits": 11,
                           "value_dtype": "F32"}
    # c = gaps - 1 = 2, 0, 5, 9 (shift 2 ties at 15 bits: the smaller shift wins)
    # low bits 0, 0, 1, 1; high parts 1, 0, 2, 4 -> ones at 1, 2, 5, 10
    assert rice.parts[0].data.tobytes() == bytes([0b1100])
    assert rice.parts[1].data.tobytes() == bytes([0b00100110, 0b100])
    ef = encode_sparse(idx, vals, 20, "F32", coding="ef")
    assert ef.params == {"count": 4, "coding": "ef", "shift": 2, "hbits": 8,
                         "value_dtype": "F32"}
    # low 2 bits 2, 3, 1, 3; high 0, 0, 2, 4 -> ones at 0, 1, 4, 7
    assert ef.parts[0].data.tobytes() == bytes([0b11_01_11_10])
    assert ef.parts[1].data.tobytes() == bytes([0b10010011])
    for enc in (rice, ef):
        out = decode("sparse_ec", enc.params, parts_of(enc), "F32", (4, 5))
        assert out.reshape(-1)[idx].tolist() == vals.tolist()
        assert np.count_nonzero(out) == 4
    half = encode_sparse(idx, np.array([0.5, -1.0, 2.0, 3.0], np.float32), 20, "F32",
                         coding="auto")
    assert half.params["value_dtype"] == "BF16"
    assert half.parts[2].data.tolist() == [0x3F00, 0xBF80, 0x4000, 0x4040]


@settings(max_examples=examples(80), deadline=None)
@given(numel=st.integers(0, 5000), density=st.floats(0, 1), seed=st.integers(0, 2**32 - 1),
       coding=st.sampled_from(["rice", "ef", "auto"]), tag=st.sampled_from(TAGS))
def test_round_trip_is_bit_exact(numel: int, density: float, seed: int, coding: str,
                                 tag: str) -> None:
    rng = np.random.default_rng(seed)
    dt = STORAGE_DTYPE[tag]
    k = int(numel * density)
    idx = rng.choice(numel, size=k, replace=False) if k else np.zeros(0, np.int64)
    raw = rng.integers(0, 256, size=(k, dt.itemsize), dtype=np.uint8)
    if tag == "BOOL":
        raw %= 2
    vals = raw.reshape(-1).view(dt)
    enc = encode_sparse(idx.astype(np.int32), vals, numel, tag, coding=coding)
    assert enc.params["coding"] in ("rice", "ef")
    out = decode("sparse_ec", enc.params, parts_of(enc), tag, (numel,))
    want = np.zeros(numel, dt)
    want[idx] = vals
    assert np.array_equal(out.view(np.uint8), want.view(np.uint8))
    got_i, got_v = sparse_entries(enc.params, parts_of(enc), numel, codec="sparse_ec",
                                  dtype=tag)
    order = np.argsort(idx)
    assert got_i.tolist() == idx[order].tolist()
    assert np.array_equal(got_v.view(np.uint8), vals[order].view(np.uint8))


@pytest.mark.parametrize("kind", ["bf16", "f16", "f32"])
def test_lossless_narrowing(kind: str) -> None:
    rng = np.random.default_rng(2)
    v = rng.standard_normal(500).astype(np.float32)
    if kind == "bf16":
        v = (v.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
        v[0] = np.float32(-0.0)
        v[1] = np.uint32(0x7FC12345 & 0xFFFF0000).view(np.float32)  # a NaN with payload
    elif kind == "f16":
        v = v.astype(np.float16).astype(np.float32)
        v[0] = np.inf
    idx = rng.choice(100_000, 500, replace=False)
    enc = encode_sparse(idx, v, 100_000, "F32", coding="auto")
    assert enc.params["value_dtype"] == {"bf16": "BF16", "f16": "F16", "f32": "F32"}[kind]
    out = decode("sparse_ec", enc.params, parts_of(enc), "F32", (100_000,))
    assert np.array_equal(out[idx].view(np.uint32), v.view(np.uint32))
    wide = encode_sparse(idx, v, 100_000, "F32", coding="auto", narrow=False)
    assert wide.params["value_dtype"] == "F32"


def test_top_1_percent_goal() -> None:
    """<= 0.65x the bytes of int32 indices + fp32 values at the same k (uniform positions,
    the hardest case for a gap coder: no clustering to exploit)."""
    rng = np.random.default_rng(0)
    g = rng.standard_normal(1_000_000).astype(np.float32)
    enc = encode("sparse_ec", g, "F32", k=10_000)
    plain = encode("sparse", g, "F32", k=10_000)
    assert plain.nbytes == 80_000
    assert enc.nbytes <= 0.65 * plain.nbytes
    assert np.array_equal(decode("sparse_ec", enc.params, parts_of(enc), "F32", g.shape),
                          decode("sparse", plain.params, parts_of(plain), "F32", g.shape))


def test_dense_lossless_and_refusals() -> None:
    x = np.array([0, 0, -0.0, 1.5, 0, np.nan], np.float32)
    enc = encode("sparse_ec", x, "F32")
    assert enc.params["count"] == 3
    assert np.array_equal(decode("sparse_ec", enc.params, parts_of(enc), "F32", (6,))
                          .view(np.uint32), x.view(np.uint32))
    with pytest.raises(CodecError) as ei:
        encode("sparse_ec", x, "F32", coding="huffman")
    assert ei.value.reason is Reason.BAD_CODEC_PARAMS
    with pytest.raises(CodecError) as ei:
        encode_sparse(np.array([1, 1]), np.ones(2, np.float32), 5, "F32", coding="rice")
    assert ei.value.reason is Reason.BAD_CODEC_PARAMS
    with pytest.raises(CodecError) as ei:
        encode_sparse(np.array([1]), np.ones(1, np.float32), 5, "F32", coding="ef",
                      delta=False)
    assert ei.value.reason is Reason.INVALID_ARGUMENT
    with pytest.raises(CodecError) as ei:
        sparse_entries(enc.params, parts_of(enc), 6, codec="sparse_ec")
    assert ei.value.reason is Reason.INVALID_ARGUMENT


def test_decoder_refusals() -> None:
    idx = np.array([2, 3, 9, 19])
    vals = np.arange(4, dtype=np.float32)
    ef = encode_sparse(idx, vals, 20, "F32", coding="ef")
    p = parts_of(ef)
    # low bits 2,3,1,3 -> make entry 1's low bits 1: index 1 < 2, not ascending
    bad_low = ro(np.array([0b11_01_01_10], np.uint8))
    with pytest.raises(CodecError) as ei:
        decode("sparse_ec", ef.params, [bad_low, p[1], p[2]], "F32", (20,))
    assert ei.value.reason is Reason.BAD_CODEC_PARAMS
    # index 19 -> 23 (high 5: ones at 0, 1, 4, 8) is out of range: hbits=9 is allowed
    with pytest.raises(CodecError) as ei:
        decode("sparse_ec", {**ef.params, "hbits": 9}, [p[0], ro(np.array([0x13, 0x01],
               np.uint8)), p[2]], "F32", (20,))
    assert ei.value.reason is Reason.BAD_CODEC_PARAMS
    rice = encode_sparse(idx, vals, 20, "F32", coding="rice")
    q = parts_of(rice)
    # three ones; five ones; last one before bit 10; a padding bit
    for high in ([0b00100110, 0], [0b00100111, 0b100], [0b10100110, 0], [0x26, 0x0C]):
        with pytest.raises(CodecError) as ei:
            decode("sparse_ec", rice.params, [q[0], ro(np.array(high, np.uint8)), q[2]],
                   "F32", (20,))
        assert ei.value.reason is Reason.BAD_CODEC_PARAMS, high
    with pytest.raises(CodecError) as ei:  # gaps sum past numel: ones at 1, 2, 5, 13
        decode("sparse_ec", {**rice.params, "hbits": 14}, [q[0], ro(np.array([0x26, 0x20],
               np.uint8)), q[2]], "F32", (20,))
    assert ei.value.reason is Reason.BAD_CODEC_PARAMS
    with pytest.raises(CodecError) as ei:  # hbits beyond count + (numel >> shift)
        decode("sparse_ec", {**rice.params, "hbits": 4 + 10 + 1}, q, "F32", (20,))
    assert ei.value.reason is Reason.BAD_CODEC_PARAMS
    with pytest.raises(CodecError) as ei:
        decode("sparse_ec", {**rice.params, "value_dtype": "BF16"}, q, "F16", (20,))
    assert ei.value.reason is Reason.BAD_CODEC_PARAMS
    nan16 = ro(np.array([0x7E00, 0, 0, 0], np.uint16).view(np.float16))
    with pytest.raises(CodecError) as ei:
        decode("sparse_ec", {**rice.params, "value_dtype": "F16"}, [q[0], q[1], nan16],
               "F32", (20,))
    assert ei.value.reason is Reason.BAD_CODEC_PARAMS


@pytest.mark.parametrize("coding", ["rice", "ef"])
def test_hostile_payloads(coding: str) -> None:
    rng = np.random.default_rng(8)
    g = rng.standard_normal(20_000).astype(np.float32)
    idx = np.sort(rng.choice(20_000, 300, replace=False))
    enc = encode_sparse(idx, g[idx], 20_000, "F32", coding=coding)
    seen = all_hostile("sparse_ec", dict(enc.params), parts_of(enc), "F32", (20_000,),
                       dense=False)
    assert "bad_codec_params" in seen
