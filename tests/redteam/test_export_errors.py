"""Export errors (issue 42 item 5): a write that fails inside a library writing the
export (torch.save within DCP, h5py) is the one-line ``io_error`` naming the output, the
offset where known and the errno, exit 1, nothing left behind; an ``--hf-config`` that is
not a regular file of a bounded size is refused in one line before it is read.

The write failures are real ones where no privilege is needed: the file-size limit
(``RLIMIT_FSIZE``; Python ignores SIGXFSZ, so a write past it fails with EFBIG as a write
into a full disk fails with ENOSPC), and errors injected into the streams DCP writes."""

from __future__ import annotations

import errno
import json
import os
import re
import resource
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from lowdiff_store import Reason, StorageError
from lowdiff_store.torch import DiffCheckpointer, export_state

from .common import ROOT, build, cli_here, one_line, train

#: The file-size limit of the exports below: smaller than the model's one weight.
LIMIT = 4096


@pytest.fixture(scope="module")
def wide_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A log of one 64x64 linear layer: a 16 KiB weight, written by torch.save in one
    write larger than any buffer (a small tensor would fail only at a buffer's flush)."""
    path = tmp_path_factory.mktemp("wide") / "log"
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with DiffCheckpointer(path, m, opt, snapshot_every=3):
        pass
    return path


@contextmanager
def file_size_limit(n: int) -> Iterator[None]:
    """Writes of this process past ``n`` bytes of a file fail with EFBIG meanwhile."""
    if signal.getsignal(signal.SIGXFSZ) != signal.SIG_IGN:  # else the signal kills it
        pytest.skip("SIGXFSZ is not ignored in this process")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (n, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


@pytest.mark.parametrize(("out", "fmt"), [("d", "dcp"), ("h", "hf"), ("o.pt", None),
                                          ("o.safetensors", None), ("o.h5", None)])
def test_export_past_the_file_size_limit(wide_log: Path, tmp_path: Path, out: str,
                                         fmt: str | None,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Every format: one line naming the output and errno 27, exit 1, nothing left. DCP
    met it inside torch.save ("enforce fail at inline_container.cc", the OSError only its
    ``__context__``, itself wrapped in DCP's CheckpointException): "internal error"
    before. A file names the offset in it the write failed at."""
    dest = tmp_path / out
    argv = ["replay", str(wide_log), "--out", str(dest)] + (["--format", fmt] if fmt else [])
    with file_size_limit(LIMIT):
        rc, _out, err = cli_here(capsys, *argv)
    assert rc == 1, err
    one_line(err, "io_error", "(errno 27)")
    m = re.search(re.escape(str(dest)) + r"(?::(\d+))?: io_error: write failed: ", err)
    assert m is not None, err
    if fmt is None:  # the first byte past the limit: the kernel wrote up to it
        assert m.group(1) == str(LIMIT), err
    assert os.listdir(tmp_path) == []  # no temp file or directory, nothing published
    rc, _out, err = cli_here(capsys, *argv)  # no limit: the same export works
    assert rc == 0, err


class _FailingStream:
    """A stream DCP writes to whose writes fail with ``err`` once ``room`` bytes went."""

    def __init__(self, stream: Any, err: int, room: int) -> None:
        self._stream, self._err, self._room = stream, err, room

    def write(self, b: Any) -> int:
        n = memoryview(b).nbytes
        if n > self._room:
            raise OSError(self._err, os.strerror(self._err))
        self._room -= n
        return int(self._stream.write(b))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@pytest.mark.parametrize(("at", "err"), [("write", errno.ENOSPC), ("write", errno.EIO),
                                         ("write", errno.EDQUOT), ("open", errno.EACCES),
                                         ("open", errno.EROFS)])
def test_dcp_stream_failure_is_io_error(wide_log: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch, at: str,
                                        err: int) -> None:
    """A DCP data file that cannot be opened or written (the failure torch.save wraps in
    a RuntimeError, DCP in a CheckpointException): a StorageError with the errno, naming
    the directory, no temp directory left."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    from lowdiff_store.torch import replay_state

    @contextmanager
    def create_stream(_self: object, path: Any, mode: str) -> Iterator[Any]:
        if at == "open":
            raise OSError(err, os.strerror(err), str(path))
        with Path(path).open(mode) as stream:
            yield _FailingStream(stream, err, room=1024)

    monkeypatch.setattr(FileSystem, "create_stream", create_stream)
    state = replay_state(wide_log, None)[0]
    out = tmp_path / "out"
    with pytest.raises(StorageError) as ei:
        export_state(state, out, format="dcp")
    assert ei.value.errno == err
    assert ei.value.reason is Reason.IO_ERROR
    one_line(ei.value, f"{out}: io_error: ", f"(errno {err})")
    assert os.listdir(tmp_path) == []


def test_write_hf_refuses_an_oversized_config(tmp_path: Path) -> None:
    """The library's ``hf_config`` path has the cap of the CLI's: a sparse file past it is
    ``metadata_too_large`` before any of it is read (before: read whole, then "not
    JSON"), and nothing is published."""
    from lowdiff_store.log.reference import MAX_INDEX_BYTES

    conf = tmp_path / "config.json"
    with open(conf, "wb") as f:
        f.truncate(MAX_INDEX_BYTES + 1)
    with pytest.raises(Exception) as ei:
        export_state({"w": torch.ones(2)}, tmp_path / "hf", format="hf", hf_config=conf)
    one_line(ei.value, str(conf), "metadata_too_large")
    assert sorted(os.listdir(tmp_path)) == ["config.json"]


#: Runs ``lowdiff-store replay LOG --format hf --out OUT-k --hf-config P`` for each P of
#: argv[3:] in one interpreter (one torch import for all), under an address-space cap (a
#: config read whole from /dev/zero ends in MemoryError, not in the machine's memory);
#: prints one JSON line per run: [exit code, stderr].
_HF_CONFIG_RUNS = """\
import contextlib, io, json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, resource.RLIM_INFINITY))
from lowdiff_store.cli import main
log, out = sys.argv[1], sys.argv[2]
for k, conf in enumerate(sys.argv[3:]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = main(["replay", log, "--format", "hf", "--out", f"{out}-{k}",
                       "--hf-config", conf])
        except BaseException as e:
            rc = repr(e)
    print(json.dumps([rc, err.getvalue()]), flush=True)
"""


def test_hf_config_that_is_not_a_bounded_regular_file(tmp_path: Path) -> None:
    """``--hf-config`` /dev/zero (read until MemoryError before), a FIFO nobody writes
    (waited on for ever before: the subprocess's timeout fails the test), a symlink to
    /dev/zero, a sparse file past the cap, a directory: each one line naming it with the
    reason, exit 1, before the replay; nothing published."""
    from lowdiff_store.log.reference import MAX_INDEX_BYTES

    m, opt = build(0)
    with DiffCheckpointer(tmp_path / "log", m, opt, snapshot_every=3):
        train(m, opt, 0, 2)
    fifo, link, sparse = tmp_path / "fifo", tmp_path / "link", tmp_path / "sparse.json"
    os.mkfifo(fifo)
    os.symlink("/dev/zero", link)
    with open(sparse, "wb") as f:
        f.truncate(MAX_INDEX_BYTES + 1)
    cases = [("/dev/zero", "not_a_regular_file"), (str(fifo), "not_a_regular_file"),
             (str(link), "not_a_regular_file"), (str(sparse), "metadata_too_large"),
             (str(tmp_path), "not_a_regular_file")]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", _HF_CONFIG_RUNS, str(tmp_path / "log"),
                        str(tmp_path / "out"), *(c for c, _ in cases)],
                       capture_output=True, text=True, timeout=120, env=env)
    runs = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(runs) == len(cases), r.stdout + r.stderr
    for (conf, reason), (rc, err) in zip(cases, runs, strict=True):
        assert rc == 1, (conf, rc, err)
        one_line(err, f"{conf}: {reason}: ")
    assert sorted(os.listdir(tmp_path)) == ["fifo", "link", "log", "sparse.json"]
