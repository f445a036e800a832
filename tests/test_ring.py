"""The writer ring's layout (format_spec/ring.md), without a process: the header, messages
round trip, every garbage field refused with its slot and offset, requests, the error
reply; and the writer's loop (``process.Server``) against a fake producer."""

from __future__ import annotations

import errno
import os
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lowdiff_store.errors import (
    BadMagicError,
    CommitError,
    ConfigError,
    FormatError,
    LowdiffError,
    Reason,
    StorageError,
    UnsupportedVersionError,
)
from lowdiff_store.format.checksum import crc32c, mask
from lowdiff_store.format.dtypes import STORAGE_DTYPE
from lowdiff_store.format.framing import align_up, pack_meta
from lowdiff_store.writer import ring as R
from lowdiff_store.writer.process import ParentWatch, Server
from lowdiff_store.writer.ring import Kind, Op, Outgoing, Ring, RingTensor, State, Word

SLOT = 8192


@pytest.fixture
def ring() -> Iterator[Ring]:
    r, fd = Ring.create(8, SLOT)
    os.close(fd)
    yield r
    r.close()


def _diff(step: int = 5) -> Outgoing:
    a = np.arange(10, dtype=np.float32)
    return R.layout_diff(step, "grad", [RingTensor.raw("w", "F32", (2, 5), a)],
                         side={"lr": 0.5})


def _recrc(ring: Ring, at: int) -> None:
    """Recompute a message's CRC after a test changed its header (a producer bug that
    still checksums what it wrote)."""
    table_len = struct.unpack_from("<I", ring.buf, at + 32)[0]
    body = bytes(ring.buf[at + 8:at + 64]) + bytes(ring.buf[at + 64:at + 64 + table_len])
    struct.pack_into("<I", ring.buf, at + 4, mask(crc32c(body)))


# ------------------------------------------------------------------------------ header

def test_attach_reads_what_create_wrote() -> None:
    r, fd = Ring.create(3, 4096)
    try:
        a = Ring.attach(fd)
        assert (a.slot_count, a.slot_size, a.size) == (3, 4096, 4096 + 3 * 4096)
        assert bytes(a.buf[:8]) == b"LDRNG\x00\r\n"
        assert [a.get(w) for w in Word] == [0, 0, -1, 0, -1, -1, 0, -1]
        a.set(Word.TAIL, 7)  # one mapping, two views: the words are shared
        assert r.get(Word.TAIL) == 7
        a.close()
    finally:
        os.close(fd)
        r.close()


@pytest.mark.parametrize(("at", "value", "reason", "offset"), [
    (0, b"LDRNX", Reason.BAD_MAGIC, 0),
    (8, struct.pack("<H", 3), Reason.UNSUPPORTED_VERSION, 8),
    (12, struct.pack("<I", 8192), Reason.BAD_RECORD_LENGTH, 12),
    (20, b"\x01", Reason.CHECKSUM_MISMATCH, 60),  # a reserved byte: only the CRC sees it
    (16, struct.pack("<I", 0), Reason.OUT_OF_BOUNDS, 16),
    (24, struct.pack("<Q", 4097), Reason.OUT_OF_BOUNDS, 24),
    (16, struct.pack("<I", 4), Reason.TRUNCATED, 16384),  # header says 4 slots, 3 are there
])
def test_attach_refuses_a_bad_header(at: int, value: bytes, reason: Reason,
                                     offset: int) -> None:
    r, fd = Ring.create(3, 4096)
    try:
        os.pwrite(fd, value, at)
        if reason not in (Reason.CHECKSUM_MISMATCH, Reason.BAD_MAGIC):
            head = os.pread(fd, 60, 0)
            os.pwrite(fd, struct.pack("<I", mask(crc32c(head))), 60)
        with pytest.raises(FormatError) as ei:
            Ring.attach(fd)
        assert ei.value.reason is reason
        assert ei.value.offset == offset
        if reason is Reason.UNSUPPORTED_VERSION:
            assert isinstance(ei.value, UnsupportedVersionError)
            assert "version 3 (this build reads up to 2)" in str(ei.value)
    finally:
        os.close(fd)
        r.close()


def test_create_refuses_bad_sizes() -> None:
    for slots, size in ((0, 4096), (R.MAX_SLOTS + 1, 4096), (2, 4000), (2, 2048)):
        with pytest.raises(ConfigError):
            Ring.create(slots, size)


