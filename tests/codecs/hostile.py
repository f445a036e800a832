"""Hostile-payload checks shared by the codec tests: every corruption of a valid encoding
either decodes to an array of the right shape and dtype or raises CodecError, and nothing
allocates more than a small multiple of the honest output."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lowdiff_store.codecs import decode
from lowdiff_store.errors import CodecError
from lowdiff_store.format.dtypes import STORAGE_DTYPE


def ro(a: np.ndarray) -> np.ndarray:
    a = a.copy()
    a.setflags(write=False)
    return a


def parts_of(enc: Any) -> list[np.ndarray]:
    return [ro(p.data) for p in enc.parts]


def _decode_or_error(codec: str, params: Any, parts: Sequence[np.ndarray], dtype: str,
                     shape: tuple[int, ...]) -> str | None:
    try:
        out = decode(codec, params, parts, dtype, shape)
    except CodecError as e:
        return e.reason.value
    assert out.shape == shape
    assert out.dtype == STORAGE_DTYPE[dtype]
    return None


def bounded(fn: Callable[[], Any], limit: int) -> Any:
    """Run ``fn``; assert its peak traced allocation stays under ``limit`` bytes."""
    tracemalloc.start()
    try:
        res = fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < limit, f"peak allocation {peak} >= {limit}"
    return res


def flip_every_byte(codec: str, params: dict[str, Any], parts: list[np.ndarray], dtype: str,
                    shape: tuple[int, ...], rng: np.random.Generator, tries: int = 200
                    ) -> set[str | None]:
    """Flip random bits of random parts: decode or CodecError, nothing else."""
    seen: set[str | None] = set()
    nonempty = [i for i, p in enumerate(parts) if p.nbytes]
    for _ in range(tries):
        i = int(rng.choice(nonempty))
        raw = parts[i].view(np.uint8).copy()
        pos = int(rng.integers(raw.size))
        raw[pos] ^= np.uint8(1 << int(rng.integers(8)))
        bad = list(parts)
        bad[i] = ro(raw.view(parts[i].dtype))
        seen.add(_decode_or_error(codec, params, bad, dtype, shape))
    return seen


def truncations(codec: str, params: dict[str, Any], parts: list[np.ndarray], dtype: str,
                shape: tuple[int, ...]) -> None:
    """Each part one byte short or one byte long (as raw bytes): decode_size_mismatch."""
    for i, p in enumerate(parts):
        raw = p.view(np.uint8)
        for cut in (raw[:-1], np.concatenate([raw, np.zeros(1, np.uint8)])):
            if raw.size == 0 and cut.size == 0:
                continue
            bad = list(parts)
            bad[i] = ro(cut)
            assert _decode_or_error(codec, params, bad, dtype, shape) in (
                "decode_size_mismatch", "bad_dtype"), (i, cut.size)
        bad = list(parts)
        bad[i] = ro(p[:-1]) if p.size else ro(np.zeros(1, p.dtype))
        assert _decode_or_error(codec, params, bad, dtype, shape) == "decode_size_mismatch"
    assert _decode_or_error(codec, params, parts[:-1], dtype, shape) == "bad_codec_params"
    assert _decode_or_error(codec, params, [*parts, parts[-1]], dtype, shape) == \
        "bad_codec_params"


def lying_params(codec: str, params: dict[str, Any], parts: list[np.ndarray], dtype: str,
                 shape: tuple[int, ...]) -> None:
    """Every key missing, an unknown key, each value a bool / str / negative / huge: all
    refused with bad_codec_params (or, where the lie changes a size, decode_size_mismatch),
    without allocating the lie."""
    ok = ("bad_codec_params", "decode_size_mismatch")
    assert _decode_or_error(codec, {**params, "extra": 1}, parts, dtype, shape) == \
        "bad_codec_params"
    for k in params:
        assert _decode_or_error(codec, {q: v for q, v in params.items() if q != k}, parts,
                                dtype, shape) == "bad_codec_params", k
        for lie in (True, False, "1", -1, 2**70, None, 1.5, [1]):
            if type(lie) is type(params[k]) and lie == params[k]:
                continue
            got = bounded(lambda lie=lie, k=k: _decode_or_error(
                codec, {**params, k: lie}, parts, dtype, shape), 1 << 24)
            assert got in ok, (k, lie, got)
        if isinstance(params[k], int) and not isinstance(params[k], bool):
            for lie in (2**31, 2**62, params[k] + 1, max(params[k] - 1, 0)):
                if lie == params[k]:
                    continue
                got = bounded(lambda lie=lie, k=k: _decode_or_error(
                    codec, {**params, k: lie}, parts, dtype, shape), 1 << 24)
                # a neighbouring value may describe the same sizes and decode differently
                near = abs(lie - params[k]) == 1
                assert got in ok or (near and got is None), (k, lie, got)


def huge_shape(codec: str, params: dict[str, Any], parts: list[np.ndarray], dtype: str) -> None:
    """A shape claiming 2**40 elements against small parts fails before allocating it."""
    got = bounded(lambda: _decode_or_error(codec, params, parts, dtype, (2**40,)), 1 << 24)
    assert got in ("decode_size_mismatch", "bad_codec_params", "limit_exceeded"), got


def all_hostile(codec: str, params: dict[str, Any], parts: list[np.ndarray], dtype: str,
                shape: tuple[int, ...], seed: int = 0, *, dense: bool = True) -> set[str | None]:
    """Every check above on one valid encoding; returns the reasons bit flips produced.

    ``dense``: the part sizes follow from the shape. A sparse encoding's do not (a huge
    shape is a legal, huge, all-zero output: the log layer caps shapes), so it skips that.
    """
    assert _decode_or_error(codec, params, parts, dtype, shape) is None
    truncations(codec, params, parts, dtype, shape)
    lying_params(codec, params, parts, dtype, shape)
    if dense:
        huge_shape(codec, params, parts, dtype)
    return flip_every_byte(codec, params, parts, dtype, shape, np.random.default_rng(seed))
