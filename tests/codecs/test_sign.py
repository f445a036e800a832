"""sign: 1 bit per element plus an optional float32 scale (DeMo's sign message)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowdiff_store.codecs import decode, encode, encode_signs
from lowdiff_store.errors import CodecError, Reason
from lowdiff_store.format.dtypes import bf16_to_f32, f32_to_bf16

from .hostile import all_hostile, parts_of, ro
from .profile import examples

FLOATS = ["F64", "F32", "F16", "BF16"]


def test_worked_example() -> None:
    """format_spec/codecs.md, "Worked examples"."""
    neg = np.array([False, True, True, False, False, False, False, False, True, False])
    enc = encode_signs(neg, "F32", scale=0.25)
    assert enc.params == {"scaled": True}
    assert [p.dtype for p in enc.parts] == ["U8", "F32"]
    assert enc.parts[0].data.tobytes() == bytes([0x06, 0x01])
    assert enc.parts[1].data.tobytes() == bytes.fromhex("0000803e")
    out = decode("sign", enc.params, parts_of(enc), "F32", (10,))
    assert out.tolist() == [0.25, -0.25, -0.25, 0.25, 0.25, 0.25, 0.25, 0.25, -0.25, 0.25]
    e1 = encode_signs(neg[:3], "BF16")
    assert e1.params == {"scaled": False}
    assert e1.parts[1].data.size == 0
    assert decode("sign", e1.params, parts_of(e1), "BF16", (3,)).tolist() == [
        0x3F80, 0xBF80, 0xBF80]


@settings(max_examples=examples(60), deadline=None)
@given(n=st.integers(0, 300), seed=st.integers(0, 2**32 - 1), tag=st.sampled_from(FLOATS),
       scaled=st.booleans())
def test_round_trip(n: int, seed: int, tag: str, scaled: bool) -> None:
    rng = np.random.default_rng(seed)
    neg = rng.random(n) < 0.5
    scale = float(rng.random() * 10.0 ** rng.integers(-30, 30)) if scaled else None
    enc = encode_signs(neg.reshape(n, 1), tag, scale=scale)
    out = decode("sign", enc.params, parts_of(enc), tag, (n, 1)).reshape(-1)
    s32 = np.float32(1.0 if scale is None else scale)
    want = np.where(neg, -s32, s32).astype(np.float32)
    if tag == "BF16":
        assert np.array_equal(out, f32_to_bf16(want))
    elif tag == "F16":
        with np.errstate(over="ignore"):
            assert np.array_equal(out, want.astype(np.float16))
    else:
        assert np.array_equal(out, want.astype(out.dtype))


@pytest.mark.parametrize("tag", FLOATS)
def test_dense_encode(tag: str) -> None:
    x = np.array([0.5, -1.5, -0.0, 2.0], np.float32)
    arr = f32_to_bf16(x) if tag == "BF16" else x.astype(
        {"F64": np.float64, "F32": np.float32, "F16": np.float16}.get(tag, np.float32))
    enc = encode("sign", arr, tag)
    out = decode("sign", enc.params, parts_of(enc), tag, (4,))
    got = (bf16_to_f32(out) if tag == "BF16" else out).astype(np.float64)
    assert got.tolist() == [1.0, -1.0, -1.0, 1.0]  # -0.0 has its sign bit set
    enc = encode("sign", arr, tag, scale=False)
    assert enc.parts[1].data.size == 0
    with pytest.raises(CodecError) as ei:
        encode("sign", np.array([np.inf], np.float32), "F32")
    assert ei.value.reason is Reason.INVALID_ARGUMENT
    with pytest.raises(CodecError) as ei:
        encode("sign", arr, tag, scale=1)
    assert ei.value.reason is Reason.BAD_CODEC_PARAMS


@pytest.mark.parametrize("tag", FLOATS)
def test_scale_at_the_largest_finites(tag: str) -> None:
    """The scale is mean |x| rounded to float32: at the largest finites of F32, F16 and BF16
    it is finite; F64 input whose mean is past float32's range is refused (invalid_argument,
    not the decoder's bad_codec_params for an inf scale the writer made)."""
    big = {"F64": 1.7976931348623157e308, "F32": float(np.finfo(np.float32).max),
           "F16": 65504.0, "BF16": float(bf16_to_f32(np.array([0x7F7F], np.uint16))[0])}[tag]
    x64 = np.array([big, -big, big, -0.0])
    arr = {"F64": lambda: x64, "F32": lambda: x64.astype(np.float32),
           "F16": lambda: x64.astype(np.float16),
           "BF16": lambda: f32_to_bf16(x64.astype(np.float32))}[tag]()
    if tag == "F64":
        for x in (x64, np.array([1e300, 1e300]), np.array([4e38, 3.5e38])):
            with pytest.raises(CodecError) as ei:
                encode("sign", x, "F64")
            assert ei.value.reason is Reason.INVALID_ARGUMENT
            assert "float32" in str(ei.value)
        ok = np.array([3.4e38, -3.4e38])  # mean 3.4e38 rounds to a float32
        enc = encode("sign", ok, "F64")
        out = decode("sign", enc.params, parts_of(enc), "F64", (2,))
        assert out.tolist() == [float(np.float32(3.4e38)), -float(np.float32(3.4e38))]
        return
    enc = encode("sign", arr, tag)
    out = decode("sign", enc.params, parts_of(enc), tag, (4,))
    got = (bf16_to_f32(out) if tag == "BF16" else out).astype(np.float64)
    s = float(np.float32(0.75 * big))
    want = np.array([s, -s, s, -s])
    if tag == "F16":
        want = want.astype(np.float16).astype(np.float64)
    elif tag == "BF16":
        want = bf16_to_f32(f32_to_bf16(want.astype(np.float32))).astype(np.float64)
    assert got.tolist() == want.tolist()


def test_decoder_refusals() -> None:
    enc = encode_signs(np.array([True, False, True]), "F32", scale=2.0)
    p = parts_of(enc)
    with pytest.raises(CodecError) as ei:
        decode("sign", enc.params, [ro(np.array([0x0D], np.uint8)), p[1]], "F32", (3,))
    assert ei.value.reason is Reason.BAD_CODEC_PARAMS  # a padding bit
    for s in (np.nan, -np.inf, -2.0):
        with pytest.raises(CodecError) as ei:
            decode("sign", enc.params, [p[0], ro(np.array([s], np.float32))], "F32", (3,))
        assert ei.value.reason is Reason.BAD_CODEC_PARAMS
    with pytest.raises(CodecError) as ei:
        decode("sign", {"scaled": False}, p, "F32", (3,))
    assert ei.value.reason is Reason.DECODE_SIZE_MISMATCH
    with pytest.raises(CodecError) as ei:
        encode_signs(np.array([1, 0]), "F32")
    assert ei.value.reason is Reason.BAD_DTYPE
    with pytest.raises(CodecError) as ei:
        encode_signs(np.array([True]), "F32", scale=-1.0)
    assert ei.value.reason is Reason.BAD_CODEC_PARAMS


def test_hostile_payloads() -> None:
    x = np.random.default_rng(4).standard_normal(1001).astype(np.float32)
    enc = encode("sign", x, "F32")
    seen = all_hostile("sign", dict(enc.params), parts_of(enc), "F32", (1001,))
    assert None in seen
