"""q8: layout, the error bound, bit-reproducible decode, validation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lowdiff_store.codecs import decode, encode
from lowdiff_store.errors import CodecError, Reason
from lowdiff_store.format.dtypes import bf16_to_f32, f32_to_bf16

from .profile import examples

FLOATS = ["F64", "F32", "F16", "BF16"]


def parts(enc) -> list[np.ndarray]:
    out = []
    for p in enc.parts:
        a = p.data.copy()
        a.setflags(write=False)
        out.append(a)
    return out


def to_tag(x64: np.ndarray, tag: str) -> np.ndarray:
    if tag == "BF16":
        return f32_to_bf16(x64.astype(np.float32))
    return x64.astype({"F64": np.float64, "F32": np.float32, "F16": np.float16}[tag])


def widen(a: np.ndarray, tag: str) -> np.ndarray:
    return (bf16_to_f32(a) if tag == "BF16" else a).astype(np.float64)


def ulp(v: np.ndarray, tag: str) -> np.ndarray:
    """One unit in the last place of ``tag`` at |v| (v float64)."""
    v = np.abs(v)
    if tag == "F64":
        return np.spacing(v)
    if tag == "F16":
        return np.spacing(v.astype(np.float16)).astype(np.float64)
    sp = np.spacing(v.astype(np.float32)).astype(np.float64)
    return sp * 65536 if tag == "BF16" else sp


def varied(rng: np.random.Generator, n: int, block: int) -> np.ndarray:
    """Normal values with a different magnitude per block, some zero blocks."""
    mags = 10.0 ** rng.uniform(-6, 4, size=-(-n // block))
    mags[rng.random(mags.size) < 0.1] = 0.0
    return rng.standard_normal(n) * np.repeat(mags, block)[:n]


def test_worked_example() -> None:
    x = np.array([1.0, -0.5, 0.25, 127.0, 2.5, 3.5], np.float32)
    enc = encode("q8", x, "F32", block=6)
    assert enc.params == {"block": 6}
    assert [p.dtype for p in enc.parts] == ["I8", "F32"]
    assert enc.parts[0].data.tolist() == [1, 0, 0, 127, 2, 4]  # ties to even
    assert enc.parts[1].data.tolist() == [1.0]
    # The bytes of format_spec/codecs.md, "Worked examples".
    assert enc.parts[0].data.tobytes() == bytes.fromhex("0100007f0204")
    assert enc.parts[1].data.tobytes() == bytes.fromhex("0000803f")
    out = decode("q8", enc.params, parts(enc), "F32", (2, 3))
    assert out.reshape(-1).tolist() == [1.0, 0.0, 0.0, 127.0, 2.0, 4.0]


def test_blocks_zero_block_and_short_tail() -> None:
    x = np.concatenate([[254.0, -127.0, 1.0, 0.0], np.zeros(4), [0.5, -1.0]]).astype(np.float32)
    enc = encode("q8", x, "F32", block=4)
    q, s = (p.data for p in enc.parts)
    assert s[:2].tolist() == [2.0, 0.0]
    # float32(1/127) is below 1/127, so the scale is rounded up to the next float32.
    assert 127 * float(s[2]) >= 1.0 > 127 * float(np.nextafter(s[2], np.float32(0)))
    assert s[2] == np.nextafter(np.float32(1 / 127), np.float32(1))
    assert q.tolist() == [127, -64, 0, 0, 0, 0, 0, 0, 63, -127]
    out = decode("q8", enc.params, parts(enc), "F32", (10,))
    assert out[:8].tolist() == [254.0, -128.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_default_block_is_256() -> None:
    enc = encode("q8", np.ones(513, np.float32), "F32")
    assert enc.params == {"block": 256}
    assert enc.parts[1].data.size == 3


def assert_within_bound(x: np.ndarray, tag: str, enc, out: np.ndarray) -> None:
    """|x - dec| <= scale/2 + ulp_T; for non-F64, |x - q*scale| <= scale/2 exactly."""
    q, s = (p.data for p in enc.parts)
    block = enc.params["block"]
    scale = np.repeat(s.astype(np.float64), block)[: x.size]
    xs, ds = widen(x, tag).reshape(-1), widen(out, tag).reshape(-1)
    assert np.all(np.abs(q.astype(np.int64)) <= 127)
    bound = scale / 2 + ulp(np.maximum(np.abs(xs), np.abs(ds)), tag)
    assert np.all(np.abs(xs - ds) <= bound)
    if tag != "F64":
        # For float32-representable inputs the quantization step itself is exact:
        # q * s and x - q * s are exact in float64.
        assert np.all(np.abs(xs - q * scale) <= scale / 2)


@pytest.mark.parametrize("tag", FLOATS)
@pytest.mark.parametrize("block", [1, 7, 256])
def test_error_bound(tag: str, block: int) -> None:
    x = to_tag(varied(np.random.default_rng(6), 5000, block), tag)
    enc = encode("q8", x, tag, block=block)
    out = decode("q8", enc.params, parts(enc), tag, x.shape)
    assert_within_bound(x, tag, enc, out)


@settings(max_examples=examples(80), deadline=None)
@given(
    x=hnp.arrays(
        np.float32,
        st.integers(0, 300),
        elements=st.floats(-(2.0**126), 2.0**126, width=32, allow_subnormal=True),
    ),
    block=st.integers(1, 64),
)
def test_quantization_bound_property(x: np.ndarray, block: int) -> None:
    enc = encode("q8", x, "F32", block=block)
    q, s = (p.data for p in enc.parts)
    scale = np.repeat(s.astype(np.float64), block)[: x.size]
    xs = x.astype(np.float64)
    amax = np.maximum.reduceat(np.abs(xs), np.arange(0, x.size, block)) if x.size else xs
    assert np.all(127 * s.astype(np.float64) >= amax)
    assert np.all(np.abs(xs - q * scale) <= scale / 2)
    out = decode("q8", enc.params, parts(enc), "F32", x.shape)
    assert np.all(np.abs(xs - out) <= scale / 2 + ulp(np.maximum(np.abs(xs), np.abs(out)), "F32"))


def test_subnormal_and_tiny_scales_round_up() -> None:
    x = np.array([1e-40, -3e-41, 0.0, 1e-45], np.float32)
    enc = encode("q8", x, "F32", block=4)
    q, s = (p.data for p in enc.parts)
    assert 127 * float(s[0]) >= 1e-40
    assert np.all(np.abs(x.astype(np.float64) - q * float(s[0])) <= float(s[0]) / 2)
    tiny = np.array([1e-300, -2e-300], np.float64)
    enc = encode("q8", tiny, "F64", block=2)
    assert enc.parts[1].data.tolist() == [np.float32(2.0**-149)]
    assert decode("q8", enc.params, parts(enc), "F64", (2,)).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("tag", FLOATS)
@pytest.mark.parametrize(("n", "block"), [(70_013, 256), (70_013, 1000), (131_073, 1), (5, 100)])
def test_decode_matches_the_reference_formula_bit_for_bit(tag: str, n: int, block: int) -> None:
    x = to_tag(varied(np.random.default_rng(7), n, block), tag)
    enc = encode("q8", x, tag, block=block)
    q, s = (p.data for p in enc.parts)
    wide = np.float64 if tag == "F64" else np.float32
    ref = q.astype(wide) * np.repeat(s.astype(wide), block)[:n]
    if tag == "F16":
        ref = ref.astype(np.float16)
    elif tag == "BF16":
        ref = f32_to_bf16(ref)
    out = decode("q8", enc.params, parts(enc), tag, (n,))
    again = decode("q8", enc.params, parts(enc), tag, (n,))
    assert out.dtype == ref.dtype
    assert out.tobytes() == ref.tobytes()
    assert again.tobytes() == out.tobytes()


def test_encode_reference_quotient_chunks() -> None:
    """Encoding in chunks gives the same q as one float64 division of the whole array."""
    x = varied(np.random.default_rng(8), 200_003, 300).astype(np.float32)
    enc = encode("q8", x, "F32", block=300)
    q, s = (p.data for p in enc.parts)
    div = np.repeat(np.where(s == 0, 1, s).astype(np.float64), 300)[: x.size]
    assert q.tolist() == np.rint(x / div).astype(np.int8).tolist()


@pytest.mark.parametrize("tag", FLOATS)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (2, 3, 4)])
def test_shapes(tag: str, shape: tuple[int, ...]) -> None:
    x = to_tag(np.asarray(np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) - 3), tag)
    enc = encode("q8", x, tag, block=5)
    out = decode("q8", enc.params, parts(enc), tag, shape)
    assert out.shape == shape
    assert out.dtype == x.dtype
    assert_within_bound(x, tag, enc, out)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 2.0**127])
def test_non_finite_or_huge_input_is_refused(bad: float) -> None:
    x = np.array([1.0, bad], np.float64)
    with pytest.raises(CodecError) as ei:
        encode("q8", x, "F64")
    assert ei.value.reason is Reason.INVALID_ARGUMENT


def test_largest_f32_inputs_decode_finite() -> None:
    x = np.array([np.nextafter(np.float32(2.0**127), np.float32(0)), -1.0], np.float32)
    enc = encode("q8", x, "F32")
    out = decode("q8", enc.params, parts(enc), "F32", (2,))
    assert np.isfinite(out).all()
    assert abs(float(out[0]) - float(x[0])) <= float(enc.parts[1].data[0]) / 2 + np.spacing(x[0])


@pytest.mark.parametrize("tag", ["I32", "U8", "BOOL", "F8_E4M3"])
def test_non_float_dtypes_are_refused(tag: str) -> None:
    from lowdiff_store.format.dtypes import storage_dtype

    with pytest.raises(CodecError) as ei:
        encode("q8", np.zeros(3, storage_dtype(tag)), tag)
    assert ei.value.reason is Reason.BAD_DTYPE
    with pytest.raises(CodecError) as ei:
        decode("q8", {"block": 4}, [np.zeros(3, np.int8), np.zeros(1, np.float32)], tag, (3,))
    assert ei.value.reason is Reason.BAD_DTYPE


@pytest.mark.parametrize("block", [0, -1, 2**31, True, 2.0, "4"])
def test_bad_block(block: object) -> None:
    with pytest.raises(CodecError) as ei:
        encode("q8", np.zeros(3, np.float32), "F32", block=block)
    assert ei.value.reason is Reason.BAD_CODEC_PARAMS
    with pytest.raises(CodecError) as ei:
        decode("q8", {"block": block}, [np.zeros(3, np.int8), np.zeros(1, np.float32)], "F32", (3,))
    assert ei.value.reason is Reason.BAD_CODEC_PARAMS


@pytest.mark.parametrize("scale", [-1.0, np.nan, np.inf, 2.0**122])
def test_bad_stored_scale(scale: float) -> None:
    ps = [np.ones(4, np.int8), np.array([1.0, scale], np.float32)]
    with pytest.raises(CodecError) as ei:
        decode("q8", {"block": 2}, ps, "F32", (4,))
    assert ei.value.reason is Reason.BAD_CODEC_PARAMS


def test_part_sizes_follow_block() -> None:
    with pytest.raises(CodecError) as ei:
        decode("q8", {"block": 2}, [np.ones(5, np.int8), np.ones(2, np.float32)], "F32", (5,))
    assert ei.value.reason is Reason.DECODE_SIZE_MISMATCH
    with pytest.raises(CodecError) as ei:
        decode("q8", {"block": 2}, [np.ones(4, np.int8), np.ones(2, np.float32)], "F32", (5,))
    assert ei.value.reason is Reason.DECODE_SIZE_MISMATCH


def test_largest_legal_scale_decodes_without_warnings() -> None:
    ps = [np.array([127, -127], np.int8), np.array([2.0**121], np.float32)]
    out = decode("q8", {"block": 2}, ps, "F16", (2,))
    assert np.isinf(out).all()
    out32 = decode("q8", {"block": 2}, ps, "F32", (2,))
    assert np.isfinite(out32).all()
