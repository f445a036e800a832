"""Segment files: a file header followed by records, appended and never rewritten.

Scanning distinguishes a *torn tail* (what a crash leaves after the last complete record
of the active segment: a partial header, a record running past the end of the file, or a
checksum failure with nothing valid after it) from *corruption* (anything else). A torn
tail is not an error; corruption is reported with file, offset and reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import CorruptRecordError, FormatError, LowdiffError, Reason
from ..format.checksum import crc32c, mask
from ..format.constants import (
    ALIGN,
    FILE_HEADER_SIZE,
    OPTIONAL_TYPE_MIN,
    RECORD_HEADER_SIZE,
    RECORD_MAGIC,
    RECORD_TYPE_DIFF,
    SEGMENT_MAGIC,
)
from ..format.framing import (
    FileHeader,
    RecordHeader,
    decode_file_header,
    decode_record_header,
    unpack_meta,
)
from ..storage import AppendHandle, Source, Store

#: Called for every corruption found: (error) -> None. Raising stops the scan (strict).
Reporter = Callable[[LowdiffError], None]


@dataclass(frozen=True)
class RecordRef:
    """A validated record's place in a segment."""

    step: int
    offset: int
    length: int
    crc: int


@dataclass
class ScanResult:
    """What a scan found: valid records, the end of valid data, and what was dropped."""

    records: list[RecordRef]
    valid_end: int
    torn_tail_bytes: int = 0
    corrupt_bytes: int = 0


def create_segment(store: Store, name: str, log_id: bytes, segment_id: int, first_step: int
                   ) -> AppendHandle:
    """Create a new segment with its header, durable (the store makes the new object
    durable in its directory; the header is synced)."""
    f = store.open_append(name, create=True)
    try:
        f.append([FileHeader(SEGMENT_MAGIC, log_id, segment_id, first_step,
                             time.time_ns()).encode()])
        f.sync()
    except BaseException:
        f.close()
        raise
    return f


def read_segment_header(src: Source) -> FileHeader:
    """The header of a segment, with the file's path in any error."""
    try:
        return decode_file_header(src.read(0, min(src.size, FILE_HEADER_SIZE)), SEGMENT_MAGIC)
    except LowdiffError as e:
        e.path = src.path
        raise _relabel(e) from None


def _relabel(e: LowdiffError) -> LowdiffError:
    # rebuild the message now that path/offset are set
    Exception.__init__(e, str(e))
    return e


def _corrupt(src: Source, offset: int, reason: Reason, detail: str) -> CorruptRecordError:
    return CorruptRecordError(detail, reason=reason, path=src.path, offset=offset)


def check_record(src: Source, offset: int, hdr: RecordHeader) -> bool:
    """True when the record's CRC matches its bytes."""
    body = src.read(offset + 8, hdr.length - 8)
    return mask(crc32c(body)) == hdr.crc


def scan_segment(
    src: Source,
    start: int,
    *,
    active: bool,
    known_end: int = 0,
    reporter: Reporter | None = None,
    min_step: int = -1,
) -> ScanResult:
    """Validate records from ``start`` to the end of ``src``.

    ``active``: this is the last segment of the log, whose tail may be torn by a crash.
    ``known_end``: bytes before this offset are known durable (an index entry names a
    record ending there), so a bad record before it is corruption, never a torn tail.
    ``reporter`` receives each corruption; if it raises, the scan stops (strict mode).
    Without a reporter the first corruption raises. In tolerant mode (a reporter that
    returns) the scan resynchronizes on the next aligned record magic with a valid CRC.
    """
    records: list[RecordRef] = []
    pos = start
    size = src.size
    corrupt = 0
    last_step = min_step

    def report(err: LowdiffError) -> None:
        if reporter is None:
            raise err
        reporter(err)

    while pos < size:
        bad: tuple[Reason, str] | None = None
        hdr: RecordHeader | None = None
        if size - pos < RECORD_HEADER_SIZE:
            bad = (Reason.TRUNCATED, f"{size - pos} bytes left, too few for a record header")
        else:
            try:
                hdr = decode_record_header(src.read(pos, RECORD_HEADER_SIZE))
            except FormatError as e:
                bad = (e.reason, e.detail)
            if hdr is not None:
                if pos + hdr.length > size:
                    bad = (Reason.TRUNCATED,
                           f"record of {hdr.length} bytes runs past the end of the file")
                elif not _check_record_safely(src, pos, hdr):
                    bad = (Reason.CHECKSUM_MISMATCH, "record checksum mismatch")
                elif hdr.type < OPTIONAL_TYPE_MIN and hdr.type != RECORD_TYPE_DIFF:
                    bad = (Reason.UNKNOWN_RECORD_TYPE, f"unknown record type {hdr.type}")
                elif hdr.type == RECORD_TYPE_DIFF and hdr.step <= last_step:
                    bad = (Reason.STEP_OUT_OF_ORDER,
                           f"step {hdr.step} does not follow step {last_step}")
        if bad is None:
            assert hdr is not None
            if hdr.type == RECORD_TYPE_DIFF:
                records.append(RecordRef(hdr.step, pos, hdr.length, hdr.crc))
                last_step = hdr.step
            pos += hdr.length
            continue
        # A problem at pos. Torn tail or corruption?
        nxt = _resync(src, pos + ALIGN, last_step)
        # A complete record with a valid CRC that breaks the rules was written that way:
        # never a crash artefact, so never a torn tail.
        tearable = bad[0] not in (Reason.STEP_OUT_OF_ORDER, Reason.UNKNOWN_RECORD_TYPE)
        if active and tearable and nxt is None and pos >= known_end:
            return ScanResult(records, pos, torn_tail_bytes=size - pos, corrupt_bytes=corrupt)
        end = nxt if nxt is not None else size
        report(_corrupt(src, pos, bad[0], f"{bad[1]}; {end - pos} bytes dropped"))
        corrupt += end - pos
        if nxt is None:
            return ScanResult(records, pos, corrupt_bytes=corrupt)
        pos = nxt
    return ScanResult(records, pos, corrupt_bytes=corrupt)


