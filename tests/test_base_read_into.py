"""Reading a base's tensors straight into the caller's memory (``BaseFile.read_into``, the
path ``restore`` loads a base through): the same bytes as ``tensor()``, every CRC still
checked (a corrupted tensor in the middle of a base is named with its offset), a file that
shrank after it was opened refused with an offset, a file renamed over the path not read."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lowdiff_store import LowdiffError, Reason
from lowdiff_store.errors import CorruptRecordError, FormatError, StorageError
from lowdiff_store.log.base import BaseFile, write_base
from lowdiff_store.storage import BytesSource, MmapSource, PreadSource, read_into

LOG_ID = bytes(range(16))
MODES = ["mmap", "private", "pread", "bytes"]


def _tensors() -> dict[str, tuple[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    return {
        "a": ("F32", rng.standard_normal(3000).astype("<f4")),
        "b": ("BF16", rng.integers(0, 1 << 16, (17, 33), dtype="<u2")),
        "c": ("F64", rng.standard_normal((5, 7, 3)).astype("<f8")),
        "scalar": ("I64", np.array(-5, dtype="<i8")),
        "empty": ("F32", np.zeros((0, 4), dtype="<f4")),
        "d": ("U8", rng.integers(0, 256, 100_001, dtype=np.uint8)),
    }


def _offsets(path: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """(data start, name -> (begin, end) in the data) from the safetensors header."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__")
    return 8 + n, {k: tuple(v["data_offsets"]) for k, v in header.items()}


def _open(path: Path, mode: str) -> BaseFile:
    if mode == "bytes":
        return BaseFile(str(path), source=BytesSource(path.read_bytes(), str(path)))
    return BaseFile(str(path), mode=mode)  # type: ignore[arg-type]


@pytest.fixture
def base_path(tmp_path: Path) -> Path:
    p = tmp_path / "base.safetensors"
    write_base(str(p), 4, _tensors(), {"torch": {"step": 4}}, LOG_ID)
    return p


@pytest.mark.parametrize("mode", MODES)
def test_read_into_gives_the_bytes_of_tensor(base_path: Path, mode: str) -> None:
    want = _tensors()
    with _open(base_path, mode) as b:
        for name, (_tag, arr) in want.items():
            out = np.full(arr.shape, 0x5A, dtype=arr.dtype)  # not the answer already
            b.read_into(name, out)
            assert out.tobytes() == arr.tobytes(), name
            assert b.tensor(name).tobytes() == arr.tobytes(), name
        with pytest.raises(LowdiffError) as ei:  # the wrong size is refused
            b.read_into("a", np.empty(10, np.float32))
        assert ei.value.reason is Reason.INVALID_ARGUMENT
        with pytest.raises(LowdiffError) as ei:  # a read-only buffer too
            b.read_into("a", want["a"][1].copy().view(np.ndarray)[::-1])
        assert ei.value.reason is Reason.INVALID_ARGUMENT


@pytest.mark.parametrize("mode", MODES)
def test_corrupted_tensor_in_the_middle_is_named_with_its_offset(base_path: Path,
                                                                  mode: str) -> None:
    start, offs = _offsets(base_path)
    b0, e0 = offs["c"]
    raw = bytearray(base_path.read_bytes())
    raw[start + (b0 + e0) // 2] ^= 0x10
    base_path.write_bytes(bytes(raw))
    want = _tensors()
    with _open(base_path, mode) as b:
        out = np.empty_like(want["a"][1])
        b.read_into("a", out)  # before it: fine
        assert out.tobytes() == want["a"][1].tobytes()
        with pytest.raises(CorruptRecordError) as ei:
            b.read_into("c", np.empty_like(want["c"][1]))
        assert ei.value.reason is Reason.CHECKSUM_MISMATCH
        assert ei.value.path == str(base_path)
        assert ei.value.offset == start + b0
        assert "'c'" in str(ei.value)
        assert str(base_path) in str(ei.value)
        out = np.empty_like(want["d"][1])
        b.read_into("d", out)  # after it: fine
        assert out.tobytes() == want["d"][1].tobytes()


@pytest.mark.parametrize("mode", ["mmap", "private", "pread"])
def test_base_that_shrank_after_opening_is_refused_with_an_offset(base_path: Path,
                                                                   mode: str) -> None:
    start, offs = _offsets(base_path)
    b0, _e0 = offs["d"]
    want = _tensors()
    with _open(base_path, mode) as b:
        os.truncate(base_path, start + b0 + 1000)  # cut inside "d", after it was opened
        out = np.empty_like(want["a"][1])
        b.read_into("a", out)
        assert out.tobytes() == want["a"][1].tobytes()
        with pytest.raises(FormatError) as ei:
            b.read_into("d", np.empty_like(want["d"][1]))
        assert ei.value.reason is Reason.TRUNCATED
        assert ei.value.path == str(base_path)
        assert ei.value.offset == start + b0 + 1000


def test_truncated_base_is_refused_when_opened(base_path: Path) -> None:
    start, offs = _offsets(base_path)
    os.truncate(base_path, start + offs["c"][0] + 3)
    for mode in ("mmap", "private", "pread"):
        with pytest.raises(FormatError) as ei:
            _open(base_path, mode)
        assert ei.value.reason is Reason.TRUNCATED
        assert ei.value.path == str(base_path)


def test_mapped_file_renamed_over_is_not_read(tmp_path: Path) -> None:
    p = tmp_path / "f"
    p.write_bytes(b"old-" * 1000)
    src = MmapSource(str(p))
    other = tmp_path / "g"
    other.write_bytes(b"new-" * 1000)
    os.replace(other, p)  # what the map holds is the old file: read_into reads it too
    out = bytearray(8)
    src.read_into(4, out, ahead=1 << 20)
    assert bytes(out) == b"old-old-"
    src.close()


def test_read_into_sources_agree_and_check_bounds(tmp_path: Path) -> None:
    data = bytes(range(256)) * 300
    p = tmp_path / "f"
    p.write_bytes(data)

    class Foreign:  # a source with read() only (an object store's)
        path = str(p)
        size = len(data)

        def read(self, offset: int, n: int) -> memoryview:
            return memoryview(data)[offset:offset + n]

        def close(self) -> None:
            pass

    srcs: list[Any] = [MmapSource(str(p)), MmapSource(str(p), private=True),
                       PreadSource(str(p)), BytesSource(data, str(p)), Foreign()]
    for src in srcs:
        out = np.empty(5000, np.uint8)
        read_into(src, 1234, out, ahead=4096)
        assert out.tobytes() == data[1234:6234], type(src)
        with pytest.raises(FormatError) as ei:
            read_into(src, len(data) - 10, np.empty(11, np.uint8))
        assert ei.value.reason is Reason.TRUNCATED
        src.close()
    for src in srcs[:3]:  # a closed local source refuses, whether it had read or not
        with pytest.raises(StorageError):
            read_into(src, 0, np.empty(4, np.uint8))
    fresh = MmapSource(str(p))
    fresh.close()
    with pytest.raises(StorageError):
        read_into(fresh, 0, np.empty(4, np.uint8))
