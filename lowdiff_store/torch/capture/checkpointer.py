"""DiffCheckpointer: per-step capture from optimizer hooks into a lowdiff-store log.

Timeline of step t (see ``docs/torch.md``, "Concepts"):

1. optimizer pre-step hook: the previous step (t-1) is complete (its scheduler step and
   scaler update ran), so its record is finalized and handed to the writer; then the
   gradients the optimizer is about to consume are captured (grad mode).
2. optimizer post-step hook: the state after step t is captured: module buffers, RNG,
   ``extra_state()``, the compressor residual, a digest every K steps, a full copy for a
   base every ``snapshot_every`` steps, the weight diff (delta mode).
3. the scheduler / scaler run; at the next pre-step hook (or ``flush`` / ``close``) their
   state and the hyperparameters complete step t's record.

A GradScaler step that skips ``optimizer.step()`` is seen by wrapping ``scaler.step`` on
the instance; it is recorded as a step with ``skipped=True``.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ...errors import ConfigError, Reason
from ..compressors.topk import GradCompressor
from ..core import schema as L
from ..core.optimizers import check_optimizer, closure_of, wrap_closure
from ..core.registry import RestoreInfo, forget, restored
from ..core.tensors import model_entries
from ..replay.restore import optimizer_names
from .bases.background import check_background
from .bases.handover import Handover, PendingStep
from .bases.initial import InitialBase, as_initial_base, start_from
from .bases.stager import BaseStager
from .bases.streaming import Streamer
from .cost_meter import CostMeter
from .delta_capture import DeltaCapture
from .grad_capture import GradCapture
from .layout import Partition, layout_for
from .opening import make_log_meta, open_sink, resume_point
from .options import CheckpointerOptions
from .side_channel import FollowedBuffers, SideChannel
from .sink import LogSink
from .stateful import ExtraSource
from .step_hooks import StepHooks, drop_hooks


class DiffCheckpointer:
    """Per-step checkpoints of ``model`` + ``optimizer`` into the log at ``path``.

    Args:
        path: log directory (created if needed).
        model: the module (plain, DDP- or compile-wrapped; names drop the wrappers).
        optimizer: the optimizer stepping ``model``'s parameters.
        scheduler: an LR scheduler to record (state after each step).
        scaler: a ``torch.amp.GradScaler`` to record (scale, growth tracker, skipped steps).
        mode: ``"grad"`` (log the consumed gradient; replay runs the optimizer) or
            ``"delta"`` (log weight diffs of the full state; replay adds).
        snapshot_every: a base every this many steps (and at step 0); ``"auto"``: tuned
            online from measured costs (``mtbf=SECONDS``; see ``docs/tuning.md``).
        batch: records per write+fsync (group commit); ``"auto"``: tuned online.
        compressor: a :class:`TopKCompressor` (or another
            :class:`~lowdiff_store.torch.compressors.topk.GradCompressor`); attached here, its
            compressed output is logged.
        extra_state: a callable returning msgpack-able data recorded after each step
            (for example the data loader position), returned by :func:`restore`; or a
            dict of objects with ``state_dict()`` / ``load_state_dict()`` (a
            ``StatefulDataLoader``, a sampler), loaded back by ``restore(...,
            extra_state=)``. See :mod:`lowdiff_store.torch.capture.stateful`.
        restored: the :class:`RestoreResult` (or its ``info``) of the :func:`restore` to
            continue from; default: what ``restore`` last put into ``optimizer``.
        initial_base: a new log only: an existing checkpoint (DCP directory, safetensors
            file or sharded safetensors directory, or an :class:`InitialBase`) loaded into
            ``model`` and ``optimizer`` and referenced by base 0 instead of copied. See
            :mod:`lowdiff_store.torch.capture.bases.initial`.
        **advanced: see :data:`~lowdiff_store.torch.capture.options.DEFAULTS` and
            ``docs/torch.md``; writer options ``max_batch_bytes``, ``max_delay_s``,
            ``memory_budget``, ``segment_bytes`` are passed to the writer.

    Step 0 is the state at creation (a base is written); step t is the state after the
    t-th ``optimizer.step()`` (or skipped scaler step) and the scheduler step after it.
    On an existing log the objects must come from :func:`restore` of that log; restoring an
    earlier step and training on needs ``resume="truncate"`` (later steps are discarded),
    otherwise a ``ConfigError(history_conflict)`` is raised. With several ranks each logs
    its share into ``path/rank-<rank>``; ``optimizer`` may be a ``ZeroRedundancyOptimizer``
    (``docs/distributed.md``).
    """

    def __init__(self, path: str | os.PathLike[str], model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, *, scheduler: Any = None,
                 scaler: Any = None, mode: str = "grad", snapshot_every: int | str = 100,
                 batch: int | str = 1, compressor: GradCompressor | None = None,
                 extra_state: Callable[[], Any] | Mapping[str, Any] | None = None,
                 restored: Any = None,
                 initial_base: str | os.PathLike[str] | InitialBase | None = None,
                 **advanced: Any) -> None:
        options = CheckpointerOptions.from_arguments(mode, snapshot_every, batch, advanced)
        options.check_compressor(compressor)
        init = None if initial_base is None else as_initial_base(initial_base)
        self._layout = layout = layout_for(path, model, optimizer, options, compressor, init)
        self.path, self._closed = layout.path, False
        err: BaseException | None = None
        try:
            info = resume_info(restored, layout.optimizer)
            self._setup(model, layout.options_for(options, info), scheduler, scaler,
                        compressor, extra_state, init)
            self._open(info)
        except Exception as e:
            err = e
        try:
            layout.agree(err)
        except Exception:
            if err is None:  # another rank failed: give this rank's log back untouched
                self._detach()
                self._finalizer.detach()
                self._out.sink.close_quietly()
            raise

    def _setup(self, model: torch.nn.Module, options: CheckpointerOptions, scheduler: Any,
               scaler: Any, compressor: GradCompressor | None,
               extra_state: Callable[[], Any] | Mapping[str, Any] | None,
               init: InitialBase | None) -> None:
        """The objects (``init`` loaded into them), the tensors this process logs, and the
        parts capturing them."""
        optimizer = self._layout.optimizer
        check_optimizer(optimizer, options.mode)
        self.options, self.mode = options, options.mode
        self._meter = CostMeter(self.path, mode=options.mode,
                                snapshot_every=options.snapshot_every, batch=options.batch,
                                mtbf=options.mtbf, tuner_options=options.tuner)
        self.model, self.optimizer, self.scheduler, self.scaler, self.compressor = \
            model, optimizer, scheduler, scaler, compressor
        self.extra_state = ExtraSource(extra_state)
        self._t_pre_end: float | None = None
        self._stats: dict[str, float] = {"steps": 0, "skipped": 0, "diff_bytes": 0,
                                         "bases": 0, "capture_s": 0.0, "finalize_s": 0.0}
        entries = model_entries(model)
        names, params = logged_params(entries.tensors, entries.buffers, optimizer)
        self._groups = [len(g["params"]) for g in optimizer.param_groups]
        self._start = None if init is None else start_from(  # referenced by base 0
            init, self.path, entries, names, params, optimizer)
        self._log_meta = make_log_meta(options, optimizer, names, params, entries,
                                       compressor=compressor, scheduler=scheduler, scaler=scaler,
                                       snapshot_every=self.snapshot_every, layout=self._layout)
        buffers = self._buffers = FollowedBuffers(model, entries)
        part = self._part = self._layout.select(names, params, entries.tensors,
                                                list(buffers), self._groups, self._log_meta)
        if options.base_mode == "background":
            check_background(options.mode, self._log_meta["optimizer"],
                             [p.device.type for p in part.params],
                             compressor is not None and compressor.error_feedback,
                             options.ef_state)
        self._grads = GradCapture(part.names, part.params, optimizer, compressor=compressor,
                                  zstd=options.grad_zstd, path=self.path)
        self._side = SideChannel(optimizer, scheduler, scaler, self.extra_state, buffers,
                                 compressor=compressor, names=part.names, params=part.params,
                                 ef_step=options.ef_state == "step", ef_zstd=options.ef_zstd,
                                 pool=self._grads.pool)
        self._delta = DeltaCapture(part.model, lambda: optimizer_state(part, optimizer),
                                   options.advanced())
        self._pending: PendingStep | None = None
        self._step_side: dict[str, Any] = {}
        self._posts = 0

    def _open(self, info: RestoreInfo | None) -> None:
        """Open the log: new, or continued from the step ``info`` (restore) put into the
        objects; attach the hooks; write the first base."""
        part = self._part
        step, base_now, existed, start_over = resume_point(
            self.path, self._log_meta, part.params, self.optimizer, info, self._layout)
        self._step = step
        sink = open_sink(self.path, self._log_meta, self.options, self._meter.batch, step,
                         existed, start_over=start_over)
        try:
            self._grads.source = source = self._layout.grad_source(self._grads.pool,
                                                                   self.options, info)
            self._grads.open_gate(self.mode, source, self.options, sink)
            stager = BaseStager.for_options(part, self.optimizer, self.compressor, source,
                                            self.options, world=self._layout.world)
            self._out = Handover(sink, self._meter, stager, self._grads.pool, self._stats,
                                 self.mode, last_base=step, start=self._start)
            Streamer.attach(self._out, self._log_meta, self.options, self._side)
            self._attach(info)
            if info is not None and restored(self.optimizer) is info:
                forget(self.optimizer)  # taken over
            if self.mode == "delta":
                self._delta.prime()
            self._side.prime()
            # a base at the start: step 0, or the restored step when restore was not exact
            if base_now and step not in sink.bases:  # written from the live tensors,
                self._pending = PendingStep(step, skipped=False)  # before training goes on
                self._out.take_base(self._pending, foreground=True, views=True)
                self._finalize(write_record=False)  # durable in the background
            if info is not None:  # the first record states everything: only parameters
                self._side.forget()  # and optimizer state were checked (the digest)
                self._delta.forget(list(self._side.buffers))  # delta: buffers go raw first
        except BaseException:
            self._detach()
            sink.close_quietly()
            raise
        if self.options.base_mode == "background":
            self._out.start_background(self.path)
        self._bg = self._out.bg  # (tests stop the worker)
        self._finalizer = weakref.finalize(self, _drop, sink, self._hooks.handles)

    def _attach(self, info: RestoreInfo | None) -> None:
        comp = self.compressor
        if comp is not None:  # it takes the residuals restore() left for it
            res = info.take_residuals() if info is not None else None
            if res is not None and not comp.residuals:
                comp.residuals = res
            comp.attach(self.optimizer)
        part = self._part
        layers = list(zip(part.names, part.params, strict=True)) \
            if self.options.capture == "layerwise" else []
        self._hooks = StepHooks(self, self.optimizer, self.scaler, self._grads, layers,
                                self._layout, model=self.model)

    def _detach(self) -> None:
        if (hooks := getattr(self, "_hooks", None)) is not None:
            hooks.remove()
        if self.compressor is not None:
            self.compressor.detach()

    # ------------------------------------------------------------------ hooks

    def _pre_hook(self, args: Any, kwargs: Any) -> Any:
        grads = self._grads
        if grads.refusal is not None:
            raise grads.refusal
        t0 = time.perf_counter()
        closure = closure_of(args, kwargs)
        check_groups(self.optimizer, self._groups, self.path)
        self._finalize(hand_over=grads.hand_over_now())  # else by the post-step hook
        self._step_side = {}
        self._side.before_step(self._step_side)
        # a pre-hook registered after ours may run before the step: see GradCapture.check
        grads.last = self._hooks.capture_is_last(closure)
        new_args = None
        if self.mode == "grad" and closure is not None:  # captured once the closure ran
            new_args = wrap_closure(args, kwargs, closure, self._capture_grads, self.optimizer)
        elif self.mode == "grad":
            self._capture_grads()
        self._t_pre_end = time.perf_counter()
        self._stats["capture_s"] += self._t_pre_end - t0
        return new_args

    def _capture_grads(self) -> None:
        self._grads.capture(self._step_side)

    def _copy_done(self) -> None:
        self._grads.copy_done(self._step + 1)

    def _post_hook(self) -> None:
        t0 = time.perf_counter()
        self._meter.on_post(t0, self._step + 1, self._stats["capture_s"],
                            None if self._t_pre_end is None else t0 - self._t_pre_end)
        self._posts += 1
        if self.mode == "grad":
            self._copy_done()  # already, unless a hook was registered before ours
            self._grads.check(self._step_side)
        self._step += 1
        self._capture_after(skipped=False)
        self._hooks.move_pre_last()
        self._stats["capture_s"] += time.perf_counter() - t0
        self._out.hand_over(live=False)  # (a live slice is waited for at the next step)

    def _scaler_step(self, orig: Callable[..., Any], optimizer: Any, *args: Any,
                     **kwargs: Any) -> Any:
        posts = self._posts
        out = orig(optimizer, *args, **kwargs)
        if self._posts == posts:  # the scaler found inf/NaN and skipped optimizer.step()
            t0 = time.perf_counter()
            self._finalize()
            self._step_side = {"skipped": True}
            self._grads.release()
            self._step += 1
            self._capture_after(skipped=True)
            self._stats["capture_s"] += time.perf_counter() - t0
        return out

    # ------------------------------------------------------------------ after a step

    def _capture_after(self, skipped: bool) -> None:
        step = self._step
        g = self._grads
        p = PendingStep(step, skipped, specs=g.specs, side=self._step_side, release=g.bufs,
                        ticket=g.take_ticket())
        g.reset()
        self._step_side = {}
        if skipped:
            self._stats["skipped"] += 1
        self._buffers.follow(self._part.model)  # a buffer replaced by assignment: logged
        if self.mode == "grad":
            self._side.buffers_after_step(p.specs, p.release)
        else:
            self._delta.capture(p.specs, p.side, lossless=self._out.base_due(step))
        self._side.after_step(p.specs, p.side, p.release)
        self._out.after_step(p)
        if (k := self.options.digest_every) and step % k == 0:  # grad mode: beside the next step
            self._out.digest(p, self._part, self.optimizer,
                             self._delta if self.mode == "delta" else None)
        self._pending = p
        self._stats["steps"] += 1

    def _finalize(self, write_record: bool = True, hand_over: bool = True) -> None:
        """Complete the pending step with what ran after it (scheduler, scaler, any
        hyperparameter change) and hand it to the writer: now, or with ``hand_over=False``
        at the post-step hook (then the writer's CRC and copies of a large record run beside
        the next forward and backward, not beside the memory-bound optimizer step)."""
        self._layout.before_finalize()
        self._out.hand_over()  # records reach the writer in step order
        p, self._pending = self._pending, None
        if p is None:
            return
        t0 = time.perf_counter()
        def complete() -> None:
            self._side.complete(p.side, skipped=p.skipped, late_extra=write_record)
            if p.base is not None:  # its metadata is the state as of now
                p.base_meta = self._side.base_meta(p.step, p.base.opt or {}, self._log_meta)
        if not self._out.finish(p, self._grads, complete):  # (settled, then completed)
            return
        p.write_record = write_record
        self._stats["finalize_s"] += time.perf_counter() - t0
        self._out.ready = p
        if hand_over:
            self._out.hand_over()

    @property
    def step(self) -> int:
        """The last step captured (complete once the scheduler has stepped)."""
        return self._step

    @property
    def durable_step(self) -> int:
        """Newest step durable on disk with every step before it (-1: none yet)."""
        return -1 if (d := self._out.sink.durable_step) is None else d

    @property
    def snapshot_every(self) -> int:
        """The base interval in force (changed by the tuner with ``"auto"``)."""
        return int(self._meter.snapshot_every)

    def flush(self) -> int:
        """Complete the current step (call it after ``scheduler.step()``), then wait until
        every step so far is durable. Returns :attr:`durable_step`."""
        self._check_open()
        self._finalize()
        self._out.flush()
        return self.durable_step

    def refer_base(self, checkpoint: str | os.PathLike[str] | InitialBase) -> bool:
        """The base of the step just taken refers to ``checkpoint`` (:meth:`.Handover.refer`)."""
        return self._out.refer(self, checkpoint)

    def stats(self) -> dict[str, float]:
        """Counters: ``steps``, ``skipped``, ``diff_bytes`` (before zstd), ``bases``, ``capture_s``,
        ``finalize_s``, ``snapshot_every``/``batch`` in force, ``lent_*``, ``record*``, ``base_*``,
        ``writer_*`` (``writer_process``: 1 for a writer process, 0 in-thread), ``background_*``;
        with ranks ``rank``, ``world_size``, ``owned_params``, ``tee_*`` (docs/torch.md)."""
        out = {**self._stats, "snapshot_every": self.snapshot_every,
               "batch": self._out.sink.batch, **self._grads.stats()}
        self._out.add_stats(out)
        self._layout.add_stats(out, self._part)
        return out

    @property
    def tuning_decisions(self) -> list[dict[str, Any]]:
        """The changes of (snapshot_every, batch) made so far in auto mode
        (``Decision.to_dict()``; each is also in its step's record, ``"tuning"``)."""
        return list(self._meter.decisions)

    def measurements(self) -> Any:
        """The measured costs so far (a :class:`lowdiff_store.tuning.Measurements`, or None
        before one step and one write); recorded in the log at every base and at close."""
        return self._meter.measurements()

    def wrap_comm_hook(self, hook: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """A DDP communication hook that runs ``hook`` and logs its post-communication
        result: ``ddp.register_comm_hook(state, ckpt.wrap_comm_hook(hook))``. With several
        ranks the compressed form of this rank's parameters is logged (docs/distributed.md);
        with a single process ``hook`` runs unchanged and the gradient is captured densely."""
        return self._layout.wrap_comm_hook(hook, self.compressor)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, foreach: bool | None = None
                        ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters (with several
        ranks, torch's own over all of them); returns the total norm. With layer-wise capture
        the scale is recorded: the gradients staged during backward stay valid (replay
        multiplies them by the same scale with the same kernel), no second copy is made."""
        every = self._layout.clip_params()
        if every is not None:
            return torch.nn.utils.clip_grad_norm_(every, max_norm, norm_type,
                                                  error_if_nonfinite, foreach)
        return self._grads.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite, foreach,
                                           layerwise=self.options.capture == "layerwise")

    @property
    def rank(self) -> int:
        """This process's rank (0 for a single process)."""
        return self._layout.rank

    @property
    def world_size(self) -> int:
        """Number of ranks (shards; 1 for a single process)."""
        return self._layout.world

    @property
    def layout(self) -> str:
        """``"single"``, or with several ranks ``"replicated"``, ``"zero"`` or ``"fsdp"``."""
        return self._layout.kind

    @property
    def root(self) -> str:
        """The checkpoint directory (with several ranks, the one holding every rank's log)."""
        return self._layout.root

    @property
    def owned(self) -> list[str]:
        """The parameters whose gradients, optimizer state and base copies this logs."""
        return list(self._layout.owned)

    def close(self) -> None:
        """Flush, then detach every hook (the compressor too). Idempotent."""
        if self._closed:
            return
        try:
            self._grads.staging.wait()  # a copy in flight (a step that raised) ends first
            self._finalize()
        finally:
            self._closed = True
            self._detach()
            self._finalizer.detach()
            self._out.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("the checkpointer is closed", reason=Reason.WRITER_CLOSED,
                              path=self.path)

    def __enter__(self) -> DiffCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_groups(optimizer: torch.optim.Optimizer, groups: list[int], path: str) -> None:
    """``ConfigError`` when the optimizer's param groups are not ``groups`` (their sizes)."""
    if [len(g["params"]) for g in optimizer.param_groups] != groups:
        raise ConfigError("the optimizer's param groups changed since the checkpointer was "
                          "created: close it and start a new log",
                          reason=Reason.STATE_MISMATCH, path=path)


def resume_info(given: Any, optimizer: torch.optim.Optimizer) -> RestoreInfo | None:
    """What the checkpointer continues from: ``given`` (a :class:`RestoreResult` or its
    ``info``), or else what :func:`restore` last put into ``optimizer`` (the registry of
    :mod:`lowdiff_store.torch.core.registry`)."""
    if given is None:
        return restored(optimizer)
    info = getattr(given, "info", given)
    if not isinstance(info, RestoreInfo):
        raise ConfigError(f"restored= takes what restore() returned, not "
                          f"{type(given).__name__}")
    return info


def logged_params(tensors: Mapping[str, torch.Tensor], buffers: list[str],
                  optimizer: torch.optim.Optimizer) -> tuple[list[str], list[torch.Tensor]]:
    """:func:`optimizer_names`, each parameter at most once (a log names it once)."""
    names, params = optimizer_names(tensors, buffers, optimizer)
    if len(set(names)) != len(names):
        raise ConfigError("a parameter appears twice in the optimizer",
                          reason=Reason.STATE_MISMATCH)
    return names, params


def optimizer_state(part: Partition, optimizer: torch.optim.Optimizer
                    ) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    """The optimizer state of the logged parameters: (tensors by name and key, packed
    non-tensor values by name)."""
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    values: dict[str, Any] = {}
    for name, prm in zip(part.names, part.params, strict=True):
        st = optimizer.state.get(prm)
        if st:
            tensors[name], values[name] = L.split_state(st, f"optimizer.state[{name!r}]")
    return tensors, values


def _drop(sink: LogSink, handles: list[Any]) -> None:
    """The checkpointer was garbage-collected without close(): detach and close quietly
    (the step still pending is lost, as in a crash)."""
    drop_hooks(handles)
    sink.close_quietly()


__all__ = ["DiffCheckpointer", "optimizer_state", "resume_info"]