def test_without_memfd_the_ring_is_an_unlinked_file_in_the_named_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_memfd(name: str, flags: int = 0) -> int:
        raise OSError(errno.ENOSYS, "no memfd")

    monkeypatch.setattr(os, "memfd_create", no_memfd)
    with pytest.raises(ConfigError, match="ring_dir"):
        R.make_ring_fd(8192)
    fd = R.make_ring_fd(8192, tmp_path)
    try:
        st_ = os.fstat(fd)
        assert st_.st_nlink == 0
        assert st_.st_size == 8192
        assert st_.st_blocks * 512 >= 8192  # allocated at open, not sparse
        assert list(tmp_path.iterdir()) == []
    finally:
        os.close(fd)


def test_a_memfd_ring_is_not_a_file_in_dev_shm() -> None:
    fd = R.make_ring_fd(8192)
    try:
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:lowdiff-ring")
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------ messages

_TAGS = sorted(STORAGE_DTYPE)


@st.composite
def _tensors(draw: Any) -> list[RingTensor]:
    n = draw(st.integers(0, 5))
    names = draw(st.lists(st.text(min_size=1, max_size=8), min_size=n, max_size=n,
                          unique=True))
    out = []
    for name in names:
        tag = draw(st.sampled_from(_TAGS))
        shape = tuple(draw(st.lists(st.integers(0, 6), max_size=3)))
        count = int(np.prod(shape))
        data = np.frombuffer(draw(st.binary(min_size=count * STORAGE_DTYPE[tag].itemsize,
                                            max_size=count * STORAGE_DTYPE[tag].itemsize)),
                             STORAGE_DTYPE[tag])
        if draw(st.booleans()):
            out.append(RingTensor.raw(name, tag, shape, data))
        else:  # parts already encoded: the ring only carries them
            idx = np.arange(draw(st.integers(0, 9)), dtype=np.int32)
            out.append(RingTensor(name, tag, shape, (("I32", idx), (tag, data)), "sparse",
                                  {"k": int(idx.size)}, draw(st.sampled_from([None, 3]))))
    return out


@given(tensors=_tensors(), step=st.integers(0, (1 << 63) - 1), lap=st.integers(0, 1 << 40),
       index=st.integers(0, 7), sync=st.booleans(),
       side=st.dictionaries(st.text(max_size=4), st.integers(-(1 << 63), (1 << 64) - 1),
                            max_size=3))
def test_a_message_round_trips(tensors: list[RingTensor], step: int, lap: int, index: int,
                               sync: bool, side: dict[str, int]) -> None:
    r, fd = Ring.create(8, SLOT)
    os.close(fd)
    try:
        msg = R.layout_diff(step, "grad", tensors, side=side, sync=sync)
        index = min(index, 8 - msg.span(SLOT))
        seq = lap * 8 + index
        R.write_message(r, seq, msg)
        got = R.read_message(r, seq)
        assert (got.seq, got.span, got.kind, got.step) == (seq, msg.span(SLOT), Kind.DIFF,
                                                           step)
        assert got.flags == (R.FLAG_SYNC if sync else 0)
        assert (got.record_kind, got.side, got.extra) == ("grad", side or None, None)
        assert [t.name for t in got.tensors] == [t.name for t in tensors]
        for want, t in zip(tensors, got.tensors, strict=True):
            assert (t.dtype, t.shape, t.codec, t.params, t.zstd) == (
                want.dtype, want.shape, want.codec, dict(want.params), want.zstd)
            for (tag, data), p in zip(want.parts, t.parts, strict=True):
                assert p.dtype == tag
                assert p.offset % 64 == 0
                assert bytes(r.buf[p.offset:p.offset + p.length]) == data.tobytes()
                view = r.array(p)
                assert view.dtype == STORAGE_DTYPE[tag]
                assert view.tobytes() == data.tobytes()
                del view
    finally:
        r.close()


