"""One rank of the FSDP2 x DCP tests, run as a subprocess by ``test_ecosystem_fsdp.py``.

Phases (gloo, CPU, ``fsdp_worker.Net`` sharded with ``fully_shard`` on a 1-D mesh, or
wrapped in DDP with ``--layout ddp``):

- ``load``: fresh FSDP2 objects load the DCP checkpoint ``--dcp`` the way a DCP user does
  (``get_*_state_dict``, ``dcp.load``, ``set_*_state_dict``); rank 0 saves the gathered
  global state to ``OUT/loaded.pt``.
- ``start``: fresh FSDP2 objects and ``DiffCheckpointer(--dir, initial_base=--dcp)``: the
  checkpoint is loaded into the pieces and every rank's base 0 references it; rank 0 saves
  the gathered state after loading (``OUT/start.pt``) and after ``--steps`` steps
  (``OUT/trained.pt``); then other fresh objects ``restore`` the sharded log and rank 0
  saves their state (``OUT/restored.pt``).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from fsdp_worker import Net, gathered  # noqa: E402

from lowdiff_store.torch import DiffCheckpointer, restore  # noqa: E402


def build(seed: int, world: int, layout: str = "fsdp") -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Net()
    if layout == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.01)
    mesh = init_device_mesh("cpu", (world,))
    for m in (model.fc1, model.fc2):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def train(model: Any, opt: Any, start: int, stop: int, rank: int) -> None:
    for t in range(start, stop):
        g = torch.Generator().manual_seed(1000 * (t + 1) + rank)
        x, y = torch.randn(8, 12, generator=g), torch.randint(0, 7, (8,), generator=g)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def load_dcp(path: str, model: Any, opt: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])


def save(rank: int, state: dict[str, torch.Tensor], path: str) -> None:
    if rank == 0:
        torch.save({k: v.clone() for k, v in state.items()}, path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dcp", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layout", default="fsdp", help="fsdp or ddp (start phase)")
    ap.add_argument("--timeout", type=float, default=100.0)
    a = ap.parse_args()
    rank, world = a.rank, a.world
    faulthandler.dump_traceback_later(a.timeout, exit=True)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    dist.init_process_group("gloo")
    if a.phase == "load":
        model, opt = build(11, world)
        load_dcp(a.dcp, model, opt)
        save(rank, gathered(model, opt), os.path.join(a.out, "loaded.pt"))
    elif a.phase == "start":
        model, opt = build(5, world, a.layout)
        torch.manual_seed(100 + rank)
        ck = DiffCheckpointer(a.dir, model, opt, snapshot_every=100, initial_base=a.dcp)
        save(rank, gathered(model, opt), os.path.join(a.out, "start.pt"))
        train(model, opt, 0, a.steps, rank)
        ck.close()
        save(rank, gathered(model, opt), os.path.join(a.out, "trained.pt"))
        model2, opt2 = build(9, world, a.layout)
        restore(a.dir, model2, opt2)
        save(rank, gathered(model2, opt2), os.path.join(a.out, "restored.pt"))
    else:
        raise SystemExit(f"unknown phase {a.phase}")
    dist.barrier()
    dist.destroy_process_group()


def serve() -> None:
    """``dcp_worker.py --serve``: a fork server (``tests/helpers/fork_server.py``) that
    makes every phase's imports once, then forks a :func:`main` per run."""
    from tests.helpers.fork_server import serve_worker

    serve_worker(main, "torch.distributed.fsdp", "torch.distributed.checkpoint",
                 "lowdiff_store.torch.capture.checkpointer")


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        main()
