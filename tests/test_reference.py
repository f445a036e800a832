"""Reference bases without torch: scanning safetensors checkpoints (a file, an index and its
shards), the hostile headers and indexes refused with one reason each, and the reference
table's schema (``format_spec/log_format.md`` section 7.1)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lowdiff_store.errors import LowdiffError, Reason
from lowdiff_store.format.checksum import crc32c
from lowdiff_store.log.base import BaseFile, write_base
from lowdiff_store.log.reference import (
    Reference,
    ReferenceBase,
    RefTensor,
    as_base,
    make_reference,
    parse_reference,
    scan_safetensors,
)


def st_bytes(tensors: dict[str, tuple[str, np.ndarray]], header_extra: Any = None) -> bytes:
    header: dict[str, Any] = {}
    off, data = 0, []
    for k, (tag, a) in tensors.items():
        header[k] = {"dtype": tag, "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        data.append(a.tobytes())
        off += a.nbytes
    if header_extra:
        header.update(header_extra)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + b"".join(data)


W = np.arange(6, dtype="<f4").reshape(2, 3)
B = np.array([7, 8], dtype="<i8")


def test_scan_a_file_and_an_index(tmp_path: Path) -> None:
    f = tmp_path / "one.safetensors"
    f.write_bytes(st_bytes({"w": ("F32", W), "b": ("I64", B)}))
    ext = scan_safetensors(f)
    assert ext.root == str(tmp_path)
    assert [(x.name, x.size, x.crc32c) for x in ext.files] == \
        [("one.safetensors", f.stat().st_size, crc32c(f.read_bytes()))]
    assert ext.tensors["w"].crc32c == crc32c(W.tobytes())
    assert (ext.tensors["b"].dtype, ext.tensors["b"].shape) == ("I64", (2,))
    d = tmp_path / "hf"
    d.mkdir()
    (d / "a.safetensors").write_bytes(st_bytes({"w": ("F32", W)}))
    (d / "b.safetensors").write_bytes(st_bytes({"b": ("I64", B)}))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"w": "a.safetensors", "b": "b.safetensors"}}))
    ext = scan_safetensors(d)
    assert [x.name for x in ext.files] == ["a.safetensors", "b.safetensors"]
    assert ext.tensors["b"].files == (1,)


@pytest.mark.parametrize(("edit", "reason"), [
    (lambda raw: struct.pack("<Q", 200 << 20) + raw[8:], Reason.METADATA_TOO_LARGE),
    (lambda raw: struct.pack("<Q", len(raw)) + raw[8:], Reason.TRUNCATED),
    (lambda raw: raw[:-4], Reason.TRUNCATED),
    (lambda raw: raw + b"\0" * 8, Reason.OUT_OF_BOUNDS),
])
def test_hostile_safetensors_files(tmp_path: Path, edit: Any, reason: Reason) -> None:
    f = tmp_path / "x.safetensors"
    f.write_bytes(edit(st_bytes({"w": ("F32", W)})))
    with pytest.raises(LowdiffError) as ei:
        scan_safetensors(f)
    assert ei.value.reason is reason
    assert ei.value.path == str(f)


@pytest.mark.parametrize(("entry", "reason"), [
    ({"dtype": "Q4", "shape": [2], "data_offsets": [24, 26]}, Reason.BAD_DTYPE),
    ({"dtype": "F32", "shape": [2], "data_offsets": [24, 36]}, Reason.BAD_RECORD_LENGTH),
    ({"dtype": "F32", "shape": [-1], "data_offsets": [24, 28]}, Reason.BAD_METADATA),
    ({"dtype": "F32", "shape": [2], "data_offsets": [40, 48]}, Reason.TRUNCATED),
    ({"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, Reason.OUT_OF_BOUNDS),
])
def test_hostile_safetensors_entries(tmp_path: Path, entry: dict[str, Any],
                                     reason: Reason) -> None:
    f = tmp_path / "x.safetensors"
    f.write_bytes(st_bytes({"w": ("F32", W)}, {"z": entry}))
    with pytest.raises(LowdiffError) as ei:
        scan_safetensors(f)
    assert ei.value.reason is reason
    assert "\n" not in str(ei.value)


@pytest.mark.parametrize(("index", "reason"), [
    ({"weight_map": ["a.safetensors"]}, Reason.BAD_METADATA),
    ({"weight_map": {"w": "../a.safetensors"}}, Reason.UNSAFE_NAME),
    ({"weight_map": {"w": "/etc/passwd"}}, Reason.UNSAFE_NAME),
    ({"weight_map": {"w": "missing.safetensors"}}, Reason.MISSING_FILE),
    ({"weight_map": {"w": "a.safetensors", "b": "dup.safetensors"}}, Reason.BAD_METADATA),
])
def test_hostile_indexes(tmp_path: Path, index: dict[str, Any], reason: Reason) -> None:
    (tmp_path / "a.safetensors").write_bytes(st_bytes({"w": ("F32", W)}))
    (tmp_path / "dup.safetensors").write_bytes(st_bytes({"w": ("F32", W)}))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(LowdiffError) as ei:
        scan_safetensors(tmp_path)
    assert ei.value.reason is reason


def test_a_fifo_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").unlink(missing_ok=True)
    os.mkfifo(tmp_path / "model.safetensors")
    with pytest.raises(LowdiffError) as ei:
        scan_safetensors(tmp_path)
    assert ei.value.reason is Reason.NOT_A_REGULAR_FILE


def _table(tmp_path: Path) -> dict[str, Any]:
    f = tmp_path / "model.safetensors"
    f.write_bytes(st_bytes({"w": ("F32", W)}))
    ext = scan_safetensors(f)
    ref = make_reference(ext, [RefTensor("w", "w", "F32", (2, 3), ext.tensors["w"].crc32c,
                                         (0,)),
                               RefTensor("row", "w", "F32", (1, 3),
                                         crc32c(W[1:].tobytes()), (0,), ((1, 0), (2, 3)))])
    return ref.to_obj()


def test_reference_base_round_trip(tmp_path: Path) -> None:
    table = _table(tmp_path)
    p = tmp_path / "base.safetensors"
    write_base(str(p), 0, {"own": ("I64", B)}, {"reference": table}, bytes(16))
    with as_base(BaseFile(str(p))) as b:
        assert isinstance(b, ReferenceBase)
        assert b.names == ["own", "w", "row"]
        assert b.info("row") == ("F32", (1, 3))
        assert b.tensor("w").tolist() == W.tolist()
        assert b.tensor("row").tolist() == W[1:].tolist()
        b.verify_all()


@pytest.mark.parametrize("edit", [
    lambda t: t.update(kind="zip"),
    lambda t: t.update(root=""),
    lambda t: t["files"][0].__setitem__(0, "a/b"),
    lambda t: t["files"][0].__setitem__(1, -1),
    lambda t: t["tensors"][0].__setitem__(5, [3]),
    lambda t: t["tensors"][0].__setitem__(5, []),
    lambda t: t["tensors"][1].__setitem__(6, [[2, 0], [2, 3]]),
    lambda t: t["tensors"][1].__setitem__(2, "Q4"),
    lambda t: t["tensors"].append(list(t["tensors"][0])),
    lambda t: t["tensors"][0].__setitem__(4, 2 ** 40),
])
def test_malformed_tables_are_bad_metadata(tmp_path: Path, edit: Any) -> None:
    table = _table(tmp_path)
    edit(table)
    with pytest.raises(LowdiffError) as ei:
        parse_reference(table, str(tmp_path / "base.safetensors"))
    assert ei.value.reason is Reason.BAD_METADATA


def test_tensor_both_in_the_file_and_referenced(tmp_path: Path) -> None:
    table = _table(tmp_path)
    p = tmp_path / "base.safetensors"
    write_base(str(p), 0, {"w": ("I64", B)}, {"reference": table}, bytes(16))
    with pytest.raises(LowdiffError) as ei:
        as_base(BaseFile(str(p)))
    assert ei.value.reason is Reason.BAD_METADATA


def test_relative_root(tmp_path: Path) -> None:
    ref = parse_reference({**_table(tmp_path), "root": "."}, str(tmp_path / "b.st"))
    assert isinstance(ref, Reference)
    assert ref.root == str(tmp_path)
