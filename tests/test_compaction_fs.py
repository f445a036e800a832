"""Compaction on file systems that refuse writes (issue #16), for real, in a mount namespace
(``unshare -rm``; skipped where that is not allowed):

- a read-only log: ``compact --dry-run`` works (it takes no lock file), a real compaction
  says one line with the reason (no ``internal error``);
- a full disk (a small tmpfs): a compaction whose new base or manifest does not fit leaves
  exactly the old files (no ``*.tmp``, no ``COMPACT.lock``, no unpublished base), verify is
  clean, and the error is one line naming ENOSPC.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lowdiff_store import LogWriter, tensor_input

HELPER = os.path.join(os.path.dirname(__file__), "helpers", "compact_fs.py")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _namespace_mounts_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "-rm", "sh", "-c",
                        "mount -t tmpfs -o size=1m tmpfs /tmp && mkdir /tmp/d && "
                        "mount --bind /tmp/d /tmp/d && mount -o remount,bind,ro /tmp/d && "
                        "! touch /tmp/d/x 2>/dev/null"],
                       capture_output=True, timeout=30)
    return r.returncode == 0


needs_ns = pytest.mark.skipif(not _namespace_mounts_work(),
                              reason="cannot mount in a user namespace here (unshare -rm)")


def _log(path: Path) -> None:
    with LogWriter(path, meta={"mode": "test"}, segment_bytes=4096) as w:
        for b in (0, 6):
            if b == 6:
                w.sync()
            w.write_base(b, {"w": ("F32", np.full(8, b, "<f4"))}, meta={"step": b})
            for t in range(b + 1, b + 7):
                w.append(t, [tensor_input("g", np.full(300, t, "<f4"), "F32")], kind="grad")
        w.sync()


@needs_ns
def test_compact_on_a_read_only_log(tmp_path: Path) -> None:
    log = tmp_path / "log"
    _log(log)
    for n in os.listdir(log):  # as a log copied from elsewhere: no lock files yet
        if n.endswith(".lock") or n == "LOCK":
            os.unlink(log / n)
    before = sorted(os.listdir(log))
    script = ('mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && '
              'exec "$2" "$3" ro "$1"')
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", str(log), sys.executable,
                        HELPER], capture_output=True, text=True, timeout=300, env=_env())
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    dry, real = out["dry"], out["real"]
    assert dry["rc"] == 0, dry
    assert json.loads(dry["stdout"])["dry_run"] is True
    assert json.loads(dry["stdout"])["delete_bases"] == [0]
    assert real["rc"] == 1, real
    err = real["stderr"].strip()
    assert len(err.splitlines()) == 1, err
    assert "internal error" not in err
    assert "io_error" in err, err
    assert "Read-only file system" in err, err
    assert out["files"] == before


@needs_ns
def test_compact_on_a_full_disk_leaves_the_old_state(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = 'mount -t tmpfs -o size=2m tmpfs "$1" && exec "$2" "$3" enospc "$1"'
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", str(mnt), sys.executable,
                        HELPER], capture_output=True, text=True, timeout=300, env=_env())
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    tries: list[dict[str, Any]] = out["tries"]
    failed = [t for t in tries if "ok" not in t]
    assert len(failed) >= 3, tries
    assert tries[-1].get("ok"), tries  # with room enough it succeeds on the same log
    for t in failed:
        assert "internal" not in t, t
        assert t["errno"] == 28, t
        assert "\n" not in t["error"], t
        assert t["files"] == out["before"], t
        assert t["verify_ok"], t
    # the failures hit while writing the base and while publishing its manifest
    assert any("base-" in t["error"] for t in failed), failed
    assert any("MANIFEST" in t["error"] for t in failed), failed
