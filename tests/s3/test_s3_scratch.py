"""Scratch directories of ``s3://`` appends without a write-ahead directory (issue 35, 4a):
named ``lowdiff-s3-HOST-PID-RANDOM``, so that the next handle removes those of writers
killed before they could (117 of them piled up in /tmp after the kill tests)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from lowdiff_store.storage.local import remove_stale_scratch_dirs
from lowdiff_store.storage.s3 import S3Options, S3Store
from lowdiff_store.storage.s3.append import SCRATCH_PREFIX

#: A writer that stages an object in STAGING, prints its scratch directory, then appends
#: and syncs until killed.
WRITER = """
import sys, time
from lowdiff_store.storage.s3 import S3Options, S3Store
store = S3Store(sys.argv[1], S3Options.from_env(staging_dir=sys.argv[2]))
h = store.open_append(sys.argv[3], create=True)
h.append([b"x" * 100])
h.sync()
print("STAGED", h._local, flush=True)
while True:
    h.append([b"y" * 100])
    h.sync()
    time.sleep(0.01)
"""


def start_writer(url: str, staging: Path, name: str) -> tuple[subprocess.Popen[str], Path]:
    """A writer process mid-append, and its scratch directory."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, url, str(staging), name],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until the handle is open (or the writer died)
    assert line.startswith("STAGED "), (line, proc.poll())
    return proc, Path(line.split(" ", 1)[1].strip()).parent


def kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=120)
    if proc.stdout is not None:
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL


def test_a_killed_writers_scratch_dir_goes_at_the_next_open(s3_url: str,
                                                            tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    staging.mkdir()
    dead, dead_dir = start_writer(s3_url, staging, "seg-a")
    live, live_dir = start_writer(s3_url, staging, "seg-b")
    try:
        assert dead_dir.name.startswith(f"{SCRATCH_PREFIX}-")
        assert dead_dir.name.split("-")[-2] == str(dead.pid)
        kill(dead)
        assert (dead_dir / "staged").is_file()  # SIGKILL: nobody removed it
        # other names of the prefix: another host's (a shared temp directory), the
        # random names of the earlier code, a plain file: never touched
        other_host = "0" * 8 if dead_dir.name.split("-")[2] != "0" * 8 else "1" * 8
        foreign = staging / f"{SCRATCH_PREFIX}-{other_host}-{dead.pid}-0123abcd"
        legacy = staging / f"{SCRATCH_PREFIX}-k2j4_x9q"
        for d in (foreign, legacy):
            d.mkdir()
        (staging / f"{SCRATCH_PREFIX}-notes.txt").write_text("keep")
        store = S3Store(s3_url, S3Options.from_env(staging_dir=str(staging)))
        h = store.open_append("seg-c", create=True)
        assert not dead_dir.exists()
        assert (live_dir / "staged").is_file()  # a live writer's directory stays
        assert live.poll() is None
        assert foreign.is_dir()
        assert legacy.is_dir()
        assert (staging / f"{SCRATCH_PREFIX}-notes.txt").read_text() == "keep"
        h.append([b"z"])
        h.close()
        mine = [p for p in staging.iterdir() if p.name.split("-")[-2:-1] == [str(os.getpid())]]
        assert mine == []  # a closed handle removes its own directory
    finally:
        if live.poll() is None:
            kill(live)
    # the live writer is dead now too: the next sweep removes its directory, only it
    assert remove_stale_scratch_dirs(staging, SCRATCH_PREFIX) == [live_dir.name]
    assert sorted(p.name for p in staging.iterdir()) == sorted(
        [foreign.name, legacy.name, f"{SCRATCH_PREFIX}-notes.txt"])


def test_a_pid_reused_by_a_live_process_keeps_its_dir(tmp_path: Path) -> None:
    """A name whose pid is a live process (here this one) is never removed, whoever made
    it; a dead pid's is."""
    from lowdiff_store.storage.local import make_scratch_dir

    mine = Path(make_scratch_dir(SCRATCH_PREFIX, str(tmp_path)))
    assert mine.parent == tmp_path
    assert mine.stat().st_mode & 0o777 == 0o700
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=120)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the pid is reaped: wait until nobody holds it
        try:
            os.kill(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    host = mine.name.split("-")[2]
    stale = tmp_path / f"{SCRATCH_PREFIX}-{host}-{proc.pid}-00000000"
    stale.mkdir()
    (stale / "staged").write_bytes(b"x")
    assert remove_stale_scratch_dirs(tmp_path, SCRATCH_PREFIX) == [stale.name]
    assert sorted(tmp_path.iterdir()) == [mine]
