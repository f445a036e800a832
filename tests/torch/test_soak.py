"""Soak: training killed with SIGKILL at random moments, again and again, with compactions
running beside the writer (and killed too), restores and ``verify`` between the crashes.
Every outcome is counted; nothing acknowledged durable may be lost, and every restore must
be the uninterrupted run's state at that step, bit for bit.

Each child is killed after a random number of its *steps* (not seconds), so a busy machine
slows a cycle down but never empties it. CI runs a smoke that goes on until it has done
what it checks (kills, a completed compaction beside a writer, restores, a run finished to
the end), bounded by a generous deadline; ``-m slow`` runs ``LOWDIFF_SOAK_SECONDS`` (default
1800 s: the 30 minutes of issue 16) and as long as that takes."""

from __future__ import annotations

import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from _cases import assert_same, build, reference, snapshot

from lowdiff_store import latest_step
from lowdiff_store.torch import restore
from lowdiff_store.verify import verify_log
from tests.helpers.timing import scaled

HERE = os.path.dirname(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
CASE = "adamw"
STEPS = 40

_TRAINER = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {here!r})
    from _cases import build, train_step
    from lowdiff_store.torch import DiffCheckpointer, restore
    torch.set_num_threads(1)
    path, stop, process = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "process"
    o = build({case!r})
    res = restore(path, o.model, o.optimizer, scheduler=o.scheduler, missing_ok=True)
    start = 0 if res is None else res.step
    ckpt = DiffCheckpointer(path, o.model, o.optimizer, scheduler=o.scheduler,
                            snapshot_every=5, digest_every=1, segment_bytes=1 << 16,
                            writer_process=process)
    for t in range(start + 1, stop + 1):
        train_step({case!r}, o, t, ckpt)
        print("DURABLE", ckpt.durable_step, flush=True)
    ckpt.close()
    print("DURABLE", ckpt.durable_step, flush=True)
    print("DONE", flush=True)
