"""Fuzzing the readers: random bytes, mutated valid files, and hostile files with valid
checksums (so the checks behind the CRC are reached). Every reader may only raise
:class:`LowdiffError` subclasses: never IndexError, KeyError, TypeError, struct.error,
UnicodeError, RecursionError or MemoryError. Huge declared sizes are refused before
anything that large is allocated.

The fast examples run in every profile; ``@pytest.mark.slow`` campaigns run thousands.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lowdiff_store import BaseFile, LogReader, LogWriter, LowdiffError
from lowdiff_store.codecs import CODECS
from lowdiff_store.format.checksum import crc32c, mask
from lowdiff_store.format.constants import INDEX_MAGIC, SEGMENT_MAGIC
from lowdiff_store.format.dtypes import STORAGE_DTYPE
from lowdiff_store.format.framing import (
    FileHeader,
    decode_file_header,
    decode_record_header,
    pack_manifest,
    pack_record_header,
    record_layout,
    unpack_manifest,
    unpack_meta,
)
from lowdiff_store.format.record import parse_tensors
from lowdiff_store.log.base import encode_base
from lowdiff_store.log.reader import Record
from lowdiff_store.log.segment import read_record_meta, scan_segment
from lowdiff_store.storage import BytesSource

LOG_ID = bytes(range(16))
_UTF8 = st.characters(codec="utf-8")
_FS = settings(suppress_health_check=[HealthCheck.function_scoped_fixture,
                                      HealthCheck.too_slow, HealthCheck.data_too_large])
SLOW = settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck))


def only_lowdiff(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """Call ``fn``: a LowdiffError is an answer (returns None); anything else fails."""
    try:
        return fn(*args, **kw)
    except LowdiffError as e:
        err = e
    assert err.reason is not None
    assert "\n" not in str(err)  # one line, always
    return None


# ------------------------------------------------------------------------- strategies

_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1),
                  st.floats(), st.text(_UTF8, max_size=8), st.binary(max_size=16))
_obj = st.recursive(_leaf, lambda ch: st.lists(ch, max_size=5)
                    | st.dictionaries(st.text(_UTF8, max_size=6), ch, max_size=5),
                    max_leaves=25)
_jleaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(),
                   st.text(max_size=8))
_jobj = st.recursive(_jleaf, lambda ch: st.lists(ch, max_size=4)
                     | st.dictionaries(st.text(max_size=6), ch, max_size=4), max_leaves=15)
_int = st.one_of(st.integers(-3, 300), st.sampled_from([64, 128, 192, 2**31, 2**48, 2**48 + 1,
                                                         2**63 - 1, 2**64 - 1, -2**63]))
_tag = st.one_of(st.sampled_from(sorted(STORAGE_DTYPE)), st.sampled_from(["f4", "", "X"]), _obj)
_codec = st.one_of(st.sampled_from(sorted(CODECS)), st.text(max_size=4), _leaf)
_params = st.dictionaries(st.sampled_from(["count", "index_dtype", "delta", "k", "block",
                                           "rank", "n", "m", "x"]),
                          st.one_of(_int, st.booleans(), st.sampled_from(["U8", "I32", "I64"]),
                                    _leaf), max_size=4)
_zstd = st.one_of(st.none(), st.fixed_dictionaries(
    {"compressor": st.sampled_from(["zstd", "lz4"]), "shuffle": st.booleans()}), _obj)
_part = st.one_of(st.tuples(_tag, _int, st.sampled_from([0, 64, 128, 192, 256, 1, 2**40]),
                            _int, _zstd).map(list), _obj)
_tensor = st.one_of(
    st.tuples(st.text(_UTF8, min_size=1, max_size=6), _tag,
              st.one_of(st.lists(_int, max_size=4), _obj), _codec, st.one_of(_params, _obj),
              st.one_of(st.lists(_part, max_size=3), _obj)).map(list),
    _obj)
_meta = st.one_of(
    st.fixed_dictionaries({"kind": st.sampled_from(["grad", "weight"]),
                           "tensors": st.lists(_tensor, max_size=4),
                           "side": st.one_of(_obj, st.dictionaries(st.text(max_size=3), _obj))}),
    st.dictionaries(st.text(_UTF8, max_size=6), _obj, max_size=4))


@st.composite
def _mutated(draw: st.DrawFn, data: bytes) -> bytes:
    """``data`` after a few random edits: bit flips, overwrites, cuts, insertions."""
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "cut", "insert", "zero", "ff"]))
        pos = draw(st.integers(0, max(len(buf) - 1, 0)))
        if op == "flip" and buf:
            buf[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and buf:
            chunk = draw(st.binary(min_size=1, max_size=8))
            buf[pos:pos + len(chunk)] = chunk
        elif op == "cut":
            del buf[pos:]
        elif op == "insert":
            buf[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op in ("zero", "ff") and buf:
            n = draw(st.integers(1, 16))
            buf[pos:pos + n] = (b"\x00" if op == "zero" else b"\xff") * len(buf[pos:pos + n])
    return bytes(buf)


def _record(step: int, meta_bytes: bytes, payload: bytes, type_: int = 1) -> bytes:
    """A record with valid framing and CRC around arbitrary metadata bytes and payload."""
    start, length = record_layout(len(meta_bytes), len(payload))
    rec = bytearray(length)
    rec[:32] = pack_record_header(type_, len(meta_bytes), step, length)
    rec[32:32 + len(meta_bytes)] = meta_bytes
    rec[start:start + len(payload)] = payload
    struct.pack_into("<I", rec, 4, mask(crc32c(bytes(rec[8:]))))
    return bytes(rec)


def _segment_header(file_id: int = 0, magic: bytes = SEGMENT_MAGIC) -> bytes:
    return FileHeader(magic, LOG_ID, file_id, 0, 0).encode()


def _read_segment(data: bytes, active: bool, strict: bool) -> None:
    """Everything a reader does with a segment: scan, read each record, decode each tensor."""
    src = BytesSource(data, "fuzz.ldlog")
    hdr = decode_file_header(src.read(0, min(64, src.size)), SEGMENT_MAGIC)
    found: list[LowdiffError] = []
    res = scan_segment(src, hdr.header_len, active=active,
                       reporter=None if strict else found.append)
    assert all(isinstance(e, LowdiffError) and e.offset is not None for e in found)
    assert res.valid_end <= len(data)
    for ref in res.records:
        only_lowdiff(_read_record, src, ref)


def _read_record(src: BytesSource, ref: Any) -> None:
    hdr, meta, payload = read_record_meta(src, ref)
    rec = Record(hdr.step, meta, payload, src.path, ref.offset, hdr.length)
    _ = rec.kind, rec.side
    for name in rec.names:
        only_lowdiff(rec.tensor, name)
        only_lowdiff(rec.parts, name)


# ----------------------------------------------------------------- random bytes, framing


@given(st.binary(max_size=200), st.sampled_from([SEGMENT_MAGIC, INDEX_MAGIC]))
def test_fuzz_decode_file_header_bytes(data: bytes, magic: bytes) -> None:
    only_lowdiff(decode_file_header, data, magic)


@given(_mutated(_segment_header()))
def test_fuzz_decode_file_header_mutated(data: bytes) -> None:
    only_lowdiff(decode_file_header, data, SEGMENT_MAGIC)
    only_lowdiff(decode_file_header, memoryview(data), SEGMENT_MAGIC)


@given(st.one_of(st.binary(max_size=64), _mutated(bytes(pack_record_header(1, 10, 5, 128)))))
def test_fuzz_decode_record_header(data: bytes) -> None:
    only_lowdiff(decode_record_header, data)


@given(st.one_of(st.binary(max_size=300), st.builds(msgpack.packb, _obj),
                 _mutated(msgpack.packb({"kind": "grad", "tensors": [["w", "F32", [4], "raw",
                                                                      {}, [["F32", 4, 0, 16,
                                                                            None]]]]}))))
def test_fuzz_unpack_meta(data: bytes) -> None:
    out = only_lowdiff(unpack_meta, data)
    assert out is None or isinstance(out, dict)


_MANIFEST = pack_manifest({"log_id": LOG_ID, "generation": 1, "next_segment_id": 1,
                           "segments": [[0, 0]], "bases": [0], "meta": {"m": 1}})


@given(st.one_of(st.binary(max_size=200), _mutated(_MANIFEST)))
def test_fuzz_unpack_manifest(data: bytes) -> None:
    only_lowdiff(unpack_manifest, data)


@given(_meta, st.integers(0, 1 << 20))
def test_fuzz_parse_tensors(meta: Any, payload_len: int) -> None:
    out = only_lowdiff(parse_tensors, meta, payload_len)
    if out is not None:  # accepted: every part really is inside the payload, aligned
        for e in out:
            for p in e.parts:
                assert p.offset % 64 == 0
                assert 0 <= p.offset <= p.offset + p.length <= payload_len


# ------------------------------------------------------------------------------ segments


@given(st.binary(max_size=2000), st.booleans(), st.booleans())
def test_fuzz_scan_segment_random_bytes(body: bytes, active: bool, strict: bool) -> None:
    only_lowdiff(_read_segment, _segment_header() + body, active, strict)


def _valid_segment() -> bytes:
    parts = [_segment_header()]
    for step in (1, 2, 5):
        arr = np.arange(step * 7, dtype="<f4")
        meta = {"kind": "grad", "side": {"lr": 0.1},
                "tensors": [["w", "F32", [arr.size], "raw", {},
                             [["F32", arr.size, 0, arr.nbytes, None]]]]}
        parts.append(_record(step, msgpack.packb(meta), arr.tobytes()))
    return b"".join(parts)


_SEGMENT = _valid_segment()


@given(_mutated(_SEGMENT), st.booleans(), st.booleans())
def test_fuzz_scan_segment_mutated(data: bytes, active: bool, strict: bool) -> None:
    only_lowdiff(_read_segment, data, active, strict)


@given(st.lists(st.tuples(_meta, st.binary(max_size=300)), min_size=1, max_size=3),
       st.booleans())
def test_fuzz_records_with_valid_crcs(items: list[tuple[Any, bytes]], strict: bool) -> None:
    """Hostile metadata behind a valid CRC: reaches parse_tensors and the codecs."""
    data = _segment_header() + b"".join(
        _record(i + 1, msgpack.packb(meta), payload) for i, (meta, payload) in enumerate(items))
    only_lowdiff(_read_segment, data, True, strict)


@given(st.binary(max_size=400), st.integers(0, 2**64 - 1), st.integers(0, 255))
def test_fuzz_records_with_garbage_metadata_and_valid_crcs(meta: bytes, step: int,
                                                          type_: int) -> None:
    rec = bytearray(_record(1, meta, b"\x01" * 64, type_))
    struct.pack_into("<Q", rec, 16, step)
    struct.pack_into("<I", rec, 4, mask(crc32c(bytes(rec[8:]))))
    for active, strict in itertools.product((True, False), repeat=2):
        only_lowdiff(_read_segment, _segment_header() + bytes(rec), active, strict)


# ------------------------------------------------------------------------------- bases


def _base_bytes(header: dict[str, Any], data: bytes, fix_crc: bool = True) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    prefix = struct.pack("<Q", len(raw))
    if fix_crc and b'"header_crc32c":"00000000"' in raw:
        crc = crc32c(prefix + raw)
        raw = raw.replace(b'"header_crc32c":"00000000"', b'"header_crc32c":"%08x"' % crc)
    return prefix + raw + data


_VALID_BASE = b"".join(bytes(c) for c in encode_base(
    3, {"w": ("F32", np.arange(5, dtype="<f4")), "b": ("BF16", np.array([7], "<u2"))},
    {"opt": "SGD"}, LOG_ID))

_jtag = st.one_of(st.sampled_from(sorted(STORAGE_DTYPE)), st.sampled_from(["f4", ""]), _jobj)
_name = st.one_of(st.text(_UTF8, min_size=1, max_size=8),
                  st.sampled_from(["\ud800", "a\udfff", "__lowdiff__.meta", "__lowdiff__.pad.0",
                                   "x" * 1025, ""]))
_entry = st.one_of(st.fixed_dictionaries({
    "dtype": _jtag, "shape": st.one_of(st.lists(_int, max_size=3), _jobj),
    "data_offsets": st.one_of(st.lists(_int, min_size=2, max_size=2), _jobj)}), _jobj)
_md = st.one_of(st.fixed_dictionaries({
    "format": st.just("lowdiff-base"),
    "format_version": st.sampled_from(["1.0", "1.7", "2.0", "0.1", "1", "x.y", "99999.0"]),
    "step": st.one_of(st.sampled_from(["3", "-1", "1e9", "9" * 5000, ""]), _jleaf),
    "log_id": st.one_of(st.just(LOG_ID.hex()), st.text(max_size=4), _jleaf),
    "crc32c": st.one_of(st.just('{"w":"00000000"}'), st.text(max_size=6), _jleaf,
                        st.builds(json.dumps, st.dictionaries(_name, _jleaf, max_size=3))),
    "header_crc32c": st.just("00000000")}), _jobj)


@st.composite
def _hostile_base(draw: st.DrawFn) -> bytes:
    header: dict[str, Any] = {"__metadata__": draw(_md)}
    for _ in range(draw(st.integers(0, 4))):
        header[draw(_name)] = draw(_entry)
    return _base_bytes(header, draw(st.binary(max_size=200)), fix_crc=draw(st.booleans()))


def _read_base(path: Path, mode: str) -> None:
    with BaseFile(str(path), mode=mode) as b:  # type: ignore[arg-type]
        _ = b.step, b.log_id, b.nbytes
        for name in b.names:
            only_lowdiff(b.tensor, name)
            b.info(name)
        only_lowdiff(b.meta)
        only_lowdiff(b.verify_all)


_counter = itertools.count()


@_FS
@given(data=st.one_of(st.binary(max_size=300), _mutated(_VALID_BASE), _hostile_base()),
       mode=st.sampled_from(["mmap", "pread"]))
def test_fuzz_base_file(tmp_path: Path, data: bytes, mode: str) -> None:
    p = tmp_path / f"b{next(_counter)}.safetensors"
    p.write_bytes(data)
    only_lowdiff(_read_base, p, mode)


# --------------------------------------------------------------------------- directories


def _read_dir(path: Path, strict: bool, mode: str) -> None:
    with LogReader(path, strict=strict, mode=mode) as r:  # type: ignore[arg-type]
        _ = r.first_step, r.last_step, r.durable_step, len(r), r.meta
        for s in r.steps:
            rec = only_lowdiff(r.record, int(s))
            if rec is not None:
                for name in rec.names:
                    only_lowdiff(rec.tensor, name)
        for b in r.bases:
            bf = only_lowdiff(r.base, b)
            if bf is not None:
                with bf:
                    for name in bf.names:
                        only_lowdiff(bf.tensor, name)
                    only_lowdiff(bf.meta)
        if r.last_step is not None:
            only_lowdiff(r.chain, r.last_step)


def _open_writer(path: Path) -> None:
    with LogWriter(path) as w:
        w.append(w.last_step + 1, [], kind="grad")


_FILES = ["MANIFEST", "seg-0000000000000000.ldlog", "seg-0000000000000000.ldidx",
          "base-0000000000000000.safetensors"]

_manifest_body = st.one_of(
    st.fixed_dictionaries({
        "log_id": st.one_of(st.just(b"?" * 16), st.binary(max_size=17), _leaf),
        "generation": _int, "next_segment_id": _int,
        "segments": st.one_of(st.lists(st.lists(_int, max_size=3), max_size=3), _obj,
                              st.just([[0, 0]])),
        "bases": st.one_of(st.lists(_int, max_size=3), _obj, st.just([0])),
        "meta": _obj}),
    st.dictionaries(st.text(max_size=4), _obj, max_size=3))


@_FS
@given(which=st.sampled_from(_FILES), data=st.data(), strict=st.booleans(),
       mode=st.sampled_from(["mmap", "pread"]), fixed_log_id=st.booleans())
def test_fuzz_log_directory(tmp_path: Path, pristine_log: Any, which: str, data: st.DataObject,
                            strict: bool, mode: str, fixed_log_id: bool) -> None:
    d = tmp_path / f"d{next(_counter)}"
    shutil.copytree(pristine_log.path, d)
    target = d / which
    original = target.read_bytes()
    if which == "MANIFEST" and data.draw(st.booleans()):  # a hostile body, valid CRC
        body = data.draw(_manifest_body)
        if fixed_log_id and isinstance(body.get("log_id"), bytes) and len(body["log_id"]) == 16:
            body["log_id"] = unpack_manifest(original)["log_id"]
        new = pack_manifest(body)
    else:
        new = data.draw(st.one_of(_mutated(original), st.binary(max_size=200)))
    target.write_bytes(new)
    only_lowdiff(_read_dir, d, strict, mode)
    only_lowdiff(_open_writer, d)
    only_lowdiff(_read_dir, d, strict, mode)


# ---------------------------------------------------------------------- allocation bounds


def _peak(fn: Callable[[], Any]) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        only_lowdiff(fn)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


_LIMIT = 1 << 20  # bytes a reader may allocate beyond the file to refuse a hostile one


def test_huge_record_length_is_refused_before_reading(tmp_path: Path) -> None:
    rec = bytearray(_record(1, msgpack.packb({"tensors": []}), b""))
    struct.pack_into("<Q", rec, 24, 1 << 62)  # length: 4 EiB
    for active in (True, False):
        data = _segment_header() + bytes(rec)
        assert _peak(lambda a=active: _read_segment(data, a, True)) < _LIMIT


def test_huge_metadata_length_is_refused_before_reading() -> None:
    rec = bytearray(_record(1, msgpack.packb({"tensors": []}), b""))
    struct.pack_into("<I", rec, 12, (64 << 20) - 1)
    struct.pack_into("<Q", rec, 24, 1 << 40)
    data = _segment_header() + bytes(rec) + bytes(4096)
    assert _peak(lambda: _read_segment(data, False, False)) < _LIMIT


def test_huge_msgpack_containers_are_refused_before_allocation() -> None:
    for raw in (b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff",  # array32, map32
                b"\x81\xa1a\xc6\xff\xff\xff\xff", b"\x81\xa1a\xdb\xff\xff\xff\xff"):  # bin, str
        assert _peak(lambda r=raw: unpack_meta(r)) < _LIMIT


def test_huge_manifest_body_is_refused_before_reading(tmp_path: Path) -> None:
    raw = bytearray(_MANIFEST)
    struct.pack_into("<I", raw, 12, (64 << 20) - 1)
    assert _peak(lambda: unpack_manifest(bytes(raw))) < _LIMIT


@pytest.mark.parametrize("n", [(100 << 20) - 1, 100 << 20, 2**64 - 1])
def test_huge_base_header_is_refused_before_reading(tmp_path: Path, n: int) -> None:
    p = tmp_path / "b.safetensors"
    p.write_bytes(struct.pack("<Q", n) + _VALID_BASE[8:200])
    for mode in ("mmap", "pread"):
        with pytest.raises(LowdiffError) as ei:
            BaseFile(str(p), mode=mode)  # type: ignore[arg-type]
        assert ei.value.reason.value in ("truncated", "metadata_too_large")
        assert _peak(lambda m=mode: BaseFile(str(p), mode=m)) < _LIMIT  # type: ignore


def test_huge_base_tensor_shape_is_refused(tmp_path: Path) -> None:
    header = {"__metadata__": {"format": "lowdiff-base", "format_version": "1.0", "step": "0",
                               "log_id": LOG_ID.hex(), "crc32c": "{}",
                               "header_crc32c": "00000000"},
              "w": {"dtype": "F64", "shape": [2**40, 2**40], "data_offsets": [0, 64]}}
    p = tmp_path / "b.safetensors"
    p.write_bytes(_base_bytes(header, bytes(64)))
    with pytest.raises(LowdiffError) as ei:
        BaseFile(str(p))
    assert ei.value.reason.value == "limit_exceeded"


def _one_tensor_record(entry: list[Any], payload: bytes) -> bytes:
    meta = {"kind": "grad", "side": {}, "tensors": [entry]}
    return _segment_header() + _record(1, msgpack.packb(meta), payload)


def test_sparse_tensor_of_a_huge_declared_shape_is_refused() -> None:
    idx = np.array([0], "<i8").tobytes()
    val = np.array([1.0], "<f4").tobytes()
    entry = ["s", "F32", [2**48], "sparse", {"count": 1, "index_dtype": "I64", "delta": False},
             [["I64", 1, 0, 8, None], ["F32", 1, 64, 4, None]]]
    src = BytesSource(_one_tensor_record(entry, idx + bytes(56) + val), "s.ldlog")
    (ref,) = scan_segment(src, 64, active=False).records
    hdr, meta, payload = read_record_meta(src, ref)
    rec = Record(hdr.step, meta, payload, src.path, ref.offset, hdr.length)
    with pytest.raises(LowdiffError) as ei:
        rec.tensor("s")
    assert ei.value.reason.value in ("limit_exceeded", "bad_codec_params")


def _forged_zstd_frame(declared: int) -> bytes:
    """A small zstd frame whose header declares ``declared`` bytes of content."""
    blob = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(bytes(4096))
    fhd = blob[4]  # frame header descriptor: FCS size flag (bits 7-6), single segment (5)
    assert fhd & 0x03 == 0  # no dictionary id
    single = bool(fhd & 0x20)
    fcs_at = 5 if single else 6  # a window descriptor byte unless single-segment
    old = {0: 1 if single else 0, 1: 2, 2: 4, 3: 8}[fhd >> 6]
    return (blob[:4] + bytes([0xC0 | (fhd & 0x3F)]) + blob[5:fcs_at]
            + struct.pack("<Q", declared) + blob[fcs_at + old:])


def test_zstd_part_declaring_a_huge_size_is_refused() -> None:
    n = 2**48  # the largest count the log layer lets through (MAX_ELEMENTS)
    frame = _forged_zstd_frame(n)
    assert zstandard.frame_content_size(frame) == n
    entry = ["z", "U8", [n], "raw", {}, [["U8", n, 0, len(frame),
                                          {"compressor": "zstd", "shuffle": False}]]]
    src = BytesSource(_one_tensor_record(entry, frame), "z.ldlog")
    (ref,) = scan_segment(src, 64, active=False).records
    hdr, meta, payload = read_record_meta(src, ref)
    rec = Record(hdr.step, meta, payload, src.path, ref.offset, hdr.length)
    with pytest.raises(LowdiffError) as ei:
        rec.tensor("z")  # refused before any allocation (a frame cannot expand that much)
    assert ei.value.reason.value == "decode_size_mismatch"


# ---------------------------------------------------------------------- slow campaigns


@pytest.mark.slow
@SLOW
@given(st.one_of(_mutated(_SEGMENT), st.binary(max_size=4000).map(lambda b: _segment_header() + b)),
       st.booleans(), st.booleans())
def test_slow_fuzz_segments(data: bytes, active: bool, strict: bool) -> None:
    only_lowdiff(_read_segment, data, active, strict)


@pytest.mark.slow
@SLOW
@given(st.lists(st.tuples(_meta, st.binary(max_size=600)), min_size=1, max_size=4),
       st.booleans())
def test_slow_fuzz_records_with_valid_crcs(items: list[tuple[Any, bytes]], strict: bool) -> None:
    test_fuzz_records_with_valid_crcs.hypothesis.inner_test(items, strict)  # type: ignore


@pytest.mark.slow
@SLOW
@given(st.one_of(st.binary(max_size=300), st.builds(msgpack.packb, _obj), _mutated(_MANIFEST)))
def test_slow_fuzz_metadata_and_manifests(data: bytes) -> None:
    only_lowdiff(unpack_meta, data)
    only_lowdiff(unpack_manifest, data)
    only_lowdiff(decode_file_header, data, SEGMENT_MAGIC)
    only_lowdiff(decode_record_header, data)


@pytest.mark.slow
@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.one_of(st.binary(max_size=300), _mutated(_VALID_BASE), _hostile_base()),
       mode=st.sampled_from(["mmap", "pread"]))
def test_slow_fuzz_base_file(tmp_path: Path, data: bytes, mode: str) -> None:
    test_fuzz_base_file.hypothesis.inner_test(tmp_path, data, mode)  # type: ignore


@pytest.mark.slow
@settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
@given(which=st.sampled_from(_FILES), data=st.data(), strict=st.booleans(),
       mode=st.sampled_from(["mmap", "pread"]), fixed_log_id=st.booleans())
def test_slow_fuzz_log_directory(tmp_path: Path, pristine_log: Any, which: str,
                                 data: st.DataObject, strict: bool, mode: str,
                                 fixed_log_id: bool) -> None:
    test_fuzz_log_directory.hypothesis.inner_test(tmp_path, pristine_log, which, data, strict,
                                                  mode, fixed_log_id)


def test_fuzz_helpers_can_fail() -> None:
    """``only_lowdiff`` lets every non-LowdiffError through (else the fuzz proves nothing)."""
    for exc in (IndexError, KeyError, TypeError, struct.error, MemoryError, UnicodeError):
        def boom(e: type[BaseException] = exc) -> None:
            raise e("x")

        with pytest.raises(exc):
            only_lowdiff(boom)
    assert os.path.exists(Path(__file__))
