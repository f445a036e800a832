"""Hostile DCP checkpoints (issue 35 item 5): a ``.metadata`` pickle that names code to run,
metadata of DCP's own classes with hostile fields, a data file torch cannot load. Each is
refused with one line naming the file and a reason, before anything runs or is written;
a log whose reference base records the hostile file's true size and CRC (a hostile log) is
refused the same way by restore, ``replay`` and ``verify``."""

from __future__ import annotations

import os
import pickle
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lowdiff_store import LowdiffError, Reason
from lowdiff_store.format.checksum import crc32c
from lowdiff_store.log.base import BaseFile, write_base
from lowdiff_store.torch import DiffCheckpointer, restore

from .common import build, cli, dcp_save, one_line, same_bits, train

BASE0 = "base-0000000000000000.safetensors"


class Payload:
    """Pickles as a call of ``os.mkdir(marker)``: proof that the pickle ran, harmless."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.marker),))


def _nothing_written(log: Path) -> None:
    assert not log.exists() or os.listdir(log) == []


@pytest.fixture
def ck(tmp_path: Path) -> Path:
    m, opt = build(0)
    train(m, opt, 0, 3)
    dcp_save(tmp_path / "ck", m, opt)
    return tmp_path / "ck"


def test_pickle_naming_code_is_refused_on_import(ck: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    meta = ck / ".metadata"
    meta.write_bytes(pickle.dumps(Payload(marker)))
    m, opt = build(1)
    with pytest.raises(LowdiffError) as ei:
        DiffCheckpointer(tmp_path / "log", m, opt, initial_base=ck)
    assert not marker.exists()  # refused, not run
    assert ei.value.reason is Reason.BAD_METADATA
    assert (ei.value.path, ei.value.offset) == (str(meta), pickle.dumps(
        Payload(marker)).find(b"posix"))
    one_line(ei.value, "mkdir", "refused, not run")
    _nothing_written(tmp_path / "log")
    same_bits(m.state_dict(), build(1)[0].state_dict())  # the model is untouched


def _log_from(ck: Path, log: Path) -> None:
    m, opt = build(5)
    with DiffCheckpointer(log, m, opt, snapshot_every=100, initial_base=ck):
        train(m, opt, 3, 5)


def _rewrite_base(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite a base with its metadata edited and every CRC recomputed (valid CRCs)."""
    bf = BaseFile(str(path))
    meta = bf.meta()
    tensors = {n: (bf.info(n)[0], np.array(bf.tensor(n))) for n in bf.names}
    step, log_id = bf.step, bf.log_id
    bf.close()
    edit(meta)
    write_base(str(path), step, tensors, meta, log_id)


def test_pickle_naming_code_under_a_hostile_log(ck: Path, tmp_path: Path) -> None:
    """The log's reference table records the hostile ``.metadata``'s own size and CRC, so
    the changed-file check passes: the allow-list still refuses it."""
    log = tmp_path / "log"
    _log_from(ck, log)
    marker = tmp_path / "ran"
    evil = pickle.dumps(Payload(marker))
    (ck / ".metadata").write_bytes(evil)

    def record(meta: dict[str, Any]) -> None:
        files = meta["reference"]["files"]
        assert files[0][0] == ".metadata"
        files[0][1:] = [len(evil), crc32c(evil)]

    _rewrite_base(log / BASE0, record)
    m, opt = build(9)
    with pytest.raises(LowdiffError) as ei:
        restore(log, m, opt)
    assert ei.value.reason is Reason.BAD_METADATA
    one_line(ei.value, str(ck / ".metadata"), "refused, not run")
    rc, _out, err = cli("replay", str(log), "--out", str(tmp_path / "x.pt"))
    assert rc == 1
    one_line(err, str(ck / ".metadata"), "bad_metadata")
    assert not (tmp_path / "x.pt").exists()
    rc, out, _err = cli("verify", str(log))
    assert rc == 3
    one_line(out, str(ck / ".metadata"), "bad_metadata")
    assert not marker.exists()


