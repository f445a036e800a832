"""Lightning: ``L.Trainer(..., callbacks=[LowDiffCallback("ckpt/")])``.

A callback rather than a ``CheckpointIO`` plugin: a ``CheckpointIO`` only sees whole
checkpoint dicts when Lightning decides to save one (every N steps, at epoch end), and
Lightning only loads one when ``fit(ckpt_path=...)`` is passed. The callback instead sees
every optimizer step (through the optimizer hooks of a
:class:`~lowdiff_store.torch.DiffCheckpointer`; Lightning's ``step(closure)`` is captured
after the closure returns) and resumes by itself when the script is run again.

Each record holds, beside the model, optimizer, LR scheduler and grad scaler, the fit
loop's state as Lightning's own ``ModelCheckpoint`` saves it after a training batch
(progress counters and, for a ``StatefulDataLoader``, the data loader position) and the
Python / NumPy RNG states. On resume the log is replayed into the objects at
``on_fit_start`` and the loop state loaded where Lightning loads a checkpoint's.

Exact (bitwise) continuation needs the data position to be restorable: a resume at an
epoch boundary always is; a resume in the middle of an epoch is exact with a data loader
that has ``state_dict`` / ``load_state_dict`` (torchdata's ``StatefulDataLoader``), and
otherwise Lightning restarts the epoch's data from its beginning: :attr:`exact` is then
False and :attr:`notes` says why (Lightning also warns). See ``docs/integrations.md``.
"""

from __future__ import annotations

import math
import os
from typing import Any

from lightning.pytorch.callbacks import Callback

from ..errors import ConfigError, Reason
from ..log.latest import latest_step
from ..torch import DiffCheckpointer, LateExtra, restore, unwrap_optimizer
from ..torch.capture.stateful import extra_at
from ..torch.core.schema import rng_states, set_rng_states
from ._common import RESUME_MODES, callback_args, refuse_existing
from ._rng import np_state, py_state, set_np_state, set_py_state


class LowDiffCallback(Callback):  # type: ignore[misc]
    """Per-step checkpoints of a Lightning ``fit`` into the log at ``path``, and automatic
    resume from the newest durable step when the same script runs again.

    Args:
        path: the log directory.
        resume: ``"auto"`` (default) continues an existing log; ``"never"`` refuses one
            (``ConfigError(history_conflict)``).
        **options: :class:`~lowdiff_store.torch.DiffCheckpointer` options (``mode``,
            ``snapshot_every``, ``batch``...).

    One optimizer (automatic optimization); the checkpointer is closed when ``fit`` ends.
    """

    def __init__(self, path: str | os.PathLike[str], *, resume: str = "auto",
                 **options: Any) -> None:
        self.path, self.resume, self.options = callback_args(path, resume, options)
        self.checkpointer: DiffCheckpointer | None = None
        #: the step the last ``fit`` resumed from (None: started fresh)
        self.resumed_step: int | None = None
        #: False when the resumed run cannot continue bitwise (see :attr:`notes`)
        self.exact = True
        self.notes: list[str] = []
        self._snap: dict[str, Any] = {}
        self._rng: dict[str, Any] | None = None

    def _snapshot(self, trainer: Any) -> None:
        self._snap = {"loops": {"fit_loop": trainer.fit_loop.state_dict()},
                      "py_rng": py_state(), "np_rng": np_state()}

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Replay the log into the module, optimizer and scheduler (when resuming), load
        the loop state, then start the checkpointer."""
        self.resumed_step, self.exact, self.notes, self._rng = None, True, [], None
        if len(trainer.optimizers) != 1:
            raise ConfigError(f"LowDiffCallback supports one optimizer, the module has "
                              f"{len(trainer.optimizers)}", reason=Reason.NOT_ALLOWED)
        opt = unwrap_optimizer(trainer.optimizers[0])
        scheds = trainer.lr_scheduler_configs
        if len(scheds) > 1:
            raise ConfigError("LowDiffCallback supports one LR scheduler",
                              reason=Reason.NOT_ALLOWED)
        sched = scheds[0].scheduler if scheds else None
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        refuse_existing(self.path, self.resume)
        step = latest_step(self.path)
        if step is not None:
            extra = extra_at(self.path, step)
            if not isinstance(extra, dict) or "loops" not in extra:
                raise ConfigError(f"{self.path} was not written by this callback (no loop "
                                  f"state at step {step})", reason=Reason.STATE_MISMATCH,
                                  path=self.path)
            restore(self.path, pl_module, opt, scheduler=sched, scaler=scaler, step=step)
            set_py_state(extra["py_rng"])
            set_np_state(extra["np_rng"])
            trainer.fit_loop.load_state_dict(extra["loops"]["fit_loop"])
            if step > 0:  # the RNG after a training step: put back where the next batch
                self._rng = rng_states()  # begins (see on_train_epoch_start)
            # (step 0: base 0 holds the RNG at fit start, which restore() just put back;
            # put back again at the epoch's start it would undo what Lightning's start-up
            # drew from it, and the resumed fit would not be the uninterrupted one)
            self.resumed_step = step
        self._snapshot(trainer)
        self.checkpointer = DiffCheckpointer(
            self.path, pl_module, opt, scheduler=sched, scaler=scaler,
            extra_state=LateExtra(lambda: self._snap), **self.options)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Note a resume that cannot continue bitwise (mid-epoch, data not restorable)."""
        if self.resumed_step is None:
            return
        dl = trainer.train_dataloader
        resumable = all(hasattr(d, "state_dict") and hasattr(d, "load_state_dict")
                        for d in _loaders(dl))
        per_epoch = math.ceil(trainer.num_training_batches / trainer.accumulate_grad_batches) \
            if math.isfinite(trainer.num_training_batches) else 0
        if not resumable and (per_epoch == 0 or self.resumed_step % per_epoch):
            self.exact = False
            self.notes.append(
                f"resumed at step {self.resumed_step}, inside an epoch, with a data loader "
                f"that has no state_dict(): Lightning restarts the epoch's data from its "
                f"beginning, so the run is not bitwise the uninterrupted one (use "
                f"torchdata's StatefulDataLoader)")

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """After a resume, the RNG state of the log, put back before the epoch's data
        iterator is made (an epoch boundary: its sampler draws the new order from the
        global generator, which Lightning's start-up may have used since the restore)."""
        if self._rng is not None:
            set_rng_states(self._rng)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        """After a resume inside an epoch, the RNG state of the log, put back after the
        data loader was rebuilt (its iterator draws from the global generator)."""
        if self._rng is not None:
            if batch_idx > 0:
                set_rng_states(self._rng)
            self._rng = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """The loop state after this batch (what ModelCheckpoint would save here)."""
        self._snapshot(trainer)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        """Close the checkpointer: every step is durable when ``fit`` returns."""
        self._close()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Close the checkpointer if ``fit`` stopped early."""
        self._close()

    def _close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()
            self.checkpointer = None


def _loaders(dl: Any) -> list[Any]:
    if dl is None:
        return []
    if isinstance(dl, (list, tuple)):
        return list(dl)
    if isinstance(dl, dict):
        return list(dl.values())
    return [dl]


__all__ = ["RESUME_MODES", "LowDiffCallback"]
