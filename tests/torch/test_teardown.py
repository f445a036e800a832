"""Process teardown with torch.distributed (gloo): the library must not keep process groups
alive past ``dist.destroy_process_group()``. A group still referenced at interpreter exit
is destroyed during interpreter teardown, with gloo's threads still running, which can
abort a rank (SIGABRT) after all its work succeeded; and a job that initializes again must
get a new coordination group, not the destroyed one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.dist import NEEDS_GLOO, check_exits, run_ranks
from tests.helpers.timing import scaled

ROOT = Path(__file__).resolve().parents[2]

pytestmark = NEEDS_GLOO

_ONE_RANK = textwrap.dedent("""
    import gc, sys, weakref
    import torch.distributed as dist
    from lowdiff_store.torch.distributed.checkpointer import coordination_group

    def init(n):
        dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}-{n}", rank=0,
                                world_size=1)

    init(0)
    g = coordination_group()
    assert coordination_group() is g            # made once per WORLD
    world, group = weakref.ref(dist.group.WORLD), weakref.ref(g)
    del g
    dist.destroy_process_group()
    gc.collect()
    assert group() is None, "the coordination group outlived destroy_process_group"
    assert world() is None, "the WORLD group outlived destroy_process_group"
    init(1)
    g = coordination_group()                    # a new group for the new WORLD
    out = [None]
    dist.all_gather_object(out, 7, group=g)
    assert out == [7], out
    dist.destroy_process_group()
    print("OK", flush=True)
""")


def test_the_coordination_group_dies_with_its_world(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", _ONE_RANK, str(tmp_path / "rendezvous")],
                       capture_output=True, text=True, timeout=scaled(120), env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["OK"], p.stdout


_RANK = textwrap.dedent("""
    import os, sys, time, torch
    import torch.distributed as dist
    from lowdiff_store.torch import DiffCheckpointer, restore
    rank, path, rdv, late = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] == "late"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with DiffCheckpointer(path, model, opt, snapshot_every=3) as ckpt:
        for t in range(5):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        if late and rank == 0:  # step 5 reaches rank 0's log only at its close
            time.sleep(2)
    res = restore(path, model, opt)
    assert res.step == 5, res.step
    dist.destroy_process_group()
    if rank == 1:
        time.sleep(0.5)   # rank 0 (and the store it serves) is gone first
    print("OK", rank, flush=True)
    # a normal interpreter exit, as a user's script ends: no os._exit
""")


@pytest.mark.parametrize("close", ["together", "late"])
def test_ranks_exit_cleanly_after_destroy_process_group(tmp_path: Path, close: str) -> None:
    """Two ranks checkpoint, restore, destroy the process group and end with a normal
    interpreter exit, rank 1 after rank 0 is gone: both exit 0 (no abort at teardown).
    ``late``: rank 0 closes its checkpointer (making step 5 durable) two seconds after
    rank 1 called ``restore``. Rank 1 read the shards before rank 0 got there, and then
    failed with "diff for step 5 is missing" once the ranks agreed on step 5 (seen 2 times
    in 8 under load with both closing together); ``restore`` now starts with a barrier."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    exits = run_ranks(lambda r: [sys.executable, "-c", _RANK, str(r), str(tmp_path / "ck"),
                                 str(tmp_path / "rendezvous"), close], 2, env=env,
                      timeout=120)
    check_exits(exits)
    for e in exits:
        assert f"OK {e.rank}" in e.output, str(e)


_KEPT = textwrap.dedent("""
    import gc, sys, weakref, torch
    import torch.distributed as dist
    from lowdiff_store.torch import DiffCheckpointer
    from lowdiff_store.torch.distributed.checkpointer import coordination_group
    rank, path, rdv = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)   # no DDP: torch's DDP itself keeps WORLD alive
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with DiffCheckpointer(path, model, opt, snapshot_every=2) as ckpt:
        for t in range(3):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    group = weakref.ref(coordination_group())
    dist.destroy_process_group()
    gc.collect()
    # ckpt (closed) is still referenced, as a script's `with ... as ckpt` keeps it
    assert ckpt is not None
    assert group() is None, "a closed checkpointer kept the coordination group alive"
    print("OK", rank, flush=True)
""")


def test_a_closed_checkpointer_keeps_no_process_group(tmp_path: Path) -> None:
    """A checkpointer the script still references after ``close()`` holds no process
    group: ``dist.destroy_process_group()`` frees the coordination group (and its gloo
    threads) at once. Before, the layout held it strongly, so the group outlived
    ``destroy_process_group`` and was destroyed in interpreter teardown with the
    checkpointer, where gloo aborted rank 0 (SIGABRT, "terminate called without an active
    exception") after all its work succeeded (``test_ranks_exit_cleanly...[together]``,
    once in a fresh-clone run beside a CPU hog)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    exits = run_ranks(lambda r: [sys.executable, "-c", _KEPT, str(r), str(tmp_path / "ck"),
                                 str(tmp_path / "rendezvous")], 2, env=env, timeout=120)
    check_exits(exits)
    for e in exits:
        assert f"OK {e.rank}" in e.output, str(e)
