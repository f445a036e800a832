"""Full disks (issue 35 item 5): exports and a checkpointer writing into a small tmpfs
mounted for the test (skipped where this process may not mount one), and the same failure
injected where DCP wraps it. A full disk is a one-line ``io_error`` naming the file and the
errno; nothing is left that looks complete; everything durable before it stays readable and
restores bit for bit once space is freed."""

from __future__ import annotations

import errno
import os
import subprocess
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest

from lowdiff_store import LowdiffError, Reason, StorageError
from lowdiff_store.torch import DiffCheckpointer, export_state, replay_state, restore

from .common import build, cli, cli_here, one_line, same_bits, train


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs at ``tmp_path/mnt`` (root only; skipped elsewhere)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(mnt: Path, leave: int = 0) -> Path:
    """Fill the file system, then free ``leave`` bytes; returns the filler file."""
    filler = mnt / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, b"\xff" * 4096)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)
    os.truncate(filler, max(0, os.path.getsize(filler) - leave))
    return filler


@pytest.fixture
def log(tmp_path: Path) -> Path:
    m, opt = build(0)
    with DiffCheckpointer(tmp_path / "log", m, opt, snapshot_every=3):
        train(m, opt, 0, 5)
    return tmp_path / "log"


@pytest.mark.parametrize(("out", "fmt"), [("d", "dcp"), ("h", "hf"), ("o.pt", None),
                                          ("o.safetensors", None), ("o.h5", None)])
def test_export_into_a_full_disk(log: Path, small_fs: Path, out: str, fmt: str | None,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    _fill(small_fs)
    argv = ["replay", str(log), "--out", str(small_fs / out)]
    argv += ["--format", fmt] if fmt else ["--with-optimizer"]
    rc, _out, err = cli_here(capsys, *argv)
    assert rc == 1, err
    one_line(err, "io_error", "errno 28")
    assert sorted(os.listdir(small_fs)) == ["filler"]  # no temp file or directory left
    os.unlink(small_fs / "filler")  # space again: the same export works
    rc, _out, err = cli_here(capsys, *argv)
    assert rc == 0, err


def test_dcp_save_failure_is_unwrapped(log: Path, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a mount: DCP's ``CheckpointException`` (a BaseException whose text is a
    traceback) carrying an ENOSPC becomes a StorageError with the errno."""
    from torch.distributed.checkpoint import state_dict_saver
    from torch.distributed.checkpoint.api import CheckpointException

    def full(*_a: object, **_k: object) -> None:
        e = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        raise CheckpointException("save failed",
                                  {0: (e, traceback.StackSummary.from_list([]))})

    monkeypatch.setattr(state_dict_saver, "save", full)
    state, _meta = replay_state(log, None)[:2]
    with pytest.raises(StorageError) as ei:
        export_state(state, tmp_path / "out", format="dcp")
    assert ei.value.errno == errno.ENOSPC
    one_line(ei.value, str(tmp_path / "out"), "io_error")
    assert sorted(os.listdir(tmp_path)) == ["log"]


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_checkpointer_on_a_full_disk_keeps_what_was_durable(small_fs: Path, tmp_path: Path,
                                                             writer: str) -> None:
    """Training into a file system that fills up: the error surfaces on a later call of
    the checkpointer with the failing step; each step reported durable before it restores
    bit for bit after space is freed, and verify passes. With a writer process too (the
    error crosses the ring as its reply)."""
    filler = _fill(small_fs, leave=120_000)
    m, opt = build(1)
    ck = DiffCheckpointer(small_fs / "log", m, opt, snapshot_every=4,
                          writer_process=writer == "process")
    states = {ck.step: {k: v.clone() for k, v in m.state_dict().items()}}
    durable, err = -1, None
    try:
        for t in range(0, 400):
            train(m, opt, t, t + 1)
            states[ck.step] = {k: v.clone() for k, v in m.state_dict().items()}
            durable = max(durable, ck.durable_step)
        ck.close()
    except LowdiffError as e:
        err = e
    assert err is not None, "400 steps fit in 120 KB?"
    one_line(err, "errno 28", "failed at step")
    assert err.reason in (Reason.IO_ERROR, Reason.WRITER_FAILED)
    try:
        ck.close()
    except LowdiffError:
        pass  # the same failure, said again
    os.unlink(filler)
    rc, out, errtext = cli("verify", str(small_fs / "log"))
    assert rc == 0, out + errtext
    m2, opt2 = build(7)
    res = restore(small_fs / "log", m2, opt2)
    assert res.step >= durable
    assert res.exact
    same_bits(m2.state_dict(), states[res.step])
