"""lcc: LC-Checkpoint's exponent buckets, priority promotion and canonical Huffman codes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lowdiff_store.codecs import decode, encode
from lowdiff_store.codecs._lcc import canonical_codes, huffman_lengths
from lowdiff_store.errors import CodecError, Reason
from lowdiff_store.format.dtypes import bf16_to_f32, f32_to_bf16

from .hostile import all_hostile, parts_of, ro
from .profile import examples

FLOATS = ["F64", "F32", "F16", "BF16"]


def reference_decode(enc, numel: int) -> np.ndarray:
    """Section "lcc" of the spec, bit by bit in Python: canonical codes read MSB first."""
    reps, lengths, _cbits, stream = (p.data for p in enc.parts)
    lengths = lengths.tolist()
    codes = canonical_codes(lengths)
    book = {(n, c): s for s, (n, c) in enumerate(zip(lengths, codes)) if n}
    bits = [(int(stream[i // 8]) >> (i % 8)) & 1 for i in range(enc.params["nbits"])]
    syms, pos = [], 0
    if not book:
        return np.zeros(numel)
    while len(syms) < numel:
        code, n = 0, 0
        while (n, code) not in book:
            code = code << 1 | bits[pos]
            pos += 1
            n += 1
        syms.append(book[(n, code)])
    assert pos == enc.params["nbits"]
    table = [0.0, *reps.astype(np.float64).tolist()]
    return np.array([table[s] for s in syms])


def test_worked_example() -> None:
    """format_spec/codecs.md, "Worked examples"."""
    x = np.array([0.3, -1.0, 0.6, 0.1, 0.0, -0.4, 2.0, 0.25], np.float32)
    enc = encode("lcc", x, "F32", bits=2)
    assert enc.params == {"symbols": 4, "chunk": 512, "nbits": 13}
    assert [p.dtype for p in enc.parts] == ["F32", "U8", "U32", "U8"]
    assert enc.parts[0].data.tolist() == [2.0, -1.0, np.float32(0.6)]  # buckets by exponent
    assert enc.parts[1].data.tolist() == [1, 3, 3, 2]  # symbol 0 (5 times) gets 1 bit
    assert enc.parts[2].data.tolist() == [13]
    # symbols 0 2 3 0 0 0 1 0; codes 0:"0" 3:"10" 1:"110" 2:"111"
    assert enc.parts[3].data.tobytes() == bytes([0x1E, 0x06])
    out = decode("lcc", enc.params, parts_of(enc), "F32", (8,))
    assert out.tolist() == [0.0, -1.0, np.float32(0.6), 0.0, 0.0, 0.0, 2.0, 0.0]


def test_huffman_helpers() -> None:
    assert huffman_lengths([5, 1, 1, 1]) == [1, 3, 3, 2]
    assert canonical_codes([1, 3, 3, 2]) == [0, 0b110, 0b111, 0b10]
    fib = [1, 1]
    while len(fib) < 40:
        fib.append(fib[-1] + fib[-2])
    lengths = huffman_lengths(fib)
    assert max(lengths) <= 15
    assert sum(2.0 ** -n for n in lengths) == 1.0
    assert huffman_lengths([0, 7, 0]) == [0, 0, 0]


def assert_in_buckets(x: np.ndarray, out: np.ndarray, bits: int) -> None:
    """The decode contract (codecs.md section 12): a kept element decodes to a value of its
    sign in its binade ``[2^e, 2^(e+1))`` (subnormals by their leading bit), the others to
    +0; the kept buckets are the ``2^bits - 1`` of largest exponent."""
    xw, ow = x.astype(np.float64), out.astype(np.float64)
    assert np.all(np.isfinite(ow))
    kept = ow != 0
    assert not np.any(np.signbit(ow[~kept]))  # a dropped element, or a zero, is +0
    assert np.all(np.signbit(ow[kept]) == np.signbit(xw[kept]))
    assert np.array_equal(np.frexp(ow[kept])[1], np.frexp(xw[kept])[1])
    assert np.all(np.abs(ow[kept] - xw[kept]) < np.abs(xw[kept]))
    exps = sorted({(int(e), bool(s)) for e, s in zip(np.frexp(xw[xw != 0])[1],
                                                       np.signbit(xw[xw != 0]))},
                  key=lambda b: (-b[0], b[1]))
    top = set(exps[: (1 << bits) - 1])
    want_kept = np.array([x_ != 0 and (int(np.frexp(x_)[1]), bool(np.signbit(x_))) in top
                          for x_ in xw.tolist()], bool)
    assert np.array_equal(kept, want_kept)


F32_EDGES = [0.0, -0.0, 2.0**-149, -(2.0**-149), 3 * 2.0**-149, 2.0**-127, -(2.0**-127),
             float(np.nextafter(np.float32(2.0**-126), np.float32(0))), 2.0**-126,
             float(np.finfo(np.float32).max), -float(np.finfo(np.float32).max),
             float(np.nextafter(np.finfo(np.float32).max, np.float32(0)))]


@settings(max_examples=examples(50), deadline=None)
@given(x=hnp.arrays(np.float32, st.integers(0, 400),
                    elements=st.one_of(
                        st.floats(-1e6, 1e6, width=32, allow_subnormal=True),
                        st.floats(width=32, allow_nan=False, allow_infinity=False),
                        st.sampled_from(F32_EDGES))),
       bits=st.integers(1, 8), chunk=st.integers(1, 64))
@example(x=np.array([4.344e-44, 1.4075e-41], np.float32), bits=1, chunk=1)  # issue 35
def test_matches_the_reference_decoder(x: np.ndarray, bits: int, chunk: int) -> None:
    enc = encode("lcc", x, "F32", bits=bits, chunk=chunk)
    out = decode("lcc", enc.params, parts_of(enc), "F32", x.shape)
    assert np.array_equal(out.astype(np.float64), reference_decode(enc, x.size))
    assert_in_buckets(x, out, bits)
    assert enc.parts[0].data.size <= (1 << bits) - 1


@settings(max_examples=examples(50), deadline=None)
@given(x=hnp.arrays(np.float64, st.integers(0, 300), elements=st.one_of(
           st.floats(allow_nan=False, allow_infinity=False, allow_subnormal=True),
           st.floats(-1e-300, 1e-300), st.sampled_from([0.0, -0.0, 5e-324, 1.7976931348623157e308,
                                                        -1.7976931348623157e308]))),
       tag=st.sampled_from(["F64", "F32", "F16", "BF16"]), bits=st.integers(1, 8))
@example(x=np.array([1.7976931348623157e308] * 3), tag="F64", bits=1)  # summed to inf
@example(x=np.array([5e-324, 1e-320]), tag="F64", bits=1)
def test_every_dtype_keeps_the_bucket_contract(x: np.ndarray, tag: str, bits: int) -> None:
    """F64 over its whole range, and F32, F16, BF16 from the same draws narrowed (those
    that overflow dropped): the contract of assert_in_buckets on the widened values."""
    with np.errstate(over="ignore", under="ignore"):
        if tag == "F64":
            arr = x
        elif tag == "BF16":
            arr = f32_to_bf16(x.astype(np.float32))
        else:
            arr = x.astype(np.float32 if tag == "F32" else np.float16)
    wide = (bf16_to_f32(arr) if tag == "BF16" else arr).astype(np.float64)
    finite = np.isfinite(wide)
    arr, wide = arr[finite], wide[finite]
    enc = encode("lcc", arr, tag, bits=bits)
    out = decode("lcc", enc.params, parts_of(enc), tag, arr.shape)
    got = (bf16_to_f32(out) if tag == "BF16" else out).astype(np.float64)
    assert_in_buckets(wide, got, bits)


def test_subnormals_bucket_by_their_leading_bit() -> None:
    """Issue 35: two subnormals 2^9 apart shared one bucket, decoded as 160x the smaller."""
    x = np.array([4.344e-44, 1.4075e-41], np.float32)
    enc = encode("lcc", x, "F32", bits=1, chunk=1)
    out = decode("lcc", enc.params, parts_of(enc), "F32", (2,))
    assert out.tolist() == [0.0, float(x[1])]  # one bucket kept: the larger binade
    enc = encode("lcc", x, "F32", bits=2, chunk=1)
    out = decode("lcc", enc.params, parts_of(enc), "F32", (2,))
    assert out.tolist() == [float(x[0]), float(x[1])]  # one element per binade: exact
    # every subnormal binade of float32 (2^-149 .. 2^-127), both signs, and the normals
    # beside them: 2^bits - 1 = 255 buckets keep them all, each element decodes to itself
    mags = [2.0**e for e in range(-149, -123)]
    y = np.array(mags + [-m for m in mags], np.float32)
    out = decode("lcc", *_enc_parts(y, "F32", bits=8), "F32", y.shape)
    assert out.tolist() == y.tolist()
    # 2^-127 and the largest subnormal share the binade 2^-127: their mean, rounded
    z = np.array([2.0**-127, 2.0**-126 - 2.0**-149, 2.0**-126], np.float32)
    out = decode("lcc", *_enc_parts(z, "F32", bits=2), "F32", z.shape)
    assert out.tolist() == [float(np.float32((z[0] + np.float64(z[1])) / 2))] * 2 + [2.0**-126]


def _enc_parts(x: np.ndarray, tag: str, **opts: int) -> tuple[dict, list[np.ndarray]]:
    enc = encode("lcc", x, tag, **opts)
    return dict(enc.params), parts_of(enc)


@pytest.mark.parametrize("tag", ["F32", "F64"])
def test_largest_finites_stay_finite(tag: str) -> None:
    """F64: the float64 sum of three largest finites overflowed, the representative became
    inf and the decoder refused what the encoder wrote."""
    t = np.float64 if tag == "F64" else np.float32
    big = np.finfo(t).max
    x = np.array([big, big, np.nextafter(big, t(0)), -big, -big, t(1.5)], t)
    out = decode("lcc", *_enc_parts(x, tag, bits=2), tag, x.shape)
    assert out.tolist() == [big, big, big, -big, -big, 1.5]
    assert_in_buckets(x, out, 2)
    out = decode("lcc", *_enc_parts(x, tag, bits=1), tag, x.shape)
    assert out.tolist() == [big, big, big, 0.0, 0.0, 0.0]


def test_f64_subnormals_and_zeros() -> None:
    x = np.array([-0.0, 0.0, 5e-324, 1e-320, -1e-310, 2.2250738585072014e-308], np.float64)
    out = decode("lcc", *_enc_parts(x, "F64", bits=4), "F64", x.shape)
    assert out.tolist() == [0.0, 0.0, 5e-324, 1e-320, -1e-310, 2.2250738585072014e-308]
    assert not np.signbit(out[0])  # -0.0 is symbol 0: decodes as +0
    out = decode("lcc", *_enc_parts(x[:4], "F64", bits=1), "F64", (4,))
    assert out.tolist() == [0.0, 0.0, 0.0, 1e-320]


@pytest.mark.parametrize("tag", ["F16", "BF16"])
def test_narrow_dtypes_keep_the_bucket(tag: str) -> None:
    """F16 and BF16 subnormals, largest finites and zeros: the float32 representative
    narrowed to the dtype stays in the element's binade."""
    if tag == "F16":
        x = np.array([2.0**-24, 3 * 2.0**-24, 2.0**-15, 65504.0, 65472.0, -65504.0, -0.0,
                      6.1e-5], np.float16)
        wide = x.astype(np.float64)
    else:
        # 2^-133 (the least), 3 * 2^-133, 2^-127, the largest finite, -2^-130, -0, 2^127
        x = np.array([0x0001, 0x0003, 0x0040, 0x7F7F, 0x8008, 0x8000, 0x7F00], np.uint16)
        wide = bf16_to_f32(x).astype(np.float64)
    out = decode("lcc", *_enc_parts(x, tag, bits=8), tag, x.shape)
    got = (bf16_to_f32(out) if tag == "BF16" else out).astype(np.float64)
    assert_in_buckets(wide, got, 8)