""")


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


class _Trainer:
    """The training child of one cycle; a thread hands its stdout lines to :meth:`line`."""

    def __init__(self, path: Path, writer: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _TRAINER.format(here=HERE, case=CASE), str(path),
             str(STEPS), writer], stdout=subprocess.PIPE, text=True, env=_env())
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)   # end of output: the child exited (or was killed)

    def line(self) -> str | None:
        """The child's next line, None at its end; fails if nothing comes for a long
        while (a hung child, not a slow one)."""
        try:
            return self.lines.get(timeout=scaled(300))
        except queue.Empty:
            self.proc.kill()
            raise AssertionError("the training child printed nothing for "
                                 f"{scaled(300):.0f} s") from None

    def close(self) -> None:
        self.proc.wait(timeout=scaled(60))
        self._reader.join(timeout=scaled(60))
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def _compactor(path: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "lowdiff_store", "compact", str(path),
                             "--keep-bases", "2", "--json"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=_env())


def _end_compaction(compactor: subprocess.Popen[str], rng: random.Random,
                    counts: dict[str, int]) -> None:
    """SIGKILL the compaction (half the time, once one has completed) or let it finish;
    count the outcome. A refusal is one line, never an internal error."""
    if compactor.poll() is None and counts["compactions"] >= 1 and rng.random() < 0.5:
        compactor.send_signal(signal.SIGKILL)
    _out, err = compactor.communicate(timeout=scaled(300))
    assert compactor.returncode in (0, -signal.SIGKILL, 1), err
    if compactor.returncode == 0:
        counts["compactions"] += 1
    elif compactor.returncode == 1:  # one line, a known refusal (a step not durable)
        assert "internal error" not in err, err
        assert err.count("\n") <= 1, err
        counts["compactions_refused"] += 1
    else:
        counts["compactions_killed"] += 1


def _cycle(path: Path, rng: random.Random, counts: dict[str, int], acked: int,
           finish: bool, writer: str) -> tuple[int, bool]:
    """One training child (its checkpointer's writer: ``"thread"`` or ``"process"``),
    SIGKILLed after a random number of its steps (or run to the end with ``finish``), a
    compaction beside it once the log has a durable base. Returns the newest step the
    child reported durable (at least ``acked``) and whether it printed DONE."""
    counts["cycles"] += 1
    kill_after = None if finish else rng.randint(1, 15)
    compact = acked >= 5 and (counts["compactions"] == 0 or rng.random() < 0.3)
    child, compactor, steps, done = _Trainer(path, writer), None, 0, False
    while (line := child.line()) is not None:
        if not line.endswith("\n"):
            continue  # the last line of a killed child, cut inside its print
        w = line.split()
        done = done or w[:1] == ["DONE"]
        if w[:1] != ["DURABLE"] or len(w) != 2:
            continue
        steps += 1
        if w[1] not in ("-1", "None"):
            acked = max(acked, int(w[1]))  # the child was told this step is durable
        if compact and compactor is None:
            compactor = _compactor(path)   # beside the writer, from its first step on
        if kill_after is not None and steps >= kill_after:
            time.sleep(rng.uniform(0.0, 0.05))   # anywhere inside the next step
            child.proc.send_signal(signal.SIGKILL)
            counts["kills"] += 1
            kill_after = None   # lines already printed are still read (and counted)
    child.close()
    if compactor is not None:
        _end_compaction(compactor, rng, counts)
    return acked, done


def _check(path: Path, ref: dict[int, Any], acked: int, counts: dict[str, int]) -> int | None:
    """verify, then restore the newest step and compare it with the uninterrupted run."""
    rep = verify_log(str(path)) if path.exists() else None
    if rep is not None:
        counts["verifies"] += 1
        assert rep.ok, [str(p) for p in rep.problems]
    latest = latest_step(path)
    assert (latest if latest is not None else -1) >= acked, (latest, acked, counts)
    if latest is not None:
        o = build(CASE)
        res = restore(path, o.model, o.optimizer, scheduler=o.scheduler)
        assert res is not None
        assert res.step == latest
        assert_same(snapshot(o), ref[latest], f"step {latest}")
        counts["restores"] += 1
    return latest


def _soak(path: Path, seconds: float, seed: int, want: dict[str, int],
          writer: str = "thread") -> dict[str, int]:
    """Cycles of kill, compact, verify and restore until ``seconds`` have passed *and*
    every count in ``want`` is reached; fails if that takes longer than a generous
    deadline. The counts, not the clock, are what the test asserts. ``writer``: the
    training children's (``"process"``: a writer process, which outlives a killed child
    for the moment it takes to make what it was handed durable; the restore waits)."""
    rng = random.Random(seed)
    _o, ref = reference(CASE, STEPS, at=tuple(range(1, STEPS + 1)))
    ref[0] = snapshot(build(CASE))
    counts = dict.fromkeys(("cycles", "kills", "finished", "compactions",
                            "compactions_killed", "compactions_refused", "restores",
                            "verifies", "fresh_runs"), 0)
    start = time.monotonic()
    deadline = start + seconds + scaled(900)
    acked = -1

    def met() -> bool:
        return all(counts[k] >= n for k, n in want.items())

    while time.monotonic() < start + seconds or not met():
        assert time.monotonic() < deadline, ("the soak did not reach", want, counts)
        # run to the end now and then, and as soon as only a finished run is missing
        finish = rng.random() < 0.15 or all(counts[k] >= n for k, n in want.items()
                                            if k != "finished")
        acked, done = _cycle(path, rng, counts, acked, finish, writer)
        latest = _check(path, ref, acked, counts)
        if done:
            counts["finished"] += 1
            assert latest == STEPS
            shutil.rmtree(path)
            acked = -1
            counts["fresh_runs"] += 1
    return counts


#: what every soak must have done, however busy the machine (the smoke runs until then)
WANT = {"cycles": 3, "kills": 2, "finished": 1, "compactions": 1, "restores": 2}


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_soak_smoke(tmp_path: Path, writer: str) -> None:
    counts = _soak(tmp_path / "log", seconds=0.0, seed=20261123, want=WANT, writer=writer)
    print("soak smoke:", counts)
    assert all(counts[k] >= n for k, n in WANT.items()), counts
    assert counts["verifies"] >= counts["restores"], counts


@pytest.mark.slow
@pytest.mark.parametrize("writer", ["thread", "process"])
def test_soak(tmp_path: Path, writer: str) -> None:
    seconds = float(os.environ.get("LOWDIFF_SOAK_SECONDS", "1800"))
    counts = _soak(tmp_path / "log", seconds=seconds, seed=int(time.time()), want=WANT,
                   writer=writer)
    print("soak:", counts)
    assert all(counts[k] >= n for k, n in WANT.items()), counts
    assert counts["restores"] >= counts["cycles"] // 2, counts
