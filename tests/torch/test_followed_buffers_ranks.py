"""A buffer the model replaces by assignment is followed on every layout (review of
42f2e0c): the per-rank layouts (replicated, ZeRO; FSDP's ``select_fsdp`` the same way) log
a copy of the model's name -> tensor map (``Partition.model``), which the bases, digests
and delta captures read. ``FollowedBuffers.follow`` updated only the checkpointer's own
map, so on 2 ranks every base (and in delta mode every record) logged the buffer the
model had dropped: ``replay_state`` gave ``count == 0`` at a base step (silently).

Each case is trained by ``followed_worker.py`` on 2 ranks (gloo, CPU; one job runs the
cases in turn, each with objects of its own) and every step is replayed offline: the
buffers must be the bits training had (rank 0's, as replay merges them)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from lowdiff_store import LogReader
from lowdiff_store.torch import replay_state
from tests.helpers.dist import NEEDS_GLOO, check_exits, free_port, run_ranks

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

pytestmark = [NEEDS_GLOO, pytest.mark.consistent_bases]  # (tests/conftest.py)


CASES = ("replicated-grad", "zero-grad", "zero-delta")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case of ``CASES`` trained by one 2-rank job (module scope: the tests run on
    one xdist worker): ``ck/<case>`` and ``out/<case>/state-<rank>.json``."""
    d = tmp_path_factory.mktemp("followed")
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    exits = run_ranks(lambda r: [
        sys.executable, str(HERE / "followed_worker.py"), "--rank", str(r), "--port",
        str(port), "--dir", str(d / "ck"), "--out", str(d / "out"), "--cases",
        ",".join(CASES)], 2, env=env, timeout=120 * len(CASES))
    check_exits(exits, killed=None, peers="ok")
    return d


@pytest.mark.parametrize("case", CASES)
def test_replaced_buffers_are_followed_on_every_rank(trained: Path, case: str) -> None:
    ck, out = trained / "ck" / case, trained / "out" / case
    live = {int(s): v for s, v in json.loads((out / "state-0.json").read_text()).items()}
    assert live[6]["count"] == [6.0]
    for r in (0, 1):  # each shard's base of step 4 holds the buffers training held
        with LogReader(ck / f"rank-0000{r}") as lr:
            assert lr.bases == [0, 4]
            base = lr.base(4)
            assert base.tensor("count").reshape(-1).tolist() == live[4]["count"], r
            assert base.tensor("ema").reshape(-1).tolist() == live[4]["ema"], r
            base.close()
    with LogReader(ck / "rank-00000") as lr:  # it changes every step: logged every step
        assert all({"count", "ema"} <= set(lr.record(s).names) for s in range(1, 7))
    for step in range(1, 7):  # (a ZeRO delta log raised a bare AssertionError here)
        state, opt = replay_state(ck, step, with_optimizer=True)
        assert opt is not None
        named = sorted(n for g in opt["param_groups"] for n in g["param_names"])
        assert named == sorted(n for n, _t in _params(state)), named
        for name in ("count", "ema"):
            got = state[name].reshape(-1)
            want = torch.tensor(live[step][name], dtype=torch.float32)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (step, name)


def _params(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The trained tensors of the worker's model (its buffers are ``count`` and ``ema``)."""
    return [(n, t) for n, t in state.items() if n not in ("count", "ema")]