@pytest.mark.parametrize("tag", FLOATS)
def test_dtypes(tag: str) -> None:
    rng = np.random.default_rng(0)
    x32 = (rng.standard_normal(3000) * 1e-3).astype(np.float32)
    arr = f32_to_bf16(x32) if tag == "BF16" else x32.astype(
        {"F64": np.float64, "F32": np.float32, "F16": np.float16}.get(tag, np.float32))
    enc = encode("lcc", arr.reshape(30, 100), tag, bits=4)
    assert enc.parts[0].dtype == ("F64" if tag == "F64" else "F32")
    out = decode("lcc", enc.params, parts_of(enc), tag, (30, 100))
    ref = reference_decode(enc, 3000)
    if tag == "BF16":
        assert np.array_equal(out.reshape(-1), f32_to_bf16(ref.astype(np.float32)))
        got = bf16_to_f32(out).astype(np.float64)
    else:
        assert np.array_equal(out.reshape(-1), ref.astype(out.dtype))
        got = out.astype(np.float64)
    assert float(np.max(np.abs(got.reshape(-1) - x32))) <= float(np.max(np.abs(x32)))


def test_special_cases() -> None:
    z = encode("lcc", np.zeros(1000, np.float32), "F32")
    assert z.params["nbits"] == 0
    assert z.params["symbols"] == 1
    assert decode("lcc", z.params, parts_of(z), "F32", (1000,)).tolist() == [0.0] * 1000
    one = encode("lcc", np.full(100, 0.75, np.float32), "F32")  # one bucket: 1 bit each
    assert one.params["nbits"] == 100
    assert decode("lcc", one.params, parts_of(one), "F32", (100,)).tolist() == [0.75] * 100
    e0 = encode("lcc", np.zeros((0, 4), np.float32), "F32")
    assert decode("lcc", e0.params, parts_of(e0), "F32", (0, 4)).shape == (0, 4)
    big = np.array([2.0**100, -(2.0**-1060), 1e-300], np.float64)
    e64 = encode("lcc", big, "F64", bits=2)
    assert decode("lcc", e64.params, parts_of(e64), "F64", (3,)).tolist() == big.tolist()


