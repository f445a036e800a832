"""Layer 1 (format): checksums, dtypes, file/record/manifest framing, record build/parse.

One test per reason code path (spec sections 3, 4, 6, 9, 10), and property-based round
trips: any list of tensors round-trips bit-exactly, deterministically, 64-aligned.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lowdiff_store import threads as threads_mod
from lowdiff_store.errors import (
    BadMagicError,
    CorruptRecordError,
    FormatError,
    LowdiffError,
    UnsupportedVersionError,
)
from lowdiff_store.format import checksum as checksum_mod
from lowdiff_store.format import framing
from lowdiff_store.format.checksum import (
    crc32c,
    crc32c_chunks,
    crc32c_combine,
    crc32c_parallel,
    crc32c_zeros,
    mask,
    unmask,
)
from lowdiff_store.format.constants import (
    ALIGN,
    FILE_HEADER_SIZE,
    FORMAT_MAJOR,
    INDEX_MAGIC,
    MANIFEST_MAGIC,
    MAX_ELEMENTS,
    MAX_META_BYTES,
    MAX_STEP,
    MAX_TENSORS_PER_RECORD,
    RECORD_HEADER_SIZE,
    SEGMENT_MAGIC,
)
from lowdiff_store.format.dtypes import (
    STORAGE_DTYPE,
    bf16_to_f32,
    f32_to_bf16,
    itemsize,
    storage_dtype,
    tag_of,
)
from lowdiff_store.format.framing import (
    FileHeader,
    align_up,
    decode_file_header,
    decode_record_header,
    pack_manifest,
    pack_meta,
    pack_record_header,
    record_layout,
    set_record_crc,
    unpack_manifest,
    unpack_meta,
)
from lowdiff_store.format.record import (
    PartInput,
    TensorInput,
    build_record,
    parse_tensors,
)
from lowdiff_store.log.reader import Record
from lowdiff_store.log.segment import read_record_meta, scan_segment
from lowdiff_store.storage import BytesSource

VECTORS = Path(__file__).resolve().parent.parent / "format_spec" / "vectors"
LOG_ID = bytes(range(16))


def _reason(ei: pytest.ExceptionInfo[LowdiffError]) -> str:
    return ei.value.reason.value


# ----------------------------------------------------------------------------- checksum


def test_crc32c_combine_matches_the_crc_of_the_concatenation() -> None:
    rng = np.random.default_rng(5)
    for n1, n2 in [(0, 0), (0, 9), (9, 0), (1, 1), (100, 4096), (4097, 3), (70000, 123457)]:
        a = rng.integers(0, 256, n1, dtype=np.uint8).tobytes()
        b = rng.integers(0, 256, n2, dtype=np.uint8).tobytes()
        assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b), (n1, n2)
    assert crc32c_combine(crc32c(b"12345"), crc32c(b"6789"), 4) == 0xE3069283
    with pytest.raises(ValueError):
        crc32c_combine(0, 0, -1)


@pytest.mark.parametrize("sizes", [[], [0], [5], [3, 0, 10, 1, 7], [40, 1, 0, 23, 64, 2]])
def test_crc32c_parallel_is_the_sequential_crc(monkeypatch: pytest.MonkeyPatch,
                                               sizes: list[int]) -> None:
    # a tiny threshold so that small buffers are cut into runs on the helper threads, runs
    # ending inside buffers and on their edges
    monkeypatch.setattr(checksum_mod, "PARALLEL_MIN_BYTES", 1)
    rng = np.random.default_rng(len(sizes))
    bufs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    for start in (0, 0xDEADBEEF):
        assert crc32c_parallel(bufs, start) == crc32c_chunks(bufs, start)
    assert crc32c_parallel([b"1234", bytearray(b"56789")]) == 0xE3069283


def test_crc32c_parallel_on_one_core_computes_on_the_caller(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checksum_mod, "PARALLEL_MIN_BYTES", 1)
    monkeypatch.setattr(threads_mod.os, "sched_getaffinity", lambda _pid: {0})
    bufs = [np.arange(1000, dtype=np.uint8)] * 3
    assert crc32c_parallel(bufs, 1) == crc32c_chunks(bufs, 1)


def test_crc32c_check_value_from_the_spec() -> None:
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0


def test_crc32c_continues_across_chunks_and_zero_runs() -> None:
    data = bytes(range(256)) * 300
    assert crc32c_chunks([data[:7], data[7:1000], memoryview(data)[1000:]]) == crc32c(data)
    assert crc32c(data[100:], crc32c(data[:100])) == crc32c(data)
    for n in (0, 1, 63, 65536, 65537, 200_000):  # crosses the 64 KiB zero block
        assert crc32c_zeros(n, crc32c(b"ab")) == crc32c(b"ab" + bytes(n)), n


def test_mask_is_leveldbs() -> None:
    # leveldb util/crc32c.h: Mask(c) = ((c >> 15) | (c << 17)) + 0xa282ead8
    assert mask(0) == 0xA282EAD8
    assert mask(0xE3069283) == ((0xE3069283 >> 15 | 0xE3069283 << 17) + 0xA282EAD8) % 2**32
    assert mask(crc32c(b"x")) != crc32c(b"x")


@given(st.integers(0, 2**32 - 1))
def test_mask_round_trips(c: int) -> None:
    assert unmask(mask(c)) == c
    assert 0 <= mask(c) < 2**32


# ------------------------------------------------------------------------------- dtypes


def test_storage_dtypes_hold_the_tags_bits() -> None:
    assert set(STORAGE_DTYPE) == {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "I64",
                                  "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL"}
    sizes = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8,
             "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}
    for tag, n in sizes.items():
        assert itemsize(tag) == n, tag
        dt = storage_dtype(tag)
        assert dt.byteorder in "<|=", tag  # little-endian or single byte
    assert storage_dtype("BF16") == np.dtype("<u2")
    assert storage_dtype("F8_E4M3") == np.dtype("u1")


@pytest.mark.parametrize("tag", ["f32", "", "FLOAT", None, 3, ["F32"], b"F32"])
def test_unknown_dtype_tag(tag: Any) -> None:
    with pytest.raises(FormatError) as ei:
        storage_dtype(tag)
    assert _reason(ei) == "bad_dtype"


def test_tag_of_native_and_big_endian_dtypes() -> None:
    for tag, dt in STORAGE_DTYPE.items():
        if tag in ("BF16", "F8_E4M3", "F8_E5M2"):
            continue  # held as U16/U8: they have no numpy type of their own
        assert tag_of(dt) == tag
    assert tag_of(np.dtype(">f4")) == "F32"
    assert tag_of(np.float64) == "F64"
    with pytest.raises(FormatError) as ei:
        tag_of(np.complex64)
    assert _reason(ei) == "bad_dtype"


def test_bf16_round_to_nearest_even_and_nan() -> None:
    def bits(u32: int) -> np.ndarray:
        return np.array([u32], "<u4").view("<f4")

    assert f32_to_bf16(np.array([1.0], "<f4"))[0] == 0x3F80
    assert f32_to_bf16(bits(0x3F808000))[0] == 0x3F80  # tie, even stays
    assert f32_to_bf16(bits(0x3F818000))[0] == 0x3F82  # tie, odd rounds up
    assert f32_to_bf16(bits(0x3F808001))[0] == 0x3F81  # above the tie
    assert f32_to_bf16(bits(0x7F7FFFFF))[0] == 0x7F80  # max float rounds to inf
    assert f32_to_bf16(np.array([np.inf, -np.inf], "<f4")).tolist() == [0x7F80, 0xFF80]
    nan = f32_to_bf16(bits(0x7F800001))  # a NaN whose payload would round to inf
    assert np.isnan(bf16_to_f32(nan))[0]


def test_bf16_widening_is_exact_for_every_pattern() -> None:
    every = np.arange(1 << 16, dtype=np.uint32).astype("<u2")
    wide = bf16_to_f32(every)
    assert wide.dtype == np.float32
    assert (wide.view("<u4") >> 16).astype("<u2").tolist() == every.tolist()
    finite = ~np.isnan(wide)
    assert np.array_equal(f32_to_bf16(wide[finite]), every[finite])
    assert np.isnan(bf16_to_f32(f32_to_bf16(wide[~finite]))).all()


# -------------------------------------------------------------------------- file header


def _file_header(magic: bytes = SEGMENT_MAGIC, **kw: Any) -> bytes:
    return FileHeader(magic, LOG_ID, kw.pop("file_id", 7), kw.pop("first_step", 42),
                      kw.pop("created_ns", 123456789), **kw).encode()


def _with_crc(body: bytes) -> bytes:
    """``body`` (header_len - 4 bytes) followed by its masked CRC."""
    return body + struct.pack("<I", mask(crc32c(body)))


def test_file_header_round_trip_and_layout() -> None:
    raw = _file_header()
    assert len(raw) == FILE_HEADER_SIZE == 64
    assert raw[:8] == b"LDSEG\x00\r\n"
    assert struct.unpack_from("<HHI", raw, 8) == (1, 0, 64)
    assert raw[16:32] == LOG_ID
    assert struct.unpack_from("<QQQI", raw, 32) == (7, 42, 123456789, 0)
    assert struct.unpack_from("<I", raw, 60)[0] == mask(crc32c(raw[:60]))
    h = decode_file_header(raw, SEGMENT_MAGIC)
    assert (h.log_id, h.file_id, h.first_step, h.created_ns, h.major, h.minor,
            h.header_len) == (LOG_ID, 7, 42, 123456789, 1, 0, 64)
    # extra bytes after the header (the records) are not the header's business
    assert decode_file_header(raw + b"\xff" * 100, SEGMENT_MAGIC) == h


@pytest.mark.parametrize("n", range(12))
def test_file_header_shorter_than_12_bytes(n: int) -> None:
    with pytest.raises(FormatError) as ei:
        decode_file_header(_file_header()[:n], SEGMENT_MAGIC)
    assert (_reason(ei), ei.value.offset) == ("truncated", 0)


@pytest.mark.parametrize("n", [12, 13, 15, 16, 40, 63])
def test_file_header_truncated_after_the_version(n: int) -> None:
    with pytest.raises(FormatError) as ei:
        decode_file_header(_file_header()[:n], SEGMENT_MAGIC)
    assert _reason(ei) == "truncated"


def test_file_header_bad_magic() -> None:
    with pytest.raises(BadMagicError) as ei:
        decode_file_header(_file_header(INDEX_MAGIC), SEGMENT_MAGIC)
    assert (_reason(ei), ei.value.offset) == ("bad_magic", 0)
    with pytest.raises(BadMagicError):
        decode_file_header(b"LDSEG\x00\n\n" + _file_header()[8:], SEGMENT_MAGIC)  # text mode


@pytest.mark.parametrize("major", [2, 7, 0xFFFF, 0])
def test_file_header_unsupported_major(major: int) -> None:
    raw = bytearray(_file_header())
    struct.pack_into("<H", raw, 8, major)
    # the major is checked before the header length and the CRC (the order is fixed, so an
    # old reader refuses a new file cleanly whatever else the new version changed)
    struct.pack_into("<I", raw, 12, 4096 + 64)
    with pytest.raises(UnsupportedVersionError) as ei:
        decode_file_header(bytes(raw[:12]), SEGMENT_MAGIC)
    assert (_reason(ei), ei.value.offset) == ("unsupported_format_version", 8)
    assert ei.value.found == major
    assert ei.value.supported == FORMAT_MAJOR == 1
    assert f"unsupported format version {major} (this build reads up to 1)" in str(ei.value)
    with pytest.raises(UnsupportedVersionError):
        decode_file_header(bytes(raw), SEGMENT_MAGIC)


def test_file_header_newer_minor_and_longer_header_are_read() -> None:
    base = _file_header()[:60]
    minor = bytearray(base)
    struct.pack_into("<H", minor, 10, 9)
    h = decode_file_header(_with_crc(bytes(minor)), SEGMENT_MAGIC)
    assert (h.major, h.minor) == (1, 9)
    longer = bytearray(base + bytes(64))  # a later minor grows the header to 128 bytes
    struct.pack_into("<I", longer, 12, 128)
    h = decode_file_header(_with_crc(bytes(longer)), SEGMENT_MAGIC)
    assert (h.header_len, h.file_id, h.first_step) == (128, 7, 42)


@pytest.mark.parametrize("header_len", [0, 32, 63, 65, 100, 96, (1 << 20) + 64, 2**32 - 64])
def test_file_header_bad_header_length(header_len: int) -> None:
    raw = bytearray(_file_header())
    struct.pack_into("<I", raw, 12, header_len)
    with pytest.raises(FormatError) as ei:
        decode_file_header(bytes(raw) + bytes(4096), SEGMENT_MAGIC)
    assert (_reason(ei), ei.value.offset) == ("bad_record_length", 12)


def test_file_header_longer_than_the_file() -> None:
    raw = bytearray(_file_header())
    struct.pack_into("<I", raw, 12, 128)
    with pytest.raises(FormatError) as ei:
        decode_file_header(bytes(raw), SEGMENT_MAGIC)
    assert (_reason(ei), ei.value.offset) == ("truncated", 0)


def test_file_header_checksum() -> None:
    raw = bytearray(_file_header())
    raw[40] ^= 1  # first_step
    with pytest.raises(CorruptRecordError) as ei:
        decode_file_header(bytes(raw), SEGMENT_MAGIC)
    assert (_reason(ei), ei.value.offset) == ("checksum_mismatch", 0)


def test_every_bit_of_the_file_header_is_checked() -> None:
    raw = _file_header(INDEX_MAGIC)
    for i in range(len(raw)):
        for bit in range(8):
            bad = bytearray(raw)
            bad[i] ^= 1 << bit
            with pytest.raises(FormatError):
                decode_file_header(bytes(bad), INDEX_MAGIC)


# ------------------------------------------------------------------------ record header


def _record_header(meta_len: int = 10, step: int = 5, length: int = 128, type_: int = 1
                   ) -> bytearray:
    h = pack_record_header(type_, meta_len, step, length)
    set_record_crc(h, 0x1234)
    return h


def test_record_header_layout_and_round_trip() -> None:
    h = _record_header(meta_len=62, step=1, length=0xC0)
    assert len(h) == RECORD_HEADER_SIZE == 32
    assert bytes(h[:4]) == b"LDRC"
    assert struct.unpack_from("<I", h, 4)[0] == mask(0x1234)
    assert struct.unpack_from("<BBHIQQ", h, 8) == (1, 0, 0, 62, 1, 0xC0)
    r = decode_record_header(bytes(h))
    assert (r.crc, r.type, r.flags, r.meta_len, r.step, r.length) == (
        mask(0x1234), 1, 0, 62, 1, 0xC0)
    assert r.payload_start == 0x80 == align_up(32 + 62)


def test_record_layout() -> None:
    assert record_layout(0, 0) == (64, 64)  # P = align(32 + meta_len)
    assert record_layout(32, 0) == (64, 64)
    assert record_layout(33, 1) == (128, 192)
    assert record_layout(62, 16) == (128, 192)
    for meta_len in range(0, 300, 7):
        for payload in (0, 1, 64, 65, 1000):
            start, length = record_layout(meta_len, payload)
            assert start % ALIGN == 0
            assert length % ALIGN == 0
            assert start >= 32 + meta_len
            assert length >= start + payload
            assert start - (32 + meta_len) < ALIGN
            assert length - (start + payload) < ALIGN


@pytest.mark.parametrize("n", [0, 1, 4, 31])
def test_record_header_truncated(n: int) -> None:
    with pytest.raises(FormatError) as ei:
        decode_record_header(bytes(_record_header())[:n])
    assert _reason(ei) == "truncated"


def test_record_header_bad_magic() -> None:
    h = _record_header()
    h[0:4] = b"LDRD"
    with pytest.raises(CorruptRecordError) as ei:
        decode_record_header(bytes(h))
    assert _reason(ei) == "bad_magic"


@pytest.mark.parametrize("length", [0, 1, 63, 65, 100, 2**64 - 1])
def test_record_header_bad_length(length: int) -> None:
    with pytest.raises(CorruptRecordError) as ei:
        decode_record_header(bytes(_record_header(meta_len=0, length=length)))
    assert _reason(ei) == "bad_record_length"


def test_record_header_metadata_overflowing_the_record() -> None:
    with pytest.raises(CorruptRecordError) as ei:
        decode_record_header(bytes(_record_header(meta_len=33, length=64)))
    assert _reason(ei) == "bad_record_length"
    decode_record_header(bytes(_record_header(meta_len=32, length=64)))  # exactly fits


def test_record_header_metadata_too_large() -> None:
    huge = MAX_META_BYTES + 1
    with pytest.raises(CorruptRecordError) as ei:
        decode_record_header(bytes(_record_header(meta_len=huge, length=align_up(huge + 96))))
    assert _reason(ei) == "metadata_too_large"
    decode_record_header(bytes(_record_header(meta_len=MAX_META_BYTES,
                                              length=align_up(MAX_META_BYTES + 32))))


def test_record_header_step_out_of_range() -> None:
    with pytest.raises(CorruptRecordError) as ei:
        decode_record_header(bytes(_record_header(step=MAX_STEP + 1)))
    assert _reason(ei) == "out_of_bounds"
    assert decode_record_header(bytes(_record_header(step=MAX_STEP))).step == MAX_STEP


# ----------------------------------------------------------------------------- metadata


def test_meta_round_trip_keeps_types() -> None:
    obj = {"kind": "grad", "b": b"\x00\xff", "i": -5, "big": 2**63, "f": 0.1, "n": None,
           "l": [1, [2, {"x": True}]], "s": "é"}
    assert unpack_meta(pack_meta(obj)) == obj
    assert pack_meta(obj) == pack_meta(dict(obj))  # deterministic


@pytest.mark.parametrize("data", [
    b"", b"\xc1", b"\x81", b"\x81\xa1a", b"\x92\x01", b"\xdf\xff\xff\xff\xff",
    b"\x81\xa1a\xc5\xff\xff", b"\xde\x00\x01\xa1",
])
def test_meta_garbage(data: bytes) -> None:
    with pytest.raises(FormatError) as ei:
        unpack_meta(data)
    assert _reason(ei) == "bad_metadata"


@pytest.mark.parametrize("obj", [[1, 2], 5, "s", None, b"x"])
def test_meta_must_be_a_map(obj: Any) -> None:
    with pytest.raises(FormatError) as ei:
        unpack_meta(msgpack.packb(obj))
    assert _reason(ei) == "bad_metadata"


def test_meta_map_keys_must_be_strings() -> None:
    with pytest.raises(FormatError) as ei:
        unpack_meta(msgpack.packb({1: 2}))
    assert _reason(ei) == "bad_metadata"


@pytest.mark.parametrize("raw", [
    msgpack.packb({"a": msgpack.ExtType(5, b"xx")}),
    msgpack.packb({"a": [msgpack.ExtType(127, b"")]}),
    b"\x81\xa1a\xd6\x80\x00\x00\x00\x01",  # fixext 4 of the reserved type -128
    # extension type -1 (timestamp) in every encoding msgpack decodes on its own
    msgpack.packb({"a": msgpack.Timestamp(1, 0)}),  # fixext 4
    msgpack.packb({"a": {"b": msgpack.Timestamp(2**33, 5)}}),  # fixext 8
    msgpack.packb({"a": [msgpack.Timestamp(2**40, 5)]}),  # ext 8, 12 bytes
    b"\x81\xa1a\xc7\x04\xff\x00\x00\x00\x01",  # ext 8 holding 4 bytes
    b"\x81\xa1a\xc8\x00\x04\xff\x00\x00\x00\x01",  # ext 16
    b"\x81\xa1a\xc9\x00\x00\x00\x04\xff\x00\x00\x00\x01",  # ext 32
], ids=["ext5", "ext127-in-list", "ext-128", "ts32", "ts64-nested", "ts96", "ts-ext8",
        "ts-ext16", "ts-ext32"])
def test_meta_extension_types_are_refused(raw: bytes) -> None:
    with pytest.raises(FormatError) as ei:
        unpack_meta(raw)
    assert _reason(ei) == "bad_metadata"
    assert "extension type" in str(ei.value)


def test_meta_bytes_that_look_like_a_timestamp_are_data() -> None:
    obj = {"b": b"\xd6\xff\x00\x00\x00\x01", "i": -1, "s": "\xff"}
    assert unpack_meta(pack_meta(obj)) == obj


def test_meta_deep_nesting_is_bad_metadata_not_recursion() -> None:
    deep = b"\x81\xa1a" + b"\x91" * 100_000 + b"\x00"
    with pytest.raises(FormatError) as ei:
        unpack_meta(deep)
    assert _reason(ei) == "bad_metadata"


def test_meta_size_caps() -> None:
    data = pack_meta({"x": b"\x00" * 100})
    with pytest.raises(FormatError) as ei:
        unpack_meta(data, cap=len(data) - 1)
    assert _reason(ei) == "metadata_too_large"
    assert unpack_meta(data, cap=len(data)) == {"x": b"\x00" * 100}


def test_pack_meta_refuses_over_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(framing, "MAX_META_BYTES", 64)
    with pytest.raises(FormatError) as ei:
        pack_meta({"x": b"\x00" * 100})
    assert _reason(ei) == "metadata_too_large"


# ----------------------------------------------------------------------------- manifest


_BODY = {"log_id": LOG_ID, "generation": 3, "next_segment_id": 2,
         "segments": [[0, 0], [1, 17]], "bases": [0, 10], "meta": {"mode": "grad"},
         "future_key": [1, 2]}


def test_manifest_round_trip_and_layout() -> None:
    raw = pack_manifest(_BODY)
    assert raw[:8] == b"LDMAN\x00\r\n" == MANIFEST_MAGIC
    major, minor, body_len, crc = struct.unpack_from("<HHII", raw, 8)
    assert (major, minor, body_len) == (1, 0, len(raw) - 20)
    assert crc == mask(crc32c(raw[20:]))
    assert unpack_manifest(raw) == _BODY
    assert unpack_manifest(memoryview(raw)) == _BODY


@pytest.mark.parametrize("n", [0, 5, 11])
def test_manifest_truncated_before_the_version(n: int) -> None:
    with pytest.raises(FormatError) as ei:
        unpack_manifest(pack_manifest(_BODY)[:n])
    assert (_reason(ei), ei.value.offset) == ("truncated", 0)


@pytest.mark.parametrize("cut", [12, 19, 20, 21, -1])
def test_manifest_truncated(cut: int) -> None:
    with pytest.raises(FormatError) as ei:
        unpack_manifest(pack_manifest(_BODY)[:cut])
    assert _reason(ei) == "truncated"


def test_manifest_longer_than_it_says() -> None:
    with pytest.raises(FormatError) as ei:
        unpack_manifest(pack_manifest(_BODY) + b"\x00")
    assert (_reason(ei), ei.value.offset) == ("truncated", 12)


def test_manifest_bad_magic() -> None:
    with pytest.raises(BadMagicError) as ei:
        unpack_manifest(b"LDSEG\x00\r\n" + pack_manifest(_BODY)[8:])
    assert (_reason(ei), ei.value.offset) == ("bad_magic", 0)


def test_manifest_future_major_and_newer_minor() -> None:
    raw = bytearray(pack_manifest(_BODY))
    struct.pack_into("<H", raw, 10, 3)
    assert unpack_manifest(bytes(raw)) == _BODY  # a newer minor is readable
    struct.pack_into("<H", raw, 8, 2)
    with pytest.raises(UnsupportedVersionError) as ei:
        unpack_manifest(bytes(raw))
    assert (_reason(ei), ei.value.offset) == ("unsupported_format_version", 8)


def test_manifest_body_over_the_cap_is_refused_before_reading_it() -> None:
    raw = bytearray(pack_manifest(_BODY))
    struct.pack_into("<I", raw, 12, (64 << 20) + 1)
    with pytest.raises(FormatError) as ei:
        unpack_manifest(bytes(raw))
    assert (_reason(ei), ei.value.offset) == ("metadata_too_large", 12)


def test_manifest_checksum() -> None:
    raw = bytearray(pack_manifest(_BODY))
    raw[-1] ^= 0x40
    with pytest.raises(CorruptRecordError) as ei:
        unpack_manifest(bytes(raw))
    assert (_reason(ei), ei.value.offset) == ("checksum_mismatch", 16)


def test_manifest_body_must_be_a_map() -> None:
    data = msgpack.packb([1, 2])
    raw = struct.pack("<8sHHII", MANIFEST_MAGIC, 1, 0, len(data), mask(crc32c(data))) + data
    with pytest.raises(FormatError) as ei:
        unpack_manifest(raw)
    assert _reason(ei) == "bad_metadata"


# ------------------------------------------------------------------------------ records


def _entry(name: str = "w", dtype: Any = "F32", shape: Any = None, codec: Any = "raw",
           params: Any = None, parts: Any = None) -> list[Any]:
    return [name, dtype, [4] if shape is None else shape, codec, {} if params is None
            else params, [["F32", 4, 0, 16, None]] if parts is None else parts]


def _parse(*entries: Any, payload_len: int = 256) -> Any:
    return parse_tensors({"tensors": list(entries)}, payload_len)


def test_parse_tensors_accepts_a_valid_entry() -> None:
    (e,) = _parse(_entry(shape=[2, 2]))
    assert (e.name, e.dtype, e.shape, e.codec, e.numel) == ("w", "F32", (2, 2), "raw", 4)
    assert (e.parts[0].offset, e.parts[0].length, e.parts[0].zstd) == (0, 16, None)
    (e,) = _parse(_entry(shape=[], parts=[["F32", 1, 64, 4, None]]))  # a scalar
    assert e.numel == 1
    (e,) = _parse(_entry(parts=[["U8", 3, 0, 3, {"compressor": "zstd"}]]))
    assert e.parts[0].zstd == {"compressor": "zstd"}
    # two empty parts may share an offset: they occupy no bytes
    _parse(_entry(shape=[0], parts=[["F32", 0, 64, 0, None], ["F32", 0, 64, 0, None]]),
           _entry("v", parts=[["F32", 4, 64, 16, None]]))


@pytest.mark.parametrize("meta", [{}, {"tensors": None}, {"tensors": {"w": 1}},
                                  {"tensors": "w"}])
def test_parse_tensors_needs_a_list(meta: dict[str, Any]) -> None:
    with pytest.raises(FormatError) as ei:
        parse_tensors(meta, 0)
    assert _reason(ei) == "bad_metadata"


def test_parse_tensors_count_limit() -> None:
    with pytest.raises(FormatError) as ei:
        parse_tensors({"tensors": [None] * (MAX_TENSORS_PER_RECORD + 1)}, 0)
    assert _reason(ei) == "limit_exceeded"


_BAD_ENTRIES: list[tuple[str, Any, str]] = [
    ("not a list", {"name": "w"}, "bad_metadata"),
    ("short", ["w", "F32", [4], "raw", {}], "bad_metadata"),
    ("empty name", _entry(name=""), "bad_metadata"),
    ("non-str name", [b"w", *_entry()[1:]], "bad_metadata"),
    ("name too long", _entry(name="é" * 513), "bad_metadata"),
    ("unknown dtype", _entry(dtype="F31"), "bad_dtype"),
    ("unhashable dtype", _entry(dtype=["F32"]), "bad_dtype"),
    ("map dtype", _entry(dtype={"a": 1}), "bad_dtype"),
    ("shape not a list", _entry(shape=4), "bad_metadata"),
    ("rank over 32", _entry(shape=[1] * 33), "limit_exceeded"),
    ("negative dim", _entry(shape=[-4]), "out_of_bounds"),
    ("float dim", _entry(shape=[4.0]), "bad_metadata"),
    ("bool dim", _entry(shape=[True]), "bad_metadata"),
    ("dim over 2^48", _entry(shape=[MAX_ELEMENTS + 1]), "out_of_bounds"),
    ("numel over 2^48", _entry(shape=[2**24, 2**24, 2]), "limit_exceeded"),
    ("codec not str", _entry(codec=1), "bad_metadata"),
    ("params not map", _entry(params=[]), "bad_metadata"),
    ("parts not list", _entry(parts={}), "bad_metadata"),
    ("17 parts", _entry(parts=[["U8", 0, 0, 0, None]] * 17), "limit_exceeded"),
    ("part not list", _entry(parts=["F32"]), "bad_metadata"),
    ("part short", _entry(parts=[["F32", 4, 0, 16]]), "bad_metadata"),
    ("part dtype", _entry(parts=[["X", 4, 0, 16, None]]), "bad_dtype"),
    ("part dtype unhashable", _entry(parts=[[["F32"], 4, 0, 16, None]]), "bad_dtype"),
    ("negative count", _entry(parts=[["F32", -1, 0, 16, None]]), "out_of_bounds"),
    ("count not int", _entry(parts=[["F32", "4", 0, 16, None]]), "bad_metadata"),
    ("offset outside", _entry(parts=[["F32", 4, 320, 16, None]]), "out_of_bounds"),
    ("negative offset", _entry(parts=[["F32", 4, -64, 16, None]]), "out_of_bounds"),
    ("offset unaligned", _entry(parts=[["F32", 4, 32, 16, None]]), "out_of_bounds"),
    ("range outside", _entry(parts=[["U8", 128, 192, 128, {}]]), "out_of_bounds"),
    ("length outside", _entry(parts=[["U8", 300, 0, 300, {}]]), "out_of_bounds"),
    ("raw length", _entry(parts=[["F32", 4, 0, 15, None]]), "bad_record_length"),
    ("raw count", _entry(parts=[["F32", 5, 0, 16, None]]), "bad_record_length"),
    ("zstd params not map", _entry(parts=[["F32", 4, 0, 16, "zstd"]]), "bad_metadata"),
]


@pytest.mark.parametrize(("entry", "reason"), [(e, r) for _n, e, r in _BAD_ENTRIES],
                         ids=[n for n, _e, _r in _BAD_ENTRIES])
def test_parse_tensors_reason_codes(entry: Any, reason: str) -> None:
    with pytest.raises(FormatError) as ei:
        _parse(entry)
    assert _reason(ei) == reason


def test_parse_tensors_duplicate_names() -> None:
    with pytest.raises(FormatError) as ei:
        _parse(_entry(), _entry(parts=[["F32", 4, 64, 16, None]]))
    assert _reason(ei) == "bad_metadata"


@pytest.mark.parametrize(("first", "second"), [
    ((0, 16), (0, 16)),      # same place, two tensors
    ((0, 100), (64, 4)),     # starts inside the first
    ((64, 64), (0, 65)),     # runs into the second (sorted the other way)
    ((0, 192), (128, 64)),   # contained
])
def test_parse_tensors_overlapping_parts(first: tuple[int, int], second: tuple[int, int]
                                         ) -> None:
    a = ["U8", first[1], first[0], first[1], None]
    b = ["U8", second[1], second[0], second[1], None]
    with pytest.raises(FormatError) as ei:
        _parse(_entry(dtype="U8", shape=[first[1]], parts=[a]),
               _entry("v", dtype="U8", shape=[second[1]], parts=[b]))
    assert _reason(ei) == "out_of_bounds"
    with pytest.raises(FormatError) as ei:  # the same two parts inside one tensor
        _parse(_entry(codec="x", parts=[a, b]))
    assert _reason(ei) == "out_of_bounds"
    # adjacent parts are fine
    _parse(_entry(codec="x", parts=[["U8", 64, 0, 64, None], ["U8", 64, 64, 64, None]]))


def test_build_record_refuses_bad_arguments() -> None:
    for step in (-1, MAX_STEP + 1):
        with pytest.raises(FormatError) as ei:
            build_record(step, [], kind="grad")
        assert _reason(ei) == "out_of_bounds"
    too_many = [TensorInput(f"t{i}", "U8", (0,), "raw", {}, [])
                for i in range(MAX_TENSORS_PER_RECORD + 1)]
    with pytest.raises(FormatError) as ei:
        build_record(1, too_many, kind="grad")
    assert _reason(ei) == "limit_exceeded"


def test_build_record_reproduces_the_worked_example() -> None:
    """Spec section 12: one raw F32 tensor [1, 2, 3, 4] at step 1, side {"lr": 0.5}."""
    golden = (VECTORS / "valid" / "one_record.ldlog").read_bytes()
    arr = np.array([1, 2, 3, 4], "<f4")
    rec = build_record(1, [TensorInput("w", "F32", (4,), "raw", {},
                                       [PartInput("F32", 4, arr.view(np.uint8).data)])],
                       kind="grad", side={"lr": 0.5})
    assert b"".join(bytes(c) for c in rec.chunks) == golden[64:]
    assert rec.length == 0xC0
    assert rec.step == 1
    assert rec.payload_bytes == 64


# --------------------------------------------------------------- record round trip (PBT)

_TAGS = sorted(STORAGE_DTYPE)
_UTF8 = st.characters(codec="utf-8")


@st.composite
def _tensor_inputs(draw: st.DrawFn) -> list[tuple[TensorInput, list[bytes]]]:
    n = draw(st.integers(0, 6))
    names = draw(st.lists(st.text(_UTF8, min_size=1, max_size=12), min_size=n, max_size=n,
                          unique=True))
    out = []
    for name in names:
        tag = draw(st.sampled_from(_TAGS))
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        numel = int(np.prod(shape)) if shape else 1
        size = itemsize(tag)
        nparts = draw(st.integers(1, 3))
        parts, raws = [], []
        for _ in range(nparts):
            count = draw(st.integers(0, 40))
            raw = draw(st.binary(min_size=count * size, max_size=count * size))
            parts.append(PartInput(tag, count, raw))
            raws.append(raw)
        codec = "raw" if nparts == 1 and parts[0].count == numel else "opaque"
        out.append((TensorInput(name, tag, shape, codec, {"k": nparts}, parts), raws))
    return out


def _record_bytes(rec: Any) -> bytes:
    data = b"".join(bytes(c) for c in rec.chunks)
    assert len(data) == rec.length
    return data


_SIDE_VALUES = st.one_of(st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=False),
                         st.binary(max_size=8), st.none())


@given(_tensor_inputs(), st.integers(0, MAX_STEP),
       st.dictionaries(st.text(_UTF8, max_size=5), _SIDE_VALUES, max_size=4))
def test_record_round_trips_bit_exactly(items: Any, step: int, side: dict[str, Any]) -> None:
    tensors = [t for t, _r in items]
    rec = build_record(step, tensors, kind="grad", side=side, extra={"digest": b"d"})
    data = _record_bytes(rec)
    # deterministic: the same input gives the same bytes
    assert _record_bytes(build_record(step, tensors, kind="grad", side=side,
                                      extra={"digest": b"d"})) == data
    assert len(data) % ALIGN == 0
    assert data[:4] == b"LDRC"
    assert struct.unpack_from("<I", data, 4)[0] == mask(crc32c(data[8:]))
    # place it in a segment after the 64-byte file header and read it back
    seg = _file_header() + data
    src = BytesSource(seg, "mem.ldlog")
    res = scan_segment(src, 64, active=False)
    assert [(r.step, r.offset, r.length) for r in res.records] == [(step, 64, len(data))]
    hdr, meta, payload = read_record_meta(src, res.records[0])
    assert meta["side"] == side
    assert meta["kind"] == "grad"
    assert meta["digest"] == b"d"
    r = Record(hdr.step, meta, payload, "mem.ldlog", 64, hdr.length)
    assert r.names == [t.name for t in tensors]
    used = bytearray(len(data))  # which bytes of the record hold something
    used[:32 + hdr.meta_len] = b"\x01" * (32 + hdr.meta_len)
    for (t, raws), entry in zip(items, r.entries):
        assert (entry.dtype, entry.shape, entry.codec) == (t.dtype, t.shape, t.codec)
        got = r.parts(t.name)
        assert [g.tobytes() for g in got] == raws
        for p, g in zip(entry.parts, got):
            at = 64 + hdr.payload_start + p.offset  # in the segment file
            assert at % ALIGN == 0  # every payload starts 64-aligned in the file
            assert g.dtype == storage_dtype(p.dtype)
            assert not g.flags.writeable
            used[at - 64:at - 64 + p.length] = b"\x01" * p.length
        if t.codec == "raw":
            arr = r.tensor(t.name)
            assert arr.shape == t.shape
            assert arr.tobytes() == raws[0]
    # every byte no header, metadata or part holds is zero padding
    assert all(b == 0 for b, u in zip(data, used) if not u)


def test_record_bytes_reference_the_callers_buffers() -> None:
    arr = np.arange(1000, dtype="<f4")
    rec = build_record(3, [TensorInput("w", "F32", (1000,), "raw", {},
                                       [PartInput("F32", 1000, arr.data)])], kind="grad")
    views = [c for c in rec.chunks if isinstance(c, memoryview) and c.nbytes == 4000]
    assert len(views) == 1
    assert np.shares_memory(np.frombuffer(views[0], np.uint8), arr)


def test_crc32c_parallel_in_a_forked_child_and_after_shutdown(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A child forked after the helper pool exists gets its own (the parent's threads do
    not exist there: the pool once queued work nobody ran, and the child hung); a pool
    that refuses work (interpreter exit) leaves the CRC to the calling thread."""
    import os
    import signal

    monkeypatch.setattr(checksum_mod, "PARALLEL_MIN_BYTES", 1)
    bufs = [np.arange(5000, dtype=np.uint8), np.arange(3000, dtype=np.uint8)]
    want = crc32c_chunks(bufs)
    assert crc32c_parallel(bufs) == want  # the pool exists in this process now
    if len(os.sched_getaffinity(0)) > 1:
        assert checksum_mod._HELPERS._pool is not None
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only with the right CRC, killed by the alarm if hung
        signal.alarm(20)
        try:
            os._exit(0 if crc32c_parallel(bufs) == want else 3)
        except BaseException:
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0

    class Closed:
        def submit(self, *a: object, **k: object) -> None:
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(checksum_mod._HELPERS, "get", lambda: (Closed(), 2))
    assert crc32c_parallel(bufs) == want
