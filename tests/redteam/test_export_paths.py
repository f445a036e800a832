"""Export destinations that point elsewhere (issue 35 item 5): a ``.pt`` path that is a
symlink to another file, a DCP directory path that is a symlink to an empty directory.
The export never writes through a link: the link itself is replaced (a file) or the
export is refused in one line (a directory), and what the link pointed to is untouched."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lowdiff_store.torch import DiffCheckpointer

from .common import build, cli_here, one_line, train


@pytest.fixture
def log(tmp_path: Path) -> Path:
    m, opt = build(0)
    with DiffCheckpointer(tmp_path / "log", m, opt, snapshot_every=3):
        train(m, opt, 0, 4)
    return tmp_path / "log"


def test_file_export_over_a_symlink_replaces_the_link(log: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, tmp_path / "x.pt")
    rc, _out, err = cli_here(capsys, "replay", str(log), "--out", str(tmp_path / "x.pt"))
    assert rc == 0, err
    assert victim.read_text() == "precious"
    assert not os.path.islink(tmp_path / "x.pt")
    assert "0.weight" in torch.load(tmp_path / "x.pt", weights_only=True)


def test_directory_export_onto_a_symlink_is_refused(log: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]
                                                    ) -> None:
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "d")
    rc, _out, err = cli_here(capsys, "replay", str(log), "--out", str(tmp_path / "d"),
                             "--format", "dcp")
    assert rc == 1
    one_line(err, str(tmp_path / "d"), "io_error")
    assert os.listdir(tmp_path / "elsewhere") == []
    assert sorted(os.listdir(tmp_path)) == ["d", "elsewhere", "log"]  # no temp left