def test_base_open_and_pad_messages_round_trip(ring: Ring) -> None:
    w = np.arange(12, dtype=np.float64).reshape(3, 4)
    R.write_message(ring, 0, R.layout_open("/x/log", {"batch": 4}, {"a": 1}))
    R.write_message(ring, 1, R.layout_base(7, [RingTensor.raw("w", "F64", w.shape, w)],
                                           {"m": 2}))
    R.write_message(ring, 2, R.pad_message(), 6)
    o, b, p = (R.read_message(ring, s) for s in (0, 1, 2))
    assert (o.kind, o.path, o.options, o.meta) == (Kind.OPEN, "/x/log", {"batch": 4},
                                                   {"a": 1})
    assert (b.kind, b.step, b.meta, b.tensors[0].shape) == (Kind.BASE, 7, {"m": 2}, (3, 4))
    arr = ring.array(b.tensors[0].parts[0]).reshape(3, 4)
    assert np.array_equal(arr, w)
    del arr
    assert (p.kind, p.span, p.tensors) == (Kind.PAD, 6, ())


def _slot_at(ring: Ring, seq: int) -> int:
    return R.HEADER_LEN + (seq % ring.slot_count) * ring.slot_size


@pytest.mark.parametrize(("field", "at", "fmt", "value", "reason", "fix_crc"), [
    ("magic", 0, "4s", b"LDSX", Reason.BAD_MAGIC, False),
    ("span zero", 28, "I", 0, Reason.OUT_OF_BOUNDS, False),
    ("span past the end", 28, "I", 7, Reason.OUT_OF_BOUNDS, False),
    ("table_len", 32, "I", 7 * SLOT, Reason.OUT_OF_BOUNDS, False),
    ("crc", 4, "I", 12345, Reason.CHECKSUM_MISMATCH, False),
    ("a byte of the header", 50, "B", 1, Reason.CHECKSUM_MISMATCH, False),
    ("seq", 8, "Q", 99, Reason.BAD_METADATA, True),
    ("kind", 24, "B", 9, Reason.UNKNOWN_RECORD_TYPE, True),
    ("flags", 25, "B", 2, Reason.BAD_METADATA, True),
    ("step", 16, "Q", 1 << 63, Reason.OUT_OF_BOUNDS, True),
    ("payload_len", 40, "Q", SLOT, Reason.OUT_OF_BOUNDS, True),
])
def test_every_garbage_header_field_is_refused_with_its_offset(
        ring: Ring, field: str, at: int, fmt: str, value: Any, reason: Reason,
        fix_crc: bool) -> None:
    seq = 8 * 3 + 2  # slot index 2, third lap
    R.write_message(ring, seq, _diff())
    base = _slot_at(ring, seq)
    struct.pack_into("<" + fmt, ring.buf, base + at, value)
    if fix_crc:
        _recrc(ring, base)
    with pytest.raises(FormatError) as ei:
        R.read_message(ring, seq)
    e = ei.value
    assert e.reason is reason, (field, e)
    assert e.offset == base + (4 if reason is Reason.CHECKSUM_MISMATCH else at)
    assert "ring slot 2" in str(e)
    assert str(e).startswith(f"offset {e.offset}: {reason.value}: ring slot 2")


def _table_message(table: Any, payload_len: int = 256) -> Outgoing:
    raw = table if isinstance(table, bytes) else pack_meta(table)
    return Outgoing(Kind.DIFF, 1, 0, raw, payload_len, [])


_T = ["w", "F32", [4], "raw", {}, None, [["F32", 0, 16]]]


def _with(i: int, v: Any) -> list[Any]:
    t = list(_T)
    t[i] = v
    return t


