"""Child process of tests/test_compaction_fs.py, run inside a mount namespace
(``unshare -rm``) where the log directory is a read-only bind mount or a small tmpfs.

``ro DIR``: run ``lowdiff-store compact DIR --dry-run --json`` and a real ``compact``
on the read-only log; print one JSON line with both exit codes and stderr.

``enospc MNT``: build a plain log on the tmpfs at MNT, then, for several amounts of free
space left by a filler file, run a compaction whose new base does not fit (or fits, but its
manifest does not); after each, check that the log's files are exactly the old ones and
that verify is clean; print one JSON line with what happened.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np

from lowdiff_store import LogWriter, tensor_input
from lowdiff_store.compaction import compact
from lowdiff_store.errors import LowdiffError
from lowdiff_store.log.reader import LogReader
from lowdiff_store.verify import verify_log

BASE_BYTES = 256 << 10


def ro(path: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, extra in (("dry", ["--dry-run", "--json", "--keep-bases", "1"]),
                        ("real", ["--keep-bases", "1"])):
        r = subprocess.run([sys.executable, "-m", "lowdiff_store", "compact", path, *extra],
                           capture_output=True, text=True, timeout=120)
        out[name] = {"rc": r.returncode, "stdout": r.stdout, "stderr": r.stderr}
    out["files"] = sorted(os.listdir(path))
    return out


def _materializer(reader: LogReader, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    arr = np.full(BASE_BYTES // 4, float(step), dtype="<f4")
    return {"w": ("F32", arr)}, {"step": step}


def _free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def enospc(mnt: str) -> dict[str, Any]:
    log = os.path.join(mnt, "log")
    with LogWriter(log, meta={"mode": "test"}, segment_bytes=8192) as w:
        w.write_base(0, {"w": ("F32", np.zeros(16, "<f4"))}, meta={"step": 0})
        for t in range(1, 13):
            w.append(t, [tensor_input("g", np.full(512, t, "<f4"), "F32")], kind="grad")
        w.sync()
    before = sorted(os.listdir(log))
    tries: list[dict[str, Any]] = []
    filler = os.path.join(mnt, "filler")
    for leave in range(BASE_BYTES - (16 << 10), BASE_BYTES + (48 << 10), 4096):
        with open(filler, "wb") as fh:
            fh.write(b"\0" * max(0, _free(mnt) - leave))
        entry: dict[str, Any] = {"leave": leave}
        try:
            compact(log, keep_bases=1, materializer=_materializer)
            entry["ok"] = True
        except LowdiffError as e:
            entry["error"] = str(e)
            entry["errno"] = getattr(e.__cause__, "errno", None)
        except Exception as e:  # the test fails on any of these
            entry["internal"] = f"{type(e).__name__}: {e}"
        os.unlink(filler)
        entry["files"] = sorted(os.listdir(log))
        rep = verify_log(log)
        entry["verify_ok"] = rep.ok
        entry["problems"] = [str(p) for p in rep.problems]
        tries.append(entry)
        if entry.get("ok"):
            break
    return {"before": before, "tries": tries}


if __name__ == "__main__":
    mode, path = sys.argv[1], sys.argv[2]
    print(json.dumps(ro(path) if mode == "ro" else enospc(path)))