def _edit_metadata(ck: Path, edit: Callable[[Any], None]) -> None:
    """Load the (trusted, ours) metadata, edit it, pickle it back: a pickle of DCP's own
    classes only, with hostile field values."""
    md = pickle.loads((ck / ".metadata").read_bytes())
    edit(md)
    (ck / ".metadata").write_bytes(pickle.dumps(md))


def _first_storage(md: Any) -> Any:
    return next(iter(md.storage_data.values()))


def _weight(md: Any) -> Any:
    return md.state_dict_metadata["model.0.weight"]


EDITS: dict[str, tuple[Callable[[Any], None], Reason]] = {
    "offset_not_an_int": (lambda md: setattr(_first_storage(md), "offset", "7"),
                          Reason.BAD_METADATA),
    "negative_length": (lambda md: setattr(_first_storage(md), "length", -5),
                        Reason.BAD_METADATA),
    "length_past_the_file": (lambda md: setattr(_first_storage(md), "length", 1 << 40),
                             Reason.TRUNCATED),
    "file_outside_the_dir": (lambda md: setattr(_first_storage(md), "relative_path",
                                                "../outside.distcp"), Reason.UNSAFE_NAME),
    "absolute_file": (lambda md: setattr(_first_storage(md), "relative_path", "/etc/passwd"),
                      Reason.UNSAFE_NAME),
    "huge_shape": (lambda md: setattr(_weight(md), "size", torch.Size([1 << 30, 1 << 30])),
                   Reason.LIMIT_EXCEEDED),
    "shape_larger_than_stored": (lambda md: setattr(_weight(md), "size",
                                                    torch.Size([5000, 6000])),
                                 Reason.LIMIT_EXCEEDED),
    "negative_shape": (lambda md: setattr(_weight(md), "size", [5, -6]), Reason.BAD_METADATA),
    "dtype_not_a_dtype": (lambda md: setattr(_weight(md).properties, "dtype", "float32"),
                          Reason.BAD_DTYPE),
    "no_storage_data": (lambda md: setattr(md, "storage_data", None), Reason.BAD_METADATA),
    "storage_key_not_an_index": (lambda md: setattr(md, "storage_data", {
        "model.0.weight": _first_storage(md)}), Reason.BAD_METADATA),
}


@pytest.mark.parametrize("case", sorted(EDITS))
def test_hostile_fields_of_dcp_classes(ck: Path, tmp_path: Path, case: str) -> None:
    edit, reason = EDITS[case]
    _edit_metadata(ck, edit)
    m, opt = build(1)
    with pytest.raises(LowdiffError) as ei:
        DiffCheckpointer(tmp_path / "log", m, opt, initial_base=ck)
    assert ei.value.reason is reason, ei.value
    one_line(ei.value)
    assert ei.value.path is not None
    assert ei.value.path.startswith(str(ck))
    _nothing_written(tmp_path / "log")


def _break_first_entry(ck: Path) -> Path:
    """Zero the end (zip directory) of the entry of ``model.0.weight`` in its data file."""
    info = next(v for k, v in pickle.loads((ck / ".metadata").read_bytes()
                                           ).storage_data.items()
                if k.fqn == "model.0.weight")
    data = ck / info.relative_path
    raw = bytearray(data.read_bytes())
    end = info.offset + info.length
    raw[end - 64:end] = bytes(64)
    data.write_bytes(bytes(raw))
    return data


def test_data_file_torch_cannot_load(ck: Path, tmp_path: Path) -> None:
    """Bytes inside the ranges the metadata declares that ``torch.load`` refuses: DCP raises
    a ``CheckpointException`` (a BaseException with a multi-line traceback in its text);
    it is one line naming the data file."""
    data = _break_first_entry(ck)
    m, opt = build(1)
    with pytest.raises(LowdiffError) as ei:
        DiffCheckpointer(tmp_path / "log", m, opt, initial_base=ck)
    assert ei.value.reason is Reason.BAD_METADATA
    one_line(ei.value, str(data), "DCP load failed")
    _nothing_written(tmp_path / "log")