@pytest.mark.parametrize(("table", "reason"), [
    (b"\xc1", Reason.BAD_METADATA),  # msgpack's never-used byte
    ({"kind": "grad", "tensors": 3}, Reason.BAD_METADATA),
    ({"kind": 1, "tensors": [_T]}, Reason.BAD_METADATA),
    ({"kind": "grad", "tensors": [_T], "side": [1]}, Reason.BAD_METADATA),
    ({"kind": "grad", "tensors": [_T[:6]]}, Reason.BAD_METADATA),
    ({"kind": "grad", "tensors": [_with(0, "")]}, Reason.BAD_METADATA),
    ({"kind": "grad", "tensors": [_T, _T]}, Reason.BAD_METADATA),  # duplicate name
    ({"kind": "grad", "tensors": [_with(1, "F33")]}, Reason.BAD_DTYPE),
    ({"kind": "grad", "tensors": [_with(2, [-1])]}, Reason.LIMIT_EXCEEDED),
    ({"kind": "grad", "tensors": [_with(2, [1] * 33)]}, Reason.LIMIT_EXCEEDED),
    ({"kind": "grad", "tensors": [_with(3, "gzip")]}, Reason.UNKNOWN_CODEC),
    ({"kind": "grad", "tensors": [_with(5, 99)]}, Reason.BAD_CODEC_PARAMS),
    ({"kind": "grad", "tensors": [_with(6, [["F32", 0, 12]])]}, Reason.BAD_RECORD_LENGTH),
    ({"kind": "grad", "tensors": [_with(6, [["F32", 0, 15]])]}, Reason.BAD_RECORD_LENGTH),
    ({"kind": "grad", "tensors": [_with(6, [["F32", 32, 16]])]}, Reason.OUT_OF_BOUNDS),
    ({"kind": "grad", "tensors": [_with(6, [["F32", 256, 16]])]}, Reason.OUT_OF_BOUNDS),
    ({"kind": "grad", "tensors": [_with(6, [["F32", 1 << 40, 16]])]}, Reason.OUT_OF_BOUNDS),
    ({"kind": "grad", "tensors": [  # two parts in one range
        ["s", "F32", [4], "sparse", {}, None, [["I32", 0, 64], ["F32", 0, 16]]]]},
     Reason.OUT_OF_BOUNDS),
])
def test_every_garbage_table_is_refused_at_the_table(ring: Ring, table: Any,
                                                     reason: Reason) -> None:
    R.write_message(ring, 1, _table_message(table))
    with pytest.raises(FormatError) as ei:
        R.read_message(ring, 1)
    assert ei.value.reason is reason, ei.value
    assert ei.value.offset == _slot_at(ring, 1) + 64
    assert "ring slot 1" in str(ei.value)


def test_the_producer_refuses_what_the_reader_would() -> None:
    a = np.zeros(4, np.float32)
    with pytest.raises(ConfigError, match="duplicate"):
        R.layout_diff(1, "grad", [RingTensor.raw("w", "F32", (4,), a)] * 2)
    with pytest.raises(FormatError) as ei:
        R.layout_diff(1, "grad", [RingTensor.raw("w", "F64", (4,), a)])
    assert ei.value.reason is Reason.BAD_DTYPE
    with pytest.raises(FormatError) as ei:
        R.layout_diff(1, "grad", [RingTensor.raw("w", "F32", (5,), a)])
    assert ei.value.reason is Reason.BAD_RECORD_LENGTH
    with pytest.raises(ConfigError, match="contiguous"):
        R.layout_diff(1, "grad", [RingTensor.raw("w", "F32", (2,), a[::2])])
    with pytest.raises(ConfigError, match="out of range"):
        R.layout_diff(-1, "grad", [])
    with pytest.raises(FormatError, match="not compressed"):
        R.layout_base(1, [RingTensor("w", "F32", (4,), (("F32", a),), zstd=3)])
    with pytest.raises(ConfigError, match="unknown writer option"):
        R.layout_open("/x", {"batches": 2}, None)
    raw = R.layout_diff(1, "grad", [RingTensor.raw("m", "U8", (3,), memoryview(b"abc"))])
    assert raw.payload_len == 3
    assert raw.size == align_up(64 + len(raw.table)) + 3


# ------------------------------------------------------------------------------ channel

def test_requests_round_trip_and_garbage_is_refused() -> None:
    assert R.unpack_request(R.pack_request(Op.FLUSH, 7)) == (Op.FLUSH, 7)
    assert len(R.pack_request(Op.PUBLISH, 1 << 40)) == R.REQUEST_SIZE == 16
    with pytest.raises(FormatError) as ei:
        R.unpack_request(b"\x01" * 15)
    assert ei.value.reason is Reason.BAD_RECORD_LENGTH
    with pytest.raises(FormatError, match="op 9"):
        R.unpack_request(struct.pack("<I4xQ", 9, 0))


# ------------------------------------------------------------------------------ error reply

def test_the_error_reply_rebuilds_the_class_reason_and_cause(ring: Ring) -> None:
    assert R.read_failure(ring) is None
    cause = StorageError("write failed: No space left on device (errno 28)",
                         path="/l/seg-1.ldlog", offset=128)
    cause.errno = errno.ENOSPC
    err = CommitError("step 3 is not durable: the writer failed at step 3", path="/l")
    err.__cause__ = cause
    R.publish_failure(ring, R.encode_reply(err, 3))
    assert ring.get(Word.STATE) == State.FAILED
    got = R.read_failure(ring)
    assert type(got) is CommitError
    assert got.reason is Reason.WRITER_FAILED
    assert str(got) == str(err)
    c = got.__cause__
    assert type(c) is StorageError
    assert c.reason is Reason.IO_ERROR
    assert c.errno == errno.ENOSPC
    assert "No space left" in str(c)


