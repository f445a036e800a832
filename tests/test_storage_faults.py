"""The log over its store when the files are not what they should be (issue 16, storage
items): special files in place of log files, files larger than their cap, a writer cutting
a torn tail under a reader's memory map, power-loss durability of directory creation and
deletion, and files a lost deletion brings back.

The hostile cases run in a subprocess with a timeout and an address-space limit: a
regression blocks (FIFO) or reads until memory runs out (/dev/zero), and must fail the test,
not hang or exhaust the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lowdiff_store import LogReader, LogWriter, tensor_input
from lowdiff_store.compaction import compact
from lowdiff_store.format.constants import BASE_NAME, INDEX_NAME, SEGMENT_NAME
from lowdiff_store.log.manifest import load_manifest
from lowdiff_store.log.shards import write_shards_manifest
from lowdiff_store.verify import verify_log
from tests.helpers.timing import scaled

ROOT = Path(__file__).resolve().parents[1]


def _base(step: int) -> dict[str, tuple[str, np.ndarray]]:
    return {"w": ("F32", np.full(64, step, np.float32))}


def _log(path: Path, steps: int = 12, *, base_every: int = 5, segment_bytes: int = 4096,
         size: int = 256) -> None:
    with LogWriter(path, segment_bytes=segment_bytes) as w:
        w.write_base(0, _base(0))
        for t in range(1, steps + 1):
            w.append(t, [tensor_input("g", np.full(size, t, np.float32), "F32")], kind="grad")
            w.sync()
            if t % base_every == 0:
                w.write_base(t, _base(t))


def _run(code: str, timeout: float = 180) -> dict[str, Any]:
    """Run ``code`` (which prints one JSON line) in a fresh interpreter with at most 3 GiB
    of address space; a hang is a failure (``timeout``, scaled, bounds a hang: it is no
    expected duration)."""
    pre = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        out = subprocess.run([sys.executable, "-c", pre + textwrap.dedent(code)],
                             capture_output=True, text=True, timeout=scaled(timeout), env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("blocked: a special file was opened and waited on instead of refused")
    assert out.returncode == 0, out.stderr[-2000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


_OUTCOMES = """
    import json
    from lowdiff_store import LogReader, LogWriter
    from lowdiff_store.errors import LowdiffError
    from lowdiff_store.verify import inspect_log, verify_log

    def outcome(fn):
        try:
            fn()
            return "ok"
        except LowdiffError as e:
            assert "\\n" not in str(e)
            return e.reason.value

    def read(p):
        with LogReader(p) as r:
            for s in r.steps:
                r.record(int(s))
            for b in r.bases:
                r.base(b).verify_all()

    def write(p):
        LogWriter(p).close()

    p = {path!r}
    out = {{"read": outcome(lambda: read(p)),
            "verify": "ok" if verify_log(p).ok else "problems",
            "inspect": outcome(lambda: inspect_log(p)),
            "write": outcome(lambda: write(p))}}
    print(json.dumps(out))
