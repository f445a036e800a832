"""``lowdiff-store replay`` and ``export_state``: the newest durable step by default, steps
past the end refused before anything is built, the format named by the suffix, the atomic
publish (fsync before rename; nothing left behind on a full disk, a read-only place, a
missing directory, Ctrl-C), the optimizer names and counts; ``inspect --json`` with the
torch layer."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import h5py
import pytest
import torch
from _cases import assert_same, build, ckpt_kwargs, reference, run
from safetensors.torch import load_file

from lowdiff_store import ConfigError, StorageError
from lowdiff_store.torch import DiffCheckpointer, export_state, flatten_optimizer_state
from lowdiff_store.torch.replay.export import format_for_path
from tests.helpers.cli import run_cli as cli_run
from tests.helpers.tiny import one_thread

STEPS = 12  # snapshot_every=10: bases at 0 and 10, diffs 1..12


#: what the autouse fixture of conftest.py does, for the module-scoped fixtures
_one_thread = contextlib.contextmanager(one_thread)


@pytest.fixture(scope="module")
def torch_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "log"
    with _one_thread():
        o = build("adamw")
        with DiffCheckpointer(path, o.model, o.optimizer, scheduler=o.scheduler,
                              **ckpt_kwargs("adamw")) as ckpt:
            run("adamw", o, 0, STEPS, ckpt)
    return path


@pytest.fixture(scope="module")
def ref() -> dict[int, Any]:
    with _one_thread():
        return reference("adamw", STEPS, at=(7,))[1]




def one_error_line(err: str, *needles: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("lowdiff-store"), err
    assert ": error: " in lines[0], err
    assert "internal error" not in err
    for n in needles:
        assert n in lines[0], (n, err)


def leftovers(d: Path, keep: set[str]) -> list[str]:
    return sorted(n for n in os.listdir(d) if n not in keep)


# ------------------------------------------------------------------- which step


def test_replay_defaults_to_the_newest_durable_step(torch_log: Path, ref: dict[int, Any],
                                                    tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "w.safetensors"
    rc, stdout, err = cli_run(["replay", str(torch_log), "--out", str(out), "--json"], capsys)
    assert (rc, err) == (0, "")
    summary = json.loads(stdout)
    assert summary == {"step": STEPS, "out": str(out), "format": "safetensors",
                       "model_tensors": len(ref[STEPS]["model"]), "optimizer_tensors": 0,
                       "bytes": os.path.getsize(out)}
    assert_same(load_file(out), ref[STEPS]["model"])
    rc, stdout, _err = cli_run(["replay", str(torch_log), "--to-step", "7", "--out",
                                str(tmp_path / "w7.safetensors")], capsys)
    assert rc == 0
    assert stdout.startswith(f"wrote {len(ref[7]['model'])} model tensors at step 7 to ")
    assert_same(load_file(tmp_path / "w7.safetensors"), ref[7]["model"])


@pytest.mark.parametrize("step", [STEPS + 1, 30_000_000, 10**12, 2**63 - 1, 2**64])
def test_a_step_past_the_end_names_the_newest_durable_step(
        torch_log: Path, tmp_path: Path, step: int, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before anything is built for the step: before, 30000000 peaked at GBs,
    10**12 and 2**63-1 ran out of memory, 2**64 overflowed."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rc, out, err = cli_run(["replay", str(torch_log), "--to-step", str(step), "--out",
                            str(tmp_path / "x.pt")], capsys)
    assert (rc, out) == (1, "")
    one_error_line(err, "no_such_step", f"step {step} is past the newest durable step "
                   f"({STEPS})")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KiB
    assert leftovers(tmp_path, set()) == []


# ------------------------------------------------------------------- the format


def _kind_of(path: Path) -> str:
    head = path.read_bytes()[:16]
    if head.startswith(b"PK\x03\x04"):
        return "pt"  # torch.save's zip container
    if head.startswith(b"\x89HDF\r\n\x1a\n"):
        return "hdf5"
    n = int.from_bytes(head[:8], "little")
    assert head[8:9] == b"{", head
    assert n < path.stat().st_size, head
    return "safetensors"


def _load(path: Path, kind: str) -> dict[str, torch.Tensor]:
    if kind == "pt":
        loaded: dict[str, torch.Tensor] = torch.load(path, weights_only=True)
        return loaded
    if kind == "safetensors":
        return load_file(path)
    with h5py.File(path, "r") as f:
        return {name: torch.from_numpy(f[name][()]) for name in f if name != "@opt"}


@pytest.mark.parametrize(("suffix", "kind"), [(".pt", "pt"), (".pth", "pt"),
                                              (".safetensors", "safetensors"),
                                              (".h5", "hdf5"), (".hdf5", "hdf5")])
def test_the_suffix_names_the_format(torch_log: Path, ref: dict[int, Any], tmp_path: Path,
                                     suffix: str, kind: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Before: every --out was written as safetensors unless --format said otherwise."""
    out = tmp_path / f"w{suffix}"
    rc, stdout, err = cli_run(["replay", str(torch_log), "--out", str(out)], capsys)
    assert (rc, err) == (0, "")
    assert f"({kind}, " in stdout
    assert _kind_of(out) == kind
    assert_same(_load(out, kind), ref[STEPS]["model"])
    assert leftovers(tmp_path, {out.name}) == []


