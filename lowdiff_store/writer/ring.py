"""The process boundary of the writer: the shared ring, its messages, the channel's requests
and the error reply, as ``format_spec/ring.md`` specifies them. This module is the only
thing the producer (:mod:`lowdiff_store.writer.ring_client`) and the writer process
(:mod:`lowdiff_store.writer.process`) share; it points back to the spec. Changing a layout
here changes the spec: bump ``RING_MINOR`` or ``RING_MAJOR`` and say so in
``format_spec/CHANGES.md``.

Every reader here checks each length and offset against the ring before it reads through
it and raises :class:`~lowdiff_store.errors.FormatError` naming the slot and the byte offset
of the field; nothing read from the ring chooses code to run (the error reply's class is
looked up in an allow-list).
"""

from __future__ import annotations

import enum
import errno as errno_codes
import math
import mmap
import os
import struct
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from .. import codecs, errors
from ..codecs.batch import RECIPES, SparseSlot
from ..codecs.batch import Slot as BatchSlot
from ..errors import (
    BadMagicError,
    CommitError,
    ConfigError,
    CorruptRecordError,
    FormatError,
    LowdiffError,
    Reason,
    StorageError,
    UnsupportedVersionError,
)
from ..format.checksum import crc32c, mask
from ..format.constants import MAX_ELEMENTS, MAX_NAME_BYTES, MAX_NDIM, MAX_STEP
from ..format.dtypes import STORAGE_DTYPE
from ..format.framing import align_up, pack_meta, unpack_meta

RING_MAGIC: Final = b"LDRNG\x00\r\n"
RING_MAJOR: Final = 2
RING_MINOR: Final = 1
HEADER_LEN: Final = 4096
SLOT_MAGIC: Final = b"LDSL"
SLOT_HEADER_LEN: Final = 64
MAX_SLOTS: Final = 65536
MIN_SLOT_SIZE: Final = 4096
MAX_SLOT_SIZE: Final = 1 << 30
#: where the error reply starts in the header, and its largest size (2.0: up to the words)
REPLY_AT: Final = 136
#: where the second area of the writer process's words starts (2.0): :class:`More`, then
#: the writer's counters (:data:`WRITER_STATS`) as float64
MORE_AT: Final = 3072
MAX_REPLY: Final = MORE_AT - REPLY_AT
#: the ``AsyncLogWriter`` counters the writer process publishes, in order, after ``More``
WRITER_STATS: Final = ("stage_s", "encode_s", "write_s", "fsync_s", "blocked_s", "base_s",
                       "bytes", "records", "batches", "appends", "last_batch_records",
                       "last_batch_bytes", "max_batch_records", "staged_bytes",
                       "staged_bytes_peak", "ack_latency_s", "queued", "bases", "base_bytes",
                       "callback_errors")
FLAG_SYNC: Final = 1
#: the doorbell the writer process rings (any byte is one)
DOORBELL: Final = b"\x01"

# magic[8] major u16 minor u16 header_len u32 slot_count u32 reserved u32 slot_size u64
# reserved[28] | crc u32
_STATIC = struct.Struct("<8sHHIIIQ28x")
_U32 = struct.Struct("<I")
# magic[4] crc u32 | seq u64 step u64 kind u8 flags u8 reserved u16 span u32 table_len u32
# reserved u32 payload_len u64 reserved[16]
_SLOT = struct.Struct("<4sIQQBBHII4xQ16x")
_REQUEST = struct.Struct("<I4xQ")
_REPLY_HEAD = struct.Struct("<II")
#: byte offset of each slot header field (for the errors that name them)
_AT = {"magic": 0, "crc": 4, "seq": 8, "step": 16, "kind": 24, "flags": 25, "span": 28,
       "table_len": 32, "payload_len": 40}
REQUEST_SIZE: Final = _REQUEST.size
assert _STATIC.size + 4 == 64
assert _SLOT.size == SLOT_HEADER_LEN


class Kind(enum.IntEnum):
    """What a message carries."""

    OPEN = 1
    DIFF = 2
    BASE = 3
    PAD = 4
    META = 5  # 2.0
    PART = 6  # 2.1: bytes of a base's tensors, ahead of the BASE that closes it


class Op(enum.IntEnum):
    """A request on the channel."""

    PUBLISH = 1
    FLUSH = 2
    CLOSE = 3


class State(enum.IntEnum):
    """The writer process's ``state`` word."""

    STARTING = 0
    READY = 1
    CLOSED = 2
    FAILED = 3


class Word(enum.IntEnum):
    """The writer process's words at [64, 128): index of each i64."""

    STATE = 0
    TAIL = 1
    DURABLE = 2
    FLUSHED = 3
    LAST_STEP = 4
    LAST_BASE = 5
    WRITER_PID = 6
    BASE = 7  # 2.0: the newest base published since open (-1: none)


class More(enum.IntEnum):
    """The writer process's words at [3072, 3072 + 8 * 8) (2.0): index of each i64; the
    counters follow at :data:`STATS_AT`."""

    TRUNCATED = 0  # records the last META truncation dropped
    SKIPPED = 1  # the newest base skipped because the store did not answer (-1: none)


#: where the float64 counters of :data:`WRITER_STATS` start
STATS_AT: Final = MORE_AT + 8 * 8
assert STATS_AT + 8 * len(WRITER_STATS) <= HEADER_LEN


#: ``AsyncLogWriter`` options an OPEN message may carry
OPEN_OPTIONS: Final = ("batch", "max_batch_bytes", "max_delay_s", "memory_budget",
                       "segment_bytes")


def _bad(reason: Reason, detail: str, offset: int | None = None) -> FormatError:
    cls = {Reason.BAD_MAGIC: BadMagicError,
           Reason.CHECKSUM_MISMATCH: CorruptRecordError}.get(reason, FormatError)
    return cls(detail, reason=reason, offset=offset)


# ------------------------------------------------------------------------------ the ring


def make_ring_fd(size: int, tmpdir: str | os.PathLike[str] | None = None) -> int:
    """A descriptor of ``size`` bytes of shared memory, every page allocated: a memfd, or,
    where ``memfd_create`` is unavailable, a temp file in ``tmpdir``, unlinked at once.
    Raises :class:`StorageError` if the memory (or disk) is short, ``ConfigError`` if
    memfd is unavailable and no ``tmpdir`` is named."""
    fd = None
    memfd = getattr(os, "memfd_create", None)
    if memfd is not None:
        try:
            fd = memfd("lowdiff-ring", os.MFD_CLOEXEC)
        except OSError as e:  # ENOSYS (old kernel), EPERM (seccomp): the file below
            if e.errno not in (errno_codes.ENOSYS, errno_codes.EPERM, errno_codes.EINVAL,
                               errno_codes.EOPNOTSUPP):
                err = StorageError(f"cannot make the writer ring: memfd_create: "
                                   f"{e.strerror or e} (errno {e.errno})")
                err.errno = e.errno  # (EMFILE: the process is out of descriptors)
                raise err from e
            fd = None
    if fd is None:
        if tmpdir is None:
            raise ConfigError("memfd_create is unavailable: name a directory for the "
                              "writer ring's file (ring_dir)")
        fd, name = tempfile.mkstemp(prefix="lowdiff-ring-", dir=tmpdir)
        os.unlink(name)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno not in (errno_codes.EOPNOTSUPP, errno_codes.EINVAL):
                raise
            os.ftruncate(fd, size)  # a filesystem without fallocate: sparse
    except OSError as e:
        os.close(fd)
        err = StorageError(f"cannot allocate a writer ring of {size} bytes: "
                           f"{e.strerror or e} (errno {e.errno})")
        err.errno = e.errno
        raise err from e
    return fd


