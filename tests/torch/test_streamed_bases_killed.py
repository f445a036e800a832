"""Streamed bases under SIGKILL (issue 50, red team): a trainer killed after a slice is
durable and before its base is complete, and between a base's last slice and the manifest
commit that names it. The restore uses the previous complete base and is exact; the next
checkpointer removes the unnamed slices and training goes on bitwise."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
from _cases import assert_same, build, ckpt_kwargs, reference, run, snapshot

from lowdiff_store.log import LogReader
from lowdiff_store.torch import DiffCheckpointer, restore
from tests.helpers.timing import scaled

HERE = os.path.dirname(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
KW = {"snapshot_every": 5, "base_slices": 3}

_CHILD = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {here!r})
    from _cases import build, ckpt_kwargs, train_step
    from lowdiff_store.torch import DiffCheckpointer
    torch.set_num_threads(1)
    case, path, kw = sys.argv[1], sys.argv[2], eval(sys.argv[3])
    o = build(case)
    ckpt = DiffCheckpointer(path, o.model, o.optimizer, scheduler=o.scheduler,
                            scaler=o.scaler, compressor=o.compressor,
                            extra_state=lambda: dict(o.extra), **{{**ckpt_kwargs(case), **kw}})
    for t in range(1, 31):
        train_step(case, o, t, ckpt)
    ckpt.close()
""")


def _kill_at(path: Any, case: str, point: str, kw: dict[str, Any]) -> None:
    """Run the trainer until the writer reports ``point`` (``lowdiff-slice-point ...``),
    then SIGKILL it there (the writer sleeps at the point)."""
    env = dict(os.environ, PYTHONPATH=ROOT, LOWDIFF_SLICE_PAUSE=f"60@{point.split()[1]}")
    child = subprocess.Popen([sys.executable, "-c", _CHILD.format(here=HERE), case, str(path),
                              repr(kw)], stderr=subprocess.PIPE, env=env, text=True)
    try:
        assert child.stderr is not None
        deadline = time.monotonic() + scaled(120)
        seen = []
        while time.monotonic() < deadline:
            line = child.stderr.readline()
            if not line and child.poll() is not None:
                break
            if line.startswith("lowdiff-slice-point"):
                seen.append(line.split()[1:])
                if line.split()[1:] == point.split():
                    break
        assert point.split() in seen, seen
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        if child.stderr is not None:
            child.stderr.close()


def _slices(path: Any) -> list[int]:
    return sorted(int(n[6:22]) for n in os.listdir(path) if n.startswith("slice-"))


@pytest.mark.parametrize(("point", "on_disk"), [
    ("slice-written 9", [3, 4, 5, 8, 9]),          # mid-base: two of three slices durable
    ("before-commit 10", [3, 4, 5, 8, 9, 10]),     # every slice durable, not yet named
])
def test_killed_before_a_streamed_base_completes(point: str, on_disk: list[int],
                                                  tmp_path: Any) -> None:
    case = "adamw"
    _, ref = reference(case, 30, at=tuple(range(1, 31)))
    path = tmp_path / "log"
    _kill_at(path, case, point, KW)
    assert _slices(path) == on_disk
    with LogReader(path) as r:
        assert r.streamed == [(5, (3, 4, 5))]  # the base of step 10 is not named
        durable = r.durable_step
    assert durable is not None
    assert durable >= 8  # (a CPU model waits at step 10 for the slice of step 9)
    o = build(case)
    res = restore(path, o.model, o.optimizer, scheduler=o.scheduler)
    assert (res.step, res.base_step, res.base_slices, res.exact) == (durable, 5, [3, 4, 5],
                                                                      True)
    assert_same(snapshot(o), ref[durable])
    # the next checkpointer removes the unnamed slices and goes on, bitwise
    with DiffCheckpointer(path, o.model, o.optimizer, scheduler=o.scheduler,
                          extra_state=lambda: dict(o.extra),
                          **{**ckpt_kwargs(case), **KW}) as ckpt:
        assert _slices(path) == [3, 4, 5]
        run(case, o, durable, 30, ckpt)
    assert_same(snapshot(o), ref[30])
    with LogReader(path) as r:
        # a base whose slices had begun before the resumed step starts at it and
        # completes up to two steps late; the later ones are on their steps
        done = [c for c, _s in r.streamed]
        first = 5 * (durable // 5 + 1)
        late = durable + 3 if first - 2 <= durable else first
        assert done == [5, late, *range(first + 5, 31, 5)], (durable, done)
        assert all(s > durable for _c, steps in r.streamed[1:] for s in steps)
    o2 = build(case)
    res = restore(path, o2.model, o2.optimizer, scheduler=o2.scheduler)
    assert (res.step, res.base_step) == (30, 30)
    assert_same(snapshot(o2), ref[30])