def test_a_format_that_contradicts_the_suffix_is_a_usage_error(
        torch_log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--out", str(tmp_path / "w.pt"), "--format", "safetensors"],
                 ["--out", str(tmp_path / "w.h5"), "--format", "pt"],
                 ["--out", str(tmp_path / "w.bin")]):  # no suffix to go by, no --format
        rc, out, err = cli_run(["replay", str(torch_log), *argv], capsys)
        assert (rc, out) == (2, ""), argv
        one_error_line(err, "lowdiff-store replay: error: ")
    assert leftovers(tmp_path, set()) == []
    rc, _out, _err = cli_run(["replay", str(torch_log), "--out", str(tmp_path / "w.bin"),
                              "--format", "pt"], capsys)
    assert rc == 0
    assert _kind_of(tmp_path / "w.bin") == "pt"


def test_format_for_path() -> None:
    assert format_for_path("a/b.PT") == "pt"
    assert format_for_path("b.hdf5") == "hdf5"
    assert format_for_path("b.bin", "safetensors") == "safetensors"
    assert format_for_path("b.safetensors", "safetensors") == "safetensors"
    for args in (("b.bin", None), ("b.pt", "hdf5"), ("b.pt", "npz")):
        with pytest.raises(ConfigError):
            format_for_path(*args)


# ------------------------------------------------------------------- the optimizer


