"""The CLI: thin over the library; exit codes 0/1/2/3/4/130 as documented in `--help`, the
``lowdiff_store.cli`` package and the README; errors are one line on stderr, never a traceback."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lowdiff_store import LowdiffError, Reason, cli
from lowdiff_store.format.framing import pack_manifest, unpack_manifest
from tests.helpers.cli import run_cli as run

INSPECT_KEYS = {"path", "sharded", "format_version", "log_id", "records", "bases",
                "first_step", "last_step", "durable_step", "segments", "bytes_on_disk",
                "segment_bytes", "base_bytes", "index_bytes", "bytes_per_step", "codecs",
                "kinds", "ratio_to_dense_fp32", "health", "torn_tail_bytes", "problems", "meta",
                "references", "streamed", "slice_bytes", "base_slices"}


@pytest.fixture
def no_torch_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run as if the optional torch layer were not installed (and keep torch unimported)."""
    monkeypatch.setitem(sys.modules, "lowdiff_store.torch", None)




def assert_one_error_line(err: str, *needles: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("lowdiff-store: error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, err)


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x20
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------------------ inspect


@pytest.mark.usefixtures("no_torch_layer")
def test_inspect_human(small_log: Any, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(["inspect", str(small_log.path)], capsys)
    assert (rc, err) == (0, "")
    rows = {line.split("  ")[0]: line.split("  ", 1)[1].strip() for line in out.splitlines()}
    assert rows["log"] == str(small_log.path)
    assert rows["health"] == "ok"
    assert rows["records"] == "4"
    assert rows["bases at steps"] == "0"
    assert rows["first / last / durable step"] == "0 / 4 / 4"
    assert rows["segments"] == "1"
    assert rows["codecs"] == "raw x2, raw+zstd x1, sparse x1, sparse+zstd x1"
    assert "problem" not in out


@pytest.mark.usefixtures("no_torch_layer")
def test_inspect_json(small_log: Any, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(["inspect", "--json", str(small_log.path)], capsys)
    assert (rc, err) == (0, "")
    assert out.count("\n") == 1  # one JSON object on one line
    info = json.loads(out)
    assert set(info) == INSPECT_KEYS
    sizes = {n: os.path.getsize(small_log.path / n) for n in os.listdir(small_log.path)}
    assert info["path"] == str(small_log.path)
    assert info["sharded"] is False
    assert info["log_id"] == unpack_manifest(small_log.manifest.read_bytes())["log_id"].hex()
    assert (info["records"], info["bases"], info["segments"]) == (4, [0], 1)
    assert (info["first_step"], info["last_step"], info["durable_step"]) == (0, 4, 4)
    assert info["codecs"] == {"raw": 2, "raw+zstd": 1, "sparse": 1, "sparse+zstd": 1}
    assert info["kinds"] == {"grad": 3, "weight": 1}
    assert info["segment_bytes"] == sizes[small_log.segment.name]
    assert info["base_bytes"] == sizes[small_log.base_file.name]
    assert info["index_bytes"] == sizes[small_log.index.name]
    assert info["bytes_on_disk"] == sum(v for k, v in sizes.items() if k != "LOCK"
                                        and not k.endswith(".lock"))
    assert info["bytes_per_step"] == small_log.ends[4] / 4 - 16  # (size - 64-byte header) / 4
    assert (info["health"], info["torn_tail_bytes"], info["problems"]) == ("ok", 0, [])
    assert info["meta"] == {"mode": "grad"}
    assert 0 < info["ratio_to_dense_fp32"]


@pytest.mark.usefixtures("no_torch_layer")
def test_inspect_reports_a_torn_tail_and_corruption(small_log: Any,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    os.unlink(small_log.index)
    os.truncate(small_log.segment, small_log.ends[4] - 1)
    rc, out, _err = run(["inspect", str(small_log.path)], capsys)
    assert rc == 0
    assert f"ok (torn tail of {small_log.ends[4] - 1 - small_log.starts[4]} bytes ignored)" \
        in out
    flip(small_log.segment, small_log.starts[2] + 100)
    rc, out, _err = run(["inspect", "--json", str(small_log.path)], capsys)
    info = json.loads(out)
    assert rc == 0
    assert info["health"] == "corrupt"
    assert info["records"] == 2
    assert [(p["reason"], p["offset"]) for p in info["problems"]] == [
        ("checksum_mismatch", small_log.starts[2])]


@pytest.mark.usefixtures("no_torch_layer")
def test_inspect_health_agrees_with_verify_on_a_damaged_indexed_record(
        small_log: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """With the index present, opening the log reads no record: the damage is found only
    by reading the record. inspect reads it (the newest records) and must not say ok."""
    assert small_log.index.exists()
    flip(small_log.segment, small_log.starts[2] + 100)
    rc, out, _err = run(["verify", str(small_log.path)], capsys)
    assert rc == 3
    assert f":{small_log.starts[2]}: checksum_mismatch" in out
    rc, out, err = run(["inspect", "--json", str(small_log.path)], capsys)
    assert (rc, err) == (0, "")
    info = json.loads(out)
    assert info["health"] == "corrupt"
    assert [(p["path"], p["offset"], p["reason"]) for p in info["problems"]] == [
        (str(small_log.segment), small_log.starts[2], "checksum_mismatch")]
    rc, out, _err = run(["inspect", str(small_log.path)], capsys)
    rows = {line.split("  ")[0]: line.split("  ", 1)[1].strip() for line in out.splitlines()
            if not line.startswith("problem: ")}
    assert rows["health"] == "corrupt"
    assert f"problem: {small_log.segment}:{small_log.starts[2]}: checksum_mismatch" in out


def test_inspect_with_the_torch_layer_on_a_plain_log(small_log: Any,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The optional torch description must not break ``inspect`` of a log it did not write."""
    rc, out, err = run(["inspect", "--json", str(small_log.path)], capsys)
    assert (rc, err) == (0, "")
    assert INSPECT_KEYS <= set(json.loads(out))


# ------------------------------------------------------------------------------- verify


def test_verify_clean(small_log: Any, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(["verify", str(small_log.path)], capsys)
    assert (rc, out) == (0, "")
    assert err.startswith("ok: 4 records, 1 bases, ")
    rc, out, _err = run(["verify", "--json", str(small_log.path)], capsys)
    rep = json.loads(out)
    assert rc == 0
    assert (rep["ok"], rep["records"], rep["bases"], rep["problems"]) == (True, 4, 1, [])
    assert rep["bytes_checked"] == os.path.getsize(small_log.segment) + \
        os.path.getsize(small_log.base_file)


def test_verify_a_torn_tail_is_clean(small_log: Any, capsys: pytest.CaptureFixture[str]) -> None:
    os.unlink(small_log.index)
    os.truncate(small_log.segment, small_log.ends[4] - 64)
    rc, out, err = run(["verify", str(small_log.path)], capsys)
    assert (rc, out) == (0, "")
    assert f"torn tail of {small_log.ends[4] - 64 - small_log.starts[4]} bytes ignored" in err


def test_verify_corrupted(small_log: Any, capsys: pytest.CaptureFixture[str]) -> None:
    flip(small_log.segment, small_log.starts[2] + 100)
    flip(small_log.segment, small_log.starts[4] + 40)
    flip(small_log.base_file, os.path.getsize(small_log.base_file) - 3)  # the meta tensor
    rc, out, err = run(["verify", str(small_log.path)], capsys)
    assert rc == 3
    lines = out.splitlines()
    assert lines == [
        f"{small_log.segment}:{small_log.starts[2]}: checksum_mismatch: record checksum "
        f"mismatch; {small_log.ends[2] - small_log.starts[2]} bytes dropped",
        f"{small_log.segment}:{small_log.starts[4]}: checksum_mismatch: record checksum "
        f"mismatch; {small_log.ends[4] - small_log.starts[4]} bytes dropped",
        lines[2],
    ]
    assert lines[2].startswith(f"{small_log.base_file}:")
    assert ": checksum_mismatch: " in lines[2]
    assert "3 problem(s)" in err
    assert "Traceback" not in err
    rc, out, _err = run(["verify", "--json", str(small_log.path)], capsys)
    rep = json.loads(out)
    assert rc == 3
    assert rep["ok"] is False
    assert [(p["path"], p["reason"]) for p in rep["problems"]] == [
        (str(small_log.segment), "checksum_mismatch"), (str(small_log.segment),
                                                        "checksum_mismatch"),
        (str(small_log.base_file), "checksum_mismatch")]


# --------------------------------------------------------------- exit 1: not a usable log


def _future_manifest(log: Any) -> str:
    raw = bytearray(log.manifest.read_bytes())
    struct.pack_into("<H", raw, 8, 2)
    log.manifest.write_bytes(bytes(raw))
    return "unsupported_format_version"


def _garbage_manifest(log: Any) -> str:
    log.manifest.write_bytes(b"this is not a manifest at all\n")
    return "bad_magic"


def _bad_body_manifest(log: Any) -> str:
    log.manifest.write_bytes(pack_manifest({"log_id": b"short"}))
    return "bad_metadata"


def _checksum_manifest(log: Any) -> str:
    flip(log.manifest, 30)
    return "checksum_mismatch"


@pytest.mark.usefixtures("no_torch_layer")
@pytest.mark.parametrize("command", ["inspect", "verify"])
@pytest.mark.parametrize("damage", [_future_manifest, _garbage_manifest, _bad_body_manifest,
                                    _checksum_manifest])
def test_unusable_manifest_is_exit_1(command: str, damage: Callable[[Any], str],
                                     small_log: Any, capsys: pytest.CaptureFixture[str]) -> None:
    reason = damage(small_log)
    rc, out, err = run([command, str(small_log.path)], capsys)
    assert (rc, out) == (1, "")
    assert_one_error_line(err, str(small_log.manifest), reason)


@pytest.mark.usefixtures("no_torch_layer")
@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_missing_directory_and_file_instead_of_directory_are_exit_1(
        command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run([command, str(tmp_path / "missing")], capsys)
    assert (rc, out) == (1, "")
    assert_one_error_line(err, str(tmp_path / "missing"), "not_a_log")
    f = tmp_path / "file"
    f.write_text("x")
    rc, out, err = run([command, "--json", str(f)], capsys)
    assert (rc, out) == (1, "")
    assert_one_error_line(err, str(f), "io_error")
    rc, out, err = run([command, str(tmp_path)], capsys)  # an empty directory
    assert (rc, out) == (1, "")
    assert_one_error_line(err, "not_a_log")


def test_internal_errors_are_one_line_unless_debugging(
        small_log: Any, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import lowdiff_store.verify as verify

    def bug(*_a: object, **_k: object) -> None:
        raise KeyError("oops")

    monkeypatch.setattr(verify, "verify_log", bug)
    monkeypatch.delenv("LOWDIFF_DEBUG", raising=False)
    rc, out, err = run(["verify", str(small_log.path)], capsys)
    assert (rc, out) == (1, "")
    assert_one_error_line(err, "internal error", "KeyError", "LOWDIFF_DEBUG")
    monkeypatch.setenv("LOWDIFF_DEBUG", "1")
    with pytest.raises(KeyError):
        cli.main(["verify", str(small_log.path)])


def test_unwrapped_os_errors_are_io_errors_not_internal_errors(
        small_log: Any, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    import lowdiff_store.verify as verify

    def read_only(*_a: object, **_k: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(small_log.path / "x.lock"))

    monkeypatch.setattr(verify, "verify_log", read_only)
    rc, out, err = run(["verify", str(small_log.path)], capsys)
    assert (rc, out) == (1, "")
    assert err == (f"lowdiff-store: error: {small_log.path / 'x.lock'}: io_error: Read-only "
                   "file system (errno 30)\n")


def test_interrupt_is_exit_130(small_log: Any, capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    import lowdiff_store.verify as verify

    def interrupted(*_a: object, **_k: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(verify, "verify_log", interrupted)
    rc, _out, err = run(["verify", str(small_log.path)], capsys)
    assert rc == 130
    assert err == "lowdiff-store: interrupted\n"


def test_replay_without_torch_is_exit_4(small_log: Any, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str],
                                        no_torch_layer: None) -> None:
    rc, out, err = run(["replay", str(small_log.path), "--to-step", "2", "--out",
                        str(tmp_path / "o.safetensors")], capsys)
    assert (rc, out) == (4, "")
    assert_one_error_line(err, "torch")
    assert not (tmp_path / "o.safetensors").exists()


# -------------------------------------------------------------------- usage and --help


@pytest.mark.parametrize("argv", [
    [], ["bogus"], ["inspect"], ["verify"], ["inspect", "a", "b"], ["verify", "--frobnicate", "x"],
    ["replay", "x"], ["replay", "x", "--to-step", "two", "--out", "o"],
    ["replay", "x", "--to-step", "2", "--out", "o", "--format", "zip"],
    # values out of range are usage errors too
    ["replay", "x", "--to-step", "-1", "--out", "o.pt"],
    ["replay", "x", "--to-step", "1.5", "--out", "o.pt"],
    ["compact", "x", "--step", "-3"],
    ["compact", "x", "--keep-bases", "0"],
    ["compact", "x", "--keep-bases", "-2"],
    ["compact", "x", "--keep-history-from", "-1"],
    ["tune", "x", "--mtbf", "0"],
    ["tune", "x", "--mtbf", "-5"],
    ["tune", "x", "--mtbf", "nan"],
    ["tune", "x", "--mtbf", "inf"],
    ["tune", "x"],
])
def test_bad_usage_is_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(argv, capsys)
    assert (rc, out) == (2, "")
    assert "error:" in err
    assert "Traceback" not in err
    assert err.count("\n") <= 3, err  # usage line(s) and one error line


def _subcommands() -> list[str]:
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return sorted(sub.choices)  # type: ignore[attr-defined]


def test_every_subcommand_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    commands = _subcommands()
    assert {"inspect", "verify", "replay"} <= set(commands)
    rc, out, _err = run(["--help"], capsys)
    assert rc == 0
    for c in commands:
        assert c in out
    for c in commands:
        rc, out, err = run([c, "--help"], capsys)
        assert (rc, err) == (0, ""), c
        assert out.startswith(f"usage: lowdiff-store {c}"), c
        body = out.split("\n\n", 1)[1]
        assert len(body.strip()) > 20, (c, out)  # more than a bare usage line
    rc, out, _err = run(["verify", "--help"], capsys)
    assert "--json" in out
    assert "log directory" in out


def test_top_help_lists_every_command_on_one_line_and_the_exit_codes(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    rc, out, _err = run(["--help"], capsys)
    assert rc == 0
    lines = out.splitlines()
    for c in ["inspect", "verify", "replay", "compact", "tune"]:
        (row,) = [i for i, line in enumerate(lines) if line.split()[:1] == [c]]
        assert len(lines[row].split()) > 3, lines[row]  # the command and its one-line help
        assert not lines[row + 1].startswith(" " * 8), lines[row:row + 2]  # no wrapped line
    codes = out.split("exit codes:", 1)[1]
    for code in ("0", "1", "2", "3", "4", "130"):
        assert any(line.split()[:1] == [code] for line in codes.splitlines()), code
    assert "interrupted" in codes


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from lowdiff_store import __version__

    rc, out, err = run(["--version"], capsys)
    assert (rc, err) == (0, "")
    assert out == f"lowdiff-store {__version__} (log format 1.0)\n"


def test_commands_are_not_optional() -> None:
    """compact and tune are plain commands of the parser, like the others."""
    assert _subcommands() == ["compact", "inspect", "replay", "report", "tune", "verify"]


# ------------------------------------------------- steps far past the end: no allocation


@pytest.mark.parametrize("step", [30_000_000, 10**12, 2**63 - 1, 2**64])
def test_compact_a_step_past_the_end_names_the_newest_durable_step(
        small_log: Any, step: int, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before anything is built for the step (before the fix: a list of every step
    up to it, GBs of memory, MemoryError or OverflowError)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for dry in ([], ["--dry-run"]):
        rc, out, err = run(["compact", str(small_log.path), "--step", str(step), *dry], capsys)
        assert (rc, out) == (1, "")
        assert_one_error_line(err, "no_such_step", f"step {step} is past the newest durable "
                              "step (4)")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KiB


# ----------------------------------------------------------------------- a real process


def test_python_m_lowdiff_store(small_log: Any) -> None:
    flip(small_log.segment, small_log.starts[3] + 64)
    env = dict(os.environ)
    env.pop("LOWDIFF_DEBUG", None)
    proc = subprocess.run([sys.executable, "-m", "lowdiff_store", "verify", str(small_log.path)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.splitlines() == [
        f"{small_log.segment}:{small_log.starts[3]}: checksum_mismatch: record checksum "
        f"mismatch; {small_log.ends[3] - small_log.starts[3]} bytes dropped"]
    assert "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "lowdiff_store", "verify",
                           str(small_log.path / "nope")], capture_output=True, text=True,
                          timeout=120, env=env)
    assert (proc.returncode, proc.stdout) == (1, "")
    assert_one_error_line(proc.stderr, "not_a_log")


def test_error_type_is_the_documented_one() -> None:
    e = LowdiffError("x", reason=Reason.NOT_A_LOG, path="/p", offset=3)
    assert str(e) == "/p:3: not_a_log: x"
    assert cli.EXIT_CORRUPT == 3
    assert cli.EXIT_USAGE == 2
    assert cli.EXIT_MISSING_DEP == 4


# ------------------------------------------------------------------- Ctrl-C, for real


def _load_interrupt() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "cli_interrupt", Path(__file__).parent / "helpers" / "interrupt.py")
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ctrl_c_during_a_long_verify_is_exit_130_without_traceback(tmp_path: Path) -> None:
    from lowdiff_store import LogWriter, tensor_input

    path = tmp_path / "big"
    big = np.random.default_rng(0).standard_normal(256 * 1024).astype("<f4")  # 1 MiB
    with LogWriter(path) as w:
        w.write_base(0, {"w": ("F32", big)})
        for s in range(1, 49):
            w.append(s, [tensor_input("g", big, "F32")], kind="grad")
        w.sync()
    proc = _load_interrupt().interrupt_when(["verify", str(path)], "seg-")
    assert (proc.returncode, proc.stdout) == (130, ""), proc.stderr
    assert proc.stderr == "lowdiff-store: interrupted\n"


def test_the_cli_loads_without_the_heavy_modules() -> None:
    """``import lowdiff_store.cli`` loads neither numpy nor the log layer: the window in
    which a Ctrl-C meets Python's own startup (a traceback no program can catch) stays
    that of the interpreter; everything heavy loads inside ``main``, which handles it."""
    code = ("import sys, lowdiff_store.cli; "
            "print(sorted(m for m in ('numpy', 'lowdiff_store.log', 'torch', 'tqdm', "
            "'zstandard') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_the_readme_documents_every_command_option_and_exit_code(
        capsys: pytest.CaptureFixture[str]) -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("## CLI\n", 1)[1].split("\n## ", 1)[0]
    for c in _subcommands():
        assert f"| `{c}` |" in section, c
        rc, out, _err = run([c, "--help"], capsys)
        assert rc == 0
        options = {w.strip("[],") for w in out.split() if w.startswith(("--", "[--"))}
        for opt in options - {"--help"}:
            assert opt in section, (c, opt)
    rc, out, _err = run(["--help"], capsys)
    codes = [line.split()[0] for line in out.split("exit codes:", 1)[1].splitlines()
             if line.strip() and line.split()[0].isdigit()]
    assert codes == ["0", "1", "2", "3", "4", "130"]
    for code in codes:
        assert f"\n| {code} | " in section, code
