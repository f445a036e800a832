"""Hostile logs with valid checksums (issue 35 item 5): a manifest and base metadata edited
and re-checksummed (a base that does not exist or belongs to another step, a missing
segment, shapes and counts far larger than the files, an optimizer outside the allow-list)
and reference tables naming what they should not (a root that does not exist, a FIFO or a
device in place of a file, a tensor larger than its files). Each is one line naming the
file and a reason code, from every entry point; nothing is allocated for it."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lowdiff_store import LowdiffError, Reason
from lowdiff_store.format.framing import pack_manifest, unpack_manifest
from lowdiff_store.log.base import BaseFile, write_base
from lowdiff_store.log.reference import (
    RefTensor,
    as_base,
    make_reference,
    scan_safetensors,
)
from lowdiff_store.torch import DiffCheckpointer, restore
from tests.test_reference import st_bytes

from .common import build, cli_here, one_line, train

pytestmark = pytest.mark.consistent_bases  # consistent bases' steps and files (tests/conftest.py)

BASE = "base-{:016d}.safetensors"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("logs")
    m, opt = build(0)
    # exact_bases: the cases copy the base of step 3, which a busy machine's staging
    # would otherwise put off a step (README, "The test suite on a busy machine")
    with DiffCheckpointer(d / "log", m, opt, snapshot_every=3, exact_bases=True):
        train(m, opt, 0, 8)
    with DiffCheckpointer(d / "other", *build(1), snapshot_every=3):
        pass
    return d


def _copy_base(src: str) -> Callable[[dict[str, Any], Path], None]:
    def edit(body: dict[str, Any], log: Path) -> None:
        shutil.copy(log / src, log / BASE.format(7))
        body["bases"].append(7)
    return edit


def _torch_meta(key: str, value: Any) -> Callable[[dict[str, Any], Path], None]:
    def edit(body: dict[str, Any], _log: Path) -> None:
        body["meta"]["torch"][key] = value
    return edit


def _huge_model(body: dict[str, Any], _log: Path) -> None:
    body["meta"]["torch"]["model"][0][2] = [1 << 20, 1 << 20]


def _missing_segment(body: dict[str, Any], _log: Path) -> None:
    body["segments"].append([body["next_segment_id"], 100])
    body["next_segment_id"] += 1


#: case -> (edit of the manifest body and the log directory, the file named, the reasons
#: of replay / verify, and of restore into a live model)
CASES: dict[str, tuple[Callable[[dict[str, Any], Path], None], str, Reason, Reason]] = {
    "base_that_does_not_exist": (lambda b, _d: b["bases"].append(7), BASE.format(7),
                                 Reason.MISSING_FILE, Reason.MISSING_FILE),
    "base_of_another_step": (_copy_base(BASE.format(3)), BASE.format(7),
                             Reason.LOG_ID_MISMATCH, Reason.LOG_ID_MISMATCH),
    "segment_that_does_not_exist": (_missing_segment, "seg-0000000000000001.ldlog",
                                    Reason.MISSING_FILE, Reason.MISSING_FILE),
    "model_shape_of_a_terabyte": (_huge_model, BASE.format(6), Reason.BAD_METADATA,
                                  Reason.STATE_MISMATCH),
    "param_group_of_2e40_parameters": (_torch_meta("groups", [1 << 40]), "MANIFEST",
                                       Reason.BAD_METADATA, Reason.BAD_METADATA),
    "200000_parameter_names": (_torch_meta("params", [f"p{i}" for i in range(200_000)]),
                               "MANIFEST", Reason.BAD_METADATA, Reason.BAD_METADATA),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_manifest_with_valid_checksum(pristine: Path, tmp_path: Path, case: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    edit, name, reason, restore_reason = CASES[case]
    log = tmp_path / "log"
    shutil.copytree(pristine / "log", log)
    body = unpack_manifest((log / "MANIFEST").read_bytes())
    edit(body, log)
    (log / "MANIFEST").write_bytes(pack_manifest(body))  # a valid header and CRC
    rc, _out, err = cli_here(capsys, "replay", str(log), "--out", str(tmp_path / "x.pt"))
    assert rc == 1
    one_line(err, name, reason.value)
    assert not (tmp_path / "x.pt").exists()
    rc, out, _err = cli_here(capsys, "verify", str(log))
    assert rc == 3
    assert f"{name}:-: {reason.value}" in out, out
    rc, out, _err = cli_here(capsys, "inspect", str(log))
    assert rc == 0
    assert ":None:" not in out  # a problem without an offset prints "-", as verify does
    m, opt = build(3)
    with pytest.raises(LowdiffError) as ei:
        restore(log, m, opt)
    assert ei.value.reason is restore_reason
    one_line(ei.value)


def test_optimizer_outside_the_allow_list(pristine: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A log naming ``os.system`` as its optimizer: replay refuses to build it
    (``not_allowed``), restore into a live AdamW refuses the mismatch."""
    log = tmp_path / "log"
    shutil.copytree(pristine / "log", log)
    body = unpack_manifest((log / "MANIFEST").read_bytes())
    body["meta"]["torch"]["optimizer"] = "os.system"
    (log / "MANIFEST").write_bytes(pack_manifest(body))
    rc, _out, err = cli_here(capsys, "replay", str(log), "--out", str(tmp_path / "x.pt"))
    assert rc == 1
    one_line(err, "not_allowed", "os.system")
    m, opt = build(3)
    with pytest.raises(LowdiffError) as ei:
        restore(log, m, opt)
    assert ei.value.reason is Reason.STATE_MISMATCH


