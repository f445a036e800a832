"""The public surface: dispatch, containers, one test per reason code, fuzzing decode."""

from __future__ import annotations

import subprocess
import sys

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lowdiff_store.codecs import (
    CODECS,
    Encoded,
    Part,
    decode,
    encode,
    encode_factors,
    encode_sparse,
    sparse_entries,
)
from lowdiff_store.errors import CodecError, LowdiffError, Reason
from lowdiff_store.format.dtypes import STORAGE_DTYPE, f32_to_bf16

from .profile import examples

TAGS = sorted(STORAGE_DTYPE)
FLOATS = ["F64", "F32", "F16", "BF16"]


def sample(tag: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 3
    x[rng.random(shape) < 0.5] = 0
    if tag == "BF16":
        return f32_to_bf16(np.asarray(x, np.float32))
    if tag.startswith("F8"):
        return np.asarray(np.abs(x) * 10, np.uint8)
    return np.asarray(x).astype(STORAGE_DTYPE[tag])


def encodings(tag: str, shape: tuple[int, ...]) -> list[tuple[Encoded, np.ndarray | None]]:
    """Every codec that accepts ``tag``, with the ref it needs."""
    x, ref = sample(tag, shape, 1), sample(tag, shape, 2)
    out: list[tuple[Encoded, np.ndarray | None]] = [
        (encode("raw", x, tag), None),
        (encode("sparse", x, tag), None),
        (encode("sparse", x, tag, delta=False), None),
        (encode("xor", x, tag, ref=ref), ref),
        (encode("sparse_ec", x, tag), None),
    ]
    if tag in FLOATS:
        out += [(encode("q8", x, tag, block=3), None), (encode("lowrank", x, tag, rank=2), None),
                (encode("tern", x, tag, block=3), None),
                (encode("qsgd", x, tag, levels=5, bucket=4), None),
                (encode("sign", x, tag), None), (encode("lcc", x, tag), None)]
    return out


def test_codec_names() -> None:
    assert frozenset({"raw", "sparse", "xor", "q8", "lowrank", "tern", "qsgd", "sign",
                      "sparse_ec", "lcc"}) == CODECS


@pytest.mark.parametrize("tag", TAGS)
def test_encodings_are_well_formed_and_survive_msgpack(tag: str) -> None:
    for enc, ref in encodings(tag, (4, 5)):
        assert enc.codec in CODECS
        for p in enc.parts:
            assert p.data.ndim == 1
            assert p.data.flags.c_contiguous
            assert p.data.dtype == STORAGE_DTYPE[p.dtype]
            assert p.data.dtype.byteorder in "<|="
        assert enc.nbytes == sum(p.data.nbytes for p in enc.parts)
        params = msgpack.unpackb(msgpack.packb(enc.params, strict_types=True))
        assert params == enc.params
        stored = [np.frombuffer(p.data.tobytes(), STORAGE_DTYPE[p.dtype]) for p in enc.parts]
        out = decode(enc.codec, params, stored, tag, [4, 5], ref=ref)  # shape as msgpack gives it
        assert out.shape == (4, 5)
        assert out.dtype == STORAGE_DTYPE[tag]


def test_lossless_codecs_agree_bit_for_bit() -> None:
    x = sample("F32", (6, 7), 3)
    x.reshape(-1)[[0, 5]] = np.array([0x7FC0BEEF, 0x80000000], np.uint32).view(np.float32)
    for enc, ref in encodings("F32", (6, 7))[:4]:
        if enc.codec == "xor":
            enc = encode("xor", x, "F32", ref=ref)
        else:
            enc = encode(
                enc.codec, x, "F32", **({"delta": enc.params["delta"]} if enc.params else {})
            )
        out = decode(enc.codec, enc.params, [p.data for p in enc.parts], "F32", (6, 7), ref=ref)
        assert out.view(np.uint32).tolist() == x.view(np.uint32).tolist(), enc.codec


def test_part_checks_its_invariants() -> None:
    Part("F32", np.zeros(3, np.float32))
    for dtype, data in (
        ("F32", np.zeros(3, np.float64)),
        ("F32", np.zeros((3, 1), np.float32)),
        ("F32", np.zeros(6, np.float32)[::2]),
        ("F32", [0.0]),
    ):
        with pytest.raises(CodecError) as ei:
            Part(dtype, data)  # type: ignore[arg-type]
        assert ei.value.reason is Reason.INVALID_ARGUMENT
    with pytest.raises(CodecError) as ei:
        Part("F33", np.zeros(3, np.float32))
    assert ei.value.reason is Reason.BAD_DTYPE


def test_encode_accepts_numpy_scalars() -> None:
    enc = encode("raw", np.float32(2.5), "F32")
    assert decode("raw", {}, [enc.parts[0].data], "F32", ()).item() == 2.5


def test_codecs_do_not_import_torch() -> None:
    code = "import sys, lowdiff_store.codecs; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- one test per reason code the codecs raise -------------------------------------------


def test_reason_unknown_codec() -> None:
    for codec in ("zip", "", None, 3):
        with pytest.raises(CodecError) as ei:
            decode(codec, {}, [np.zeros(1, np.uint8)], "U8", (1,))  # type: ignore[arg-type]
        assert ei.value.reason is Reason.UNKNOWN_CODEC
    with pytest.raises(CodecError) as ei:
        encode("zip", np.zeros(1, np.uint8), "U8")
    assert ei.value.reason is Reason.UNKNOWN_CODEC


def test_reason_bad_codec_params() -> None:
    part = [np.zeros(4, np.float32)]
    for params in (None, [], {"x": 1}, {1: 2}):
        with pytest.raises(CodecError) as ei:
            decode("raw", params, part, "F32", (4,))  # type: ignore[arg-type]
        assert ei.value.reason is Reason.BAD_CODEC_PARAMS
    for parts in ([], part * 2, "abcd", None, [[0.0] * 4], [np.zeros((2, 2), np.float32)]):
        with pytest.raises(CodecError) as ei:
            decode("raw", {}, parts, "F32", (4,))  # type: ignore[arg-type]
        assert ei.value.reason is Reason.BAD_CODEC_PARAMS
    for shape in ((-1,), (2.0,), "4", None, (True,), (1,) * 65):
        with pytest.raises(CodecError) as ei:
            decode("raw", {}, part, "F32", shape)  # type: ignore[arg-type]
        assert ei.value.reason is Reason.BAD_CODEC_PARAMS
    with pytest.raises(CodecError) as ei:
        encode("raw", np.zeros(1, np.uint8), "U8", block=4)
    assert ei.value.reason is Reason.BAD_CODEC_PARAMS


def test_reason_decode_size_mismatch() -> None:
    with pytest.raises(CodecError) as ei:
        decode("raw", {}, [np.zeros(5, np.float32)], "F32", (2, 2))
    assert ei.value.reason is Reason.DECODE_SIZE_MISMATCH
    with pytest.raises(CodecError) as ei:
        decode("raw", {}, [np.zeros(15, np.uint8)], "F32", (4,))
    assert ei.value.reason is Reason.DECODE_SIZE_MISMATCH


def test_reason_bad_dtype() -> None:
    for tag in ("F33", "", None, "f32"):
        with pytest.raises(CodecError) as ei:
            decode("raw", {}, [np.zeros(1, np.float32)], tag, (1,))  # type: ignore[arg-type]
        assert ei.value.reason is Reason.BAD_DTYPE
    with pytest.raises(CodecError) as ei:
        decode("raw", {}, [np.zeros(4, np.int32)], "F32", (4,))
    assert ei.value.reason is Reason.BAD_DTYPE
    with pytest.raises(CodecError) as ei:
        decode("raw", {}, [np.zeros(4, ">f4")], "F32", (4,))
    assert ei.value.reason is Reason.BAD_DTYPE
    with pytest.raises(CodecError) as ei:
        encode("raw", np.zeros(4, np.float32), "BF16")
    assert ei.value.reason is Reason.BAD_DTYPE


def test_reason_invalid_argument() -> None:
    with pytest.raises(CodecError) as ei:
        encode("raw", [1.0], "F64")  # type: ignore[arg-type]
    assert ei.value.reason is Reason.INVALID_ARGUMENT
    ref = np.zeros(2, np.float32)
    with pytest.raises(CodecError) as ei:
        encode("raw", ref, "F32", ref=ref)
    assert ei.value.reason is Reason.INVALID_ARGUMENT
    with pytest.raises(CodecError) as ei:
        decode(
            "q8",
            {"block": 2},
            [np.zeros(2, np.int8), np.zeros(1, np.float32)],
            "F32",
            (2,),
            ref=ref,
        )
    assert ei.value.reason is Reason.INVALID_ARGUMENT


def test_reason_limit_exceeded() -> None:
    with pytest.raises(CodecError) as ei:
        decode("raw", {}, [np.zeros(0, np.float32)], "F32", (2**62,))
    assert ei.value.reason is Reason.LIMIT_EXCEEDED
    with pytest.raises(CodecError) as ei:
        decode("raw", {}, [np.zeros(0, np.float32)], "F32", (0, 2**62))
    assert ei.value.reason is Reason.LIMIT_EXCEEDED
    # A sparse tensor may legitimately decode to far more than its parts; an output too
    # large to allocate is limit_exceeded, not MemoryError.
    params = {"count": 0, "index_dtype": "I64", "delta": True}
    empty = [np.zeros(0, np.int64), np.zeros(0, np.uint8)]
    with pytest.raises(CodecError) as ei:
        decode("sparse", params, empty, "U8", (2**56,))
    assert ei.value.reason is Reason.LIMIT_EXCEEDED
    assert sparse_entries(params, empty, 2**56)[0].size == 0


def test_errors_are_one_line_and_carry_the_reason() -> None:
    with pytest.raises(CodecError) as ei:
        decode(
            "sparse",
            {"count": 1, "index_dtype": "I32", "delta": True},
            [np.array([7], np.int32), np.ones(1, np.float32)],
            "F32",
            (3,),
        )
    err = ei.value
    assert isinstance(err, ValueError)
    assert "\n" not in str(err)
    assert str(err).startswith("bad_codec_params: ")


# --- fuzzing: decode must return a correct array or raise a LowdiffError -------------------

_DTYPES = [*dict.fromkeys(STORAGE_DTYPE.values()), np.dtype(">f4"), np.dtype("c8")]
_values = st.one_of(
    st.integers(-(2**65), 2**65),
    st.integers(-2, 40),
    st.booleans(),
    st.floats(),
    st.sampled_from(["I32", "I64", "zstd", ""]),
    st.none(),
    st.lists(st.integers(0, 3), max_size=2),
)
_params = st.one_of(
    st.dictionaries(
        st.sampled_from(["block", "rank", "count", "index_dtype", "delta", "x"]),
        _values,
        max_size=4,
    ),
    st.none(),
    st.lists(st.integers(), max_size=2),
)
_arrays = st.one_of(
    hnp.arrays(
        st.sampled_from(_DTYPES), hnp.array_shapes(min_dims=1, max_dims=1, min_side=0, max_side=24)
    ),
    hnp.arrays(np.uint8, st.integers(0, 40)).map(lambda a: a.view(np.bool_)),
    hnp.arrays(np.int32, st.integers(0, 30), elements=st.integers(-3, 30)),
    hnp.arrays(np.float32, (2, 3)),
)
_shapes = st.one_of(
    st.lists(st.integers(0, 6), max_size=3).map(tuple),
    st.lists(st.integers(-2, 6), max_size=3).map(tuple),
    st.sampled_from([(2**62,), (2**40, 2**40), "3", None, (1.5,)]),
)


def _check_decode(
    codec: object, params: object, parts: object, tag: object, shape: object, ref: object
) -> None:
    try:
        out = decode(codec, params, parts, tag, shape, ref=ref)  # type: ignore[arg-type]
    except LowdiffError:
        return
    assert isinstance(out, np.ndarray)
    assert out.shape == tuple(shape)  # type: ignore[arg-type]
    assert out.dtype == STORAGE_DTYPE[tag]  # type: ignore[index]
    if tag == "BOOL":
        assert out.view(np.uint8).max(initial=0) <= 1


@settings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    codec=st.sampled_from([*sorted(CODECS), "nope"]),
    params=_params,
    parts=st.lists(_arrays, max_size=3),
    tag=st.sampled_from([*TAGS, "X"]),
    shape=_shapes,
    ref=st.one_of(st.none(), _arrays),
)
def test_fuzz_decode_random_inputs(codec, params, parts, tag, shape, ref) -> None:
    _check_decode(codec, params, parts, tag, shape, ref)