class Ring:
    """One ring mapped in this process: its static layout and the writer's words.

    ``buf`` is a view of the whole mapping; views handed out of it (messages' arrays) keep
    the mapping alive: :meth:`close` only succeeds once they are gone."""

    def __init__(self, mm: mmap.mmap, slot_count: int, slot_size: int) -> None:
        self.mm = mm
        self.slot_count = slot_count
        self.slot_size = slot_size
        self.buf = memoryview(mm)
        self._words = self.buf[64:128].cast("q")
        self._more = self.buf[MORE_AT:STATS_AT].cast("q")
        self._stats = self.buf[STATS_AT:STATS_AT + 8 * len(WRITER_STATS)].cast("d")

    @classmethod
    def create(cls, slot_count: int, slot_size: int,
               tmpdir: str | os.PathLike[str] | None = None) -> tuple[Ring, int]:
        """Make a ring (see :func:`make_ring_fd`) and write its header; returns the ring and
        its descriptor (the caller passes it to the writer process, then closes it)."""
        if type(slot_count) is not int or not 1 <= slot_count <= MAX_SLOTS:
            raise ConfigError(f"ring slots={slot_count!r} must be an int in 1..{MAX_SLOTS}")
        if (type(slot_size) is not int or not MIN_SLOT_SIZE <= slot_size <= MAX_SLOT_SIZE
                or slot_size % MIN_SLOT_SIZE):
            raise ConfigError(f"ring slot_size={slot_size!r} must be a multiple of 4096 in "
                              f"4096..{MAX_SLOT_SIZE}")
        fd = make_ring_fd(HEADER_LEN + slot_count * slot_size, tmpdir)
        try:
            mm = mmap.mmap(fd, HEADER_LEN + slot_count * slot_size)
        except BaseException:
            os.close(fd)
            raise
        head = _STATIC.pack(RING_MAGIC, RING_MAJOR, RING_MINOR, HEADER_LEN, slot_count, 0,
                            slot_size)
        mm[0:60] = head
        mm[60:64] = _U32.pack(mask(crc32c(head)))
        ring = cls(mm, slot_count, slot_size)
        for w in (Word.DURABLE, Word.LAST_STEP, Word.LAST_BASE, Word.BASE):
            ring.set(w, -1)
        ring.set_more(More.SKIPPED, -1)
        return ring, fd

    @classmethod
    def attach(cls, fd: int) -> Ring:
        """Map the ring behind ``fd`` after checking its header (section 2's order)."""
        size = os.fstat(fd).st_size
        if size < HEADER_LEN:
            raise _bad(Reason.TRUNCATED, f"ring of {size} bytes is shorter than its header",
                       size)
        head = os.pread(fd, 64, 0)
        magic, major, _minor, header_len, count, _r, slot_size = _STATIC.unpack_from(head)
        if magic != RING_MAGIC:
            raise _bad(Reason.BAD_MAGIC, f"not a writer ring (magic {magic!r})", 0)
        if major != RING_MAJOR:
            raise UnsupportedVersionError(major, RING_MAJOR, offset=8)
        if header_len != HEADER_LEN:
            raise _bad(Reason.BAD_RECORD_LENGTH, f"ring header_len {header_len}", 12)
        if _U32.unpack_from(head, 60)[0] != mask(crc32c(head[:60])):
            raise _bad(Reason.CHECKSUM_MISMATCH, "ring header CRC does not match", 60)
        if not 1 <= count <= MAX_SLOTS:
            raise _bad(Reason.OUT_OF_BOUNDS, f"ring slot_count {count}", 16)
        if not MIN_SLOT_SIZE <= slot_size <= MAX_SLOT_SIZE or slot_size % MIN_SLOT_SIZE:
            raise _bad(Reason.OUT_OF_BOUNDS, f"ring slot_size {slot_size}", 24)
        if size != HEADER_LEN + count * slot_size:
            raise _bad(Reason.TRUNCATED, f"ring of {size} bytes, its header says "
                       f"{HEADER_LEN + count * slot_size}", size)
        return cls(mmap.mmap(fd, size), count, slot_size)

    @property
    def size(self) -> int:
        """Bytes of the whole ring."""
        return HEADER_LEN + self.slot_count * self.slot_size

    def get(self, word: Word) -> int:
        """One of the writer process's words."""
        return int(self._words[word])

    def set(self, word: Word, value: int) -> None:
        """Store one word (one aligned 8-byte store)."""
        self._words[word] = value

    def get_more(self, word: More) -> int:
        """One of the writer process's words of the second area (2.0)."""
        return int(self._more[word])

    def set_more(self, word: More, value: int) -> None:
        """Store one word of the second area."""
        self._more[word] = value

    def stats(self) -> dict[str, float]:
        """The writer's counters as last published (each word read whole; the set may mix
        two publications)."""
        return {name: float(self._stats[i]) for i, name in enumerate(WRITER_STATS)}

    def set_stats(self, stats: Mapping[str, float]) -> None:
        """Publish the writer's counters (those of :data:`WRITER_STATS`)."""
        for i, name in enumerate(WRITER_STATS):
            self._stats[i] = float(stats.get(name, 0.0))

    def slot_offset(self, seq: int) -> int:
        """Byte offset of the slot that slot number ``seq`` uses."""
        return HEADER_LEN + (seq % self.slot_count) * self.slot_size

    def array(self, part: SlotPart) -> np.ndarray:
        """A read-only view of a part's bytes in its storage dtype (no copy: it keeps the
        mapping alive, and the slot must not be reused while it is referenced)."""
        dt = STORAGE_DTYPE[part.dtype]
        out: np.ndarray = np.frombuffer(self.mm, dt, part.length // dt.itemsize, part.offset)
        return out

    def close(self) -> None:
        """Unmap (raises ``BufferError`` while views of the ring are alive)."""
        self._stats.release()
        self._more.release()
        self._words.release()
        self.buf.release()
        self.mm.close()


# ------------------------------------------------------------------------------ tensors


@dataclass(frozen=True)
class RingTensor:
    """A tensor to put in the ring: ``parts`` are (dtype tag, buffer) pairs in the codec's
    order, each buffer C-contiguous; a plain array is ``codec="raw"`` with one part of the
    tensor's dtype (:meth:`raw`)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    parts: tuple[tuple[str, Any], ...]
    codec: str = "raw"
    params: Mapping[str, Any] = field(default_factory=dict)
    zstd: int | None = None

    @classmethod
    def raw(cls, name: str, dtype: str, shape: Sequence[int], data: Any) -> RingTensor:
        """A plain array: ``data`` (a numpy array or any C-contiguous buffer) holds the
        ``prod(shape)`` elements of ``dtype`` in its storage dtype."""
        return cls(name, dtype, tuple(shape), ((dtype, data),))


@dataclass(frozen=True)
class SlotPart:
    """A part read from a message: its dtype tag and its byte range in the ring."""

    dtype: str
    offset: int
    length: int


@dataclass(frozen=True)
class SlotTensor:
    """A tensor read from a message (its fields as :class:`RingTensor`'s)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    codec: str
    params: dict[str, Any]
    zstd: int | None
    parts: tuple[SlotPart, ...]


@dataclass(frozen=True)
class SlotRecipe:
    """A tensor whose stored form the writer process makes (section 3.1): its place in the
    record, name, dtype, shape, zstd level, and the recipe (op, slots, params) that
    :func:`lowdiff_store.codecs.batch.run_recipe` runs on the batch's arrays; a slot is
    ``(buffer, offset, numel)``, a sparse slot ``(slot, slot, base, sorted)``."""

    at: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    zstd: int | None
    op: str
    slots: tuple[Any, ...]
    params: tuple[Any, ...]


@dataclass(frozen=True)
class SlotBatch:
    """The arrays of a DIFF message encoded by the writer process (section 3.1)."""

    buffers: tuple[SlotPart, ...]
    sorts: tuple[tuple[int, int, tuple[tuple[int, int], ...]], ...]
    layouts: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]
    recipes: tuple[SlotRecipe, ...]
    bits_gen: int
    #: (name, dtype tag, buffer index) the ``changed`` comparisons of a new ``bits_gen``
    #: start from
    seeds: tuple[tuple[str, str, int], ...] = ()


@dataclass
class RingBatch:
    """A step's arrays for the writer process to encode (the producer's side of
    :class:`SlotBatch`): ``buffers`` (dtype tag, flat array) are copied into the payload;
    ``sorts``, ``layouts`` and ``recipes`` name them by their index in ``buffers`` (then
    ``fills``); a recipe is ``(at, name, dtype, shape, zstd, op, slots, params)``."""

    buffers: list[tuple[str, Any]] = field(default_factory=list)
    #: buffers the caller fills in place, after ``buffers`` in the numbering: (dtype tag,
    #: bytes, ``fill(view)`` writing exactly those bytes into the ring's memoryview)
    fills: list[tuple[str, int, Callable[[memoryview], None]]] = field(default_factory=list)
    sorts: list[tuple[int, int, Sequence[tuple[int, int]]]] = field(default_factory=list)
    layouts: list[tuple[int, Sequence[tuple[int, int]]]] = field(default_factory=list)
    recipes: list[tuple[Any, ...]] = field(default_factory=list)
    bits_gen: int = 0
    #: with a new ``bits_gen``: the bits it starts from, (name, dtype tag, buffer index)
    seeds: list[tuple[str, str, int]] = field(default_factory=list)


@dataclass(frozen=True)
class SlotPiece:
    """A piece of a base's tensor read from a PART message (2.1): the tensor's name, dtype
    and whole shape, the piece's byte offset in the tensor (``at``) and its bytes in the
    ring (``part``)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    at: int
    part: SlotPart


@dataclass(frozen=True)
class Message:
    """A message read from the ring, its table parsed: ``record_kind``, ``side`` and
    ``extra`` (DIFF), ``meta`` (OPEN, BASE), ``path`` and ``options`` (OPEN)."""

    seq: int
    span: int
    kind: Kind
    step: int
    flags: int
    tensors: tuple[SlotTensor, ...] = ()
    record_kind: str = ""
    side: dict[str, Any] | None = None
    extra: dict[str, Any] | None = None
    meta: dict[str, Any] | None = None
    path: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    batch: SlotBatch | None = None  # DIFF (2.0): arrays encoded by the writer process
    truncate_after: int | None = None  # META (2.0)
    records_per_batch: int | None = None  # META (2.0)
    pieces: tuple[SlotPiece, ...] = ()  # PART (2.1)
    parts: int = 0  # BASE (2.1): the PART messages of this base before it
    #: PART (2.1), the first of a base: (name, dtype tag, shape) of each of its tensors
    layout: tuple[tuple[str, str, tuple[int, ...]], ...] | None = None


def check_tensor(name: object, dtype: object, shape: object, codec: object, zstd: object,
                 parts: Sequence[tuple[object, int]], base: bool, *,
                 parts_known: bool = True) -> None:
    """The rules of section 3 for one tensor, on either side (``parts``: dtype tag and
    byte length of each; ``parts_known=False``: a recipe's, made by the writer process,
    so only the name, dtype, shape and zstd level); raises :class:`FormatError`."""
    if type(name) is not str or not name or len(name.encode()) > MAX_NAME_BYTES:
        raise _bad(Reason.BAD_METADATA, f"bad tensor name {name!r}")
    if type(dtype) is not str or dtype not in STORAGE_DTYPE:
        raise _bad(Reason.BAD_DTYPE, f"tensor {name!r}: unknown dtype tag {dtype!r}")
    if (not isinstance(shape, (list, tuple)) or len(shape) > MAX_NDIM
            or not all(type(d) is int and 0 <= d <= MAX_ELEMENTS for d in shape)
            or math.prod(shape) > MAX_ELEMENTS):
        raise _bad(Reason.LIMIT_EXCEEDED, f"tensor {name!r}: bad shape {shape!r}")
    if type(codec) is not str or codec not in codecs.CODECS:
        raise _bad(Reason.UNKNOWN_CODEC, f"tensor {name!r}: unknown codec {codec!r}")
    if zstd is not None and (type(zstd) is not int or not -7 <= zstd <= 22):
        raise _bad(Reason.BAD_CODEC_PARAMS, f"tensor {name!r}: zstd level {zstd!r}")
    if not parts_known:
        return
    for tag, length in parts:
        if type(tag) is not str or tag not in STORAGE_DTYPE:
            raise _bad(Reason.BAD_DTYPE, f"tensor {name!r}: unknown part dtype {tag!r}")
        if length % STORAGE_DTYPE[tag].itemsize:
            raise _bad(Reason.BAD_RECORD_LENGTH, f"tensor {name!r}: a part of {length} "
                       f"bytes is not a whole number of {tag}")
    if codec == "raw" or base:
        if codec != "raw" or len(parts) != 1 or parts[0][0] != dtype or (
                base and zstd is not None):
            raise _bad(Reason.BAD_METADATA, f"tensor {name!r}: a raw tensor is one part of "
                       "its dtype" + (", not compressed (a base)" if base else ""))
        want = math.prod(shape) * STORAGE_DTYPE[dtype].itemsize
        if parts[0][1] != want:
            raise _bad(Reason.BAD_RECORD_LENGTH, f"tensor {name!r}: {parts[0][1]} bytes for "
                       f"shape {list(shape)} of {dtype} ({want} bytes)")


# ------------------------------------------------------------------------------ writing


@dataclass
class Outgoing:
    """A message laid out by the producer, not yet in the ring: its table and the buffers
    to copy, each at its offset from P."""

    kind: Kind
    step: int
    flags: int
    table: bytes
    payload_len: int
    buffers: list[tuple[int, memoryview]]
    #: (offset, bytes, fill) of buffers written in place by ``fill(view of the ring)``
    fills: list[tuple[int, int, Callable[[memoryview], None]]] = field(default_factory=list)

    @property
    def size(self) -> int:
        """Bytes of the message from its header to the end of its payload."""
        return align_up(SLOT_HEADER_LEN + len(self.table)) + self.payload_len

    def span(self, slot_size: int) -> int:
        """Slots the message occupies."""
        return -(-self.size // slot_size)


def bytes_of(name: str, tag: str, data: Any) -> memoryview:
    """``data`` (a numpy array holding ``tag``'s storage dtype, or a C-contiguous buffer) as
    a flat view of its bytes; ``ConfigError`` / ``FormatError`` naming ``name`` otherwise."""
    if isinstance(data, np.ndarray) and data.dtype != STORAGE_DTYPE[tag]:
        raise _bad(Reason.BAD_DTYPE, f"tensor {name!r}: array dtype {data.dtype} does not "
                   f"hold {tag}")
    try:
        mv = memoryview(data)
    except TypeError:
        raise ConfigError(f"tensor {name!r}: a part must be a numpy array or a buffer, "
                          f"got {type(data).__name__}") from None
    if not mv.c_contiguous:
        raise ConfigError(f"tensor {name!r}: a part must be C-contiguous")
    if mv.nbytes == 0:  # (a view with a 0 in its shape cannot be cast)
        return memoryview(b"")
    return mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv


def _layout_tensors(tensors: Sequence[RingTensor], base: bool
                    ) -> tuple[list[list[Any]], int, list[tuple[int, memoryview]]]:
    entries: list[list[Any]] = []
    buffers: list[tuple[int, memoryview]] = []
    names: set[str] = set()
    off = end = 0
    for t in tensors:
        if not isinstance(t, RingTensor):
            raise ConfigError(f"a tensor must be a RingTensor, got {type(t).__name__}")
        views = [(tag, bytes_of(t.name, tag, d)) for tag, d in t.parts]
        check_tensor(t.name, t.dtype, t.shape, t.codec, t.zstd,
                     [(tag, v.nbytes) for tag, v in views], base)
        if t.name in names:
            raise ConfigError(f"duplicate tensor name {t.name!r}")
        names.add(t.name)
        parts = []
        for tag, v in views:
            parts.append([tag, off, v.nbytes])
            buffers.append((off, v))
            end = off + v.nbytes
            off = align_up(end)
        entries.append([t.name, t.dtype, list(t.shape), t.codec, dict(t.params), t.zstd,
                        parts])
    return entries, end, buffers


def _table(obj: Mapping[str, Any], what: str) -> bytes:
    try:
        return pack_meta(obj)
    except (TypeError, ValueError, OverflowError) as e:
        if isinstance(e, LowdiffError):
            raise
        raise ConfigError(f"{what} cannot be stored as msgpack: {e}") from e


def _step(step: int) -> int:
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        raise ConfigError(f"step {step!r} out of range", reason=Reason.OUT_OF_BOUNDS)
    return step


def layout_diff(step: int, kind: str, tensors: Sequence[RingTensor], *,
                side: Mapping[str, Any] | None = None, extra: Mapping[str, Any] | None = None,
                sync: bool = False, batch: RingBatch | None = None) -> Outgoing:
    """Lay out the DIFF message of ``step`` (checks what the writer process would refuse,
    except ``batch``'s recipes: the writer process checks those, section 3.1)."""
    if type(kind) is not str:
        raise ConfigError(f"kind must be a str, got {type(kind).__name__}")
    entries, payload_len, buffers = _layout_tensors(tensors, base=False)
    obj: dict[str, Any] = {"kind": kind, "tensors": entries,
                           "side": dict(side) if side else None,
                           "extra": dict(extra) if extra else None}
    fills: list[tuple[int, int, Callable[[memoryview], None]]] = []
    if batch is not None and (batch.recipes or batch.buffers or batch.fills):
        off = align_up(payload_len)
        wire = []
        for i, (tag, data) in enumerate(batch.buffers):
            v = bytes_of(f"batch buffer {i}", tag, data)
            wire.append([tag, off, v.nbytes])
            buffers.append((off, v))
            payload_len = off + v.nbytes
            off = align_up(payload_len)
        for tag, nbytes, fill in batch.fills:
            if tag not in STORAGE_DTYPE or nbytes % STORAGE_DTYPE[tag].itemsize:
                raise ConfigError(f"a filled buffer of {nbytes} bytes of {tag!r}")
            wire.append([tag, off, nbytes])
            fills.append((off, nbytes, fill))
            payload_len = off + nbytes
            off = align_up(payload_len)
        obj["batch"] = {"buffers": wire, "sorts": batch.sorts, "layouts": batch.layouts,
                        "recipes": batch.recipes, "bits_gen": batch.bits_gen}
        if batch.seeds:
            obj["batch"]["seeds"] = batch.seeds
    table = _table(obj, "side/extra")
    return Outgoing(Kind.DIFF, _step(step), FLAG_SYNC if sync else 0, table, payload_len,
                    buffers, fills)


def layout_meta(*, truncate_after: int | None = None, meta: Mapping[str, Any] | None = None,
                batch: int | None = None) -> Outgoing:
    """Lay out a META message (2.0): truncate the log after a step, merge keys into its
    metadata, set the records per group commit; applied in that order, in the order of
    the messages."""
    if truncate_after is not None and (type(truncate_after) is not int
                                       or not -1 <= truncate_after <= MAX_STEP):
        raise ConfigError(f"truncate_after={truncate_after!r} out of range")
    if batch is not None and (type(batch) is not int or batch < 1):
        raise ConfigError(f"batch={batch!r} must be an int >= 1")
    table = _table({"truncate_after": truncate_after, "meta": dict(meta) if meta else None,
                    "batch": batch}, "meta")
    return Outgoing(Kind.META, 0, 0, table, 0, [])


def layout_base(step: int, tensors: Sequence[RingTensor],
                meta: Mapping[str, Any] | None = None, *, parts: int = 0) -> Outgoing:
    """Lay out the BASE message of ``step``: raw, uncompressed tensors; ``parts``: the PART
    messages of this base sent just before it (2.1), whose tensors it adds."""
    entries, payload_len, buffers = _layout_tensors(tensors, base=True)
    obj: dict[str, Any] = {"tensors": entries, "meta": dict(meta) if meta else None}
    if parts:
        obj["parts"] = parts
    table = _table(obj, "base meta")
    return Outgoing(Kind.BASE, _step(step), 0, table, payload_len, buffers)


def layout_part(step: int, pieces: Sequence[tuple[str, str, Sequence[int], int, Any]],
                layout: Sequence[tuple[str, str, Sequence[int]]] | None = None,
                meta: Mapping[str, Any] | None = None) -> Outgoing:
    """Lay out a PART message (2.1) of the base of ``step``: ``pieces`` are (name, dtype
    tag, the tensor's whole shape, byte offset of the piece in the tensor, buffer of the
    piece's bytes); the first PART of a base carries its ``layout`` (name, dtype tag,
    shape of every tensor, in the order of the pieces) and ``meta``; the BASE closing the
    base follows (``layout_base(parts=n)``)."""
    obj: dict[str, Any] = {}
    if layout is not None:
        for name, tag, shape in layout:
            check_tensor(name, tag, shape, "raw", None, [], True, parts_known=False)
        obj["base"] = {"tensors": [[n, t, list(sh)] for n, t, sh in layout],
                       "meta": dict(meta) if meta else None}
    entries: list[list[Any]] = []
    buffers: list[tuple[int, memoryview]] = []
    off = end = 0
    for name, tag, shape, at, data in pieces:
        check_tensor(name, tag, shape, "raw", None, [], True, parts_known=False)
        v = bytes_of(name, "U8", data)
        size = math.prod(shape) * STORAGE_DTYPE[tag].itemsize
        if not 0 <= at <= at + v.nbytes <= size or (at | v.nbytes) % STORAGE_DTYPE[tag].itemsize:
            raise ConfigError(f"tensor {name!r}: a piece [{at}, {at + v.nbytes}) of a "
                              f"tensor of {size} bytes")
        entries.append([name, tag, list(shape), at, off, v.nbytes])
        buffers.append((off, v))
        end = off + v.nbytes
        off = align_up(end)
    obj["pieces"] = entries
    return Outgoing(Kind.PART, _step(step), 0, _table(obj, "base meta"), end, buffers)


def layout_open(path: str, options: Mapping[str, Any],
                meta: Mapping[str, Any] | None) -> Outgoing:
    """Lay out the OPEN message: the log's path, the writer's options, a new log's meta."""
    unknown = set(options) - set(OPEN_OPTIONS)
    if unknown:
        raise ConfigError(f"unknown writer option(s) {sorted(unknown)}")
    table = _table({"path": path, "options": dict(options), "meta": dict(meta) if meta
                    else None}, "meta")
    return Outgoing(Kind.OPEN, 0, 0, table, 0, [])


#: a buffer of at least this many bytes is copied into the ring by numpy, which releases
#: the GIL during the copy (a slice of a base copied on a helper thread then leaves the
#: training thread running; a ``memoryview`` assignment holds the GIL throughout)
_COPY_WITHOUT_GIL: Final = 256 << 10


def write_message(ring: Ring, seq: int, msg: Outgoing, span: int | None = None) -> None:
    """Copy ``msg`` into the slots from ``seq`` (the caller owns them: they are free), its
    header last. ``span``: the slots a PAD covers (else the message's own)."""
    at = ring.slot_offset(seq)
    span = msg.span(ring.slot_size) if span is None else span
    assert at + span * ring.slot_size <= ring.size, "a message never wraps"
    buf = ring.buf
    p = at + align_up(SLOT_HEADER_LEN + len(msg.table))
    for off, v in msg.buffers:
        if v.nbytes >= _COPY_WITHOUT_GIL:  # (numpy's copy lets other threads run)
            np.copyto(np.frombuffer(ring.mm, np.uint8, v.nbytes, p + off),
                      np.frombuffer(v, np.uint8))
        else:
            buf[p + off:p + off + v.nbytes] = v
    for off, n, fill in msg.fills:
        if n:
            with buf[p + off:p + off + n] as view:
                fill(view)
    buf[at + SLOT_HEADER_LEN:at + SLOT_HEADER_LEN + len(msg.table)] = msg.table
    head = bytearray(_SLOT.pack(SLOT_MAGIC, 0, seq, msg.step, msg.kind, msg.flags, 0, span,
                                len(msg.table), msg.payload_len))
    _U32.pack_into(head, 4, mask(crc32c(msg.table, crc32c(memoryview(head)[8:]))))
    buf[at:at + SLOT_HEADER_LEN] = head


def pad_message() -> Outgoing:
    """The PAD message (its span is given to :func:`write_message`)."""
    return Outgoing(Kind.PAD, 0, 0, b"", 0, [])


# ------------------------------------------------------------------------------ reading


def read_message(ring: Ring, seq: int) -> Message:
    """Read and check the message at slot number ``seq`` (section 3's order)."""
    index = seq % ring.slot_count
    at = ring.slot_offset(seq)
    where = f"ring slot {index}"
    magic, crc, got_seq, step, kind, flags, _r, span, table_len, payload_len = \
        _SLOT.unpack_from(ring.buf, at)
    if magic != SLOT_MAGIC:
        raise _bad(Reason.BAD_MAGIC, f"{where}: no message (magic {magic!r})", at)
    if not 1 <= span <= ring.slot_count - index:
        raise _bad(Reason.OUT_OF_BOUNDS, f"{where}: span {span} past the end of the ring "
                   f"({ring.slot_count - index} slots left)", at + _AT["span"])
    room = span * ring.slot_size
    if table_len > room - SLOT_HEADER_LEN:
        raise _bad(Reason.OUT_OF_BOUNDS, f"{where}: table of {table_len} bytes in a "
                   f"message of {room}", at + _AT["table_len"])
    t0 = at + SLOT_HEADER_LEN
    with ring.buf[t0:t0 + table_len] as table_view:  # (released: no view outlives a read)
        table_bytes = bytes(table_view)
    if crc != mask(crc32c(table_bytes, crc32c(ring.buf[at + 8:t0]))):
        raise _bad(Reason.CHECKSUM_MISMATCH, f"{where}: message CRC does not match",
                   at + _AT["crc"])
    if got_seq != seq:
        raise _bad(Reason.BAD_METADATA, f"{where}: sequence number {got_seq}, expected "
                   f"{seq}", at + _AT["seq"])
    if kind not in Kind.__members__.values():
        raise _bad(Reason.UNKNOWN_RECORD_TYPE, f"{where}: unknown kind {kind}",
                   at + _AT["kind"])
    if flags & ~FLAG_SYNC or (flags and kind != Kind.DIFF):
        raise _bad(Reason.BAD_METADATA, f"{where}: flags {flags:#x}", at + _AT["flags"])
    if step > MAX_STEP:
        raise _bad(Reason.OUT_OF_BOUNDS, f"{where}: step {step}", at + _AT["step"])
    p = align_up(SLOT_HEADER_LEN + table_len)
    if payload_len > room - p:
        raise _bad(Reason.OUT_OF_BOUNDS, f"{where}: payload of {payload_len} bytes past "
                   f"the message's {span} slot(s)", at + _AT["payload_len"])
    msg = Message(seq, span, Kind(kind), step, flags)
    if kind == Kind.PAD:
        return msg
    try:
        return _parse_table(msg, unpack_meta(table_bytes), at + p, payload_len)
    except FormatError as e:
        raise _bad(e.reason, f"{where}: {e.detail}", t0) from None


def _opt_map(table: Mapping[str, Any], key: str) -> dict[str, Any] | None:
    v = table.get(key)
    if v is not None and not isinstance(v, dict):
        raise _bad(Reason.BAD_METADATA, f"{key!r} is not a map")
    return v


def _parse_table(msg: Message, table: dict[str, Any], p: int, payload_len: int) -> Message:
    kind = msg.kind
    if kind == Kind.OPEN:
        path, options = table.get("path"), table.get("options")
        if type(path) is not str or not isinstance(options, dict) or set(options) - set(
                OPEN_OPTIONS):
            raise _bad(Reason.BAD_METADATA, "OPEN needs a path and known options")
        return Message(msg.seq, msg.span, kind, msg.step, msg.flags, path=path,
                       options=options, meta=_opt_map(table, "meta"))
    if kind == Kind.META:
        cut, batch = table.get("truncate_after"), table.get("batch")
        if cut is not None and (type(cut) is not int or not -1 <= cut <= MAX_STEP):
            raise _bad(Reason.BAD_METADATA, f"META truncate_after {cut!r}")
        if batch is not None and (type(batch) is not int or batch < 1):
            raise _bad(Reason.BAD_METADATA, f"META batch {batch!r}")
        return Message(msg.seq, msg.span, kind, msg.step, msg.flags,
                       meta=_opt_map(table, "meta"), truncate_after=cut,
                       records_per_batch=batch)
    if kind == Kind.PART:
        base = table.get("base")
        layout = None
        meta = None
        if base is not None:
            if not isinstance(base, dict) or not isinstance(base.get("tensors"), list):
                raise _bad(Reason.BAD_METADATA, "PART 'base' is not a map of tensors")
            layout = []
            for i, t in enumerate(base["tensors"]):
                if not isinstance(t, list) or len(t) != 3:
                    raise _bad(Reason.BAD_METADATA, f"base tensor {i} is not a 3-item list")
                check_tensor(t[0], t[1], t[2], "raw", None, [], True, parts_known=False)
                layout.append((t[0], t[1], tuple(t[2])))
            if len({n for n, _t, _s in layout}) != len(layout):
                raise _bad(Reason.BAD_METADATA, "a base tensor named twice")
            meta = _opt_map(base, "meta")
        return Message(msg.seq, msg.span, kind, msg.step, msg.flags,
                       pieces=_parse_pieces(table.get("pieces"), p, payload_len),
                       layout=None if layout is None else tuple(layout), meta=meta)
    tensors = _parse_tensors(table.get("tensors"), p, payload_len, kind == Kind.BASE)
    if kind == Kind.BASE:
        parts = table.get("parts", 0)
        if type(parts) is not int or not 0 <= parts <= MAX_STEP:
            raise _bad(Reason.BAD_METADATA, f"BASE parts {parts!r}")
        return Message(msg.seq, msg.span, kind, msg.step, msg.flags, tensors,
                       meta=_opt_map(table, "meta"), parts=parts)
    record_kind = table.get("kind")
    if type(record_kind) is not str:
        raise _bad(Reason.BAD_METADATA, f"record kind {record_kind!r} is not a str")
    raw_batch = table.get("batch")
    batch = None
    if raw_batch is not None:
        batch = parse_batch(raw_batch, p, payload_len, tensors)
    return Message(msg.seq, msg.span, kind, msg.step, msg.flags, tensors, record_kind,
                   _opt_map(table, "side"), _opt_map(table, "extra"), batch=batch)


def _parse_tensors(raw: object, p: int, payload_len: int, base: bool
                   ) -> tuple[SlotTensor, ...]:
    if not isinstance(raw, list):
        raise _bad(Reason.BAD_METADATA, "'tensors' is not a list")
    out = []
    names: set[str] = set()
    end = 0  # parts are in increasing order: each starts at or after the previous end
    for i, t in enumerate(raw):
        if not isinstance(t, list) or len(t) != 7:
            raise _bad(Reason.BAD_METADATA, f"tensor {i} is not a 7-item list")
        name, dtype, shape, codec, params, zstd, parts = t
        if not isinstance(parts, list) or not all(
                isinstance(x, list) and len(x) == 3 and type(x[1]) is int
                and type(x[2]) is int for x in parts) or not isinstance(params, dict):
            raise _bad(Reason.BAD_METADATA, f"tensor {i}: bad parts or params")
        check_tensor(name, dtype, shape, codec, zstd, [(x[0], x[2]) for x in parts], base)
        if name in names:
            raise _bad(Reason.BAD_METADATA, f"duplicate tensor name {name!r}")
        names.add(name)
        slot_parts = []
        for tag, off, length in parts:
            if off % 64 or off < end or length < 0 or off + length > payload_len:
                raise _bad(Reason.OUT_OF_BOUNDS, f"tensor {name!r}: part [{off}, "
                           f"{off + length}) is not aligned, ordered and inside the "
                           f"payload of {payload_len} bytes")
            end = off + length
            slot_parts.append(SlotPart(tag, p + off, length))
        out.append(SlotTensor(name, dtype, tuple(shape), codec, params, zstd,
                              tuple(slot_parts)))
    return tuple(out)


def _parse_pieces(raw: object, p: int, payload_len: int) -> tuple[SlotPiece, ...]:
    """A PART's pieces (2.1), each checked against the tensor it names and the payload;
    that the pieces of a tensor follow each other is the writer process's to check."""
    if not isinstance(raw, list):
        raise _bad(Reason.BAD_METADATA, "'pieces' is not a list")
    out = []
    end = 0
    for i, t in enumerate(raw):
        if not isinstance(t, list) or len(t) != 6 or not all(type(x) is int for x in t[3:]):
            raise _bad(Reason.BAD_METADATA, f"piece {i} is not a 6-item list")
        name, dtype, shape, at, off, length = t
        check_tensor(name, dtype, shape, "raw", None, [], True, parts_known=False)
        item = STORAGE_DTYPE[dtype].itemsize
        size = math.prod(shape) * item
        if not 0 <= at <= at + length <= size or (at | length) % item:
            raise _bad(Reason.OUT_OF_BOUNDS, f"piece {i} of {name!r}: bytes [{at}, "
                       f"{at + length}) of a tensor of {size} bytes")
        if off % 64 or off < end or off + length > payload_len:
            raise _bad(Reason.OUT_OF_BOUNDS, f"piece {i} of {name!r}: [{off}, "
                       f"{off + length}) is not aligned, ordered and inside the payload "
                       f"of {payload_len} bytes")
        end = off + length
        out.append(SlotPiece(name, dtype, tuple(shape), at, SlotPart("U8", p + off, length)))
    return tuple(out)


def _bad_batch(detail: str) -> FormatError:
    return _bad(Reason.BAD_METADATA, f"batch: {detail}")


def _int(v: object, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v <= hi


def _layout_list(raw: object, what: str) -> tuple[tuple[int, int], ...]:
    if not isinstance(raw, list) or not all(
            isinstance(x, list) and len(x) == 2 and _int(x[0], 0, MAX_ELEMENTS)
            and _int(x[1], 0, MAX_ELEMENTS) for x in raw):
        raise _bad_batch(f"{what}: a layout is a list of [numel, k]")
    return tuple((int(n), int(k)) for n, k in raw)


def parse_batch(raw: object, p: int, payload_len: int, tensors: Sequence[SlotTensor]
                ) -> SlotBatch:
    """Check and read a DIFF table's ``batch`` (section 3.1): buffers inside the payload
    after the tensors' parts, sorts and layouts naming int64 index buffers, each recipe's
    op, slots (inside their buffers) and params, record places a permutation."""
    if not isinstance(raw, dict):
        raise _bad_batch("not a map")
    bufs, sorts, lays, recs, gen = (raw.get(k) for k in (
        "buffers", "sorts", "layouts", "recipes", "bits_gen"))
    if not (isinstance(bufs, list) and isinstance(sorts, list) and isinstance(lays, list)
            and isinstance(recs, list) and _int(gen, 0, MAX_STEP)):
        raise _bad_batch("buffers, sorts, layouts, recipes must be lists, bits_gen an int")
    end = max((q.offset + q.length - p for t in tensors for q in t.parts), default=0)
    parts: list[SlotPart] = []
    elems: list[int] = []
    for i, b in enumerate(bufs):
        if not (isinstance(b, list) and len(b) == 3 and b[0] in STORAGE_DTYPE
                and _int(b[1], 0, payload_len) and _int(b[2], 0, payload_len)):
            raise _bad_batch(f"buffer {i} is not [dtype, offset, length]")
        tag, off, length = b
        size = STORAGE_DTYPE[tag].itemsize
        if off % 64 or off < end or off + length > payload_len or length % size:
            raise _bad(Reason.OUT_OF_BOUNDS, f"batch buffer {i}: [{off}, {off + length}) is "
                       f"not aligned, ordered, whole {tag} and inside the payload of "
                       f"{payload_len} bytes")
        end = off + length
        parts.append(SlotPart(tag, p + off, length))
        elems.append(length // size)

    def index_buffer(j: object, what: str) -> int:
        if type(j) is not int or not 0 <= j < len(parts) or parts[j].dtype != "I64":
            raise _bad_batch(f"{what}: {j!r} is not an I64 buffer")
        return j

    sort_t = []
    for i, x in enumerate(sorts):
        if not isinstance(x, list) or len(x) != 3 or not _int(x[1], 0, len(parts) - 1):
            raise _bad_batch(f"sort {i} is not [indices, values, layout]")
        ib, vb = index_buffer(x[0], f"sort {i}"), int(x[1])
        lay = _layout_list(x[2], f"sort {i}")
        if sum(k for _n, k in lay) != elems[ib] or elems[ib] != elems[vb]:
            raise _bad_batch(f"sort {i}: its layout holds {sum(k for _n, k in lay)} pairs, "
                             f"its buffers {elems[ib]} and {elems[vb]}")
        sort_t.append((ib, vb, lay))
    lay_t = []
    for i, x in enumerate(lays):
        if not isinstance(x, list) or len(x) != 2:
            raise _bad_batch(f"layout {i} is not [indices, layout]")
        lay_t.append((index_buffer(x[0], f"layout {i}"), _layout_list(x[1], f"layout {i}")))
    total = len(tensors) + len(recs)
    names = {t.name for t in tensors}
    places: set[int] = set()
    out = []
    for i, r in enumerate(recs):
        rec = _parse_recipe(i, r, total, elems)
        if rec.name in names or rec.at in places:
            raise _bad_batch(f"recipe {i}: duplicate name {rec.name!r} or place {rec.at}")
        names.add(rec.name)
        places.add(rec.at)
        out.append(rec)
    seeds = raw.get("seeds", [])
    if not isinstance(seeds, list) or not all(
            isinstance(x, list) and len(x) == 3 and type(x[0]) is str and x[1] in STORAGE_DTYPE
            and _int(x[2], 0, len(parts) - 1) for x in seeds):
        raise _bad_batch("seeds: each is [name, dtype, buffer]")
    assert type(gen) is int
    return SlotBatch(tuple(parts), tuple(sort_t), tuple(lay_t), tuple(out), gen,
                     tuple((str(n), str(t), int(b)) for n, t, b in seeds))


def _slot(x: object, elems: Sequence[int], what: str) -> tuple[int, int, int]:
    if not (isinstance(x, list) and len(x) == 3 and _int(x[0], 0, len(elems) - 1)
            and _int(x[1], 0, MAX_ELEMENTS) and _int(x[2], 0, MAX_ELEMENTS)):
        raise _bad_batch(f"{what}: a slot is [buffer, offset, numel]")
    b, off, n = x
    if off + n > elems[b]:
        raise _bad(Reason.OUT_OF_BOUNDS, f"batch: {what}: elements [{off}, {off + n}) past "
                   f"buffer {b} of {elems[b]}")
    return int(b), int(off), int(n)


def _parse_recipe(i: int, r: object, total: int, elems: Sequence[int]) -> SlotRecipe:
    if not isinstance(r, list) or len(r) != 8:
        raise _bad_batch(f"recipe {i} is not an 8-item list")
    at, name, dtype, shape, zstd, op, slots, params = r
    what = f"recipe {i} ({name!r})"
    if not _int(at, 0, total - 1):
        raise _bad_batch(f"{what}: place {at!r} outside the record's {total} tensors")
    check_tensor(name, dtype, shape, "raw", zstd, [], base=False, parts_known=False)
    spec = RECIPES.get(op) if type(op) is str else None
    if spec is None or not isinstance(slots, list) or not isinstance(params, list) or (
            len(slots), len(params)) != spec[1:]:
        raise _bad_batch(f"{what}: unknown op {op!r} or wrong slots/params")
    got: list[Any] = []
    for j, x in enumerate(slots):
        if op == "topk":
            if not (isinstance(x, list) and len(x) == 4 and type(x[2]) is int
                    and type(x[3]) is bool):
                raise _bad_batch(f"{what}: a sparse slot is [slot, slot, base, sorted]")
            got.append(SparseSlot(BatchSlot(*_slot(x[0], elems, what)),
                                  BatchSlot(*_slot(x[1], elems, what)), x[2], x[3]))
        else:
            got.append(BatchSlot(*_slot(x, elems, f"{what} slot {j}")))
    n = math.prod(shape)
    ok = {"bits": params[:1] == [dtype], "changed": params == [dtype, name],
          "topk": params == [n, dtype],
          "qsgd": all(_int(v, 1, 1 << 30) for v in params)}.get(op, True)
    if not ok:
        raise _bad_batch(f"{what}: params {params!r} do not fit op {op!r}, dtype {dtype}, "
                         f"shape {list(shape)}")
    return SlotRecipe(at, name, dtype, tuple(shape), zstd, op, tuple(got), tuple(params))


# ------------------------------------------------------------------------------ channel


def pack_request(op: Op, arg: int) -> bytes:
    """One request packet."""
    return _REQUEST.pack(op, arg)


def unpack_request(data: bytes) -> tuple[Op, int]:
    """Parse one request packet (``FormatError`` on a bad size or op)."""
    if len(data) != _REQUEST.size:
        raise _bad(Reason.BAD_RECORD_LENGTH, f"request of {len(data)} bytes, not "
                   f"{_REQUEST.size}")
    op, arg = _REQUEST.unpack(data)
    if op not in Op.__members__.values():
        raise _bad(Reason.BAD_METADATA, f"unknown request op {op}")
    return Op(op), arg


# ------------------------------------------------------------------------------ error reply

#: the classes a reply may name: every LowdiffError class of lowdiff_store.errors
_ERRORS: Final[dict[str, type[LowdiffError]]] = {
    n: c for n in errors.__all__
    if isinstance(c := getattr(errors, n), type) and issubclass(c, LowdiffError)}


def _describe(e: BaseException) -> dict[str, Any]:
    """The class, reason, detail and errno of an exception, as section 6 carries them."""
    if isinstance(e, LowdiffError):
        name = next(c.__name__ for c in type(e).__mro__ if c.__name__ in _ERRORS)
        return {"class": name, "reason": e.reason.value, "detail": e.detail,
                "errno": getattr(e, "errno", None)}
    if isinstance(e, OSError):
        return {"class": "OSError", "reason": None, "detail": e.strerror or str(e),
                "errno": e.errno}
    return {"class": "RuntimeError", "reason": None, "detail": f"{type(e).__name__}: {e}",
            "errno": None}


def encode_reply(err: BaseException, step: int | None) -> bytes:
    """The error reply for ``err`` (a LowdiffError; anything else is wrapped as the
    writer process's CommitError), its detail cut to fit the header."""
    if not isinstance(err, LowdiffError):
        wrapped = CommitError(f"writer process failed: {type(err).__name__}: {err}")
        wrapped.__cause__ = err
        err = wrapped
    cause = err.__cause__
    body = _describe(err)
    body.update(path=err.path, offset=err.offset, step=step,
                cause=None if cause is None else _describe(cause))
    out = pack_meta(body)
    if len(out) > MAX_REPLY:  # cut to 1400 + 800 + 400 bytes of text at most: it fits
        body["detail"] = _cut(body["detail"], 1400)
        if body["cause"] is not None:
            body["cause"]["detail"] = _cut(body["cause"]["detail"], 800)
        if body["path"] is not None:
            body["path"] = _cut(body["path"], 400)
        out = pack_meta(body)
    return out


def _cut(text: str, n: int) -> str:
    """``text`` in at most ``n`` UTF-8 bytes (cut texts end with "...")."""
    raw = text.encode()
    return text if len(raw) <= n else raw[:n - 3].decode(errors="ignore") + "..."


def publish_failure(ring: Ring, reply: bytes) -> None:
    """Write the error reply, then its length, then ``state = failed`` (section 6)."""
    ring.buf[REPLY_AT:REPLY_AT + len(reply)] = reply
    ring.buf[128:136] = _REPLY_HEAD.pack(0, mask(crc32c(reply)))
    ring.buf[128:132] = _U32.pack(len(reply))
    ring.set(Word.STATE, State.FAILED)


def _rebuild(d: Mapping[str, Any], *, path: str | None = None,
             offset: int | None = None) -> BaseException:
    cls_name, detail, code = d.get("class"), str(d.get("detail", "")), d.get("errno")
    if cls_name == "OSError" and type(code) is int:
        return OSError(code, detail)
    if cls_name == "RuntimeError" or cls_name == "OSError":
        return RuntimeError(detail)
    cls = _ERRORS.get(cls_name, CommitError) if type(cls_name) is str else CommitError
    reason = d.get("reason")
    err = cls.__new__(cls)
    LowdiffError.__init__(err, detail, path=path, offset=offset,
                          reason=Reason(reason) if reason in Reason._value2member_map_
                          else None)
    if type(code) is int and isinstance(err, OSError):
        err.errno = code
    return err


def read_failure(ring: Ring) -> BaseException | None:
    """The writer process's failure as the exception to raise (``None`` if none): the
    class, reason, path, offset and detail it had, its cause as ``__cause__``."""
    n, crc = _REPLY_HEAD.unpack_from(ring.buf, 128)
    if n == 0:
        return None
    reply = bytes(ring.buf[REPLY_AT:REPLY_AT + min(n, MAX_REPLY)])
    try:
        if n > MAX_REPLY or crc != mask(crc32c(reply)):
            raise _bad(Reason.CHECKSUM_MISMATCH, "error reply does not match its CRC")
        d = unpack_meta(reply)
        path, offset = d.get("path"), d.get("offset")
        err = _rebuild(d, path=path if type(path) is str else None,
                       offset=offset if type(offset) is int else None)
        cause = d.get("cause")
        if isinstance(cause, dict):
            err.__cause__ = _rebuild(cause)
    except FormatError as e:
        return CommitError(f"the writer process failed; its error reply is unreadable "
                           f"({e.detail})")
    return err


__all__ = ["DOORBELL", "FLAG_SYNC", "HEADER_LEN", "MAX_REPLY", "MAX_SLOTS", "MAX_SLOT_SIZE",
           "MIN_SLOT_SIZE", "OPEN_OPTIONS", "REPLY_AT", "REQUEST_SIZE", "RING_MAGIC",
           "RING_MAJOR", "RING_MINOR", "SLOT_HEADER_LEN", "SLOT_MAGIC", "Kind", "Message",
           "MORE_AT", "STATS_AT", "WRITER_STATS", "More", "Op", "Outgoing", "Ring",
           "RingBatch", "RingTensor", "SlotBatch", "SlotPart", "SlotPiece", "SlotRecipe",
           "SlotTensor", "State", "Word", "check_tensor", "encode_reply", "layout_base",
           "bytes_of", "layout_diff", "layout_part", "layout_meta", "layout_open", "parse_batch",
           "make_ring_fd", "pad_message", "pack_request", "publish_failure", "read_failure",
           "read_message", "unpack_request", "write_message"]
