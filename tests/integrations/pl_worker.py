"""One Lightning ``fit`` with ``LowDiffCallback`` (or without), in its own process.

``python pl_worker.py OUT CKPT LOADER [KILL_AT]``: a tiny module (dropout on) trained with
Adam + a step LR scheduler; LOADER is ``stateful`` (torchdata's StatefulDataLoader),
``plain`` (torch DataLoader, shuffled) or ``streamed`` (``stateful`` with streamed bases,
issue 50: ``base_slices=2``, ``snapshot_every=3``). Writes to OUT (.npz) the final weights,
optimizer state and per-step losses; losses are also appended to OUT.losses as they happen
(so a killed run leaves them). With KILL_AT the process SIGKILLs itself inside step
KILL_AT+1 (``streamed``: once step KILL_AT-1 is durable and a streamed base complete, so
that the resume restores from one).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import warnings
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from lowdiff_store.integrations.lightning import LowDiffCallback
from lowdiff_store.log.latest import latest_step
from tests.helpers.durable import await_streamed_base
from tests.helpers.timing import scaled

#: the callback's options, per LOADER
OPTIONS: dict[str, dict[str, Any]] = {
    "stateful": {"snapshot_every": 4}, "plain": {"snapshot_every": 4},
    # bases 3, 6, 9, 12, each in 2 slices (base 3's taken after steps 2 and 3)
    "streamed": {"snapshot_every": 3, "base_slices": 2},
}


class Net(pl.LightningModule):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                                       torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Record(pl.Callback):  # type: ignore[misc]
    def __init__(self, out: str, kill_at: int | None, streamed: str | None = None) -> None:
        self.out, self.kill_at, self.losses = out, kill_at, []
        self.streamed = streamed  # the log in which a kill waits for a streamed base

    def on_train_batch_end(self, trainer: Any, m: Any, outputs: Any, b: Any, i: int) -> None:
        rec = [trainer.global_step, float(outputs["loss"])]
        self.losses.append(rec)
        with open(self.out + ".losses", "a") as fh:
            fh.write(json.dumps(rec) + "\n")

    def on_before_optimizer_step(self, trainer: Any, m: Any, opt: Any) -> None:
        if trainer.global_step == self.kill_at:
            _await_durable(self.kill_at - 1)
            if self.streamed:
                await_streamed_base(self.streamed, trainer.global_step - 1)
            os.kill(os.getpid(), signal.SIGKILL)


def _hold_from(step: int) -> None:
    """With LOWDIFF_TEST_KILL_DURABLE, records of ``step`` and later are never written (the
    writer thread holds them until the kill): the durable step at the kill is exactly
    ``step - 1``, however fast the writer runs (a kill in step 11 found step 10 durable
    once on a loaded machine, so the boundary case went untested)."""
    if not os.environ.get("LOWDIFF_TEST_KILL_DURABLE"):
        return
    from lowdiff_store.log.writer import LogWriter

    orig = LogWriter._write

    def held(self: Any, records: Any, deferred: Any) -> None:
        if any(r.step >= step for r in [*records, *([deferred] if deferred else [])]):
            time.sleep(3600)  # killed meanwhile
        orig(self, records, deferred)

    LogWriter._write = held  # type: ignore[method-assign]


def _await_durable(step: int) -> None:
    """With LOWDIFF_TEST_KILL_DURABLE=CKPT, wait until ``step`` is durable in CKPT before
    the kill: a test of one exact durable step must not depend on how fast the background
    writer runs on a loaded machine. A hang bound (``scaled(120)`` s), not a duration: past
    it the process exits 3 (the test fails naming it) instead of being killed."""
    ckpt = os.environ.get("LOWDIFF_TEST_KILL_DURABLE")
    end = time.monotonic() + scaled(120)
    while ckpt:
        durable = latest_step(ckpt)
        if durable is not None and durable >= step:
            return
        if time.monotonic() > end:
            print(f"step {step} never became durable ({durable})", file=sys.stderr,
                  flush=True)
            os._exit(3)
        time.sleep(0.01)


def loader(kind: str) -> Any:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(36, 8, generator=g)
    data = list(zip(x, x.sum(1, keepdim=True).sin(), strict=True))
    cls = torch.utils.data.DataLoader if kind == "plain" else StatefulDataLoader
    return cls(data, batch_size=4, shuffle=True)


def run(out: str, ckpt: str, kind: str, kill_at: int | None = None) -> None:
    torch.set_num_threads(1)
    rec = Record(out, kill_at, ckpt if kind == "streamed" else None)
    if kill_at is not None:
        _hold_from(kill_at)
    cbs: list[Any] = [rec]
    if ckpt != "-":
        cbs.insert(0, LowDiffCallback(ckpt, **OPTIONS[kind]))
    trainer = pl.Trainer(max_steps=14, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=cbs,
                         default_root_dir=os.path.dirname(out))
    model = Net()
    trainer.fit(model, loader(kind))
    opt = trainer.optimizers[0]
    arrays = {f"model/{k}": v.detach().numpy() for k, v in model.state_dict().items()}
    for i, st in enumerate(opt.state.values()):
        for k, v in st.items():
            arrays[f"opt/{i}/{k}"] = v.detach().numpy()
    arrays["global_step"] = np.array(trainer.global_step)
    arrays["lr"] = np.array([g["lr"] for g in opt.param_groups])
    cb = cbs[0] if ckpt != "-" else None
    arrays["resumed"] = np.array(-1 if cb is None or cb.resumed_step is None
                                 else cb.resumed_step)
    arrays["exact"] = np.array(True if cb is None else cb.exact)
    np.savez(out, **arrays)


if __name__ == "__main__":
    warnings.filterwarnings("ignore")  # Lightning's advice on workers, logging, resume
    a = sys.argv[1:]
    run(a[0], a[1], a[2], int(a[3]) if len(a) > 3 else None)
