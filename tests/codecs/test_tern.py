"""tern: 2-bit ternary codes x float32 scales (TernGrad's message)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lowdiff_store.codecs import decode, encode, encode_ternary
from lowdiff_store.errors import CodecError, Reason
from lowdiff_store.format.dtypes import bf16_to_f32, f32_to_bf16

from .hostile import all_hostile, parts_of, ro
from .profile import examples

FLOATS = ["F64", "F32", "F16", "BF16"]


def test_worked_example() -> None:
    """format_spec/codecs.md, "Worked examples"."""
    codes = np.array([[1, 0, -1], [-1, 0, 1]], np.int8)
    enc = encode_ternary(codes, np.array([0.5, 2.0], np.float32), "F32", block=3)
    assert enc.codec == "tern"
    assert enc.params == {"block": 3}
    assert [p.dtype for p in enc.parts] == ["U8", "F32"]
    # codes 1,0,2,2 | 0,1 -> 0b10_10_00_01 = 0x A1, 0b01_00 = 0x04
    assert enc.parts[0].data.tobytes() == bytes([0xA1, 0x04])
    assert enc.parts[1].data.tobytes() == bytes.fromhex("0000003f00000040")
    out = decode("tern", enc.params, parts_of(enc), "F32", (2, 3))
    assert out.tolist() == [[0.5, 0.0, -0.5], [-2.0, 0.0, 2.0]]


@settings(max_examples=examples(60), deadline=None)
@given(
    n=st.integers(0, 300),
    block=st.integers(1, 70),
    seed=st.integers(0, 2**32 - 1),
    tag=st.sampled_from(FLOATS),
)
def test_precomputed_round_trip(n: int, block: int, seed: int, tag: str) -> None:
    rng = np.random.default_rng(seed)
    codes = rng.integers(-1, 2, n).astype(np.int8)
    scales = (rng.random(-(-n // block)) * 10.0 ** rng.integers(-30, 30)).astype(np.float32)
    enc = encode_ternary(codes, scales, tag, block=block)
    out = decode("tern", enc.params, parts_of(enc), tag, (n,))
    want = codes.astype(np.float32) * np.repeat(scales, block)[:n]
    if tag == "F64":
        assert np.array_equal(out, codes * np.repeat(scales.astype(np.float64), block)[:n])
    elif tag == "BF16":
        assert np.array_equal(out, f32_to_bf16(want))
    elif tag == "F16":
        with np.errstate(over="ignore"):
            assert np.array_equal(out, want.astype(np.float16))
    else:
        assert np.array_equal(out.view(np.uint32), want.view(np.uint32))


F32_MAX = float(np.finfo(np.float32).max)


@settings(max_examples=examples(40), deadline=None)
@given(x=hnp.arrays(np.float64, st.integers(0, 200), elements=st.one_of(
           st.floats(-2.0**100, 2.0**100, width=32),
           st.floats(width=32, allow_nan=False, allow_infinity=False),
           st.floats(allow_nan=False, allow_infinity=False, allow_subnormal=True))),
       block=st.integers(1, 64), tag=st.sampled_from(["F32", "F64"]))
@example(x=np.array([1.7976931348623157e308]), block=1, tag="F64")  # wrote an inf scale
@example(x=np.array([F32_MAX, -F32_MAX, 1.0]), block=2, tag="F32")
def test_nearest_encoding_error_bound(x: np.ndarray, block: int, tag: str) -> None:
    """Every float: |x - out| <= s / 2 <= |x|max / 2 per block. F64 input beyond the largest
    float32 (no float32 scale covers it) is refused with invalid_argument."""
    if tag == "F32":  # F64 draws narrowed to float32; those that overflow are dropped
        with np.errstate(over="ignore"):
            x = x.astype(np.float32).astype(np.float64)
        x = x[np.isfinite(x)]
    if tag == "F64" and x.size and float(np.abs(x).max()) > F32_MAX:
        with pytest.raises(CodecError) as ei:
            encode("tern", x, tag, block=block)
        assert ei.value.reason is Reason.INVALID_ARGUMENT
        assert "largest float32" in str(ei.value)
        return
    arr = x.astype(np.float32) if tag == "F32" else x
    enc = encode("tern", arr, tag, block=block)
    out = decode("tern", enc.params, parts_of(enc), tag, x.shape).astype(np.float64)
    s = np.repeat(enc.parts[1].data.astype(np.float64), block)[: x.size]
    assert np.all(np.isfinite(out))
    assert np.all(np.abs(x - out) <= s / 2)
    assert np.all(s >= np.abs(x))


def test_stochastic_rounding_is_unbiased_and_seeded() -> None:
    x = np.full(200_000, 0.25, np.float32)
    x[0] = 1.0
    e1 = encode("tern", x, "F32", seed=7)
    e2 = encode("tern", x, "F32", seed=7)
    assert [p.data.tobytes() for p in e1.parts] == [p.data.tobytes() for p in e2.parts]
    out = decode("tern", e1.params, parts_of(e1), "F32", x.shape)
    assert abs(float(out[1:].mean()) - 0.25) < 0.01
    assert set(np.unique(out).tolist()) <= {0.0, 1.0}


@pytest.mark.parametrize("tag", FLOATS)
def test_dtypes_and_shapes(tag: str) -> None:
    x = np.array([[0.5, -3.0], [1.75, 0.0]], np.float32)
    arr = f32_to_bf16(x) if tag == "BF16" else x.astype({"F64": np.float64, "F32": np.float32,
                                                         "F16": np.float16}.get(tag, np.float32))
    enc = encode("tern", arr, tag)
    out = decode("tern", enc.params, parts_of(enc), tag, (2, 2))
    got = bf16_to_f32(out) if tag == "BF16" else out
    assert got.astype(np.float64).tolist() == [[0.0, -3.0], [3.0, 0.0]]
    e0 = encode("tern", np.zeros((0, 3), np.float32), "F32")
    assert decode("tern", e0.params, parts_of(e0), "F32", (0, 3)).shape == (0, 3)
    es = encode("tern", np.float32(-2.0), "F32")
    assert decode("tern", es.params, parts_of(es), "F32", ()).tolist() == -2.0


def test_encoder_refusals() -> None:
    with pytest.raises(CodecError) as ei:
        encode("tern", np.array([1.0, np.nan], np.float32), "F32")
    assert ei.value.reason is Reason.INVALID_ARGUMENT
    with pytest.raises(CodecError) as ei:
        encode("tern", np.zeros(3, np.int32), "I32")
    assert ei.value.reason is Reason.BAD_DTYPE
    for bad in (0, True, 1.0):
        with pytest.raises(CodecError) as ei:
            encode("tern", np.zeros(3, np.float32), "F32", block=bad)
        assert ei.value.reason is Reason.BAD_CODEC_PARAMS
    with pytest.raises(CodecError) as ei:
        encode_ternary(np.array([2], np.int8), np.ones(1, np.float32), "F32", block=1)
    assert ei.value.reason is Reason.INVALID_ARGUMENT
    with pytest.raises(CodecError) as ei:
        encode_ternary(np.array([1], np.int8), np.ones(2, np.float32), "F32", block=1)
    assert ei.value.reason is Reason.INVALID_ARGUMENT
    with pytest.raises(CodecError) as ei:
        encode_ternary(np.array([1], np.int8), -np.ones(1, np.float32), "F32", block=1)
    assert ei.value.reason is Reason.BAD_CODEC_PARAMS


def test_decoder_refuses_code_3_bad_scales_and_padding() -> None:
    enc = encode_ternary(np.array([1, -1, 0, 1, 1], np.int8), np.ones(2, np.float32),
                         "F32", block=3)
    p = parts_of(enc)
    for bad_codes in (np.array([0xC0 | p[0][0], p[0][1]], np.uint8),  # code 3
                      np.array([p[0][0], p[0][1] | 0x10], np.uint8)):  # padding bit
        with pytest.raises(CodecError) as ei:
            decode("tern", enc.params, [ro(bad_codes), p[1]], "F32", (5,))
        assert ei.value.reason is Reason.BAD_CODEC_PARAMS
    for s in (np.nan, np.inf, -1.0):
        with pytest.raises(CodecError) as ei:
            decode("tern", enc.params, [p[0], ro(np.array([1.0, s], np.float32))], "F32",
                   (5,))
        assert ei.value.reason is Reason.BAD_CODEC_PARAMS


def test_hostile_payloads() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal(1000).astype(np.float32)
    enc = encode("tern", x, "F32", block=100)
    seen = all_hostile("tern", dict(enc.params), parts_of(enc), "F32", (1000,))
    assert "bad_codec_params" in seen
    assert None in seen