"""


@pytest.mark.parametrize("victim", ["MANIFEST", "index", "segment", "base"])
@pytest.mark.parametrize("kind", ["fifo", "devzero"])
def test_special_files_in_a_log_are_refused_not_waited_on(tmp_path: Path, victim: str,
                                                          kind: str) -> None:
    p = tmp_path / "log"
    _log(p, steps=6, segment_bytes=1 << 20)
    name = {"MANIFEST": "MANIFEST", "index": INDEX_NAME.format(0),
            "segment": SEGMENT_NAME.format(0), "base": BASE_NAME.format(5)}[victim]
    (p / name).unlink()
    if kind == "fifo":
        os.mkfifo(p / name)
    else:
        (p / name).symlink_to("/dev/zero")
    out = _run(_OUTCOMES.format(path=str(p)))
    if victim == "index":  # a cache: unusable, so the segment is scanned instead
        assert out == {"read": "ok", "verify": "problems", "inspect": "ok", "write": "ok"}
        assert (p / name).is_file()
        assert not (p / name).is_symlink()
    else:
        assert out["read"] == "not_a_regular_file", out
        assert out["verify"] == "problems"
        if victim == "base":  # opening a writer or inspecting reads no base
            assert (out["write"], out["inspect"]) == ("ok", "ok"), out
        else:
            assert out["write"] == out["inspect"] == "not_a_regular_file", out


@pytest.mark.parametrize("kind", ["fifo", "devzero"])
def test_a_special_shards_manifest_is_refused(tmp_path: Path, kind: str) -> None:
    p = tmp_path / "ckpt"
    write_shards_manifest(p, 1)
    (p / "SHARDS").unlink()
    if kind == "fifo":
        os.mkfifo(p / "SHARDS")
    else:
        (p / "SHARDS").symlink_to("/dev/zero")
    out = _run(f"""
        import json
        from lowdiff_store.errors import LowdiffError
        from lowdiff_store.log.shards import read_shards_manifest
        from lowdiff_store.verify import verify_log
        try:
            read_shards_manifest({str(p)!r})
            got = "ok"
        except LowdiffError as e:
            got = e.reason.value
        print(json.dumps({{"read": got, "verify": verify_log({str(p)!r}).ok}}))
    """)
    assert out == {"read": "not_a_regular_file", "verify": False}


#: larger than the address space ``_run`` gives its interpreter (3 GiB): a whole read of
#: such a file fails there. Not much larger: verify scans an active index's zero tail in
#: 1 MiB reads (8 GiB took 30-45 s of it)
_HUGE = 4 << 30


def test_a_huge_manifest_or_index_is_not_read(tmp_path: Path) -> None:
    """Regular files far larger than the spec allows (sparse, so nothing is allocated on
    disk): the manifest is refused before reading, the index is read up to its cap only."""
    p = tmp_path / "log"
    _log(p, steps=6, segment_bytes=1 << 20)
    with open(p / INDEX_NAME.format(0), "r+b") as fh:
        fh.truncate(_HUGE)  # entries past the valid ones: never read
    out = _run(_OUTCOMES.format(path=str(p)))
    assert out["read"] == "ok"
    with open(p / "MANIFEST", "r+b") as fh:
        fh.truncate(_HUGE)
    out = _run(_OUTCOMES.format(path=str(p)))
    assert out["read"] == "metadata_too_large"
    assert out["write"] == "metadata_too_large"


# ------------------------------------------------------------------ torn tail vs mmap


_READER = """
    import os, sys, time
    from lowdiff_store import LogReader
    path, stop = sys.argv[1], sys.argv[2]
    opens = 0
    while not os.path.exists(stop) or opens < 5:
        with LogReader(path) as r:  # mmap: views into the segment
            total = 0
            for s in r.steps:
                rec = r.record(int(s))
                total += int(rec.tensor("g")[0])
            assert total == sum(int(s) for s in r.steps), total
        opens += 1
    print(opens)
"""


def test_a_reader_survives_a_writer_cutting_the_torn_tail(tmp_path: Path) -> None:
    """A real second process: a reader opening the log and reading every record through
    its memory map, over and over, while this process appends an 8 MiB torn tail to the
    active segment (what a crash mid-write leaves) and opens a writer, which cuts it with
    ``ftruncate``. Before the reader mapped only the validated prefix, it died of SIGBUS."""
    p = tmp_path / "log"
    _log(p, steps=20, segment_bytes=1 << 20, size=1024)
    seg = p / SEGMENT_NAME.format(load_manifest(p).segments[-1][0])
    stop = tmp_path / "stop"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    reader = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_READER), str(p),
                               str(stop)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    tail = np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8).tobytes()
    try:
        time.sleep(0.3)
        for _ in range(12):
            with open(seg, "ab") as fh:
                fh.write(tail)
            time.sleep(0.02)
            LogWriter(p).close()  # cuts the tail
            if reader.poll() is not None:
                break
    finally:
        stop.touch()
        out, err = reader.communicate(timeout=120)
    assert reader.returncode == 0, (reader.returncode, err[-2000:])
    assert int(out) >= 5
    with LogReader(p) as r:
        assert r.report.clean
        assert r.durable_step == 20


# ------------------------------------------------------------------ durability


def _trace_dir_fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every unlink and every fsync of a directory, in order, whoever calls them."""
    events: list[str] = []
    real_fsync, real_unlink = os.fsync, os.unlink

    def fsync(fd: int) -> None:
        target = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.isdir(target):
            events.append(f"fsync {target}")
        real_fsync(fd)

    def unlink(path: Any, *a: Any, **k: Any) -> None:
        real_unlink(path, *a, **k)
        events.append(f"unlink {os.path.abspath(path)}")

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "unlink", unlink)
    return events