def _check_record_safely(src: Source, offset: int, hdr: RecordHeader) -> bool:
    """:func:`check_record`, where bytes that vanish while being read (a pread source whose
    file a writer cut meanwhile: ``truncated``) count as a failed check (a torn tail)."""
    try:
        return check_record(src, offset, hdr)
    except FormatError as e:
        if e.reason is Reason.TRUNCATED:
            return False
        raise


def _resync(src: Source, pos: int, last_step: int) -> int | None:
    """The offset of the next aligned, fully valid record after ``pos``, or None."""
    size = src.size
    pos = (pos + ALIGN - 1) // ALIGN * ALIGN
    chunk = 1 << 20
    while pos + RECORD_HEADER_SIZE <= size:
        try:
            window = bytes(src.read(pos, min(chunk, size - pos)))
        except FormatError as e:  # the file was cut while being read: nothing follows
            if e.reason is Reason.TRUNCATED:
                return None
            raise
        i = window.find(RECORD_MAGIC)
        while i >= 0:
            if i % ALIGN == 0 and pos + i + RECORD_HEADER_SIZE <= size:
                cand = pos + i
                try:
                    hdr = decode_record_header(src.read(cand, RECORD_HEADER_SIZE))
                    if (cand + hdr.length <= size and _check_record_safely(src, cand, hdr)
                            and hdr.step > last_step):
                        return cand
                except FormatError:
                    pass
            i = window.find(RECORD_MAGIC, i + 1)
        pos += max(ALIGN, len(window) - len(window) % ALIGN)
    return None


def read_record_meta(src: Source, ref: RecordRef, *, verify: bool = True
                     ) -> tuple[RecordHeader, dict[str, Any], memoryview]:
    """Read a record: (header, metadata map, payload view). Checks step, length and CRC."""
    hdr_bytes = src.read(ref.offset, RECORD_HEADER_SIZE)
    try:
        hdr = decode_record_header(hdr_bytes)
    except LowdiffError as e:
        e.path, e.offset = src.path, ref.offset
        raise _relabel(e) from None
    if hdr.step != ref.step or hdr.length != ref.length:
        raise CorruptRecordError(
            f"index says step {ref.step} ({ref.length} bytes) but the record holds step "
            f"{hdr.step} ({hdr.length} bytes)", reason=Reason.INDEX_STALE,
            path=src.path, offset=ref.offset)
    record = src.read(ref.offset, hdr.length)
    if verify and mask(crc32c(record[8:])) != hdr.crc:
        raise _corrupt(src, ref.offset, Reason.CHECKSUM_MISMATCH, "record checksum mismatch")
    try:
        meta = unpack_meta(record[RECORD_HEADER_SIZE:RECORD_HEADER_SIZE + hdr.meta_len])
    except LowdiffError as e:
        e.path, e.offset = src.path, ref.offset + RECORD_HEADER_SIZE
        raise _relabel(e) from None
    return hdr, meta, record[hdr.payload_start:]




__all__ = [
    "RecordRef",
    "Reporter",
    "ScanResult",
    "check_record",
    "create_segment",
    "read_record_meta",
    "read_segment_header",
    "scan_segment",
]