@settings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tag=st.sampled_from(TAGS),
    which=st.integers(0, 5),
    mutation=st.sampled_from(["param", "drop_param", "part", "part_values", "part_cut", "shape"]),
    data=st.data(),
)
def test_fuzz_decode_mutated_encodings(tag, which, mutation, data) -> None:
    """Start from a valid encoding and break one thing."""
    shape = (3, 4)
    choices = encodings(tag, shape)
    enc, ref = choices[which % len(choices)]
    params = dict(enc.params)
    parts = [p.data for p in enc.parts]
    if mutation == "param" and params:
        params[data.draw(st.sampled_from(sorted(params)))] = data.draw(_values)
    elif mutation == "drop_param" and params:
        del params[data.draw(st.sampled_from(sorted(params)))]
    elif mutation == "part":
        parts[data.draw(st.integers(0, len(parts) - 1))] = data.draw(_arrays)
    elif mutation == "part_values":
        i = data.draw(st.integers(0, len(parts) - 1))
        raw = parts[i].view(np.uint8).copy()
        if raw.size:
            pos = data.draw(st.integers(0, raw.size - 1))
            raw[pos] = data.draw(st.integers(0, 255))
        parts[i] = raw.view(parts[i].dtype)
    elif mutation == "part_cut":
        i = data.draw(st.integers(0, len(parts) - 1))
        parts[i] = parts[i][: data.draw(st.integers(0, parts[i].size))]
    elif mutation == "shape":
        shape = data.draw(_shapes)
    _check_decode(enc.codec, params, parts, tag, shape, ref)
    if mutation == "part_values" and enc.codec in ("sparse",):
        # Whatever decodes must agree with the validated entries.
        try:
            idx, vals = sparse_entries(params, parts, 12)
            dense = decode("sparse", params, parts, tag, (3, 4))
        except LowdiffError:
            return
        assert dense.reshape(-1)[idx].tobytes() == vals.tobytes()


def test_factor_and_sparse_helpers_raise_only_codec_errors() -> None:
    for args in ((None, None, "F32", (1,)), (np.zeros((1, 1)), np.zeros((1, 1)), "F32", None)):
        with pytest.raises(CodecError):
            encode_factors(*args)  # type: ignore[arg-type]
    for args in ((None, np.zeros(1, np.float32), 3, "F32"), (np.zeros(1, int), None, 3, "F32")):
        with pytest.raises(CodecError):
            encode_sparse(*args)  # type: ignore[arg-type]
    with pytest.raises(CodecError):
        sparse_entries(None, None, 3)  # type: ignore[arg-type]


def test_decode_takes_the_parts_of_an_encoded() -> None:
    x = sample("F32", (3, 4), 4)
    for enc, ref in encodings("F32", (3, 4)):
        a = decode(enc.codec, enc.params, enc.parts, "F32", (3, 4), ref=ref)
        b = decode(enc.codec, enc.params, [p.data for p in enc.parts], "F32", (3, 4), ref=ref)
        assert a.tobytes() == b.tobytes()
    enc = encode("sparse", x, "F32")
    idx, vals = sparse_entries(enc.params, enc.parts, 12)
    assert x.reshape(-1)[idx].tolist() == vals.tolist()
