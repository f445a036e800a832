"""Random payloads for the 1.1 codecs: whatever the params and bytes, decode returns an
array of the declared shape and dtype or raises CodecError; nothing else escapes."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lowdiff_store.codecs import decode
from lowdiff_store.errors import CodecError
from lowdiff_store.format.dtypes import STORAGE_DTYPE

from .hostile import bounded
from .profile import examples

_INT = st.one_of(st.integers(0, 40), st.integers(-3, 2**64), st.booleans())
_PARAMS = {
    "tern": st.fixed_dictionaries({"block": _INT}),
    "qsgd": st.fixed_dictionaries({"levels": _INT, "bucket": _INT}),
    "sign": st.fixed_dictionaries({"scaled": st.one_of(st.booleans(), _INT)}),
    "sparse_ec": st.fixed_dictionaries({
        "count": _INT, "coding": st.sampled_from(["rice", "ef", "x"]), "shift": _INT,
        "hbits": _INT, "value_dtype": st.sampled_from(["F32", "BF16", "F16", "I8"])}),
    "lcc": st.fixed_dictionaries({"symbols": _INT, "chunk": _INT, "nbits": _INT}),
}
_PART_DTYPES = ["U8", "F32", "U32", "BF16", "F16", "F64"]


@st.composite
def payload(draw: Any) -> tuple[str, dict[str, Any], list[np.ndarray], str, tuple[int, ...]]:
    codec = draw(st.sampled_from(sorted(_PARAMS)))
    params = draw(_PARAMS[codec])
    nparts = {"tern": 2, "qsgd": 2, "sign": 2, "sparse_ec": 3, "lcc": 4}[codec]
    nparts += draw(st.sampled_from([0, 0, 0, -1, 1]))
    parts = []
    for _ in range(max(nparts, 0)):
        tag = draw(st.sampled_from(_PART_DTYPES))
        raw = draw(st.binary(max_size=64))
        dt = STORAGE_DTYPE[tag]
        raw = raw[: len(raw) // dt.itemsize * dt.itemsize]
        arr = np.frombuffer(raw, np.uint8) if draw(st.booleans()) else \
            np.frombuffer(raw, dt)
        parts.append(arr)
    dtype = draw(st.sampled_from(["F32", "F64", "F16", "BF16", "I32"]))
    shape = draw(st.sampled_from([(), (0,), (1,), (5,), (3, 7), (64,), (2**40,)]))
    return codec, params, parts, dtype, shape


@settings(max_examples=examples(400), deadline=None)
@given(p=payload())
def test_random_payloads_decode_or_raise_codec_error(p: Any) -> None:
    codec, params, parts, dtype, shape = p

    def run() -> None:
        try:
            out = decode(codec, params, parts, dtype, shape)
        except CodecError:
            return
        assert out.shape == shape
        assert out.dtype == STORAGE_DTYPE[dtype]

    if shape == (2**40,) and codec == "sparse_ec":
        return  # a legal all-zero output of that size (the log layer caps shapes)
    bounded(run, 1 << 24)
