"""``verify`` decodes everything replay decodes (issue #16): a log that verify calls ok is
one that the readers accept. And a verify running beside a compaction does not report the
files that compaction deleted after verify read the older manifest (it retries on the newer
manifest before reporting)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zstandard

from lowdiff_store import LogReader, LogWriter, tensor_input
from lowdiff_store.errors import LowdiffError, Reason
from lowdiff_store.format.record import PartInput, TensorInput
from lowdiff_store.log import base as base_mod
from lowdiff_store.verify import verify_log


def _log(path: Path, *, tensors: list[TensorInput] | None = None) -> None:
    with LogWriter(path, meta={"mode": "test"}, segment_bytes=4096) as w:
        w.write_base(0, {"w": ("F32", np.zeros(8, "<f4"))}, meta={"step": 0})
        for t in range(1, 4):
            w.append(t, [tensor_input("g", np.full(300, t, "<f4"), "F32")], kind="grad")
        if tensors is not None:
            w.append(4, tensors, kind="grad")
        w.sync()


def test_verify_decodes_base_metadata(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A base whose metadata is msgpack nested 10,000 deep (valid CRCs): replay refuses to
    decode it, so verify must report it."""
    path = tmp_path / "log"
    _log(path)
    deep = b"\x81\xa5extra" + b"\x91" * 10_000 + b"\x01"
    with monkeypatch.context() as m:
        m.setattr(base_mod, "pack_meta", lambda meta: deep)
        with LogWriter(path) as w:
            w.write_base(3, {"w": ("F32", np.ones(8, "<f4"))}, meta={})
    with LogReader(path) as r, r.base(3) as bf:
        bf.verify_all()  # every CRC is valid
        with pytest.raises(LowdiffError) as ei:
            bf.meta()
    assert ei.value.reason is Reason.BAD_METADATA
    rep = verify_log(str(path))
    assert not rep.ok
    assert [p.reason for p in rep.problems] == [Reason.BAD_METADATA]
    assert rep.problems[0].path == str(path / "base-0000000000000003.safetensors")


def _lying_frame(declared: int, actual: int) -> bytes:
    """A zstd frame whose header declares ``declared`` bytes but whose content holds
    ``actual`` (single-segment frame, one-byte content size field)."""
    blob = bytearray(zstandard.ZstdCompressor(level=3).compress(bytes(range(actual))))
    assert blob[4] == 0x20
    assert blob[5] == actual
    blob[5] = declared
    return bytes(blob)


def test_verify_decodes_every_tensor(tmp_path: Path) -> None:
    path = tmp_path / "log"
    part = PartInput("U8", 200, _lying_frame(200, 196), {"compressor": "zstd",
                                                        "shuffle": False})
    _log(path, tensors=[TensorInput("g", "U8", (200,), "raw", {}, [part])])
    with LogReader(path) as r:
        rec = r.record(4)  # the record's CRC and metadata are fine
        with pytest.raises(LowdiffError) as ei:
            rec.tensor("g")
    assert ei.value.reason is Reason.DECODE_SIZE_MISMATCH
    rep = verify_log(str(path))
    assert [p.reason for p in rep.problems] == [Reason.DECODE_SIZE_MISMATCH]
    assert rep.problems[0].path is not None
    assert rep.problems[0].offset is not None


def test_verify_of_a_healthy_log_decodes_all_codecs(tmp_path: Path) -> None:
    path = tmp_path / "log"
    ref = np.arange(64, dtype="<f4")
    _log(path, tensors=[
        tensor_input("z", np.arange(500, dtype="<f4"), "F32", zstd=3),
        tensor_input("s", np.eye(8, dtype="<f4"), "F32", "sparse"),
        tensor_input("x", ref + 1, "F32", "xor", ref=ref, zstd=1),
        tensor_input("q", np.linspace(0, 1, 512, dtype="<f4"), "F32", "q8"),
    ])
    rep = verify_log(str(path))
    assert rep.ok, [str(p) for p in rep.problems]
    assert rep.records == 4
    assert rep.bases == 1


def test_verify_beside_a_compaction_retries_on_the_newer_manifest(tmp_path: Path) -> None:
    """verify reads the manifest, then a compaction publishes a newer one and deletes base
    0 and the old segments; verify must not report them missing."""
    path = tmp_path / "log"
    with LogWriter(path, meta={"mode": "test"}, segment_bytes=4096) as w:
        for b in (0, 9):
            if b:
                w.sync()
            w.write_base(b, {"w": ("F32", np.full(8, b, "<f4"))}, meta={"step": b})
            for t in range(b + 1, b + 10):
                w.append(t, [tensor_input("g", np.full(300, t, "<f4"), "F32")], kind="grad")
        w.sync()
    env = dict(os.environ, LOWDIFF_COMPACT_PAUSE="1.0")
    proc = subprocess.Popen([sys.executable, "-m", "lowdiff_store", "compact", str(path),
                             "--keep-bases", "1"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stderr is not None
        assert proc.stderr.readline().strip() == "lowdiff-compact-point locked"
        calls: list[Any] = []

        def progress(done: int, total: int) -> None:
            if not calls:  # verify has read the manifest: let the compaction finish now
                assert proc.wait(timeout=60) == 0
            calls.append(done)

        rep = verify_log(str(path), progress=progress)
    finally:
        proc.kill()
        proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
    assert calls
    assert not os.path.exists(path / "base-0000000000000000.safetensors")
    assert rep.ok, [str(p) for p in rep.problems]
    assert rep.bases == 1
