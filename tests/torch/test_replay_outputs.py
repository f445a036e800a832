"""``replay --out`` and ``export_state`` never write onto a log (issue 42): a destination
that is one of the log's files (``MANIFEST``, a base, a segment), a new file or checkpoint
directory inside the log, or the log directory itself, reached directly, from inside the
log or through a symlink, is refused with one line and exit 2 before anything is replayed;
nothing is written and the log still opens. The same rule for ``report -o`` and the
temp-name cases are in ``tests/test_outputs.py``."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _cases import build, ckpt_kwargs, run

from lowdiff_store import ConfigError, LogReader, cli
from lowdiff_store.errors import Reason
from lowdiff_store.torch import DiffCheckpointer, export_state

BASE = "base-0000000000000000.safetensors"
SEG = "seg-0000000000000000.ldlog"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("outputs") / "log"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        o = build("adamw")
        with DiffCheckpointer(path, o.model, o.optimizer, scheduler=o.scheduler,
                              **ckpt_kwargs("adamw")) as ckpt:
            run("adamw", o, 0, 3, ckpt)
    finally:
        torch.set_num_threads(threads)
    return path


@pytest.fixture
def log(built: Path, tmp_path: Path) -> Path:
    """A private copy: before the fix these tests wrote into the log."""
    dst = tmp_path / "log"
    shutil.copytree(built, dst)
    return dst


@pytest.fixture
def cwd() -> Iterator[None]:
    old = os.getcwd()
    try:
        yield
    finally:
        os.chdir(old)


def snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def replay_refused(argv: list[str], log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = snapshot(log)
    rc = cli.main(["replay", *argv])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert (rc, out) == (2, ""), err
    assert len(lines) == 1, err
    assert lines[0].startswith("lowdiff-store replay: error: "), err
    assert "not_allowed" in lines[0], err
    assert "inside the log" in lines[0], err
    assert snapshot(log) == before
    with LogReader(log) as r:
        assert r.durable_step == 3


@pytest.mark.parametrize(("name", "fmt"), [
    ("MANIFEST", "safetensors"), (BASE, None), (SEG, "pt"), ("x.h5", None),
    ("ckpt", "dcp"), ("hf", "hf"), (".", "dcp")])
def test_replay_onto_the_log_is_refused(log: Path, name: str, fmt: str | None,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    argv = [str(log), "--out", str(log / name)] + (["--format", fmt] if fmt else [])
    replay_refused(argv, log, capsys)


def test_replay_from_inside_the_log_and_through_a_symlink(
        log: Path, tmp_path: Path, cwd: None, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "link").symlink_to(log)
    os.chdir(log)
    replay_refused([".", "--out", "MANIFEST", "--format", "safetensors"], log, capsys)
    replay_refused([".", "--out", "./w.safetensors"], log, capsys)
    os.chdir(tmp_path)
    replay_refused(["log", "--out", f"link/{BASE}"], log, capsys)
    replay_refused(["link", "--out", "log/../link/w.pt"], log, capsys)


def test_export_state_refuses_a_destination_in_a_log(log: Path) -> None:
    before = snapshot(log)
    state = {"w": torch.ones(3)}
    for out, fmt in [(log / BASE, None), (log / "d", "dcp"), (log / "h", "hf")]:
        with pytest.raises(ConfigError) as e:
            export_state(state, out, fmt)
        assert e.value.reason is Reason.NOT_ALLOWED
        assert e.value.path == str(out)
    assert snapshot(log) == before
