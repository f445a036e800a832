"""Crash safety of compaction: a real process running ``lowdiff-store compact`` is killed
with SIGKILL at random moments, at every crash point.

After each kill the log must be the old state or the new one (its manifest's bases and
segments are one of the two), clean under ``verify``, and restore to the exact state; what
the killed compaction left behind is removed by the next writer open or by the next
compaction (alternately), after which the log is still exact.

To make the moments reachable the compaction runs with ``LOWDIFF_COMPACT_PAUSE`` (a sleep
at each crash point, announced on stderr); the kill lands at a uniformly random time inside
the chosen point's pause, or at a uniformly random time since the process started. The
compacting processes are forked from a *zygote* that imported torch once (this module run
as ``python test_compaction_crash.py zygote``), so a kill costs milliseconds, not a
second of imports; each is still a separate process running the CLI's ``main``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.timing import scaled

pytestmark = pytest.mark.consistent_bases  # consistent bases' steps and files (tests/conftest.py)

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "torch"))

#: The crash points of ``compaction.compact``, in order (see ``compaction._pause``).
POINTS = ("locked", "materialized", "base-written", "published", "deleting", "deleted")
PAUSE = 0.12
STEPS = 57


class Zygote:
    """Forks compacting processes on request; reports their pid and exit status."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen([sys.executable, __file__, "zygote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "ready"

    def start(self, argv: list[str], stderr: Path, hold: str | None = None) -> int:
        """A compacting process; ``hold``: the crash point at which it stops until killed
        (else it pauses :data:`PAUSE` at each)."""
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"argv": argv, "stderr": str(stderr),
                                          "pause": str(PAUSE), "hold": hold}) + "\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def status(self) -> int:
        assert self.proc.stdout is not None
        return int(json.loads(self.proc.stdout.readline())["status"])

    def close(self) -> None:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def zygote() -> Any:
    z = Zygote()
    yield z
    z.close()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A gradient log (bases every 10 steps, several segments), the state at its durable
    step, and the manifest an uninterrupted compaction leaves."""
    from _cases import build, run, snapshot

    from lowdiff_store.compaction import compact
    from lowdiff_store.log.manifest import load_manifest
    from lowdiff_store.torch import DiffCheckpointer, materialize_base, restore

    d = tmp_path_factory.mktemp("crash")
    p = d / "log"
    torch.set_num_threads(1)
    o = build("adamw")
    with DiffCheckpointer(p, o.model, o.optimizer, scheduler=o.scheduler, snapshot_every=10,
                          segment_bytes=40000, digest_every=1) as ckpt:
        run("adamw", o, 0, STEPS, ckpt)
    o = build("adamw")
    restore(p, o.model, o.optimizer, scheduler=o.scheduler)
    want = snapshot(o)
    q = d / "reference"
    shutil.copytree(p, q)
    compact(str(q), keep_bases=1, materializer=materialize_base)
    old, new = load_manifest(str(p)), load_manifest(str(q))
    assert new.bases == [STEPS]
    assert len(new.segments) < len(old.segments)
    return {"path": p, "want": want, "old": (old.bases, old.segments),
            "new": (new.bases, new.segments)}


def referenced(path: Path) -> set[str]:
    from lowdiff_store.format.constants import BASE_NAME, INDEX_NAME, SEGMENT_NAME
    from lowdiff_store.log.manifest import load_manifest

    m = load_manifest(str(path))
    out = {"MANIFEST", "MANIFEST.lock", "COMPACT.lock", "LOCK"}
    out |= {BASE_NAME.format(b) for b in m.bases}
    for s, _f in m.segments:
        out |= {SEGMENT_NAME.format(s), INDEX_NAME.format(s)}
    return out


def check_state(path: Path, pristine: dict[str, Any]) -> str:
    """Old or new state, verify clean, restore exact. Returns "old" or "new"."""
    from _cases import assert_same, build, snapshot

    from lowdiff_store.log.manifest import load_manifest
    from lowdiff_store.torch import restore
    from lowdiff_store.verify import verify_log

    m = load_manifest(str(path))
    state = (m.bases, m.segments)
    assert state in (pristine["old"], pristine["new"]), state
    rep = verify_log(str(path))
    assert rep.ok, [str(e) for e in rep.problems]
    o = build("adamw")
    res = restore(path, o.model, o.optimizer, scheduler=o.scheduler)
    assert res.step == STEPS
    assert_same(snapshot(o), pristine["want"])
    return "old" if state == pristine["old"] else "new"


def kill_once(zygote: Zygote, pristine: dict[str, Any], work: Path, point: str | None,
              rng: random.Random, cleanup: str) -> tuple[str, str]:
    """One compaction killed at ``point`` (None: at a random time since start). Returns
    (the last crash point reached, the state found)."""
    from lowdiff_store import LogWriter
    from lowdiff_store.compaction import compact
    from lowdiff_store.torch import materialize_base

    p = work / "log"
    shutil.copytree(pristine["path"], p)
    err = work / "stderr"
    err.write_text("")
    t0 = time.monotonic()
    # at a chosen point the process holds until killed (a loaded machine that wakes this
    # test late must not find it past the point); a random moment pauses at every point
    pid = zygote.start(["compact", str(p), "--keep-bases", "1"], err, hold=point)
    if point is None:
        deadline = t0 + rng.uniform(0.0, PAUSE * (len(POINTS) + 1))
    else:
        marker = f"lowdiff-compact-point {point}\n"
        while marker not in err.read_text():
            assert time.monotonic() - t0 < scaled(120), f"crash point {point} not reached"
            time.sleep(0.002)
        deadline = time.monotonic() + rng.uniform(0.0, 0.8 * PAUSE)  # inside the hold
    while time.monotonic() < deadline:
        time.sleep(0.001)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    status = zygote.status()
    reached = [ln.split()[-1] for ln in err.read_text().splitlines()
               if ln.startswith("lowdiff-compact-point ")]
    last = reached[-1] if reached else "start"
    if status == 0:
        last = "completed"
    found = check_state(p, pristine)
    if point is not None and POINTS.index(point) >= POINTS.index("published") \
            and status != 0:
        assert found == "new"
    if point is not None and POINTS.index(point) <= POINTS.index("base-written"):
        assert found == "old"  # the new base, if written, is not in a manifest yet
    # leftovers: removed by the next writer open, or by the next compaction
    if cleanup == "writer":
        with LogWriter(p):
            pass
    else:
        compact(str(p), keep_bases=1, materializer=materialize_base)
        assert check_state(p, pristine) == "new"
    assert set(os.listdir(p)) <= referenced(p), set(os.listdir(p)) - referenced(p)
    check_state(p, pristine)
    shutil.rmtree(p)
    return last, found


def campaign(zygote: Zygote, pristine: dict[str, Any], tmp_path: Path, kills: int,
             seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    seen: dict[str, int] = {}
    for i in range(kills):
        point = None if i % (len(POINTS) + 1) == len(POINTS) else POINTS[i % (len(POINTS) + 1)]
        work = tmp_path / f"k{i}"
        work.mkdir()
        last, found = kill_once(zygote, pristine, work, point, rng,
                                "writer" if i % 2 == 0 else "compaction")
        seen[f"{last}:{found}"] = seen.get(f"{last}:{found}", 0) + 1
    return seen


def test_sigkill_at_each_crash_point(zygote: Zygote, pristine: dict[str, Any],
                                     tmp_path: Path) -> None:
    seen = campaign(zygote, pristine, tmp_path, kills=len(POINTS) + 1, seed=5)
    print(seen)
    reached = {k.split(":")[0] for k in seen}
    assert set(POINTS) - {"deleted"} <= reached | {"completed"}, seen
    assert {k.split(":")[1] for k in seen} == {"old", "new"}, seen


@pytest.mark.slow
def test_sigkill_campaign(zygote: Zygote, pristine: dict[str, Any], tmp_path: Path) -> None:
    seen = campaign(zygote, pristine, tmp_path, kills=40, seed=int(time.time()))
    print(seen)
    assert sum(seen.values()) == 40
    assert {k.split(":")[1] for k in seen} == {"old", "new"}, seen


def _hold_at(point: str) -> None:
    """This compacting process stops at ``point`` until it is killed (after the pause's
    marker is written)."""
    from lowdiff_store.compaction import single

    pause = single._pause

    def held(at: str) -> None:
        pause(at)
        if at == point:
            time.sleep(3600)

    single._pause = held


def _zygote() -> None:
    """Import everything once, then fork one ``lowdiff-store compact`` per request."""
    torch.set_num_threads(1)
    from lowdiff_store import cli
    from lowdiff_store.torch import materialize_base  # noqa: F401  (warm the import)

    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.AdamW([p])  # torch.optim's first optimizer imports dynamo (~1 s)
    p.grad = torch.ones(1)
    opt.step()
    print("ready", flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the compacting process
            try:
                fd = os.open(job["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 2)
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, 1)
                os.environ["LOWDIFF_COMPACT_PAUSE"] = job["pause"]
                if job.get("hold"):
                    _hold_at(job["hold"])
                try:
                    rc = cli.main(job["argv"])
                except SystemExit as e:
                    rc = e.code if isinstance(e.code, int) else 1
            finally:
                sys.stderr.flush()
            os._exit(rc or 0)
        print(pid, flush=True)
        _pid, status = os.waitpid(pid, 0)
        print(json.dumps({"pid": pid, "status": status}), flush=True)


if __name__ == "__main__" and sys.argv[1:] == ["zygote"]:
    _zygote()