def test_with_optimizer_writes_at_opt_names_and_counts_them(
        torch_log: Path, ref: dict[int, Any], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _err = cli_run(["replay", "--help"], capsys)
    assert "'@opt/<parameter name>/<key>'" in " ".join(out.split())
    path = tmp_path / "w.safetensors"
    rc, out, err = cli_run(["replay", str(torch_log), "--out", str(path), "--with-optimizer",
                            "--json"], capsys)
    assert (rc, err) == (0, "")
    summary = json.loads(out)
    got = load_file(path)
    opt = {k: v for k, v in got.items() if k.startswith("@opt/")}
    assert summary["optimizer_tensors"] == len(opt) > 0
    assert summary["model_tensors"] == len(got) - len(opt) == len(ref[STEPS]["model"])
    assert "@opt/layer.linear1.weight/exp_avg" in opt
    st = ref[STEPS]["optimizer"]
    assert len(opt) == sum(isinstance(v, torch.Tensor) for e in st["state"].values()
                           for v in e.values())
    rc, out, _err = cli_run(["replay", str(torch_log), "--out", str(tmp_path / "h.pt"),
                             "--with-optimizer"], capsys)
    assert rc == 0
    assert out.startswith(f"wrote {len(ref[STEPS]['model'])} model tensors and {len(opt)} "
                          "optimizer tensors (@opt/...) at step 12 to ")


# ------------------------------------------------------------- where it cannot write


def test_unwritable_destinations_are_one_line_and_leave_nothing(
        torch_log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: ``internal error: ...`` (and a .tmp left where it could be created)."""
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir.pt").mkdir()
    cases = [("/nonexistent/x.pt", "does not exist"),
             (str(tmp_path / "adir.pt"), "is a directory"),
             (str(tmp_path), "is a directory"),
             (str(tmp_path / "afile" / "x.pt"), "is not a directory")]
    for out, why in cases:
        rc, stdout, err = cli_run(["replay", str(torch_log), "--out", out], capsys)
        assert (rc, stdout) == (1, ""), out
        one_error_line(err, out, "io_error", why)
    assert leftovers(tmp_path, {"afile", "adir.pt"}) == []
    assert os.listdir(tmp_path / "adir.pt") == []


def _unshare_tmpfs_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "-rm", "sh", "-c",
                        "mount -t tmpfs -o size=1m tmpfs /tmp && touch /tmp/x"],
                       capture_output=True, timeout=30)
    return r.returncode == 0


_REPO = str(Path(__file__).resolve().parents[2])

# In a user + mount namespace: a tmpfs too small for the export; each replay exits 1 with one
# line; then what the disk holds (nothing), then the same tmpfs read-only. The commands run
# in one interpreter (cli.main, as the entry point calls it) so torch loads once.
_SCRIPT = """
mount -t tmpfs -o size=24k tmpfs "$1" || exit 99
exec "$2" -c "$3" "$1" "$4"
"""
_COMMANDS = """
import os, subprocess, sys
from lowdiff_store import cli
mnt, log = sys.argv[1:]
for name in ("w.pt", "w.safetensors", "w.h5"):
    rc = cli.main(["replay", log, "--with-optimizer", "--out", os.path.join(mnt, name)])
    print(f"rc={rc}", f"left={sorted(os.listdir(mnt))}", flush=True)
subprocess.run(["mount", "-o", "remount,ro", mnt], check=True)
rc = cli.main(["replay", log, "--out", os.path.join(mnt, "r.pt")])
print(f"rc={rc}", f"left={sorted(os.listdir(mnt))}", flush=True)
"""


@pytest.mark.skipif(not _unshare_tmpfs_works(),
                    reason="cannot mount a tmpfs without privileges here (unshare -rm)")
def test_full_disk_and_read_only_place(torch_log: Path, tmp_path: Path) -> None:
    """Before: ``internal error: SafetensorError``, ``RuntimeError: [enforce fail at
    inline_container.cc:672]``, ``OSError: [Errno 28]``, and a .tmp left on the disk."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    env = dict(os.environ, PYTHONPATH=_REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    env.pop("LOWDIFF_DEBUG", None)
    r = subprocess.run(["unshare", "-rm", "sh", "-c", _SCRIPT, "sh", str(mnt), sys.executable,
                        _COMMANDS, str(torch_log)], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.stdout.splitlines() == ["rc=1 left=[]"] * 4, (r.stdout, r.stderr)
    errs = r.stderr.splitlines()
    assert len(errs) == 4, r.stderr
    for name, line in zip(["w.pt", "w.safetensors", "w.h5"], errs[:3], strict=True):
        # FILE:OFFSET where the write failed (issue 42, item 5)
        assert re.match(rf"lowdiff-store: error: {re.escape(str(mnt / name))}:\d+: io_error: ",
                        line), line
        assert "No space left on device (errno 28)" in line, line
    assert errs[3].startswith(f"lowdiff-store: error: {mnt / 'r.pt'}: io_error: "), errs[3]
    assert "read-only" in errs[3]
    assert "Traceback" not in r.stderr


# ----------------------------------------------------------------- the publish itself


def test_export_fsyncs_the_data_before_the_rename(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 16: the export was renamed into place with its data never fsynced (a power cut
    could leave an empty file under the final name)."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        events.append(("rename", os.fspath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    state = {"a": torch.arange(6, dtype=torch.float32)}
    for name in ("x.pt", "x.safetensors", "x.h5"):
        events.clear()
        res = export_state(state, tmp_path / name)
        assert res.bytes == os.path.getsize(tmp_path / name)
        kinds = [k for k, _p in events]
        assert kinds == ["fsync", "rename", "fsync"], events
        tmp = events[0][1]
        assert os.path.dirname(tmp) == str(tmp_path)  # the temp file is beside the target
        assert tmp.endswith(".tmp")
        assert events[1][1] == str(tmp_path / name)
        assert events[2][1] == str(tmp_path)  # then the directory
    assert sorted(os.listdir(tmp_path)) == ["x.h5", "x.pt", "x.safetensors"]


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_export_leaves_the_old_file_and_nothing_else(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: type[BaseException]) -> None:
    target = tmp_path / "x.pt"
    target.write_bytes(b"old")
    real_save = torch.save

    def save_then_fail(obj: Any, f: Any, *a: Any, **k: Any) -> None:
        real_save(obj, f, *a, **k)
        raise exc("stop")

    monkeypatch.setattr(torch, "save", save_then_fail)
    with pytest.raises(exc):
        export_state({"a": torch.ones(3)}, target)
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["x.pt"]


def test_export_storage_errors_name_the_destination(tmp_path: Path) -> None:
    with pytest.raises(StorageError) as ei:
        export_state({"a": torch.ones(3)}, tmp_path / "missing" / "x.pt")
    assert ei.value.path == str(tmp_path / "missing" / "x.pt")
    assert ei.value.errno == 2


def test_flattened_names_match_the_export(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    names = ["weight", "bias"]
    for g in sd["param_groups"]:
        g["param_names"] = [names[i] for i in g["params"]]
    res = export_state(dict(model.state_dict()), tmp_path / "m.safetensors",
                       optimizer_state=sd)
    got = load_file(tmp_path / "m.safetensors")
    assert sorted(k for k in got if k.startswith("@opt/")) == sorted(
        flatten_optimizer_state(sd))
    assert (res.model_tensors, res.optimizer_tensors) == (2, len(flatten_optimizer_state(sd)))


# ------------------------------------------------------------------- inspect, Ctrl-C


def test_inspect_json_has_the_torch_metadata_once(torch_log: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Before: the raw manifest metadata (meta.torch) and the torch layer's description
    (torch) both."""
    rc, out, err = cli_run(["inspect", "--json", str(torch_log)], capsys)
    assert (rc, err) == (0, "")
    info = json.loads(out)
    assert "torch" not in info["meta"]
    assert info["torch"]["optimizer"] == "torch.optim.adamw.AdamW"
    assert out.count('"torch_version"') == 1


def _interrupt_when() -> Any:
    spec = importlib.util.spec_from_file_location(
        "cli_interrupt", Path(__file__).parents[1] / "helpers" / "interrupt.py")
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.interrupt_when


def test_ctrl_c_during_replay_is_exit_130_and_leaves_nothing(torch_log: Path,
                                                             tmp_path: Path) -> None:
    out = tmp_path / "w.pt"
    proc = _interrupt_when()(["replay", str(torch_log), "--to-step", str(STEPS), "--out",
                              str(out)], "seg-", cwd=_REPO)
    assert (proc.returncode, proc.stdout) == (130, ""), proc.stderr
    assert proc.stderr == "lowdiff-store: interrupted\n"
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("step", [STEPS + 1, 2**63 - 1, 2**64])
def test_the_library_refuses_a_step_past_the_end_before_building_anything(
        torch_log: Path, step: int) -> None:
    from lowdiff_store import LogReader, StepNotFoundError
    from lowdiff_store.torch import materialize_base, replay_state

    with pytest.raises(StepNotFoundError, match=f"newest durable step \\({STEPS}\\)"):
        replay_state(torch_log, step)
    with LogReader(str(torch_log)) as reader, \
            pytest.raises(StepNotFoundError, match=f"newest durable step \\({STEPS}\\)"):
        materialize_base(reader, step)
