"""Byte layouts of file headers, record headers and metadata (pure: bytes in, bytes out).

Every function here validates what it parses and raises a :class:`FormatError` subclass
with a stable reason; callers add the file path and absolute offset. The layouts are
specified in ``format_spec/log_format.md``.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from ..errors import (
    BadMagicError,
    CorruptRecordError,
    FormatError,
    Reason,
    UnsupportedVersionError,
)
from .checksum import crc32c, mask
from .constants import (
    ALIGN,
    FILE_HEADER_SIZE,
    FORMAT_MAJOR,
    FORMAT_MINOR,
    MANIFEST_HEADER_SIZE,
    MANIFEST_MAGIC,
    MAX_MANIFEST_BYTES,
    MAX_META_BYTES,
    MAX_STEP,
    RECORD_HEADER_SIZE,
    RECORD_MAGIC,
)

# magic[8] major u16 minor u16 header_len u32 log_id[16] file_id u64 first_step u64
# created_ns u64 reserved u32 | crc u32 (masked crc32c of the preceding header bytes)
_FILE_HEADER = struct.Struct("<8sHHI16sQQQI")
_U32 = struct.Struct("<I")
# magic[4] crc u32 | type u8 flags u8 reserved u16 meta_len u32 step u64 length u64
_RECORD_HEADER = struct.Struct("<4sIBBHIQQ")
# magic[8] major u16 minor u16 body_len u32 crc u32
_MANIFEST_HEADER = struct.Struct("<8sHHII")

assert _FILE_HEADER.size + 4 == FILE_HEADER_SIZE
assert _RECORD_HEADER.size == RECORD_HEADER_SIZE
assert _MANIFEST_HEADER.size == MANIFEST_HEADER_SIZE


def align_up(n: int, a: int = ALIGN) -> int:
    """Round ``n`` up to a multiple of ``a``."""
    return (n + a - 1) // a * a


def check_version(major: int, minor: int, offset: int | None = None) -> None:
    """Refuse a newer major version; any minor of a known major is readable.
    ``offset`` is where the major version field sits in the file (for the error)."""
    if major > FORMAT_MAJOR or major < 1:
        raise UnsupportedVersionError(major, FORMAT_MAJOR, offset=offset)


# ----------------------------------------------------------------------------- file header


@dataclass(frozen=True)
class FileHeader:
    """Header of a segment (``.ldlog``) or index (``.ldidx``) file."""

    magic: bytes
    log_id: bytes
    file_id: int
    first_step: int
    created_ns: int
    major: int = FORMAT_MAJOR
    minor: int = FORMAT_MINOR
    header_len: int = FILE_HEADER_SIZE

    def encode(self) -> bytes:
        """The 64-byte header, CRC included."""
        body = _FILE_HEADER.pack(
            self.magic, self.major, self.minor, FILE_HEADER_SIZE, self.log_id,
            self.file_id, self.first_step, self.created_ns, 0,
        )
        return body + _U32.pack(mask(crc32c(body)))


def decode_file_header(buf: bytes | memoryview, magic: bytes) -> FileHeader:
    """Parse and check a file header. ``buf`` holds at least the first bytes of the file.

    Order of checks (fixed forever, so old readers refuse new files cleanly): length,
    magic, major version, header length, CRC.
    """
    if len(buf) < 12:
        raise FormatError(f"file shorter than its header ({len(buf)} bytes)",
                          reason=Reason.TRUNCATED, offset=0)
    if bytes(buf[:8]) != magic:
        raise BadMagicError(f"expected magic {magic!r}, found {bytes(buf[:8])!r}", offset=0)
    major, minor = struct.unpack_from("<HH", buf, 8)
    check_version(major, minor, 8)
    if len(buf) < 16:
        raise FormatError("file shorter than its header", reason=Reason.TRUNCATED, offset=0)
    (header_len,) = _U32.unpack_from(buf, 12)
    if header_len < FILE_HEADER_SIZE or header_len % ALIGN or header_len > 1 << 20:
        raise FormatError(f"bad header length {header_len}", reason=Reason.BAD_RECORD_LENGTH,
                          offset=12)
    if len(buf) < header_len:
        raise FormatError(f"file shorter than its {header_len}-byte header",
                          reason=Reason.TRUNCATED, offset=0)
    (stored,) = _U32.unpack_from(buf, header_len - 4)
    if mask(crc32c(bytes(buf[: header_len - 4]))) != stored:
        raise CorruptRecordError("file header checksum mismatch",
                                 reason=Reason.CHECKSUM_MISMATCH, offset=0)
    (_m, major, minor, _hl, log_id, file_id, first_step, created_ns, _r) = (
        _FILE_HEADER.unpack_from(buf, 0))
    return FileHeader(magic, log_id, file_id, first_step, created_ns, major, minor, header_len)


# --------------------------------------------------------------------------- record header


@dataclass(frozen=True)
class RecordHeader:
    """The fixed 32-byte header of a record. ``length`` counts the whole record."""

    crc: int
    type: int
    flags: int
    meta_len: int
    step: int
    length: int

    @property
    def payload_start(self) -> int:
        """Offset of the payload area from the start of the record."""
        return align_up(RECORD_HEADER_SIZE + self.meta_len)


def record_layout(meta_len: int, payload_len: int) -> tuple[int, int]:
    """(payload_start, total record length) for the given sizes."""
    start = align_up(RECORD_HEADER_SIZE + meta_len)
    return start, align_up(start + payload_len)


def pack_record_header(type_: int, meta_len: int, step: int, length: int) -> bytearray:
    """A record header with a zero CRC field; the caller fills the CRC with
    :func:`set_record_crc` once the CRC over bytes [8, length) is known."""
    return bytearray(_RECORD_HEADER.pack(RECORD_MAGIC, 0, type_, 0, 0, meta_len, step, length))


def set_record_crc(header: bytearray, crc: int) -> None:
    """Store the masked CRC into a header made by :func:`pack_record_header`."""
    _U32.pack_into(header, 4, mask(crc))


def decode_record_header(buf: bytes | memoryview) -> RecordHeader:
    """Parse a record header and check what can be checked without the rest of the record
    (magic, length alignment, meta length). The CRC is checked by the caller."""
    if len(buf) < RECORD_HEADER_SIZE:
        raise FormatError("truncated record header", reason=Reason.TRUNCATED)
    magic, crc, type_, flags, _res, meta_len, step, length = _RECORD_HEADER.unpack_from(buf, 0)
    if magic != RECORD_MAGIC:
        raise CorruptRecordError(f"bad record magic {magic!r}", reason=Reason.BAD_MAGIC)
    if length % ALIGN or length < ALIGN:
        raise CorruptRecordError(f"bad record length {length}", reason=Reason.BAD_RECORD_LENGTH)
    if meta_len > MAX_META_BYTES:
        raise CorruptRecordError(f"metadata of {meta_len} bytes exceeds the cap",
                                 reason=Reason.METADATA_TOO_LARGE)
    if align_up(RECORD_HEADER_SIZE + meta_len) > length:
        raise CorruptRecordError(f"metadata of {meta_len} bytes overflows the record",
                                 reason=Reason.BAD_RECORD_LENGTH)
    if step > MAX_STEP:
        raise CorruptRecordError(f"step {step} out of range", reason=Reason.OUT_OF_BOUNDS)
    return RecordHeader(crc, type_, flags, meta_len, step, length)


# -------------------------------------------------------------------------------- msgpack


def pack_meta(obj: Mapping[str, Any]) -> bytes:
    """Metadata is msgpack with str keys; bin for bytes; no extension types."""
    out: bytes = msgpack.packb(obj, use_bin_type=True)
    if len(out) > MAX_META_BYTES:
        raise FormatError(f"metadata of {len(out)} bytes exceeds the cap",
                          reason=Reason.METADATA_TOO_LARGE)
    return out


def unpack_meta(buf: bytes | memoryview, *, cap: int = MAX_META_BYTES) -> dict[str, Any]:
    """Decode msgpack metadata (a map at the top), with size caps on every container.

    No extension types and no object hooks: nothing read can choose code to run.
    """
    if len(buf) > cap:
        raise FormatError(f"metadata of {len(buf)} bytes exceeds the cap",
                          reason=Reason.METADATA_TOO_LARGE)
    try:
        obj = msgpack.unpackb(
            buf, raw=False, strict_map_key=True, use_list=True,
            ext_hook=_no_ext,
        )
    except FormatError:
        raise
    except Exception as e:  # msgpack raises several unrelated types on bad input
        raise FormatError(f"undecodable metadata ({type(e).__name__})",
                          reason=Reason.BAD_METADATA) from None
    if not isinstance(obj, dict):
        raise FormatError("metadata is not a map", reason=Reason.BAD_METADATA)
    # msgpack decodes extension type -1 (timestamp) itself, without calling ext_hook. Every
    # encoding of it holds the type byte 0xFF, so the walk that refuses it runs only when
    # that byte occurs somewhere (a -1, or inside some bin or str).
    if b"\xff" in bytes(buf):
        _refuse_timestamps(obj)
    return obj


def _no_ext(code: int, data: bytes) -> Any:
    raise FormatError(f"msgpack extension type {code} is not allowed", reason=Reason.BAD_METADATA)


def _refuse_timestamps(obj: Any) -> None:
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, msgpack.Timestamp):
            _no_ext(-1, b"")
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)


# ----------------------------------------------------------------------------- manifest


def pack_manifest(body: Mapping[str, Any], magic: bytes = MANIFEST_MAGIC) -> bytes:
    """The whole manifest file: header then msgpack body (``magic`` selects the kind:
    a log's ``MANIFEST`` or a sharded checkpoint's ``SHARDS``)."""
    data = pack_meta(body)
    return _MANIFEST_HEADER.pack(magic, FORMAT_MAJOR, FORMAT_MINOR, len(data),
                                 mask(crc32c(data))) + data


def unpack_manifest(buf: bytes | memoryview, magic: bytes = MANIFEST_MAGIC) -> dict[str, Any]:
    """Parse and check a manifest file's bytes."""
    if len(buf) < 12:
        raise FormatError("manifest shorter than its header", reason=Reason.TRUNCATED, offset=0)
    if bytes(buf[:8]) != magic:
        raise BadMagicError(f"expected magic {magic!r}, found {bytes(buf[:8])!r}",
                            offset=0)
    major, minor = struct.unpack_from("<HH", buf, 8)
    check_version(major, minor, 8)
    if len(buf) < MANIFEST_HEADER_SIZE:
        raise FormatError("manifest shorter than its header", reason=Reason.TRUNCATED, offset=0)
    _m, _ma, _mi, body_len, stored = _MANIFEST_HEADER.unpack_from(buf, 0)
    if body_len > MAX_MANIFEST_BYTES:
        raise FormatError(f"manifest body of {body_len} bytes exceeds the cap",
                          reason=Reason.METADATA_TOO_LARGE, offset=12)
    if len(buf) != MANIFEST_HEADER_SIZE + body_len:
        raise FormatError(f"manifest is {len(buf)} bytes, header says "
                          f"{MANIFEST_HEADER_SIZE + body_len}", reason=Reason.TRUNCATED, offset=12)
    body = bytes(buf[MANIFEST_HEADER_SIZE:])
    if mask(crc32c(body)) != stored:
        raise CorruptRecordError("manifest checksum mismatch", reason=Reason.CHECKSUM_MISMATCH,
                                 offset=16)
    return unpack_meta(body, cap=MAX_MANIFEST_BYTES)


__all__ = [
    "FileHeader",
    "RecordHeader",
    "align_up",
    "check_version",
    "decode_file_header",
    "decode_record_header",
    "pack_manifest",
    "pack_meta",
    "pack_record_header",
    "record_layout",
    "set_record_crc",
    "unpack_manifest",
    "unpack_meta",
]
