"""One rank of ``test_followed_buffers_ranks.py``: a DDP model that replaces its buffers
by assignment every forward (``count = count + 1``), checkpointed on 2 ranks (gloo, CPU)
in a per-rank layout, for each case of ``--cases`` in turn (``replicated-grad``,
``zero-grad``, ``zero-delta``: the layout, replicated or ZeRO, and the ``mode``), each
with a model, optimizer and checkpointer of its own, as a job of its own would (one job
for them all: its imports cost most of a case's time). Each case writes its checkpoint in
``DIR/<case>`` and ``OUT/<case>/state-<rank>.json``: the buffers' values after each step
(float lists)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from lowdiff_store.torch import DiffCheckpointer
from tests.helpers.tiny import Counting


def run(case: str, root: str, out: str, steps: int, every: int) -> None:
    """One case (``<layout>-<mode>``) trained and checkpointed to ``steps``."""
    layout, mode = case.split("-")
    torch.manual_seed(0)
    model = Counting()
    ddp = DDP(model)
    opt: torch.optim.Optimizer
    if layout == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD,
                                      lr=0.1)
    else:
        assert layout == "replicated", case
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    states: dict[int, dict[str, list[float]]] = {}
    with DiffCheckpointer(os.path.join(root, case), ddp, opt, mode=mode,
                          snapshot_every=every) as ck:
        for step in range(1, steps + 1):
            g = torch.Generator().manual_seed(step)
            opt.zero_grad(set_to_none=True)
            ddp(torch.randn(4, 8, generator=g)).square().mean().backward()
            opt.step()
            states[step] = {n: b.detach().reshape(-1).tolist()
                            for n, b in model.named_buffers()}
        ck.flush()
    Path(out, case).mkdir(parents=True, exist_ok=True)
    Path(out, case, f"state-{dist.get_rank()}.json").write_text(json.dumps(states))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--every", type=int, default=4)
    a = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    dist.init_process_group("gloo", rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        for case in a.cases.split(","):
            run(case, a.dir, a.out, a.steps, a.every)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
