"""Glue between codecs and records: numpy arrays in, record tensor entries out, and back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import codecs
from ..errors import CodecError, FormatError, LowdiffError, Reason
from ..format.dtypes import STORAGE_DTYPE, storage_dtype
from ..format.record import PartInput, TensorEntry, TensorInput


def tensor_input(
    name: str,
    array: np.ndarray,
    dtype: str,
    codec: str = "raw",
    *,
    ref: np.ndarray | None = None,
    zstd: int | None = None,
    shuffle: bool = True,
    **options: Any,
) -> TensorInput:
    """Encode ``array`` (bits in the storage dtype of ``dtype``) for a record.

    ``zstd``: compress every part at this level (``None``: store raw, zero-copy readable).
    The returned parts reference ``array`` when no transformation was needed: the caller
    must not change ``array`` until the record is written.
    """
    if array.dtype != storage_dtype(dtype):
        raise FormatError(f"tensor {name!r}: array dtype {array.dtype} does not hold {dtype}",
                          reason=Reason.BAD_DTYPE)
    if codec == "raw":
        if zstd is None and array.flags.c_contiguous:  # the common case, in few steps
            return TensorInput(name, dtype, tuple(array.shape), "raw", {},
                               [PartInput(dtype, array.size, array.reshape(-1)
                                          .view(np.uint8).data)])
        enc = codecs.Encoded("raw", {}, (codecs.Part(dtype, np.ascontiguousarray(array)
                                                     .reshape(-1)),))
    else:
        enc = codecs.encode(codec, array, dtype, ref=ref, **options)
    return from_encoded(name, dtype, tuple(array.shape), enc, zstd=zstd, shuffle=shuffle)


def from_encoded(name: str, dtype: str, shape: tuple[int, ...], enc: codecs.Encoded, *,
                 zstd: int | None = None, shuffle: bool = True) -> TensorInput:
    """A record tensor from an already encoded value (e.g. a compressor's top-k output)."""
    parts = []
    for p in enc.parts:
        data = p.data.reshape(-1)
        if zstd is not None and data.nbytes > 0:
            blob, zparams = codecs.compress(data, level=zstd, shuffle=shuffle)
            parts.append(PartInput(p.dtype, int(data.size), blob, zparams))
        else:
            parts.append(PartInput(p.dtype, int(data.size), data.view(np.uint8).data))
    return TensorInput(name, dtype, shape, enc.codec, dict(enc.params), parts)


def part_arrays(entry: TensorEntry, payload: memoryview) -> list[np.ndarray]:
    """The stored parts of a tensor as 1-D arrays (decompressed when needed; raw parts are
    zero-copy views of ``payload``, writable only when ``payload`` is: a copy-on-write
    map, see :class:`~lowdiff_store.log.reader.LogReader`'s ``mode``)."""
    out = []
    for p in entry.parts:
        mv = payload[p.offset:p.offset + p.length]
        if p.zstd is None:
            out.append(np.frombuffer(mv, dtype=STORAGE_DTYPE[p.dtype]))
        else:
            out.append(codecs.decompress(mv, p.zstd, dtype=p.dtype, count=p.count))
    return out


def decode_entry(entry: TensorEntry, payload: memoryview, *, ref: np.ndarray | None = None
                 ) -> np.ndarray:
    """Decode a tensor to an array of its storage dtype and shape."""
    parts = part_arrays(entry, payload)
    if entry.codec == "raw" and len(parts) == 1 and parts[0].dtype == \
            STORAGE_DTYPE[entry.dtype] and parts[0].size == entry.numel:
        return parts[0].reshape(entry.shape)
    return codecs.decode(entry.codec, entry.params, parts, entry.dtype, entry.shape, ref=ref)


def describe_entry(entry: TensorEntry) -> Mapping[str, Any]:
    """A JSON-friendly description of a tensor entry (for inspect)."""
    return {"name": entry.name, "dtype": entry.dtype, "shape": list(entry.shape),
            "codec": entry.codec,
            "compressed": any(p.zstd is not None for p in entry.parts),
            "stored_bytes": sum(p.length for p in entry.parts)}


__all__ = ["CodecError", "LowdiffError", "decode_entry", "describe_entry", "from_encoded",
           "part_arrays", "tensor_input"]
