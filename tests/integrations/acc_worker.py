"""One plain accelerate loop with per-step checkpoints (the glue of
``examples/accelerate_loop.py``: ``restore(..., missing_ok=True)`` then a
``DiffCheckpointer`` on the prepared objects), in its own process.

``python acc_worker.py OUT CKPT [KILL_AT]``: a tiny MLP (dropout on) trained with AdamW,
gradient clipping and a per-step LR scheduler, all prepared by ``Accelerator(cpu=True)``;
bases streamed in 3 slices (``base_slices=3``, ``snapshot_every=4``: the slices of base 4
are taken after steps 2, 3 and 4). Writes to OUT (.npz) the final weights, optimizer
state, learning rate, the step resumed from and the restore's ``base_slices``; per-step
losses are also appended to OUT.losses as they happen (so a killed run leaves them). CKPT
"-" trains without checkpoints. With KILL_AT the process SIGKILLs itself inside step
KILL_AT+1 (after its backward), once step KILL_AT-1 is durable and a streamed base is
complete (30 s at most), so the restore starts from a streamed base.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator

from lowdiff_store.torch import DiffCheckpointer, restore
from tests.helpers.durable import await_streamed_base

STEPS = 14
#: the checkpointer's options
OPTIONS: dict[str, Any] = {"snapshot_every": 4, "base_slices": 3}


def model() -> torch.nn.Module:
    """Four layers of near equal size: 3 slices of the parameters, not fewer (one
    parameter larger than a third of the rest would leave a slice empty)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Dropout(0.2),
                               torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 1))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of ``step``: the loop's own position (it starts at the restored step)."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
    return x, x.sum(1, keepdim=True).sin()


def run(out: str, ckpt: str, kill_at: int | None = None) -> None:
    torch.set_num_threads(1)
    acc = Accelerator(cpu=True)
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    net, opt, sched = acc.prepare(net, opt, sched)
    torch.manual_seed(5)  # dropout draws from the global generator (restored by restore)
    res = None if ckpt == "-" else restore(ckpt, net, opt, scheduler=sched, missing_ok=True)
    ck = None if ckpt == "-" else DiffCheckpointer(ckpt, net, opt, scheduler=sched, **OPTIONS)
    for step in range(0 if res is None else res.step, STEPS):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        acc.backward(loss)
        acc.clip_grad_norm_(net.parameters(), 0.5)
        if step == kill_at:
            await_streamed_base(ckpt, kill_at - 1)
            os.kill(os.getpid(), signal.SIGKILL)
        opt.step()
        sched.step()
        with open(out + ".losses", "a") as fh:
            fh.write(json.dumps([step + 1, float(loss.detach())]) + "\n")
    if ck is not None:
        ck.close()
    save(out, net, opt, res)


def save(out: str, net: torch.nn.Module, opt: Any, res: Any) -> None:
    arrays = {f"model/{k}": v.detach().numpy() for k, v in net.state_dict().items()}
    inner = opt.optimizer
    for i, st in enumerate(inner.state.values()):
        for k, v in st.items():
            arrays[f"opt/{i}/{k}"] = v.detach().numpy()
    arrays["lr"] = np.array([g["lr"] for g in inner.param_groups])
    arrays["resumed"] = np.array(-1 if res is None else res.step)
    arrays["base_slices"] = np.array([] if res is None else res.base_slices, dtype=np.int64)
    np.savez(out, **arrays)


if __name__ == "__main__":
    a = sys.argv[1:]
    run(a[0], a[1], int(a[2]) if len(a) > 2 else None)
