"""``lowdiff-store replay --out FILE`` killed by SIGKILL while its temp file exists: the
target is untouched, the temp file stays (nothing can remove it in a killed process), and
the next export into that directory removes it, and nothing else."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from lowdiff_store.storage import PUBLISH_TEMP_MARK, publish_temp_name
from lowdiff_store.torch import DiffCheckpointer

ROOT = Path(__file__).resolve().parents[2]
KILL_TRIES = 8


def make_log(path: Path) -> None:
    """A log whose export (model and optimizer, ~36 MB) takes long enough to be caught."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1536, 1024), torch.nn.Linear(1024, 1536))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with DiffCheckpointer(path, model, opt, snapshot_every=4):
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            opt.step()  # the checkpointer hooks the step


def replay_cmd(log: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "lowdiff_store", "replay", str(log), "--out", str(out),
            "--with-optimizer"]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def temps(d: Path) -> list[str]:
    return [n for n in os.listdir(d) if PUBLISH_TEMP_MARK in n]


def kill_while_publishing(log: Path, out: Path) -> tuple[str, int]:
    """Run the CLI and SIGKILL it as soon as its temp file appears (again if the publish
    finished between two looks). Returns the temp file's name and the killed pid."""
    for _ in range(KILL_TRIES):
        out.unlink(missing_ok=True)
        proc = subprocess.Popen(replay_cmd(log, out), env=env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            while proc.poll() is None and not temps(out.parent):
                time.sleep(0.0005)
            proc.send_signal(signal.SIGKILL)
            rc = proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        left = temps(out.parent)
        if rc == -signal.SIGKILL and left:
            assert len(left) == 1
            return left[0], proc.pid
    raise AssertionError(f"the temp file was never seen in {KILL_TRIES} runs")


def test_sigkill_leaves_a_temp_the_next_export_removes(tmp_path: Path) -> None:
    log = tmp_path / "log"
    make_log(log)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    target = out_dir / "state.safetensors"
    stale, pid = kill_while_publishing(log, target)
    assert not target.exists()  # never a partial target
    assert stale.startswith(f".state.safetensors.{PUBLISH_TEMP_MARK}-")
    assert f"-{pid}-" in stale
    # beside it: a temp of a live writer (this process) and files that are not ours
    live = publish_temp_name("other.pt")
    keep = [live, ".state.safetensors.1a2b3c4d.tmp", "notes.tmp"]
    for n in keep:
        (out_dir / n).write_bytes(b"x")
    r = subprocess.run(replay_cmd(log, out_dir / "again.safetensors"), env=env(),
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(out_dir)) == sorted([*keep, "again.safetensors"])
    state = load_file(str(out_dir / "again.safetensors"))
    assert state["0.weight"].shape == (1024, 1536)
    assert "@opt/0.weight/exp_avg" in state
