"""Diff records: metadata schema, validation, and assembly into aligned, checksummed bytes.

A record holds one step's diff: for each tensor its name, dtype, shape, codec, codec
parameters and the location of its parts (stored buffers) in the payload area, plus the
step's side channel (an opaque msgpack map) and optional fields. See
``format_spec/log_format.md``, "Records".
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import FormatError, Reason
from .checksum import crc32c, crc32c_chunks
from .constants import (
    MAX_ELEMENTS,
    MAX_NAME_BYTES,
    MAX_NDIM,
    MAX_PARTS_PER_TENSOR,
    MAX_STEP,
    MAX_TENSORS_PER_RECORD,
    RECORD_HEADER_SIZE,
    RECORD_TYPE_DIFF,
)
from .dtypes import STORAGE_DTYPE
from .framing import align_up, pack_meta, pack_record_header, record_layout, set_record_crc

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class PartEntry:
    """Where one stored buffer of a tensor lives, relative to the payload area start.

    ``length`` is the stored byte count; ``zstd`` is the compression stage's parameters
    (``None`` when stored raw, then ``length == count * itemsize(dtype)``).
    """

    dtype: str
    count: int
    offset: int
    length: int
    zstd: dict[str, Any] | None = None


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a record (validated metadata, no payload bytes)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    codec: str
    params: dict[str, Any]
    parts: tuple[PartEntry, ...]

    @property
    def numel(self) -> int:
        """Number of elements of the decoded tensor."""
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class PartInput:
    """A buffer to store: ``data`` is bytes-like (already compressed when ``zstd`` is set)."""

    dtype: str
    count: int
    data: Buffer
    zstd: dict[str, Any] | None = None


@dataclass
class TensorInput:
    """A tensor to put in a record, already encoded by a codec."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    codec: str
    params: dict[str, Any]
    parts: list[PartInput] = field(default_factory=list)


@dataclass
class RecordBytes:
    """A record ready to write: ``chunks`` concatenated are exactly ``length`` bytes;
    ``chunks[0]`` is the header (a bytearray holding the CRC once it is computed)."""

    step: int
    length: int
    crc: int
    chunks: list[Buffer]
    payload_bytes: int


_PAD = bytes(64)


def build_record(
    step: int,
    tensors: Sequence[TensorInput],
    *,
    kind: str,
    side: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    type_: int = RECORD_TYPE_DIFF,
    checksum: bool = True,
) -> RecordBytes:
    """Lay out and checksum a record. Payload buffers are referenced, not copied.

    The caller must keep the part buffers alive and unchanged until the record is written
    (the writer's staging guarantees that). With ``checksum=False`` the CRC field is left
    zero (``crc`` is -1) and :func:`finish_record` must run before the record is synced:
    the writer computes it on another core while the record is being written.
    """
    if not 0 <= step <= MAX_STEP:
        raise FormatError(f"step {step} out of range", reason=Reason.OUT_OF_BOUNDS)
    if len(tensors) > MAX_TENSORS_PER_RECORD:
        raise FormatError(f"{len(tensors)} tensors exceed the per-record limit",
                          reason=Reason.LIMIT_EXCEEDED)
    entries: list[list[Any]] = []
    placed: list[tuple[int, Buffer]] = []
    off = 0
    for t in tensors:
        parts = []
        for p in t.parts:
            nbytes = memoryview(p.data).nbytes
            parts.append([p.dtype, p.count, off, nbytes, p.zstd])
            placed.append((off, p.data))
            off = align_up(off + nbytes)
        entries.append([t.name, t.dtype, list(t.shape), t.codec, t.params, parts])
    meta: dict[str, Any] = {"kind": kind, "tensors": entries, "side": dict(side or {})}
    if extra:
        for k, v in extra.items():
            if k not in meta:
                meta[k] = v
    meta_bytes = pack_meta(meta)
    payload_start, length = record_layout(len(meta_bytes), off)
    header = pack_record_header(type_, len(meta_bytes), step, length)
    chunks: list[Buffer] = [header, meta_bytes]
    pos = RECORD_HEADER_SIZE + len(meta_bytes)
    for rel, data in placed:
        target = payload_start + rel
        if target > pos:
            chunks.append(_pad(target - pos))
            pos = target
        mv = memoryview(data).cast("B") if memoryview(data).ndim != 1 or \
            memoryview(data).format != "B" else memoryview(data)
        chunks.append(mv)
        pos += mv.nbytes
    if length > pos:
        chunks.append(_pad(length - pos))
    rec = RecordBytes(step, length, -1, chunks, off)
    if checksum:
        finish_record(rec)
    return rec


def record_crc(rec: RecordBytes) -> int:
    """The CRC of a record: over bytes [8, length), i.e. the header after the CRC field,
    the metadata, every padding and every payload. Releases the GIL on large buffers."""
    return crc32c_chunks(rec.chunks[1:], crc32c(memoryview(rec.chunks[0])[8:]))


