"""Power-loss crash states (tools/crash_explorer.py): every state the persistence model
allows after a cut opens, verifies, and restores bit for bit to a step at or after the
last one acknowledged durable. A strided subset runs in CI; the full enumeration is slow."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import crash_explorer as ce


def _states_of(rec: ce.Recorder) -> list[dict[str, bytes]]:
    out = []
    for cs in ce.crash_states(rec.ops):
        st, root = ce.build(rec, cs)
        files: dict[str, bytes] = {}

        def walk(ino: int, prefix: str, st: ce.State = st, files: dict[str, bytes] = files
                 ) -> None:
            for name, child in st.dirs.get(ino, {}).items():
                if child in st.dirs:
                    walk(child, prefix + name + "/")
                else:
                    files[prefix + name] = bytes(st.files.get(child, b""))
        walk(root, "")
        out.append(files)
    return out


def test_the_model_finds_a_rename_published_before_its_data(tmp_path: Path) -> None:
    """The classic hole: data written, not fsynced, renamed into place, directory fsynced.
    A power cut can leave the new name with no data; SIGKILL never shows it."""
    with ce.Recorder(str(tmp_path)) as rec:
        fd = os.open(tmp_path / "f.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, b"new content")
        os.close(fd)
        os.replace(tmp_path / "f.tmp", tmp_path / "f")
        dfd = os.open(tmp_path, os.O_RDONLY)
        os.fsync(dfd)
        os.close(dfd)
    kinds = [op.kind for op in rec.ops]
    assert kinds == ["creat", "trunc", "write", "rename", "dsync"]
    states = _states_of(rec)
    assert {"f": b""} in states                     # the hole
    assert {"f": b"new content"} in states
    assert {"f.tmp": b"new content"} in states      # rename not yet durable


def test_the_model_keeps_what_was_synced(tmp_path: Path) -> None:
    with ce.Recorder(str(tmp_path)) as rec:
        fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"abcd")
        os.fsync(fd)
        os.write(fd, b"efgh")
        os.close(fd)
        dfd = os.open(tmp_path, os.O_RDONLY)
        os.fsync(dfd)
        os.close(dfd)
    final = [s for s in _states_of(rec) if "f" in s]
    assert {s["f"] for s in final} >= {b"abcd", b"abcdefgh", b"abcdef"}   # torn: half
    # once the directory is fsynced, every state at the end has the synced prefix
    last = list(ce.crash_states(rec.ops))
    ends = [ce.build(rec, cs) for cs in last if cs.point == len(rec.ops)]
    for st, root in ends:
        ino = st.dirs[root]["f"]
        assert bytes(st.files[ino]).startswith(b"abcd")


@pytest.mark.parametrize("workload", ["writer", "diffwriter", "compaction"])
def test_crash_states_smoke(workload: str, tmp_path: Path) -> None:
    rep = ce.explore(workload, stride=3, limit=60, workdir=str(tmp_path))
    assert rep.distinct >= 10, rep.to_dict()
    assert rep.failures == [], "\n".join(rep.failures[:10])


@pytest.mark.parametrize("late", ["writeback", "writeback-runs", "thread"])
def test_crash_states_of_records_written_before_their_crc(late: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """Every append takes the path of large records: the record is written with a zero CRC
    field, the CRC stored in place afterwards (streamed with writeback hints, in one run or
    in several, each its own write; or from a helper thread). No crash state may lose an
    acknowledged step or show a wrong one."""
    from lowdiff_store.log import writer as writer_mod
    from lowdiff_store.storage import local as local_mod

    monkeypatch.setattr(writer_mod, "WRITEBACK_CRC_BYTES", 64)
    monkeypatch.setattr(writer_mod, "OVERLAP_CRC_BYTES", 64)
    if late == "writeback-runs":  # a 1 KiB record goes out in five writes
        monkeypatch.setattr(writer_mod, "WRITEBACK_RUN_BYTES", 256)
    if late == "thread":
        monkeypatch.setattr(local_mod, "_sync_file_range", None)
    rep = ce.explore("writer", stride=3, limit=60, workdir=str(tmp_path))
    assert rep.distinct >= 10, rep.to_dict()
    assert rep.failures == [], "\n".join(rep.failures[:10])


@pytest.mark.parametrize("workload", ["torch", "torch-process"])
def test_crash_states_torch_smoke(workload: str, tmp_path: Path) -> None:
    """DiffCheckpointer, its log written in this process or by a writer process (whose
    own operations are recorded there, each step acked as it publishes it)."""
    pytest.importorskip("torch")
    rep = ce.explore(workload, stride=5, limit=12, workdir=str(tmp_path))
    assert rep.distinct >= 8, rep.to_dict()
    assert rep.acked == 7, rep.to_dict()  # every step of the run was acknowledged
    assert rep.failures == [], "\n".join(rep.failures[:10])


@pytest.mark.slow
@pytest.mark.parametrize("workload", sorted(ce.WORKLOADS))
def test_crash_states_full(workload: str, tmp_path: Path) -> None:
    if workload == "torch":
        pytest.importorskip("torch")
    rep = ce.explore(workload, workdir=str(tmp_path))
    print(f"{workload}: {rep.states} crash states, {rep.distinct} distinct checked")
    assert rep.failures == [], "\n".join(rep.failures[:10])


def _drop_index_after(log: object, keep: int) -> None:
    """Cut the index to its first ``keep`` entries (what a power cut that lost the newer
    index writes leaves)."""
    idx = log.index  # type: ignore[attr-defined]
    idx.write_bytes(idx.read_bytes()[:64 + 32 * keep])


def test_a_lost_write_before_a_kept_one_is_a_torn_tail(small_log: object) -> None:
    """Record 2 never reached the disk (zeros) while records 3 and 4 did; the index lost
    their entries too. Not corruption: nothing from step 2 on was acknowledged."""
    from lowdiff_store import LogReader, LogWriter
    from lowdiff_store.verify import verify_log

    log = small_log
    seg = log.segment  # type: ignore[attr-defined]
    data = bytearray(seg.read_bytes())
    a, b = log.starts[2], log.ends[2]  # type: ignore[attr-defined]
    data[a:b] = bytes(b - a)
    seg.write_bytes(bytes(data))
    _drop_index_after(log, 1)
    with LogReader(log.path) as r:  # type: ignore[attr-defined]
        assert r.durable_step == 1
        assert r.report.clean
        assert r.report.torn_tail_bytes == len(data) - a
    assert verify_log(str(log.path)).ok  # type: ignore[attr-defined]
    LogWriter(log.path).close()  # type: ignore[attr-defined]  # the writer cuts it
    assert seg.stat().st_size == a


def test_a_flipped_bit_before_a_valid_record_is_still_corruption(small_log: object) -> None:
    from lowdiff_store import LogReader
    from lowdiff_store.errors import LowdiffError
    from lowdiff_store.verify import verify_log

    log = small_log
    seg = log.segment  # type: ignore[attr-defined]
    data = bytearray(seg.read_bytes())
    data[log.starts[2] + 40] ^= 0x04  # type: ignore[attr-defined]
    seg.write_bytes(bytes(data))
    _drop_index_after(log, 1)  # unindexed: only the content tells the two apart
    with pytest.raises(LowdiffError) as ei:
        LogReader(log.path)  # type: ignore[attr-defined]
    assert ei.value.reason.value in ("checksum_mismatch", "bad_metadata", "bad_magic")
    rep = verify_log(str(log.path))  # type: ignore[attr-defined]
    assert not rep.ok


def test_the_index_is_written_at_every_sync(tmp_path: Path) -> None:
    import numpy as np

    from lowdiff_store import LogWriter, tensor_input
    from lowdiff_store.log.index import RESERVE_BYTES, load_index
    from lowdiff_store.storage import LocalStore

    ipath = tmp_path / "log" / "seg-0000000000000000.ldidx"
    with LogWriter(tmp_path / "log") as w:
        w.write_base(0, {"w": ("F32", np.zeros(4, np.float32))})
        for t in (1, 2, 3):
            w.append(t, [tensor_input("w", np.full(4, t, np.float32), "F32")], kind="weight")
            w.sync()
            # the entry is in the file (written into the reserve of zeros) at every sync
            ents = load_index(LocalStore(str(tmp_path / "log")), ipath.name, 0,
                              w.manifest.log_id, 1 << 20)
            assert ents is not None
            assert [int(e["step"]) for e in ents] == list(range(1, t + 1))
            assert ipath.stat().st_size == 64 + RESERVE_BYTES
            tail = ipath.read_bytes()[64 + 32 * t:]
            assert tail == bytes(len(tail))
    assert ipath.stat().st_size == 64 + 32 * 3  # closing cuts the reserve
