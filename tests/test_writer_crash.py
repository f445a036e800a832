"""Real crashes: a child process appends through AsyncLogWriter and reports each step it is told
is durable; the parent SIGKILLs it at a random moment and reopens the log. The log must
hold exactly steps 1..N, bit for bit, with N >= the last acknowledged step, and nothing
else; the next run resumes on the same log (recovery cuts any torn tail).

SIGKILL loses the process, not the page cache: this checks the writer's ordering, framing
and recovery, not the disk's flush semantics (that needs a power-cut rig).

The full-disk test mounts a 3 MiB tmpfs in an unprivileged user + mount namespace
(``unshare -rm``); where that is not allowed it is skipped and the injected ENOSPC tests
of test_writer.py stand in for it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from tests.helpers.timing import scaled, wait_for

HELPER = os.path.join(os.path.dirname(__file__), "helpers", "crash_writer.py")
_spec = importlib.util.spec_from_file_location("crash_writer", HELPER)
assert _spec is not None
assert _spec.loader is not None
crash_writer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(crash_writer)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_and_kill(path: str, rng: random.Random, batch: int, big: bool = False
                 ) -> tuple[int | None, bool]:
    """Start the child, SIGKILL it once it has acknowledged a random number (1-40) of steps
    durable in this run, 0-50 ms after that acknowledgement (anywhere in a later write:
    counted in steps, so a busy machine delays the kill but never empties the run).
    Returns (last acknowledged durable step, whether it was killed rather than finished)."""
    with subprocess.Popen([sys.executable, HELPER, path, "--batch", str(batch)]
                          + (["--big"] if big else []),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=_env()) as proc:
        lines: list[str] = []

        def pump() -> None:
            assert proc.stdout is not None
            lines.extend(line.strip() for line in proc.stdout)

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        want = rng.randint(1, 40)
        wait_for(lambda: proc.poll() is not None or sum(
            x.startswith("durable ") for x in list(lines)) >= want,
                 f"{want} steps acknowledged by the child", timeout=120)
        time.sleep(rng.uniform(0.0, 0.05))
        killed = proc.poll() is None
        if killed:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(scaled(60))
        t.join(scaled(10))
        err = proc.stderr.read() if proc.stderr is not None else ""
    if not killed:
        assert proc.returncode == 0, err
    acks = [int(x.split()[1]) for x in lines if x.startswith("durable ")]
    assert "ready" in lines, err
    return (max(acks) if acks else None), killed


def crash_campaign(tmp_path: Any, kills: int, seed: int, big: bool = False) -> None:
    rng = random.Random(seed)
    path = str(tmp_path / "log")
    best = 0
    killed_any = False
    for _ in range(kills):
        batch = rng.choice([1, 4, 16])
        acked, killed = run_and_kill(path, rng, batch, big)
        killed_any |= killed
        n, bases = crash_writer.check_log(path, big)
        assert acked is None or n >= acked, f"acknowledged {acked} but only {n} survived"
        assert n >= best, "a step that survived an earlier crash was lost"
        assert 0 in bases
        best = n
    assert killed_any
    assert best > 0


def test_sigkill_three_times(tmp_path: Any) -> None:
    crash_campaign(tmp_path, kills=3, seed=int(os.environ.get("CRASH_SEED", "1")))


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "big"), [(11, False), (12, True)])
def test_sigkill_campaign(tmp_path: Any, seed: int, big: bool) -> None:
    """24 kills in all; with ``big`` records of 16 MiB, some kills cut a record."""
    crash_campaign(tmp_path, kills=12, seed=seed, big=big)


def _unshare_tmpfs_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "-rm", "sh", "-c",
                        "mount -t tmpfs -o size=1m tmpfs /tmp && touch /tmp/x"],
                       capture_output=True, timeout=30)
    return r.returncode == 0


@pytest.mark.skipif(not _unshare_tmpfs_works(),
                    reason="cannot mount a tmpfs without privileges here (unshare -rm)")
@pytest.mark.parametrize("batch", [1, 4])
def test_full_disk_on_a_small_tmpfs(tmp_path: Any, batch: int) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = ('mount -t tmpfs -o size=3m tmpfs "$1" && '
              'exec "$2" "$3" "$1/log" --enospc --batch "$4"')
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", str(mnt), sys.executable,
                        HELPER, str(batch)], capture_output=True, text=True, timeout=120,
                       env=_env())
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ok"], out
    assert out["type"] == "CommitError"
    assert "failed at step" in out["error"]
    assert out["cause_errno"] == 28  # ENOSPC, as the storage layer reported it
    assert out["acked"] is not None
    assert out["n"] >= out["acked"]
    assert out["n"] < out["failed_at_append"]