def test_data_file_changed_under_a_log_is_one_line(ck: Path, tmp_path: Path) -> None:
    """The same damage after the log started, same size: restore (which checks sizes, then
    every tensor's CRC) and ``replay`` say so in one line."""
    log = tmp_path / "log"
    _log_from(ck, log)
    data = _break_first_entry(ck)
    m, opt = build(9)
    with pytest.raises(LowdiffError) as ei:
        restore(log, m, opt)
    one_line(ei.value, str(data))
    rc, _out, err = cli("replay", str(log), "--out", str(tmp_path / "x.pt"))
    assert rc == 1
    one_line(err, str(data))


def test_the_allow_list_reads_what_torch_writes(ck: Path) -> None:
    """Every global a real DCP ``.metadata`` names is on the allow-list (sharded,
    optimizer state, bytes entries): torch's own checkpoints keep loading."""
    from lowdiff_store.torch.core.dcp_source import read_metadata_file

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        md = read_metadata_file(str(ck / ".metadata"))
    assert md.state_dict_metadata.keys() == pickle.loads(
        (ck / ".metadata").read_bytes()).state_dict_metadata.keys()


def test_metadata_of_more_than_a_gibibyte_is_not_read(ck: Path, tmp_path: Path) -> None:
    """A sparse 2 GiB ``.metadata``: refused by its size, before a byte is read."""
    with open(ck / ".metadata", "r+b") as f:
        f.truncate(2 << 30)
    m, opt = build(1)
    with pytest.raises(LowdiffError) as ei:
        DiffCheckpointer(tmp_path / "log", m, opt, initial_base=ck)
    assert ei.value.reason is Reason.METADATA_TOO_LARGE
    assert (ei.value.path, ei.value.offset) == (str(ck / ".metadata"), 0)
    one_line(ei.value)
    _nothing_written(tmp_path / "log")


class Call:
    """Pickles as a call of ``fn(*args)``."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.fn, self.args)


@pytest.mark.parametrize(("fn", "args", "named"), [
    (eval, ("1 + 1",), "builtins.eval"),
    (getattr, ("abc", "upper"), "builtins.getattr"),
    (torch.load, ("/dev/null",), "torch.serialization.load"),
    (torch.zeros, (4,), "builtins.getattr"),  # torch.zeros pickles as getattr(torch, ...)
])
def test_globals_outside_the_allow_list(ck: Path, fn: Any, args: tuple[Any, ...],
                                        named: str) -> None:
    """Builtins, torch functions (a name of module ``torch`` is allowed only when it is a
    dtype): each refused by name, none called."""
    from lowdiff_store.torch.core.dcp_source import read_metadata_file

    (ck / ".metadata").write_bytes(pickle.dumps(Call(fn, *args)))
    with pytest.raises(LowdiffError) as ei:
        read_metadata_file(str(ck / ".metadata"))
    assert ei.value.reason is Reason.BAD_METADATA
    one_line(ei.value, named, "refused, not run")


def test_a_torch_name_that_is_not_a_dtype(ck: Path) -> None:
    """``torch._dynamo`` named directly (a GLOBAL opcode): refused without looking it up
    (``getattr`` on torch may import a submodule)."""
    from lowdiff_store.torch.core.dcp_source import read_metadata_file

    (ck / ".metadata").write_bytes(b"ctorch\n_dynamo\n.")
    with pytest.raises(LowdiffError) as ei:
        read_metadata_file(str(ck / ".metadata"))
    assert (ei.value.reason, ei.value.offset) == (Reason.BAD_METADATA, 1)
    one_line(ei.value, "torch._dynamo")