def test_encoder_refusals() -> None:
    for opt in ({"bits": 0}, {"bits": 9}, {"bits": True}, {"chunk": 0}, {"chunk": 2**31}):
        with pytest.raises(CodecError) as ei:
            encode("lcc", np.ones(4, np.float32), "F32", **opt)
        assert ei.value.reason is Reason.BAD_CODEC_PARAMS
    with pytest.raises(CodecError) as ei:
        encode("lcc", np.array([np.inf], np.float32), "F32")
    assert ei.value.reason is Reason.INVALID_ARGUMENT


def test_decoder_refusals() -> None:
    x = np.array([0.3, -1.0, 0.6, 0.1, 0.0, -0.4, 2.0, 0.25], np.float32)
    enc = encode("lcc", x, "F32", bits=2)
    reps, lengths, cbits, stream = parts_of(enc)

    def refused(params=enc.params, parts=(reps, lengths, cbits, stream)) -> None:
        with pytest.raises(CodecError) as ei:
            decode("lcc", params, list(parts), "F32", (8,))
        assert ei.value.reason is Reason.BAD_CODEC_PARAMS

    for bad in ([1, 3, 3, 3], [1, 2, 3, 2], [16, 1, 0, 0], [0, 0, 0, 1]):  # not complete; >15
        refused(parts=(reps, ro(np.array(bad, np.uint8)), cbits, stream))
    refused(parts=(ro(np.array([1.0, np.nan, 2.0], np.float32)), lengths, cbits, stream))
    refused(parts=(reps, lengths, cbits, ro(np.array([0x1E, 0x26], np.uint8))))  # padding
    # a desynchronised stream: the first symbol becomes "110", so the chunk ends elsewhere
    refused(parts=(reps, lengths, cbits, ro(np.array([0x1B, 0x06], np.uint8))))
    refused(params={**enc.params, "nbits": 8 * 15 + 1})


