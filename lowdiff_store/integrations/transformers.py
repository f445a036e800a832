"""Hugging Face ``Trainer``: ``Trainer(..., callbacks=[LowDiffCallback("ckpt/")])``.

Every optimizer step is checkpointed by a :class:`~lowdiff_store.torch.DiffCheckpointer`
on the trainer's model, optimizer (accelerate's wrapper removed), LR scheduler and grad
scaler. Beside them each record holds the trainer's own bookkeeping after the step (the
``TrainerState`` a Trainer checkpoint would save as ``trainer_state.json``, the running
loss not yet logged, the FLOs not yet stored, the Python and NumPy RNG states).

Resuming goes through the Trainer's own resume path, so the data position is the one
``train(resume_from_checkpoint=...)`` would give: when the log holds a durable step,
``trainer.train()`` runs as ``train(resume_from_checkpoint=DIR)`` with ``DIR`` a temporary
folder holding only that ``trainer_state.json`` (the Trainer then skips the epochs and
batches already trained); model, optimizer, scheduler and scaler are replayed from the log
at ``on_train_begin``; the RNG states are put back where the Trainer puts back its
``rng_state.pth`` (after fast-forwarding the data loader). See ``docs/integrations.md``.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import sys
import tempfile
from typing import Any

import msgpack
import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ..errors import ConfigError, Reason
from ..log.latest import latest_step
from ..torch import DiffCheckpointer, LateExtra, restore, unwrap_optimizer
from ..torch.capture.stateful import extra_at
from ..torch.core.schema import rng_states, set_rng_states
from ..torch.core.typed_msgpack import pack, unpack
from ._common import RESUME_MODES, callback_args, refuse_existing
from ._rng import np_state, py_state, set_np_state, set_py_state


def _find_trainer(cb: object) -> Any:
    """The Trainer whose callback handler holds ``cb`` (its method is on the call stack:
    callbacks receive no reference to the trainer)."""
    f = sys._getframe(1)
    while f is not None:
        obj = f.f_locals.get("self")
        handler = getattr(obj, "callback_handler", None)
        if handler is not None and any(c is cb for c in getattr(handler, "callbacks", ())):
            return obj
        f = f.f_back  # type: ignore[assignment]
    return None


class LowDiffCallback(TrainerCallback):  # type: ignore[misc]
    """Per-step checkpoints of a Hugging Face ``Trainer`` run into the log at ``path``,
    and automatic bitwise resume when the same script runs again after a crash.

    Args:
        path: the log directory.
        resume: ``"auto"`` (default): an existing log is continued from its newest durable
            step; ``"never"``: an existing log raises ``ConfigError(history_conflict)``.
        **options: :class:`~lowdiff_store.torch.DiffCheckpointer` options (``mode``,
            ``snapshot_every``, ``batch``, ``digest_every``, writer options...).

    Pass it to the constructor (``Trainer(..., callbacks=[LowDiffCallback(path)])``): it
    takes over ``trainer.train()`` then. The checkpointer is closed (every step durable)
    at the end of training; :attr:`checkpointer` is the live one during training.
    """

    def __init__(self, path: str | os.PathLike[str], *, resume: str = "auto",
                 **options: Any) -> None:
        self.path, self.resume, self.options = callback_args(path, resume, options)
        self.checkpointer: DiffCheckpointer | None = None
        #: the step the last ``train()`` resumed from (None: started fresh)
        self.resumed_step: int | None = None
        self._trainer: Any = None
        self._resume: tuple[int, dict[str, Any]] | None = None
        self._rng: dict[str, Any] = {}
        self._snap: dict[str, Any] = {}
        self._log_blob = b""
        self._log_n = 0

    # ------------------------------------------------------------------ binding

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Bind to the trainer being built: ``train()`` now resumes from the log."""
        trainer = _find_trainer(self)
        if trainer is None or trainer is self._trainer:
            return
        self._trainer = trainer
        loop = trainer._inner_training_loop

        def inner_training_loop(*a: Any, **kw: Any) -> Any:
            return self._train(loop, *a, **kw)

        trainer._inner_training_loop = inner_training_loop

    def _train(self, loop: Any, batch_size: Any = None, args: Any = None,
               resume_from_checkpoint: str | None = None, trial: Any = None,
               ignore_keys_for_eval: Any = None) -> Any:
        trainer = self._trainer
        self._resume = None
        self.resumed_step = None
        kw = {"batch_size": batch_size, "args": args, "trial": trial,
              "ignore_keys_for_eval": ignore_keys_for_eval}
        refuse_existing(self.path, self.resume)
        step = None if resume_from_checkpoint is not None else latest_step(self.path)
        self._log_blob, self._log_n = b"", 0
        if step is None:
            return loop(resume_from_checkpoint=resume_from_checkpoint, **kw)
        extra = extra_at(self.path, step)
        if not isinstance(extra, dict) or "trainer_state" not in extra:
            raise ConfigError(f"{self.path} was not written by this callback (no trainer "
                              f"state at step {step})", reason=Reason.STATE_MISMATCH,
                              path=self.path)
        self._resume = (step, extra)
        blob = extra["trainer_state"]["log_history"]
        history = [unpack(e) for e in msgpack.Unpacker(io.BytesIO(blob), raw=False)]
        self._log_blob, self._log_n = blob, len(history)
        tmp = tempfile.mkdtemp(prefix="lowdiff-resume-")
        try:
            with open(os.path.join(tmp, "trainer_state.json"), "w") as fh:
                json.dump({**extra["trainer_state"], "log_history": history}, fh)
            trainer._load_rng_state = self._load_rng_state
            return loop(resume_from_checkpoint=tmp, **kw)
        finally:
            trainer.__dict__.pop("_load_rng_state", None)
            shutil.rmtree(tmp, ignore_errors=True)

    # ------------------------------------------------------------------ state

    def _snapshot(self, *_: Any, **__: Any) -> None:
        """The trainer's bookkeeping now (after a step and its logging); recorded with the
        step when its record is completed."""
        tr = self._trainer
        st = tr.state
        d = {f.name: getattr(st, f.name) for f in dataclasses.fields(st)}
        d["log_history"] = self._history(st.log_history)
        cbs: dict[str, Any] = {}
        for cb in [*tr.callback_handler.callbacks, tr.control]:
            if isinstance(cb, ExportableState):
                name = type(cb).__name__
                s = cb.state()
                cbs[name] = [*cbs[name], s] if isinstance(cbs.get(name), list) else \
                    ([cbs[name], s] if name in cbs else s)
        d["stateful_callbacks"] = cbs
        self._snap = {
            "trainer_state": d,
            "tr_loss": tr._tr_loss.detach().to("cpu", copy=True),
            "total_loss": float(tr._total_loss_scalar),
            "last_logged": int(tr._globalstep_last_logged),
            "initial_step": int(tr._initial_global_step),
            "flos": float(tr.current_flos),
            "py_rng": py_state(),
            "np_rng": np_state(),
        }

    on_step_end = on_log = on_save = on_evaluate = on_epoch_end = _snapshot

    def _history(self, hist: list[dict[str, Any]]) -> bytes:
        """``log_history`` as concatenated msgpack entries, extended as entries are logged
        (never changed once logged): recording it costs O(1) per step, not O(entries)."""
        if len(hist) < self._log_n:
            self._log_blob, self._log_n = b"", 0
        if len(hist) > self._log_n:
            self._log_blob += b"".join(msgpack.packb(pack(e, "log_history entry"))
                                       for e in hist[self._log_n:])
            self._log_n = len(hist)
        return self._log_blob

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """Replaces ``Trainer._load_rng_state`` while resuming: the states the log holds,
        put back at the point the Trainer puts back its own."""
        if checkpoint is None or not self._rng:
            return
        set_rng_states(self._rng["torch"])
        set_py_state(self._rng["py"])
        set_np_state(self._rng["np"])

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, lr_scheduler: Any = None,
                       **kwargs: Any) -> None:
        """Replay the log into the prepared objects (when resuming), then start the
        checkpointer."""
        tr = self._trainer
        if tr is None:
            raise ConfigError("LowDiffCallback must be passed to the Trainer constructor "
                              "(Trainer(..., callbacks=[LowDiffCallback(path)]))",
                              reason=Reason.INVALID_ARGUMENT)
        opt = unwrap_optimizer(optimizer)
        scaler = getattr(tr.accelerator, "scaler", None)
        if self._resume is not None:
            step, extra = self._resume
            restore(self.path, model, opt, scheduler=lr_scheduler, scaler=scaler, step=step)
            self._rng = {"torch": rng_states(), "py": extra["py_rng"],
                         "np": extra["np_rng"]}
            with torch.no_grad():
                tr._tr_loss.copy_(extra["tr_loss"].to(tr._tr_loss.device))
            tr._total_loss_scalar = extra["total_loss"]
            tr._globalstep_last_logged = extra["last_logged"]
            tr._initial_global_step = extra["initial_step"]  # train_loss: the whole run
            tr.current_flos = extra["flos"]
            self.resumed_step = step
        self._snapshot()
        self.checkpointer = DiffCheckpointer(
            self.path, model, opt, scheduler=lr_scheduler, scaler=scaler,
            extra_state=LateExtra(lambda: self._snap), **self.options)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Close the checkpointer: every step of the run is durable when ``train()``
        returns."""
        if self.checkpointer is not None:
            self.checkpointer.close()
            self.checkpointer = None
        self._resume = None
        self._rng = {}


__all__ = ["RESUME_MODES", "LowDiffCallback"]