def test_a_reply_for_any_exception_fits_and_names_it(ring: Ring) -> None:
    R.publish_failure(ring, R.encode_reply(ValueError("x" * 10000), None))
    got = R.read_failure(ring)
    assert type(got) is CommitError
    assert "ValueError" in str(got)
    assert len(str(got)) < 2100
    assert type(got.__cause__) is RuntimeError
    R.publish_failure(ring, R.encode_reply(OSError(errno.EIO, "I/O error"), 1))
    got = R.read_failure(ring)
    assert type(got.__cause__) is OSError
    assert got.__cause__.errno == errno.EIO


def test_a_reply_naming_an_unknown_class_or_torn_is_a_commit_error(ring: Ring) -> None:
    R.publish_failure(ring, pack_meta({"class": "Popen", "reason": "io_error",
                                       "detail": "d", "path": None, "offset": None}))
    got = R.read_failure(ring)
    assert type(got) is CommitError
    assert got.reason is Reason.IO_ERROR
    ring.buf[R.REPLY_AT] ^= 0xFF
    got = R.read_failure(ring)
    assert type(got) is CommitError
    assert "unreadable" in str(got)


# ------------------------------------------------------------------------------ the loop

def test_the_writer_loop_fails_on_a_garbage_message_naming_its_slot(tmp_path: Path) -> None:
    """The writer's side against a fake producer: OPEN, one good step, one garbage slot."""
    ring, fd = Ring.create(4, 4096)
    os.close(fd)
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server = Server(ring, theirs, ParentWatch(os.getppid()))
    status: list[int] = []
    t = threading.Thread(target=lambda: status.append(server.run()))
    t.start()
    try:
        R.write_message(ring, 0, R.layout_open(str(tmp_path / "log"), {}, None))
        R.write_message(ring, 1, _diff(1))
        R.write_message(ring, 2, _diff(2))
        ring.buf[_slot_at(ring, 2) + 1] ^= 0x40
        mine.send(R.pack_request(Op.PUBLISH, 3))
        t.join(60)
        assert status == [1]
        err = R.read_failure(ring)
        assert isinstance(err, BadMagicError)
        assert err.offset == _slot_at(ring, 2)
        assert "ring slot 2" in str(err)
        assert ring.get(Word.STATE) == State.FAILED
        assert ring.get(Word.DURABLE) == 1  # the good step was made durable on the way out
    finally:
        t.join(60)
        mine.close()
        theirs.close()
        ring.close()


def test_an_error_raised_by_the_log_is_raised_by_read_failure_as_its_class(
        tmp_path: Path) -> None:
    ring, fd = Ring.create(4, 4096)
    os.close(fd)
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    (tmp_path / "log").write_text("not a directory")
    server = Server(ring, theirs, ParentWatch(os.getppid()))
    try:
        R.write_message(ring, 0, R.layout_open(str(tmp_path / "log"), {}, None))
        mine.send(R.pack_request(Op.PUBLISH, 1))
        mine.close()  # then end of file: the loop ends
        assert server.run() == 1
        err = R.read_failure(ring)
        assert isinstance(err, LowdiffError)
        assert ring.get(Word.TAIL) == 1
    finally:
        theirs.close()
        ring.close()


def test_a_descriptor_limit_at_make_is_named_not_mistaken_for_no_memfd(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """EMFILE from ``memfd_create`` is the process's descriptor limit, raised as such (not
    the "memfd unavailable, name a ring_dir" of a kernel without memfd)."""
    import errno

    from lowdiff_store.errors import StorageError
    from lowdiff_store.writer.ring import make_ring_fd

    def full(*_a: object) -> int:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
    monkeypatch.setattr(os, "memfd_create", full)
    with pytest.raises(StorageError) as ei:
        make_ring_fd(8192)
    assert ei.value.errno == errno.EMFILE
    assert "Too many open files" in str(ei.value)

    def nosys(*_a: object) -> int:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))
    monkeypatch.setattr(os, "memfd_create", nosys)
    with pytest.raises(ConfigError, match="name a directory"):
        make_ring_fd(8192)