def test_multi_chunk_desync_is_caught() -> None:
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(5000) * 1e-2).astype(np.float32)
    enc = encode("lcc", x, "F32", chunk=100)
    reps, lengths, cbits, stream = parts_of(enc)
    moved = cbits.copy()
    moved[3] += 1
    moved[4] -= 1
    with pytest.raises(CodecError) as ei:
        decode("lcc", enc.params, [reps, lengths, ro(moved), stream], "F32", (5000,))
    assert ei.value.reason is Reason.BAD_CODEC_PARAMS


def test_hostile_payloads() -> None:
    rng = np.random.default_rng(9)
    x = (rng.standard_normal(3000) * 1e-3).astype(np.float32)
    enc = encode("lcc", x, "F32", chunk=256)
    seen = all_hostile("lcc", dict(enc.params), parts_of(enc), "F32", (3000,))
    assert "bad_codec_params" in seen


@pytest.mark.parametrize(("n", "chunk"), [(100_001, None), (20_000, 777), (20_001, 1000),
                                          (20_000, 20_000), (19_999, 40_000)])
def test_two_symbol_steps_match_one_symbol_steps(n: int, chunk: int | None,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Large tensors decode two codes per step; odd chunks and a short last chunk finish
    with one-code steps. Both paths give the same symbols."""
    from lowdiff_store.codecs import _lcc

    x = (np.random.default_rng(n).standard_normal(n) * 1e-3).astype(np.float32)
    enc = encode("lcc", x, "F32", bits=3, chunk=chunk)
    assert 2 * int(enc.parts[1].data.max()) <= _lcc._PAIR_BITS
    assert n >= 4 << (2 * int(enc.parts[1].data.max()))  # the pair path is taken
    paired = decode("lcc", enc.params, parts_of(enc), "F32", (n,))
    monkeypatch.setattr(_lcc, "_PAIR_BITS", 0)
    single = decode("lcc", enc.params, parts_of(enc), "F32", (n,))
    assert np.array_equal(paired, single)
    reps = enc.parts[0].data
    assert set(np.unique(paired).tolist()) <= {0.0, *reps.tolist()}