# ---------------------------------------------------------------- reference tables

W = np.arange(6, dtype="<f4").reshape(2, 3)


def _reference_base(tmp_path: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """A base referencing ``model.safetensors`` (tensor ``w``), its table edited, CRCs
    valid."""
    f = tmp_path / "ext" / "model.safetensors"
    f.parent.mkdir()
    f.write_bytes(st_bytes({"w": ("F32", W)}))
    ext = scan_safetensors(f)
    table = make_reference(ext, [RefTensor("w", "w", "F32", (2, 3), ext.tensors["w"].crc32c,
                                           (0,))]).to_obj()
    edit(table)
    p = tmp_path / "base.safetensors"
    write_base(str(p), 0, {"own": ("I64", np.array([1, 2], "<i8"))}, {"reference": table},
               bytes(16))
    return p


def _open(p: Path) -> None:
    with as_base(BaseFile(str(p))) as b:
        b.verify_all()
        for n in b.names:
            b.tensor(n)


def test_table_shape_larger_than_its_files(tmp_path: Path) -> None:
    """A table claiming a [2**20, 2**20] tensor in a 100-byte file: refused when the base
    is opened, before any consumer allocates from ``info()``."""
    def huge(t: dict[str, Any]) -> None:
        t["tensors"][0][3] = [1 << 20, 1 << 20]

    p = _reference_base(tmp_path, huge)
    with pytest.raises(LowdiffError) as ei:
        _open(p)
    assert ei.value.reason is Reason.LIMIT_EXCEEDED
    assert ei.value.path == str(p)
    one_line(ei.value, "'w'")


def test_table_box_of_a_larger_tensor(tmp_path: Path) -> None:
    def big_box(t: dict[str, Any]) -> None:
        t["tensors"][0][3] = [1, 3]
        t["tensors"][0][6] = [[0, 0], [1 << 30, 3]]

    with pytest.raises(LowdiffError) as ei:
        _open(_reference_base(tmp_path, big_box))
    assert ei.value.reason is Reason.LIMIT_EXCEEDED


@pytest.mark.parametrize(("edit", "reason"), [
    (lambda t: t.update(root="/nonexistent/checkpoint"), Reason.MISSING_FILE),
    (lambda t: t["files"][0].__setitem__(0, "other.safetensors"), Reason.MISSING_FILE),
    (lambda t: t["files"][0].__setitem__(0, ".."), Reason.BAD_METADATA),
    (lambda t: t["files"][0].__setitem__(0, "../ext/model.safetensors"), Reason.BAD_METADATA),
    (lambda t: t["tensors"][0].__setitem__(1, "not-there"), Reason.REFERENCE_CHANGED),
    (lambda t: t["tensors"][0].__setitem__(2, "I32"), Reason.REFERENCE_CHANGED),
    (lambda t: t["tensors"][0].__setitem__(3, [3, 2]), Reason.REFERENCE_CHANGED),
    (lambda t: t["tensors"][0].__setitem__(4, 12345), Reason.REFERENCE_CHANGED),
])
def test_table_naming_what_is_not_there(tmp_path: Path, edit: Callable[[dict[str, Any]], None],
                                        reason: Reason) -> None:
    with pytest.raises(LowdiffError) as ei:
        _open(_reference_base(tmp_path, edit))
    assert ei.value.reason is reason, ei.value
    one_line(ei.value)


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_referenced_file_replaced_by_a_special_file(tmp_path: Path, kind: str) -> None:
    """Never opened (a FIFO would block, /dev/zero would read forever): refused by its
    type, naming it."""
    p = _reference_base(tmp_path, lambda t: None)
    f = tmp_path / "ext" / "model.safetensors"
    f.unlink()
    if kind == "fifo":
        os.mkfifo(f)
    else:
        os.symlink("/dev/zero", f)
    with pytest.raises(LowdiffError) as ei:
        _open(p)
    assert ei.value.reason is Reason.NOT_A_REGULAR_FILE
    assert ei.value.path == str(f)


# ------------------------------------------------------------------- diff records


def _rewrite_step_3(log: Path, change: Callable[[dict[str, tuple[str, np.ndarray]]], None]
                    ) -> None:
    """Replace the record of step 3 by one with its gradients changed (valid CRCs)."""
    from lowdiff_store import LogReader, LogWriter, tensor_input

    with LogReader(log) as r:
        rec = r.record(3)
        kind, side = rec.kind, rec.side
        grads = {n: (rec.entry(n).dtype, np.array(rec.tensor(n))) for n in rec.names}
    change(grads)
    with LogWriter(log) as w:
        w.truncate_after(2)
        w.append(3, [tensor_input(n, a, tag) for n, (tag, a) in grads.items()], kind=kind,
                 side=side)
        w.sync()


def _wider(g: dict[str, tuple[str, np.ndarray]]) -> None:
    g["@grad/0.weight"] = ("F32", np.zeros((5, 7), np.float32))


def _f64(g: dict[str, tuple[str, np.ndarray]]) -> None:
    g["@grad/0.weight"] = ("F64", g["@grad/0.weight"][1].astype(np.float64))


@pytest.mark.parametrize("change", [_wider, _f64])
def test_gradient_that_does_not_fit_names_record_and_step(
        pristine: Path, tmp_path: Path, change: Callable[[dict[str, Any]], None],
        capsys: pytest.CaptureFixture[str]) -> None:
    """A gradient record of another shape or dtype than its parameter: ``state_mismatch``
    naming the segment, the record's offset and the step (**fixed**: it named neither)."""
    log = tmp_path / "log"
    shutil.copytree(pristine / "log", log)
    _rewrite_step_3(log, change)
    from lowdiff_store import LogReader

    with LogReader(log) as r:
        seg, off, _n = r.record_location(3)
    m, opt = build(3)
    with pytest.raises(LowdiffError) as ei:
        restore(log, m, opt, step=3)
    assert ei.value.reason is Reason.STATE_MISMATCH
    assert (ei.value.path, ei.value.offset) == (seg, off)
    one_line(ei.value, "step 3", "@grad/0.weight")
    rc, _out, err = cli_here(capsys, "replay", str(log), "--to-step", "3", "--out",
                             str(tmp_path / "x.pt"))
    assert rc == 1
    one_line(err, f"{seg}:{off}: state_mismatch: step 3")


# --------------------------------------------------------------- sharded checkpoints


@pytest.mark.parametrize(("case", "needle"), [
    ("a_rank_missing", "declares 2 ranks but rank-00001 holds no log"),
    ("a_million_ranks", "declares 1048576 ranks but rank-00001 holds no log"),
    ("layout_naming_a_path", "unknown shard layout '../../etc'"),
    ("one_log_posing_as_two_ranks", "is not rank 0 of this 2-rank"),
])
def test_hostile_shards_manifest(pristine: Path, tmp_path: Path, case: str, needle: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``SHARDS`` (the top-level manifest of per-rank logs, local-update runs included)
    declaring ranks that are not there, a million of them, a layout that is a path, or the
    same log copied as two ranks: ``bad_metadata`` (from ``replay``, ``log_id_mismatch``
    naming both directories for the copy) in one line from ``replay`` and ``restore``, at
    once (no walk over a million directories)."""
    from lowdiff_store.log.shards import write_shards_manifest

    world, layout, ranks = {"a_rank_missing": (2, "replicated", (0,)),
                            "a_million_ranks": (1 << 20, "replicated", (0,)),
                            "layout_naming_a_path": (1, "../../etc", (0,)),
                            "one_log_posing_as_two_ranks": (2, "replicated", (0, 1))}[case]
    d = tmp_path / "ck"
    for r in ranks:
        shutil.copytree(pristine / "log", d / f"rank-{r:05d}")
    write_shards_manifest(d, world, layout=layout)
    rc, _out, err = cli_here(capsys, "replay", str(d), "--out", str(tmp_path / "x.pt"))
    assert rc == 1
    if case == "one_log_posing_as_two_ranks":  # the replay CLI reads the shards as one
        one_line(err, "rank-00001: log_id_mismatch: this log is a copy of", "rank-00000")
    else:
        one_line(err, "bad_metadata", needle)
    m, opt = build(3)
    with pytest.raises(LowdiffError) as ei:   # restore checks each log's shard section first
        restore(d, m, opt)
    assert ei.value.reason is Reason.BAD_METADATA
    one_line(ei.value, needle)