def finish_record(rec: RecordBytes, crc: int | None = None) -> None:
    """Store the record's CRC (computed now unless given) into its header."""
    rec.crc = record_crc(rec) if crc is None else crc
    header = rec.chunks[0]
    assert isinstance(header, bytearray)
    set_record_crc(header, rec.crc)


def _pad(n: int) -> bytes:
    return _PAD[:n] if n <= len(_PAD) else bytes(n)


def _fail(detail: str, reason: Reason = Reason.BAD_METADATA) -> FormatError:
    return FormatError(detail, reason=reason)


def _int(v: Any, what: str, lo: int = 0, hi: int = MAX_ELEMENTS) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise _fail(f"{what} must be an integer in [{lo}, {hi}], got {v!r}",
                    Reason.OUT_OF_BOUNDS if type(v) is int else Reason.BAD_METADATA)
    return v


def parse_tensors(meta: Mapping[str, Any], payload_len: int) -> list[TensorEntry]:
    """Validate the ``tensors`` list of a record's metadata against the payload size.

    Every part must lie inside the payload area, start aligned, and not overlap another;
    raw parts must have exactly ``count * itemsize`` bytes. Nothing is allocated here.
    """
    raw = meta.get("tensors")
    if not isinstance(raw, list):
        raise _fail("record metadata has no tensor list")
    if len(raw) > MAX_TENSORS_PER_RECORD:
        raise _fail(f"{len(raw)} tensors exceed the per-record limit", Reason.LIMIT_EXCEEDED)
    out: list[TensorEntry] = []
    spans: list[tuple[int, int]] = []
    names: set[str] = set()
    for item in raw:
        if not isinstance(item, list) or len(item) < 6:
            raise _fail("tensor entry is not a 6-element list")
        name, dtype, shape, codec, params, parts = item[:6]
        if not isinstance(name, str) or not name or len(name.encode()) > MAX_NAME_BYTES:
            raise _fail(f"bad tensor name {name!r}")
        if name in names:
            raise _fail(f"duplicate tensor name {name!r}")
        names.add(name)
        if not isinstance(dtype, str) or dtype not in STORAGE_DTYPE:
            raise _fail(f"tensor {name!r}: unknown dtype {dtype!r}", Reason.BAD_DTYPE)
        if not isinstance(shape, list) or len(shape) > MAX_NDIM:
            raise _fail(f"tensor {name!r}: bad shape", Reason.LIMIT_EXCEEDED
                        if isinstance(shape, list) else Reason.BAD_METADATA)
        n = 1
        for d in shape:
            n *= _int(d, f"tensor {name!r} dimension")
            if n > MAX_ELEMENTS:
                raise _fail(f"tensor {name!r} has too many elements", Reason.LIMIT_EXCEEDED)
        if not isinstance(codec, str) or not isinstance(params, dict):
            raise _fail(f"tensor {name!r}: bad codec fields")
        if not isinstance(parts, list) or len(parts) > MAX_PARTS_PER_TENSOR:
            raise _fail(f"tensor {name!r}: bad part list", Reason.LIMIT_EXCEEDED
                        if isinstance(parts, list) else Reason.BAD_METADATA)
        pes = []
        for p in parts:
            if not isinstance(p, list) or len(p) < 5:
                raise _fail(f"tensor {name!r}: part is not a 5-element list")
            pd, cnt, off, ln, z = p[:5]
            if not isinstance(pd, str) or pd not in STORAGE_DTYPE:
                raise _fail(f"tensor {name!r}: unknown part dtype {pd!r}", Reason.BAD_DTYPE)
            cnt = _int(cnt, "part count")
            off = _int(off, "part offset", 0, payload_len)
            ln = _int(ln, "part length", 0, payload_len)
            if off % 64:
                raise _fail(f"tensor {name!r}: part offset {off} not aligned",
                            Reason.OUT_OF_BOUNDS)
            if off + ln > payload_len:
                raise _fail(f"tensor {name!r}: part [{off}, {off + ln}) outside the "
                            f"{payload_len}-byte payload", Reason.OUT_OF_BOUNDS)
            if z is None:
                if ln != cnt * STORAGE_DTYPE[pd].itemsize:
                    raise _fail(f"tensor {name!r}: raw part of {ln} bytes holds "
                                f"{cnt} x {pd}", Reason.BAD_RECORD_LENGTH)
            elif not isinstance(z, dict):
                raise _fail(f"tensor {name!r}: bad compression parameters")
            if ln:
                spans.append((off, off + ln))
            pes.append(PartEntry(pd, cnt, off, ln, z))
        out.append(TensorEntry(name, dtype, tuple(shape), codec, params, tuple(pes)))
    spans.sort()
    for (_a0, a1), (b0, _b1) in itertools.pairwise(spans):
        if b0 < a1:
            raise _fail(f"parts overlap at payload offset {b0}", Reason.OUT_OF_BOUNDS)
    return out


__all__ = [
    "PartEntry",
    "PartInput",
    "RecordBytes",
    "TensorEntry",
    "TensorInput",
    "build_record",
    "finish_record",
    "parse_tensors",
    "record_crc",
]
