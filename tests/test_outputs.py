"""Outputs never land on a log (issue 42): ``report -o`` inside a log (its ``MANIFEST``, a
segment, a new file there, the log directory itself; through ``.``, ``..`` and symlinks; any
rank of a sharded checkpoint) is refused with one line and exit 2, nothing written;
``report .`` run inside a log puts its page beside the log; every output is published
through a unique temp name created exclusively, so a symlink planted at a temp name never
redirects the write. ``replay --out`` has the same cases in ``tests/torch``."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from lowdiff_store import ConfigError, LogReader, LogWriter
from lowdiff_store.cli import main
from lowdiff_store.errors import Reason
from lowdiff_store.log.shards import write_shards_manifest
from lowdiff_store.report import default_output, report_log
from lowdiff_store.storage import local as local_mod

GOLDEN = Path(__file__).resolve().parent / "golden" / "logs"
SEG = "seg-0000000000000000.ldlog"


@pytest.fixture(autouse=True)
def _no_plots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages without plots: what is tested here is where a page goes, and drawing costs
    a second a page."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails


@pytest.fixture
def log(tmp_path: Path) -> Path:
    dst = tmp_path / "log"
    shutil.copytree(GOLDEN / "grad_demo", dst)
    return dst


def snapshot(d: Path) -> dict[str, bytes]:
    """Every file under ``d`` (links as their target), by relative path."""
    return {str(p.relative_to(d)): (f"-> {os.readlink(p)}".encode() if p.is_symlink()
                                    else p.read_bytes())
            for p in sorted(d.rglob("*")) if p.is_symlink() or p.is_file()}


def refused(rc: int, err: str, where: Path) -> None:
    """Exit 2 and one line naming the destination and the reason."""
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("lowdiff-store report: error: "), err
    assert "not_allowed" in lines[0], err
    assert "inside the log" in lines[0], err
    assert str(where) in lines[0], err


@pytest.fixture
def cwd(tmp_path: Path) -> Iterator[None]:
    old = os.getcwd()
    try:
        yield
    finally:
        os.chdir(old)


@pytest.mark.parametrize("name", ["MANIFEST", SEG, "base-0000000000000000.safetensors",
                                  "new-page.html", "."])
def test_report_onto_a_file_of_the_log_is_refused(log: Path, name: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    before = snapshot(log)
    out = log / name
    rc = main(["report", str(log), "-o", str(out)])
    refused(rc, capsys.readouterr().err, log)
    assert snapshot(log) == before
    with LogReader(log) as r:
        assert r.durable_step == 7


def test_report_into_the_log_through_dot_dotdot_and_a_symlink(
        log: Path, tmp_path: Path, cwd: None, capsys: pytest.CaptureFixture[str]) -> None:
    before = snapshot(log)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(log)
    os.chdir(tmp_path / "elsewhere")
    for out in ["../log/MANIFEST", "../link/MANIFEST", "../link/./x.html", "../link"]:
        rc = main(["report", str(log), "-o", out])
        refused(rc, capsys.readouterr().err, log)
    os.chdir(log)
    for out in ["MANIFEST", "./x.html", SEG]:
        rc = main(["report", ".", "-o", out])
        refused(rc, capsys.readouterr().err, log)
    assert snapshot(log) == before


def test_a_destination_symlink_into_the_log_is_refused(log: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    (tmp_path / "page.html").symlink_to(log / "MANIFEST")
    before = snapshot(log)
    rc = main(["report", str(log), "-o", str(tmp_path / "page.html")])
    refused(rc, capsys.readouterr().err, log)
    assert snapshot(log) == before


def write_sharded(root: Path) -> None:
    write_shards_manifest(root, 2)
    for rank in range(2):
        with LogWriter(root / f"rank-{rank:05d}") as w:
            w.write_base(0, {"w": ("F32", np.full(4, rank, np.float32))})


@pytest.mark.parametrize("where", ["SHARDS", "page.html", "rank-00001/MANIFEST",
                                   "rank-00000/page.html", "rank-00001"])
def test_report_into_any_rank_of_a_sharded_checkpoint_is_refused(
        tmp_path: Path, where: str, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ckpt"
    write_sharded(root)
    before = snapshot(root)
    rc = main(["report", str(root), "-o", str(root / where)])
    refused(rc, capsys.readouterr().err, root)
    assert snapshot(root) == before


def test_a_rank_directory_elsewhere_is_part_of_its_checkpoint(tmp_path: Path) -> None:
    """A rank directory linked from the root counts as the checkpoint's, even before its
    log has a MANIFEST (the rank never started)."""
    from lowdiff_store.outputs import check_output

    root = tmp_path / "ckpt"
    write_shards_manifest(root, 2)
    (tmp_path / "far").mkdir()
    (root / "rank-00000").symlink_to(tmp_path / "far")
    with pytest.raises(ConfigError) as e:
        check_output(tmp_path / "far" / "x.pt", logs=[root])
    assert e.value.reason is Reason.NOT_ALLOWED
    check_output(tmp_path / "x.pt", logs=[root])  # beside it: fine


def test_report_of_the_current_directory_inside_a_log_writes_beside_it(
        log: Path, tmp_path: Path, cwd: None, capsys: pytest.CaptureFixture[str]) -> None:
    before = snapshot(log)
    os.chdir(log)
    assert main(["report", "."]) == 0
    page = tmp_path / "log-report.html"
    assert f"report written to {page} (health ok)" in capsys.readouterr().err
    assert "<html" in page.read_text()
    assert snapshot(log) == before
    os.chdir(tmp_path)
    assert default_output(log) == "log-report.html"  # outside a log: the current directory


def test_report_from_inside_a_rank_goes_beside_the_whole_checkpoint(tmp_path: Path,
                                                                    cwd: None) -> None:
    root = tmp_path / "ckpt"
    write_sharded(root)
    os.chdir(root / "rank-00001")
    assert default_output(".") == str(tmp_path / "rank-00001-report.html")
    os.chdir(root)
    assert default_output(".") == str(tmp_path / "ckpt-report.html")


def test_the_library_refuses_too(log: Path) -> None:
    before = snapshot(log)
    with pytest.raises(ConfigError) as e:
        report_log(log, log / "MANIFEST")
    assert e.value.reason is Reason.NOT_ALLOWED
    assert e.value.path == str(log / "MANIFEST")
    assert snapshot(log) == before


def test_a_log_without_its_manifest_is_still_protected_as_the_source(
        log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (log / "MANIFEST").unlink()
    before = snapshot(log)
    rc = main(["report", str(log), "-o", str(log / SEG)])
    refused(rc, capsys.readouterr().err, log)
    assert snapshot(log) == before


def test_a_file_named_manifest_that_is_no_log_is_no_log(tmp_path: Path) -> None:
    """A distutils ``MANIFEST`` (text) does not make its directory a log."""
    from lowdiff_store.outputs import check_output, enclosing_log

    (tmp_path / "MANIFEST").write_text("include README\n")
    assert enclosing_log(tmp_path / "x.html") is None
    check_output(tmp_path / "x.html")


def test_a_symlink_at_the_old_fixed_temp_name_is_not_followed(
        log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    out = tmp_path / "page.html"
    (tmp_path / "page.html.tmp").symlink_to(victim)
    assert main(["report", str(log), "-o", str(out)]) == 0
    assert victim.read_bytes() == b"precious"
    assert "<html" in out.read_text()
    assert not out.is_symlink()


@pytest.mark.parametrize("directory", [False, True])
def test_a_symlink_at_the_unique_temp_name_is_skipped(tmp_path: Path, directory: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A temp name already taken (here: a symlink planted at the next name drawn) is never
    opened: the publish draws another name, and the link and its target stay as they
    were."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "f").write_bytes(b"precious")
    monkeypatch.setattr(local_mod.secrets, "token_hex", lambda n: "0badc0de")
    planted = tmp_path / local_mod.publish_temp_name("out")
    planted.symlink_to(victim / "f" if not directory else victim)
    tokens = iter(["0badc0de", "600dd00d"])  # the first name drawn is the planted one
    monkeypatch.setattr(local_mod.secrets, "token_hex", lambda n: next(tokens))
    out = tmp_path / "out"
    if directory:
        local_mod.atomic_publish_dir(out, lambda d: Path(d, "f").write_bytes(b"new"))
        assert (out / "f").read_bytes() == b"new"
    else:
        local_mod.atomic_publish(out, lambda f: f.write(b"new"))
        assert out.read_bytes() == b"new"
    assert snapshot(victim) == {"f": b"precious"}
    assert planted.is_symlink()
    assert not out.is_symlink()