def test_creating_a_log_makes_its_directory_durable(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    events = _trace_dir_fsyncs(monkeypatch)
    with LogWriter(tmp_path / "a" / "b" / "log") as w:
        w.write_base(0, _base(0))
    for parent in ("a/b", "a", ""):  # each new directory's entry, in its parent
        assert f"fsync {str(tmp_path / parent).rstrip('/')}" in events, (parent, events)


def test_compaction_and_truncation_deletions_are_durable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "log"
    _log(p, steps=30)
    events = _trace_dir_fsyncs(monkeypatch)
    res = compact(p, keep_bases=1)
    assert res.plan.delete_bases
    assert res.plan.delete_segments

    def check(events: list[str]) -> None:
        unlinked = [i for i, e in enumerate(events) if e.startswith("unlink ")
                    and not e.endswith(".tmp")]
        assert unlinked
        last_fsync = max(i for i, e in enumerate(events) if e == f"fsync {p}")
        assert last_fsync > unlinked[-1], events

    check(events)
    events.clear()
    with LogWriter(p) as w:
        assert w.truncate_after(27) == 3
    check(events)


def test_files_a_lost_deletion_brings_back_are_tolerated(tmp_path: Path) -> None:
    """A power cut after compaction's unlinks but before they were durable brings the
    deleted bases and segments back: every open must ignore what the manifest does not
    name, and the next writer open (or compaction) removes them."""
    p = tmp_path / "log"
    _log(p, steps=30)
    before = tmp_path / "before"
    shutil.copytree(p, before)
    res = compact(p, keep_bases=1)
    gone = sorted(set(os.listdir(before)) - set(os.listdir(p)))
    assert len(gone) >= 3
    for name in gone:  # resurrected
        shutil.copy2(before / name, p / name)
    with LogReader(p) as r:
        assert r.bases == res.plan.keep_bases
        assert r.durable_step == 30
        assert r.report.clean
    rep = verify_log(str(p))
    assert rep.ok, [str(e) for e in rep.problems]
    assert any("not referenced by the manifest" in n for n in rep.notes)
    again = compact(p, keep_bases=1)  # resurrected files are not in any plan
    assert again.plan.delete_bases == []
    assert again.plan.delete_segments == []
    with LogWriter(p) as w:
        assert w.durable_step == 30
    assert not set(gone) & set(os.listdir(p))
    assert verify_log(str(p)).notes == []


# ------------------------------------------------------------------ reader vs compaction


def _stale_first(monkeypatch: pytest.MonkeyPatch, stale: Any) -> None:
    """The next LogReader reads ``stale`` (a manifest from before a compaction) as if it had
    read it just before the compaction committed and deleted; later reads are real."""
    import lowdiff_store.log.reader as reader_mod

    real = reader_mod.load_manifest
    served: list[bool] = []

    def load(location: Any) -> Any:
        if not served:
            served.append(True)
            return stale
        return real(location)

    monkeypatch.setattr(reader_mod, "load_manifest", load)


def test_a_reader_that_read_the_manifest_before_a_compaction_reads_the_new_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "log"
    _log(p, steps=30)
    stale = load_manifest(p)
    res = compact(p, keep_bases=1)
    assert res.plan.delete_segments
    _stale_first(monkeypatch, stale)
    with LogReader(p) as r:  # strict: a missing segment would raise
        assert r.report.clean
        assert r.bases == [30]
        assert r.manifest.generation > stale.generation


def test_verify_rereads_the_manifest_when_a_compaction_deleted_a_base(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The false alarm of issue 16 (`missing_file: base named by the manifest is missing` on
    a healthy log): verify had read the manifest just before a compaction deleted a base."""
    p = tmp_path / "log"
    _log(p, steps=30, segment_bytes=1 << 20)  # one segment: only bases are deleted
    stale = load_manifest(p)
    res = compact(p, keep_bases=1)
    assert res.plan.delete_bases
    assert not res.plan.delete_segments
    _stale_first(monkeypatch, stale)
    rep = verify_log(str(p))
    assert rep.ok, [str(e) for e in rep.problems]
    assert rep.bases == 1
