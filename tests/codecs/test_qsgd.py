"""qsgd: per-bucket float32 norm, sign and level packed in 1 + bit_length(s) bits."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowdiff_store.codecs import decode, encode, encode_qsgd
from lowdiff_store.errors import CodecError, Reason
from lowdiff_store.format.dtypes import f32_to_bf16

from .hostile import all_hostile, parts_of, ro
from .profile import examples

FLOATS = ["F64", "F32", "F16", "BF16"]


def reference(signed: np.ndarray, norms: np.ndarray, s: int, d: int) -> np.ndarray:
    """Section "qsgd" of the spec, element by element in Python floats (float64)."""
    out = []
    for i, v in enumerate(signed.tolist()):
        q = float(norms[i // d]) * abs(v) / s
        out.append(-q if v < 0 else q)
    return np.array(out, np.float64)


def test_worked_example() -> None:
    """format_spec/codecs.md, "Worked examples"."""
    signed = np.array([3, -1, 0, 2, -3], np.int64)
    enc = encode_qsgd(signed, np.array([1.5, 6.0], np.float32), "F32", levels=3, bucket=3)
    assert enc.params == {"levels": 3, "bucket": 3}
    assert [p.dtype for p in enc.parts] == ["F32", "U8"]
    # entries (level << 1 | sign), 3 bits each: 6, 3, 0, 4, 7
    assert enc.parts[1].data.tobytes() == bytes([0x1E, 0x78])
    out = decode("qsgd", enc.params, parts_of(enc), "F32", (5,))
    assert out.tolist() == [1.5, -0.5, 0.0, 4.0, -6.0]


@settings(max_examples=examples(60), deadline=None)
@given(n=st.integers(0, 300), d=st.integers(1, 80), s=st.sampled_from([1, 2, 3, 7, 8, 127,
       255, 256, 1000, 65535]), seed=st.integers(0, 2**32 - 1), tag=st.sampled_from(FLOATS))
def test_round_trip(n: int, d: int, s: int, seed: int, tag: str) -> None:
    rng = np.random.default_rng(seed)
    signed = rng.integers(-s, s + 1, n)
    norms = (rng.random(-(-n // d)) * 10.0 ** rng.integers(-20, 20)).astype(np.float32)
    enc = encode_qsgd(signed, norms, tag, levels=s, bucket=d)
    assert enc.parts[1].data.size == (n * (1 + s.bit_length()) + 7) // 8
    out = decode("qsgd", enc.params, parts_of(enc), tag, (n,))
    want = reference(signed, norms, s, d)
    if tag == "F64":
        assert np.array_equal(out, want)
    elif tag == "BF16":
        assert np.array_equal(out, f32_to_bf16(want.astype(np.float32)))
    else:
        with np.errstate(over="ignore"):
            assert np.array_equal(out, want.astype(np.float32).astype(out.dtype))


@pytest.mark.parametrize("seed", [None, 5])
def test_dense_encode(seed: int | None) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal(10_000).astype(np.float32)
    enc = encode("qsgd", x, "F32", levels=8, bucket=512, seed=seed)
    out = decode("qsgd", enc.params, parts_of(enc), "F32", x.shape).astype(np.float64)
    norms = np.repeat(enc.parts[0].data.astype(np.float64), 512)[: x.size]
    step = norms / 8
    bound = step / 2 if seed is None else step
    assert np.all(np.abs(out - x) <= bound * (1 + 1e-6))
    assert np.all(np.sign(out) * np.sign(x) >= 0)
    if seed is not None:  # unbiased: the mean error is small against the step
        assert abs(float((out - x).mean())) < float(step.mean()) * 0.02


def test_encoder_refusals() -> None:
    x = np.ones(4, np.float32)
    for bad in ({"levels": 0}, {"levels": 2**16}, {"levels": True}, {"levels": 2, "bucket": 0}):
        with pytest.raises(CodecError) as ei:
            encode("qsgd", x, "F32", **bad)
        assert ei.value.reason is Reason.BAD_CODEC_PARAMS
    with pytest.raises(CodecError) as ei:
        encode("qsgd", x, "F32")
    assert ei.value.reason is Reason.BAD_CODEC_PARAMS
    with pytest.raises(CodecError) as ei:
        encode("qsgd", np.array([np.nan], np.float32), "F32", levels=2)
    assert ei.value.reason is Reason.INVALID_ARGUMENT
    with pytest.raises(CodecError) as ei:
        encode_qsgd(np.array([3]), np.ones(1, np.float32), "F32", levels=2, bucket=1)
    assert ei.value.reason is Reason.INVALID_ARGUMENT


def test_decoder_refusals() -> None:
    enc = encode_qsgd(np.array([1, -2]), np.ones(1, np.float32), "F32", levels=2, bucket=2)
    p = parts_of(enc)  # 3-bit entries: 2, 5 -> 0b101_010 = 0x2A
    assert p[1].tolist() == [0x2A]
    for raw in (0x2E, 0x29, 0x6A):  # level 3 > s; sign on level 0 (entry 1); padding
        with pytest.raises(CodecError) as ei:
            decode("qsgd", enc.params, [p[0], ro(np.array([raw], np.uint8))], "F32", (2,))
        assert ei.value.reason is Reason.BAD_CODEC_PARAMS, hex(raw)
    with pytest.raises(CodecError) as ei:
        decode("qsgd", enc.params, [ro(np.array([np.nan], np.float32)), p[1]], "F32", (2,))
    assert ei.value.reason is Reason.BAD_CODEC_PARAMS


def test_hostile_payloads() -> None:
    x = np.random.default_rng(6).standard_normal(999).astype(np.float32)
    enc = encode("qsgd", x, "F32", levels=5, bucket=128)
    seen = all_hostile("qsgd", dict(enc.params), parts_of(enc), "F32", (999,))
    assert "bad_codec_params" in seen


def test_a_norm_past_float32_is_refused_without_a_warning() -> None:
    """F64 input whose bucket norm overflows float32 (here the squares overflow float64 as
    well): invalid_argument, and no RuntimeWarning on the way (tests turn them into errors)."""
    for x in (np.array([1e200, 1e200]), np.array([1.7976931348623157e308, 1.0]),
              np.array([3e38, 3e38])):
        with pytest.raises(CodecError) as ei:
            encode("qsgd", x, "F64", levels=3)
        assert ei.value.reason is Reason.INVALID_ARGUMENT
        assert "overflows float32" in str(ei.value)
    enc = encode("qsgd", np.array([3e38, 0.0]), "F64", levels=3)  # norm 3e38 fits
    assert enc.parts[0].data.tolist() == [np.float32(3e38)]
