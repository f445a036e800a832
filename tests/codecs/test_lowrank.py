"""lowrank: SVD encode, stored factors, the decode formula, validation."""

from __future__ import annotations

import numpy as np
import pytest

from lowdiff_store.codecs import decode, encode, encode_factors
from lowdiff_store.errors import CodecError, Reason
from lowdiff_store.format.dtypes import bf16_to_f32, f32_to_bf16

FLOATS = ["F64", "F32", "F16", "BF16"]


def parts(enc) -> list[np.ndarray]:
    out = []
    for p in enc.parts:
        a = p.data.copy()
        a.setflags(write=False)
        out.append(a)
    return out


def to_tag(x: np.ndarray, tag: str) -> np.ndarray:
    if tag == "BF16":
        return f32_to_bf16(x.astype(np.float32))
    return x.astype({"F64": np.float64, "F32": np.float32, "F16": np.float16}[tag])


def widen(a: np.ndarray, tag: str) -> np.ndarray:
    return (bf16_to_f32(a) if tag == "BF16" else a).astype(np.float64)


@pytest.mark.parametrize("tag", FLOATS)
@pytest.mark.parametrize("shape", [(40, 30), (12, 5, 6), (30, 40)])
def test_rank_r_input_is_reconstructed(tag: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(9)
    n, m = shape[0], int(np.prod(shape[1:]))
    x = to_tag((rng.standard_normal((n, 3)) @ rng.standard_normal((3, m))).reshape(shape), tag)
    enc = encode("lowrank", x, tag, rank=3)
    assert enc.params == {"rank": 3}
    p, q = enc.parts
    assert (p.dtype, q.dtype) == ("F32", "F32")
    assert (p.data.size, q.data.size) == (n * 3, m * 3)
    out = decode("lowrank", enc.params, parts(enc), tag, shape)
    assert out.shape == shape
    assert out.dtype == x.dtype
    tol = {"F64": 1e-5, "F32": 1e-5, "F16": 2e-3, "BF16": 1.6e-2}[tag]
    np.testing.assert_allclose(widen(out, tag), widen(x, tag), rtol=tol, atol=tol * 10)


def test_truncation_drops_the_smallest_singular_values() -> None:
    u, _ = np.linalg.qr(np.random.default_rng(10).standard_normal((20, 20)))
    x = (u[:, :3] * [10.0, 5.0, 0.01]) @ u[:, 3:6].T
    enc = encode("lowrank", x, "F64", rank=2)
    out = decode("lowrank", enc.params, parts(enc), "F64", x.shape)
    np.testing.assert_allclose(out, (u[:, :2] * [10.0, 5.0]) @ u[:, 3:5].T, atol=1e-5)
    assert np.abs(out - x).max() <= 0.011


def test_rank_is_clipped_to_the_matrix() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    enc = encode("lowrank", x, "F32", rank=10)
    assert enc.params == {"rank": 2}
    out = decode("lowrank", enc.params, parts(enc), "F32", (2, 3))
    np.testing.assert_allclose(out, x, atol=1e-5)


@pytest.mark.parametrize("shape", [(), (0,), (5,), (0, 4), (4, 0), (3, 2, 0)])
def test_degenerate_shapes(shape: tuple[int, ...]) -> None:
    x = np.full(shape, 2.5, np.float32)
    enc = encode("lowrank", x, "F32", rank=4)
    out = decode("lowrank", enc.params, parts(enc), "F32", shape)
    assert out.shape == shape
    np.testing.assert_allclose(out, x, atol=1e-6)


def test_rank_zero_decodes_to_zeros() -> None:
    enc = encode("lowrank", np.ones((3, 4), np.float32), "F32", rank=0)
    assert enc.params == {"rank": 0}
    assert [p.data.size for p in enc.parts] == [0, 0]
    assert decode("lowrank", enc.params, parts(enc), "F32", (3, 4)).tolist() == [[0.0] * 4] * 3


@pytest.mark.parametrize("tag", FLOATS)
def test_factors_are_stored_as_given_and_decode_is_p_qt(tag: str) -> None:
    rng = np.random.default_rng(11)
    p = rng.standard_normal((64, 4)).astype(np.float32)
    q = rng.standard_normal((3 * 5, 4)).astype(np.float32)
    enc = encode_factors(p, q, tag, (64, 3, 5))
    assert enc.params == {"rank": 4}
    assert enc.parts[0].data.tobytes() == p.tobytes()
    assert enc.parts[1].data.tobytes() == q.tobytes()
    out = decode("lowrank", enc.params, parts(enc), tag, (64, 3, 5))
    ref = (p @ q.T).reshape(64, 3, 5)
    ref = f32_to_bf16(ref) if tag == "BF16" else ref.astype(out.dtype)
    assert out.tobytes() == ref.tobytes()
    again = decode("lowrank", enc.params, parts(enc), tag, (64, 3, 5))
    assert again.tobytes() == out.tobytes()


def test_factors_of_a_strided_array_are_stored_c_order() -> None:
    p = np.arange(8, dtype=np.float32).reshape(2, 4).T  # (4, 2), Fortran order
    q = np.ones((3, 2), np.float32)
    enc = encode_factors(p, q, "F32", (4, 3))
    assert enc.parts[0].data.tolist() == p.reshape(-1).tolist()


def test_factor_validation() -> None:
    p, q = np.ones((4, 2), np.float32), np.ones((3, 2), np.float32)
    cases = [
        ((p.astype(np.float64), q, "F32", (4, 3)), Reason.BAD_DTYPE),
        ((p, q, "I32", (4, 3)), Reason.BAD_DTYPE),
        ((p, q[:, :1], "F32", (4, 3)), Reason.INVALID_ARGUMENT),
        ((p, q, "F32", (5, 3)), Reason.INVALID_ARGUMENT),
        ((p.reshape(-1), q, "F32", (4, 3)), Reason.INVALID_ARGUMENT),
        ((p, q, "F32", (4, -3)), Reason.BAD_CODEC_PARAMS),
    ]
    for args, reason in cases:
        with pytest.raises(CodecError) as ei:
            encode_factors(*args)
        assert ei.value.reason is reason, args


def test_encode_validation() -> None:
    x = np.ones((3, 4), np.float32)
    for rank in (-1, 1.5, True, None):
        with pytest.raises(CodecError) as ei:
            encode("lowrank", x, "F32", rank=rank)
        assert ei.value.reason is Reason.BAD_CODEC_PARAMS
    with pytest.raises(CodecError) as ei:
        encode("lowrank", x, "F32")
    assert ei.value.reason is Reason.BAD_CODEC_PARAMS
    x[1, 1] = np.nan
    with pytest.raises(CodecError) as ei:
        encode("lowrank", x, "F32", rank=1)
    assert ei.value.reason is Reason.INVALID_ARGUMENT
    with pytest.raises(CodecError) as ei:
        encode("lowrank", np.ones(3, np.int64), "I64", rank=1)
    assert ei.value.reason is Reason.BAD_DTYPE


def test_singular_values_past_float32_are_refused() -> None:
    """A finite matrix whose factors P = U S overflow float32 was stored with inf factors
    (decoding to inf and NaN) and numpy overflow warnings: now invalid_argument. Values
    that fit keep their factors."""
    top = float(np.finfo(np.float32).max)
    for x, tag in ((np.array([[top, top], [1.0, 2.0]], np.float32), "F32"),
                   (np.array([[1e300, 1.0], [1.0, 2.0]]), "F64"),
                   (np.array([[4e38, 0.0], [0.0, 1.0]]), "F64")):
        with pytest.raises(CodecError) as ei:
            encode("lowrank", x, tag, rank=1)
        assert ei.value.reason is Reason.INVALID_ARGUMENT
        assert "overflow float32" in str(ei.value)
    x = np.array([[3e38, 0.0], [0.0, 1.0]], np.float32)
    enc = encode("lowrank", x, "F32", rank=2)
    out = decode("lowrank", enc.params, [p.data for p in enc.parts], "F32", (2, 2))
    assert np.all(np.isfinite(out))
    assert abs(float(out[0, 0]) - 3e38) <= 3e38 * 1e-6  # (the 1.0 is below its precision)


def test_decode_validation() -> None:
    p, q = np.ones(8, np.float32), np.ones(6, np.float32)
    ok = decode("lowrank", {"rank": 2}, [p, q], "F32", (4, 3))
    assert ok.tolist() == [[2.0] * 3] * 4
    cases = [
        ({"rank": 3}, [p, q], "F32", Reason.DECODE_SIZE_MISMATCH),
        ({"rank": -1}, [p, q], "F32", Reason.BAD_CODEC_PARAMS),
        ({"rank": "2"}, [p, q], "F32", Reason.BAD_CODEC_PARAMS),
        ({}, [p, q], "F32", Reason.BAD_CODEC_PARAMS),
        ({"rank": 2}, [p], "F32", Reason.BAD_CODEC_PARAMS),
        ({"rank": 2}, [p.astype(np.float16), q], "F32", Reason.BAD_DTYPE),
        ({"rank": 2}, [p, q], "U8", Reason.BAD_DTYPE),
    ]
    for params, ps, tag, reason in cases:
        with pytest.raises(CodecError) as ei:
            decode("lowrank", params, ps, tag, (4, 3))
        assert ei.value.reason is reason, (params, tag)


@pytest.mark.parametrize("tag", FLOATS)
def test_non_finite_factors_decode_without_warnings(tag: str) -> None:
    """pytest turns warnings into errors: a RuntimeWarning here would escape decode."""
    p = np.array([np.inf, 0.0, 3e38, np.nan], np.float32)
    q = np.array([0.0, 1.0, 3e38, 1.0], np.float32)
    out = decode("lowrank", {"rank": 2}, [p, q], tag, (2, 2))
    assert out.shape == (2, 2)
    assert np.isnan(widen(out, tag)).sum() >= 2
