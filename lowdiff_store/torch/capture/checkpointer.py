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

import logging
import os
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from ...errors import ConfigError, Reason
from ...log import LogReader
from ...threads import usable_cores
from ..compressors.topk import GradCompressor
from ..core import schema as L
from ..core.optimizers import (
    check_optimizer,
    closure_of,
    step_reads_grads_only,
    unwrap_optimizer,
    wrap_closure,
)
from ..core.registry import forget, restored
from ..core.specs import Spec, raw_spec
from ..core.tensors import bits_view, local_of, model_entries, same_bytes, tag_of, to_bits
from ..core.typed_msgpack import pack
from ..replay.materialize import base_meta, live_base_arrays, residual_tensors
from .background import BackgroundBases, check_background
from .cost_meter import CostMeter
from .delta_capture import DELTA_CODECS, DeltaCapture
from .grad_capture import GradIdent, GradStaging, copies_done, grad_ident
from .initial_base import InitialBase, start_from
from .sink import WRITER_OPTIONS, Sink, manifest_exists
from .stateful import ExtraSource

_log = logging.getLogger(__name__)

#: Advanced options and their defaults (the table in docs/torch.md, "Python API summary").
DEFAULTS: dict[str, Any] = {
    "capture": "dense",         # grad mode: "dense" | "layerwise"
    "digest_every": 10,         # digest of params + optimizer state every K steps (0: never)
    "grad_zstd": None,          # zstd level for dense gradients (None: raw, zero-copy)
    "delta_codec": "xor",       # delta mode: "xor" (lossless) | "q8" | "topk" | "lcc"
    "delta_ratio": 0.01,        # delta_codec="topk": fraction of entries kept
    "delta_block": 256,         # delta_codec="q8": elements per scale
    "delta_bits": 3,            # delta_codec="lcc": 2**bits - 1 exponent buckets
    "delta_min_numel": 4096,    # lossy codecs apply to float tensors at least this large
    "delta_zstd": 3,            # zstd level for xor deltas (None: raw)
    "ef_state": "base",         # compressor residuals: "base" | "step"
    "ef_zstd": None,            # zstd level for per-step residuals
    "resume": "continue",       # existing log: "continue" | "truncate"
    "base_mode": "foreground",  # "background": a worker process makes bases from the log
    "mtbf": None,               # auto tuning: the job's MTBF in seconds (None: 24 h)
    "tuner": None,              # auto tuning: further AutoTuner keyword arguments (a dict)
}


#: A carried value that never equals a real one (packed form): forces the next record to
#: state the value.
_UNKNOWN: dict[str, Any] = {"\x00unknown": 0}


@dataclass
class _Pending:
    """A step whose optimizer work is done but whose scheduler/scaler may still run."""

    step: int
    skipped: bool
    specs: list[Spec] = field(default_factory=list)
    side: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    release: list[torch.Tensor] = field(default_factory=list)
    base: dict[str, tuple[str, np.ndarray]] | None = None
    base_opt: dict[str, Any] | None = None
    copied: list[Any] = field(default_factory=list)  # CUDA events: copies complete
    base_meta: dict[str, Any] | None = None  # set when finalized
    write_record: bool = True


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
        initial_base: a new log only: an existing checkpoint (DCP directory, safetensors
            file or sharded safetensors directory, or an :class:`InitialBase`) loaded into
            ``model`` and ``optimizer`` and referenced by base 0 instead of copied. See
            :mod:`lowdiff_store.torch.capture.initial_base`.
        **advanced: see ``DEFAULTS`` in this module and ``docs/torch.md``; writer options
            ``max_batch_bytes``, ``max_delay_s``, ``memory_budget``, ``segment_bytes``
            are passed to the writer.

    Step 0 is the state at creation (a base is written); step t is the state after the
    t-th ``optimizer.step()`` (or skipped scaler step) and the scheduler step after it.
    On an existing log the objects must come from :func:`restore` of that log; restoring an
    earlier step and training on needs ``resume="truncate"`` (later steps are discarded),
    otherwise a ``ConfigError(history_conflict)`` is raised.
    """

    #: chooses the class ``DiffCheckpointer(path, ...)`` instantiates; installed by
    #: :mod:`lowdiff_store.torch.api`, the one module that decides sharded vs single log
    route: ClassVar[Callable[[Any], type[DiffCheckpointer]] | None] = None

    def __new__(cls, *args: Any, **kwargs: Any) -> DiffCheckpointer:
        """With ``torch.distributed`` initialized and several ranks, an instance of
        :class:`~lowdiff_store.torch.distributed.checkpointer.ShardedCheckpointer`
        (one log per rank)."""
        route = DiffCheckpointer.route
        if cls is DiffCheckpointer and route is not None:
            cls = route(args[0] if args else kwargs.get("path"))
        return super().__new__(cls)

    def __init__(self, path: str | os.PathLike[str], model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, *, scheduler: Any = None,
                 scaler: Any = None, mode: str = "grad", snapshot_every: int | str = 100,
                 batch: int | str = 1, compressor: GradCompressor | None = None,
                 extra_state: Callable[[], Any] | Mapping[str, Any] | None = None,
                 initial_base: str | os.PathLike[str] | InitialBase | None = None,
                 **advanced: Any) -> None:
        self.path = os.fspath(path)
        optimizer = unwrap_optimizer(optimizer)  # accelerate, Lightning: the real one
        writer_opts = {k: advanced.pop(k) for k in WRITER_OPTIONS if k in advanced}
        unknown = set(advanced) - set(DEFAULTS)
        if unknown:
            raise ConfigError(f"unknown option(s) {sorted(unknown)}; known: "
                              f"{sorted(DEFAULTS) + list(WRITER_OPTIONS)}")
        opts = {**DEFAULTS, **advanced}
        self._check_options(mode, snapshot_every, batch, compressor, opts)
        check_optimizer(optimizer, mode)
        self.mode = mode
        self._meter = CostMeter(self.path, mode=mode, snapshot_every=snapshot_every,
                                batch=batch, mtbf=opts["mtbf"], tuner_options=opts["tuner"])
        self.snapshot_every = self._meter.snapshot_every
        self._bg: BackgroundBases | None = None
        self._t_pre_end: float | None = None
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.compressor = compressor
        self.extra_state = ExtraSource(extra_state)
        self.opts = opts
        self._closed = False
        self._gstage = GradStaging()  # host buffers and layer-wise copies
        self._pool = self._gstage.pool
        self._stats: dict[str, float] = {"steps": 0, "skipped": 0, "diff_bytes": 0,
                                         "bases": 0, "capture_s": 0.0, "finalize_s": 0.0}

        # -- names: model tensors, optimizer order, groups
        entries = model_entries(model)
        self._model, self._aliases, buffers = entries.tensors, entries.aliases, entries.buffers
        self._order = entries.order
        by_id = {id(t): n for n, t in self._model.items() if n not in buffers}
        self._params = L.params_of(optimizer)
        try:
            self._names = [by_id[id(p)] for p in self._params]
        except KeyError:
            raise ConfigError("the optimizer holds a parameter that is not in the model",
                              reason=Reason.STATE_MISMATCH) from None
        if len(set(self._names)) != len(self._names):
            raise ConfigError("a parameter appears twice in the optimizer",
                              reason=Reason.STATE_MISMATCH)
        self._buffers = {n: self._model[n] for n in buffers}
        self._groups = [len(g["params"]) for g in optimizer.param_groups]
        # a new log starting from an external checkpoint: loaded now, referenced by base 0
        self._start = None if initial_base is None else start_from(
            initial_base, self.path, entries, self._names, self._params, optimizer)
        self._log_meta = self._make_log_meta()
        self._select_shard()  # distributed: keep this rank's share (no-op here)
        if opts["base_mode"] == "background":
            check_background(mode, self._log_meta["optimizer"],
                             [p.device.type for p in self._params],
                             compressor is not None and compressor.error_feedback,
                             opts["ef_state"])

        # -- carried state (what the log says the objects hold after the last step)
        self._hyper: Any = L.hyper_of(optimizer)
        self._sched = self._sched_state()
        self._scaler_state = self._scaler_packed()
        self._extra = self._extra_packed()
        self._prev_bufs: dict[str, np.ndarray] = {}
        self._prev_rng: dict[str, np.ndarray] = {}
        self._delta = DeltaCapture(self._model, self._opt_state, opts)  # delta mode
        self._prev_ef: dict[str, np.ndarray] = {}
        self._pending: _Pending | None = None
        self._ready: _Pending | None = None  # finalized, handed to the writer after the step
        self._grads: dict[str, GradIdent] = {}  # name -> the gradient captured
        self._capture_last = True  # no pre-step hook ran after our capture (see _pre_hook)
        self._refused: ConfigError | None = None  # a step that could not be logged
        self._grad_specs: list[Spec] = []
        self._grad_bufs: list[torch.Tensor] = []
        self._grads_copied: list[Any] = []
        self._step_side: dict[str, Any] = {}
        self._posts = 0
        self._clip: tuple[torch.Tensor, dict[str, int]] | None = None

        # -- the log: new, or continued after restore()
        info = restored(optimizer)
        self._step = 0
        base_now = True
        existed = manifest_exists(self.path)
        if existed:
            with LogReader(self.path) as r:
                log_id, last, bases = r.log_id, r.last_step, list(r.bases)
                old = r.meta.get("torch")
            if last is not None and last >= 0:
                if not bases:
                    raise ConfigError(
                        f"{self.path} holds records up to step {last} but no base (the run "
                        f"crashed before its first base was published): nothing can be "
                        f"restored from it; remove it or use another directory",
                        reason=Reason.NO_BASE, path=self.path)
                self._check_compatible(old)
                if info is None or info.log_id != log_id:
                    raise ConfigError(
                        f"{self.path} already holds a log up to step {last}: call "
                        f"restore(path, model, optimizer, ...) first to continue it, or use "
                        f"an empty directory", reason=Reason.HISTORY_CONFLICT, path=self.path)
                if L.digest_objects(self._params, optimizer) != info.digest:
                    raise ConfigError(
                        f"model/optimizer changed since restore() put step {info.step} into "
                        f"them", reason=Reason.STATE_MISMATCH, path=self.path)
                self._step = info.step
                base_now = not info.exact
        self._last_base = self._step
        self._sink = Sink(self.path, meta={"torch": self._log_meta}, batch=self._meter.batch,
                          options=writer_opts)
        try:
            if self._sink.last_step > self._step:
                if self.opts["resume"] != "truncate":
                    raise ConfigError(
                        f"the objects hold step {self._step} but the log goes on to step "
                        f"{self._sink.last_step}: training now would mix two histories. Pass "
                        f"resume='truncate' to discard steps {self._step + 1}.."
                        f"{self._sink.last_step}", reason=Reason.HISTORY_CONFLICT,
                        path=self.path)
                self._sink.truncate_after(self._step)
            if existed:
                self._sink.update_meta({"torch": self._log_meta})
            self._attach()  # a compressor takes the residuals restore() left for it
            if info is not None:
                forget(optimizer)
            if self.mode == "delta":
                self._delta.prime()
            self._prev_rng = L.rng_states()
            self._prev_bufs = {n: to_bits(b)[1] for n, b in self._buffers.items()}
            # a base at the start: step 0, or the restored step when restore was not exact
            if base_now and self._step not in self._sink.bases:
                self._pending = _Pending(self._step, skipped=False)
                self._take_base(self._pending, foreground=True)
                self._finalize(write_record=False)
            if info is not None:
                self._forget_carried()
        except BaseException:
            self._detach()
            self._sink.close_quietly()
            raise
        if self.opts["base_mode"] == "background":
            try:
                self._bg = BackgroundBases(self.path)
            except OSError as e:  # no process to spare: bases stay in the foreground
                _log.warning("lowdiff-store: cannot start the background base worker (%s); "
                             "bases are taken in the foreground", e)
        sink = self._sink
        self._finalizer = weakref.finalize(self, _drop, sink, self._handles)

    def _select_shard(self) -> None:
        """Hook for :class:`~lowdiff_store.torch.distributed.checkpointer.ShardedCheckpointer`."""

    def wrap_comm_hook(self, hook: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """A DDP communication hook that runs ``hook`` and logs its post-communication
        result: ``ddp.register_comm_hook(state, ckpt.wrap_comm_hook(hook))``. With several
        ranks the compressed form is logged (see ``docs/distributed.md``); with a single
        process ``hook`` runs unchanged and the gradient is captured densely."""
        from ..core.hook_records import passthrough

        return passthrough(hook)

    def _forget_carried(self) -> None:
        """After a resume the first record states everything (hyperparameters, scheduler,
        scaler, extra, buffers, RNG): only the parameters and optimizer state were checked
        against the log (digest); the rest may have been touched since restore()."""
        self._hyper = self._sched = self._scaler_state = self._extra = _UNKNOWN
        self._prev_bufs, self._prev_rng, self._prev_ef = {}, {}, {}
        self._delta.forget(list(self._buffers))  # delta mode: buffers go raw first

    # ------------------------------------------------------------------ configuration

    @staticmethod
    def _check_options(mode: str, snapshot_every: int | str, batch: int | str,
                       compressor: GradCompressor | None, o: Mapping[str, Any]) -> None:
        if mode not in ("grad", "delta"):
            raise ConfigError(f"mode={mode!r} must be 'grad' or 'delta'")
        if snapshot_every != "auto" and (type(snapshot_every) is not int or snapshot_every < 1):
            raise ConfigError(f"snapshot_every={snapshot_every!r} must be an int >= 1 or "
                              f"'auto'")
        if batch != "auto" and (type(batch) is not int or batch < 1):
            raise ConfigError(f"batch={batch!r} must be an int >= 1 or 'auto'")
        if o["base_mode"] not in ("foreground", "background"):
            raise ConfigError(f"base_mode={o['base_mode']!r} must be 'foreground' or "
                              f"'background'")
        if o["mtbf"] is not None and not (isinstance(o["mtbf"], (int, float))
                                          and 0 < o["mtbf"] < float("inf")):
            raise ConfigError(f"mtbf={o['mtbf']!r} must be a positive number of seconds")
        if o["tuner"] is not None and not isinstance(o["tuner"], Mapping):
            raise ConfigError("tuner must be a dict of AutoTuner keyword arguments")
        if compressor is not None and not isinstance(compressor, GradCompressor):
            raise ConfigError("compressor must be a TopKCompressor, TernGradCompressor, "
                              "QSGDCompressor or DeMoCompressor")
        if compressor is not None and mode != "grad":
            raise ConfigError("a compressor only applies to mode='grad'")
        if compressor is not None and compressor.optimizer is not None:
            raise ConfigError("the compressor is already attached: pass it unattached, the "
                              "checkpointer attaches it", reason=Reason.NOT_ALLOWED)
        if o["capture"] not in ("dense", "layerwise"):
            raise ConfigError(f"capture={o['capture']!r} must be 'dense' or 'layerwise'")
        if o["capture"] == "layerwise" and (mode != "grad" or compressor is not None):
            raise ConfigError("capture='layerwise' applies to dense gradients in mode='grad'")
        if o["delta_codec"] not in DELTA_CODECS:
            raise ConfigError(f"delta_codec={o['delta_codec']!r} must be 'xor', 'q8', 'topk' "
                              f"or 'lcc'")
        if type(o["delta_bits"]) is not int or not 1 <= o["delta_bits"] <= 8:
            raise ConfigError("delta_bits must be an int in 1..8")
        if o["ef_state"] not in ("base", "step"):
            raise ConfigError(f"ef_state={o['ef_state']!r} must be 'base' or 'step'")
        if o["resume"] not in ("continue", "truncate"):
            raise ConfigError(f"resume={o['resume']!r} must be 'continue' or 'truncate'")
        if type(o["digest_every"]) is not int or o["digest_every"] < 0:
            raise ConfigError("digest_every must be an int >= 0")
        if not 0.0 < float(o["delta_ratio"]) <= 1.0:
            raise ConfigError("delta_ratio must be in (0, 1]")

    def _make_log_meta(self) -> dict[str, Any]:
        comp = None
        if self.compressor is not None:
            comp = {**self.compressor.config(), "ef_state": self.opts["ef_state"]}
        return {
            "schema": L.SCHEMA,
            "mode": self.mode,
            "capture": self.opts["capture"],
            "optimizer": L.class_name(self.optimizer),
            "params": self._names,
            "groups": self._groups,
            "model": [[n, tag_of(t, n), list(t.shape)] for n, t in self._model.items()],
            "buffers": list(self._buffers),
            "aliases": self._aliases,
            "state_dict": self._order,
            "compressor": comp,
            "grad_codec": self.compressor.grad_codec if self.compressor is not None else "raw",
            "grad_zstd": self.opts["grad_zstd"],
            "delta_codec": self.opts["delta_codec"] if self.mode == "delta" else None,
            "digest_every": self.opts["digest_every"],
            "snapshot_every": self.snapshot_every,
            "scheduler": L.class_name(self.scheduler) if self.scheduler is not None else None,
            "scaler": L.class_name(self.scaler) if self.scaler is not None else None,
            "torch_version": torch.__version__,
            "device": self._params[0].device.type if self._params else "cpu",
        }

    def _check_compatible(self, old: Any) -> None:
        if not isinstance(old, dict):
            raise ConfigError(f"{self.path} is not a log written by DiffCheckpointer",
                              reason=Reason.STATE_MISMATCH, path=self.path)
        for key in ("mode", "optimizer", "params", "groups", "model", "compressor"):
            mine = self._log_meta[key]
            theirs = old.get(key)
            if key == "optimizer" and isinstance(theirs, str):
                theirs = L.current_class_name(theirs)
            if theirs != mine:
                raise ConfigError(f"the log's {key} ({_short(theirs)}) differs from this "
                                  f"run's ({_short(mine)})", reason=Reason.STATE_MISMATCH,
                                  path=self.path)

    # ------------------------------------------------------------------ hooks

    def _attach(self) -> None:
        ref = weakref.ref(self)
        self._handles: list[Any] = []
        if self.compressor is not None:
            self.compressor.attach(self.optimizer)

        def pre(opt: Any, args: Any, kwargs: Any) -> Any:
            me = ref()
            return None if me is None else me._pre_hook(args, kwargs)

        def post(opt: Any, args: Any, kwargs: Any) -> None:
            me = ref()
            if me is not None:
                me._post_hook()

        def copied(opt: Any, args: Any, kwargs: Any) -> None:
            me = ref()
            if me is not None:
                me._copy_done()

        self._pre_handle = self.optimizer.register_step_pre_hook(pre)
        self._handles.append(self._pre_handle)
        # the first post-step hook (kept first): a copy beside the step ends before any
        # other post-step hook can touch the gradients (zero_grad in a hook, say)
        self._copied_handle = self.optimizer.register_step_post_hook(copied)
        self._handles.append(self._copied_handle)
        self._handles.append(self.optimizer.register_step_post_hook(post))
        if self.scaler is not None:
            orig = self.scaler.step

            def scaler_step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
                me = ref()
                if me is None or optimizer is not me.optimizer:
                    return orig(optimizer, *args, **kwargs)
                return me._scaler_step(orig, optimizer, *args, **kwargs)

            self.scaler.step = scaler_step
            self._handles.append(_AttrRestore(self.scaler, "step", scaler_step))
        if self.opts["capture"] == "layerwise":
            for name, p in zip(self._names, self._params, strict=True):
                self._handles.append(p.register_post_accumulate_grad_hook(
                    _layer_hook(ref, name)))

    def _detach(self) -> None:
        for h in getattr(self, "_handles", []):
            h.remove()
        self._handles = []
        if self.compressor is not None:
            self.compressor.detach()

    def _pre_hook(self, args: Any, kwargs: Any) -> Any:
        if self._refused is not None:
            raise self._refused
        t0 = time.perf_counter()
        closure = closure_of(args, kwargs)
        if [len(g["params"]) for g in self.optimizer.param_groups] != self._groups:
            raise ConfigError("the optimizer's param groups changed since the checkpointer "
                              "was created: close it and start a new log",
                              reason=Reason.STATE_MISMATCH, path=self.path)
        self._finalize(hand_over=False)  # handed over by the post-step hook
        self._step_side = {}
        hyper = L.hyper_of(self.optimizer)
        if not L.same(hyper, self._hyper):
            self._step_side["hyper"] = hyper
            self._hyper = hyper
        # Captured right before the step's own code runs, unless a pre-hook registered
        # after ours runs in between (moved last after this step): see _check_grads.
        hooks = getattr(self.optimizer, "_optimizer_step_pre_hooks", None)
        self._capture_last = closure is not None or not hooks or \
            next(reversed(hooks)) == self._pre_handle.id
        posts = getattr(self.optimizer, "_optimizer_step_post_hooks", None)
        if posts is not None and self._copied_handle.id in posts:
            posts.move_to_end(self._copied_handle.id, last=False)
        new_args = None
        if self.mode == "grad" and closure is not None:  # captured once the closure ran
            new_args = wrap_closure(args, kwargs, closure, self._capture_grads, self.optimizer)
        elif self.mode == "grad":
            self._capture_grads()
        self._t_pre_end = time.perf_counter()
        self._stats["capture_s"] += self._t_pre_end - t0
        return new_args

    def _post_hook(self) -> None:
        t0 = time.perf_counter()
        self._meter.on_post(t0, self._step + 1, self._stats["capture_s"],
                            None if self._t_pre_end is None else t0 - self._t_pre_end)
        self._posts += 1
        if self.mode == "grad":
            self._copy_done()  # already, unless a hook was registered before ours
            self._check_grads()
        self._step += 1
        self._capture_after(skipped=False)
        self._move_pre_hook_last()
        self._stats["capture_s"] += time.perf_counter() - t0
        self._hand_over()

    def _scaler_step(self, orig: Callable[..., Any], optimizer: Any, *args: Any,
                     **kwargs: Any) -> Any:
        posts = self._posts
        out = orig(optimizer, *args, **kwargs)
        if self._posts == posts:  # the scaler found inf/NaN and skipped optimizer.step()
            t0 = time.perf_counter()
            self._finalize()
            self._step_side = {"skipped": True}
            self._release_grads()
            self._step += 1
            self._capture_after(skipped=True)
            self._stats["capture_s"] += time.perf_counter() - t0
        return out

    def _move_pre_hook_last(self) -> None:
        """Hooks registered after ours run after it and could change the gradients: keep
        our capture the last pre-step hook (their change is caught by _check_grads)."""
        hooks = getattr(self.optimizer, "_optimizer_step_pre_hooks", None)
        hid = self._pre_handle.id
        if hooks is not None and hid in hooks and next(reversed(hooks)) != hid:
            hooks.move_to_end(hid)

    # ------------------------------------------------------------------ gradients

    def _capture_grads(self) -> None:
        self._grad_specs = []
        self._grads = {}
        copies: list[tuple[str, torch.Tensor]] = []
        sources: list[torch.Tensor] = []
        comp = self.compressor
        zstd = self.opts["grad_zstd"]
        clip = self._clip
        self._clip = None
        scaled: list[str] = []
        for name, p in zip(self._names, self._params, strict=True):
            g = p.grad
            if g is None:
                continue
            if g.layout != torch.strided:
                raise ConfigError(f"parameter {name}: sparse gradients are not supported",
                                  reason=Reason.NOT_ALLOWED, path=self.path)
            self._grads[name] = grad_ident(g)
            logged = comp.specs(p, name, zstd) if comp is not None else None
            if logged is not None:  # the compressor's message (see compress.py)
                self._grad_specs.extend(logged)
                continue
            buf, staged = self._gstage.claim(name, g)
            if staged and clip is not None and clip[1].get(name) == g._version:
                scaled.append(name)  # the copy is the pre-clip gradient: replay rescales
            copies.append((name, buf))
            sources.append(local_of(g))
            self._grad_bufs.append(buf)
        # CPU copies run beside a step that only reads its gradients (waited for by the
        # first post-step hook), when nothing runs between this capture and the step's
        # code and a core is free for them; under CUDA they are non-blocking anyway
        by_scaler = isinstance(getattr(self.optimizer, "grad_scale", None), torch.Tensor)
        self._gstage.copy_claimed(beside=self._capture_last
                                  and torch.get_num_threads() < usable_cores()
                                  and step_reads_grads_only(self.optimizer,
                                                            grad_scale=by_scaler))
        self._gstage.drop_unclaimed()
        self._grads_copied = copies_done(sources, self._gstage.streams)
        for name, buf in copies:
            tag, arr = bits_view(buf)
            self._grad_specs.append(raw_spec(L.GRAD + name, tag, arr, zstd))
        if scaled:
            assert clip is not None
            self._step_side["clip"] = {"scale": pack(clip[0].cpu()), "params": scaled}
        amp = {k: pack(getattr(self.optimizer, k).detach().cpu())
               for k in ("grad_scale", "found_inf")
               if isinstance(getattr(self.optimizer, k, None), torch.Tensor)}
        if amp:
            self._step_side["amp"] = amp

    def _copy_done(self) -> None:
        """Wait for the gradient copy running beside the step. A step known to only read
        its gradients (``step_reads_grads_only``) that changed one anyway (its version
        moved) may have torn the copy: the step is refused, and so is every later one
        (the log would run a step behind the optimizer); the steps before it stay."""
        if self._gstage.wait():
            return
        self._refused = ConfigError(
            f"a gradient changed during optimizer.step() while it was being copied beside "
            f"the step ({type(self.optimizer).__name__} is known to only read its "
            f"gradients): step {self._step + 1} cannot be logged, and the checkpointer "
            f"takes no later step; is another thread or a patched step writing gradients?",
            reason=Reason.STATE_MISMATCH, path=self.path)
        raise self._refused

    def _release_grads(self) -> None:
        self._gstage.wait()
        for ev in self._grads_copied:
            ev.synchronize()  # before the buffers can be reused
        self._grads_copied = []
        self._pool.give(self._grad_bufs)
        self._grad_bufs = []
        self._grad_specs = []
        self._grads = {}

    def _check_grads(self) -> None:
        """A gradient changed between our capture and the end of the step: when a pre-step
        hook ran after ours, it may have changed it before the step consumed it; capture
        it again. When ours ran last, the step itself changed it (foreach SGD with Nesterov
        momentum adds the momentum into ``.grad``) after consuming what we captured, and
        replay's step will change it again: the capture stands."""
        if self._capture_last:
            return
        for name, p in zip(self._names, self._params, strict=True):
            seen = self._grads.get(name)
            g = p.grad
            now = None if g is None else grad_ident(g)
            if seen == now:
                continue
            self._grad_specs = [s for s in self._grad_specs if s.name != L.GRAD + name]
            clip = self._step_side.get("clip")
            if clip is not None and name in clip["params"]:
                clip["params"].remove(name)
            if g is not None:
                tag, arr = to_bits(g, name)
                self._grad_specs.append(raw_spec(L.GRAD + name, tag, arr,
                                                 self.opts["grad_zstd"]))
                self._grads[name] = grad_ident(g)
            else:
                self._grads.pop(name, None)

    def _stage_layer(self, name: str, p: torch.Tensor) -> None:
        """Layer-wise capture: copy a gradient as soon as backward has produced it."""
        if p.grad is not None:
            self._gstage.stage(name, p.grad)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, foreach: bool | None = None
                        ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters, recorded as
        a scale: with ``capture="layerwise"`` the gradients staged during backward stay
        valid (replay multiplies them by the same scale with the same kernel), so no
        second copy is needed. Returns the total norm, like torch's."""
        grads = [p.grad for p in self._params if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        if not grads:
            return total
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        valid = {n for n, p in zip(self._names, self._params, strict=True)
                 if p.grad is not None and self._gstage.valid(n, p.grad)}
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in grads:
            by_device.setdefault(g.device, []).append(g)
        for dev, gs in by_device.items():
            torch._foreach_mul_(gs, coef.to(dev))
        if self.opts["capture"] == "layerwise":
            after: dict[str, int] = {}
            for n, p in zip(self._names, self._params, strict=True):
                if n in valid and p.grad is not None:
                    self._gstage.rescaled(n, p.grad)
                    after[n] = p.grad._version
            self._clip = (coef.detach(), after)
        return total

    # ------------------------------------------------------------------ after a step

    def _capture_after(self, skipped: bool) -> None:
        step = self._step
        p = _Pending(step, skipped, specs=self._grad_specs, side=self._step_side,
                     release=self._grad_bufs, copied=self._grads_copied)
        self._grad_specs, self._grad_bufs, self._step_side = [], [], {}
        self._grads_copied = []
        self._grads = {}
        if skipped:
            self._stats["skipped"] += 1
        if self.mode == "grad":
            self._capture_buffers(p)
        else:
            self._delta.capture(p.specs, p.side, lossless=self._base_due(step))
        self._capture_rng(p)
        if not self.extra_state.late:
            self._put_extra(p)
        comp = self.compressor
        if comp is not None and comp.error_feedback and self.opts["ef_state"] == "step":
            for name, prm in zip(self._names, self._params, strict=True):
                r = comp.residuals.get(prm)
                if r is None:
                    continue
                tag, arr = to_bits(r, name)
                prev = self._prev_ef.get(name)
                if prev is None or not same_bytes(prev, arr):
                    p.specs.append(raw_spec(L.EF + name, tag, arr, self.opts["ef_zstd"]))
                    self._prev_ef[name] = arr
        k = self.opts["digest_every"]
        if k and step % k == 0:
            p.extra["digest"] = (L.digest_objects(self._params, self.optimizer)
                                 if self.mode == "grad" else self._delta.digest(self._names))
        if self._base_due(step):
            self._take_base(p)
        self._pending = p
        self._stats["steps"] += 1

    def _capture_buffers(self, p: _Pending) -> None:
        for name, b in self._buffers.items():
            tag, arr = to_bits(b, name)
            prev = self._prev_bufs.get(name)
            if prev is None or not same_bytes(prev, arr):
                p.specs.append(raw_spec(name, tag, arr))
                self._prev_bufs[name] = arr

    def _capture_rng(self, p: _Pending) -> None:
        for name, arr in L.rng_states().items():
            prev = self._prev_rng.get(name)
            if prev is None or not same_bytes(prev, arr):
                p.specs.append(raw_spec(name, "U8", arr))
                self._prev_rng[name] = arr

    def _opt_state(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
        tensors: dict[str, dict[str, torch.Tensor]] = {}
        values: dict[str, Any] = {}
        for name, prm in zip(self._names, self._params, strict=True):
            st = self.optimizer.state.get(prm)
            if not st:
                continue
            t, v = L.split_state(st, f"optimizer.state[{name!r}]")
            tensors[name] = t
            values[name] = v
        return tensors, values

    def _base_due(self, step: int) -> bool:
        """A base is taken after ``step``: every ``snapshot_every`` steps (counted from the
        last base when the interval is tuned, since it changes)."""
        if self._meter.auto_snapshot:
            return step - self._last_base >= self.snapshot_every
        return step % self.snapshot_every == 0

    def _take_base(self, p: _Pending, foreground: bool = False) -> None:
        """Copy the state for a base (foreground), or ask the background worker for one."""
        t0 = time.perf_counter()
        nbytes = 0
        if not foreground and self._bg is not None and self._bg.active:
            self._bg.request(p.step)
        else:
            p.base, p.base_opt = self._stage_base()
            nbytes = sum(a.nbytes for _t, a in p.base.values())
        self._last_base = p.step
        self._meter.on_base_staged(time.perf_counter() - t0, nbytes)

    def _stage_base(self) -> tuple[dict[str, tuple[str, np.ndarray]], dict[str, Any]]:
        """A consistent copy of the full state after this step (written at finalize), laid
        out as :func:`materialize_base` lays out a base made from the log."""
        comp = self.compressor
        res = residual_tensors(self._names, self._params, comp.residuals) \
            if comp is not None and comp.error_feedback else {}
        return live_base_arrays(self._model, self._names, self._params, self.optimizer, res)

    # ------------------------------------------------------------------ finalizing

    def _sched_state(self) -> Any:
        if self.scheduler is None:
            return None
        return pack(self.scheduler.state_dict(), "scheduler.state_dict()")

    def _scaler_packed(self) -> Any:
        if self.scaler is None:
            return None
        return pack(self.scaler.state_dict(), "scaler.state_dict()")

    def _extra_packed(self) -> Any:
        if not self.extra_state.active:
            return None
        return pack(self.extra_state(), "extra_state()")

    def _put_extra(self, p: _Pending) -> None:
        extra = self._extra_packed()
        if not L.same(extra, self._extra):
            p.side["extra"] = extra
            self._extra = extra

    def _finalize(self, write_record: bool = True, hand_over: bool = True) -> None:
        """Complete the pending step with what ran after it (scheduler, scaler, any
        hyperparameter change) and hand it to the writer: now, or with ``hand_over=False``
        at :meth:`_hand_over` (the pre-step hook finalizes the previous step, the post-step
        hook hands it over: the writer's CRC and copies of a large record then run beside
        the next forward and backward rather than beside the memory-bound optimizer step)."""
        self._hand_over()  # records reach the writer in step order
        p = self._pending
        if p is None:
            return
        self._pending = None
        t0 = time.perf_counter()
        hyper = L.hyper_of(self.optimizer)
        if not L.same(hyper, self._hyper):
            p.side["hyper_after"] = hyper
            self._hyper = hyper
        sched = self._sched_state()
        if not L.same(sched, self._sched):
            p.side["sched"] = sched
            self._sched = sched
        scaler = self._scaler_packed()
        if not L.same(scaler, self._scaler_state):
            p.side["scaler"] = scaler
            self._scaler_state = scaler
        if p.skipped:
            p.side["skipped"] = True
        if self.extra_state.late and write_record:
            self._put_extra(p)
        if p.base is not None:  # its metadata is the state as of now
            p.base_meta = base_meta(p.step, hyper=self._hyper, sched=self._sched,
                                    scaler=self._scaler_state, extra=self._extra,
                                    opt=p.base_opt or {}, log=self._log_meta)
        p.write_record = write_record
        self._stats["finalize_s"] += time.perf_counter() - t0
        self._ready = p
        if hand_over:
            self._hand_over()

    def _hand_over(self) -> None:
        """Give the finalized step (if any) to the writer: its record, then its base."""
        p = self._ready
        if p is None:
            return
        self._ready = None
        t0 = time.perf_counter()
        if p.write_record:
            for ev in p.copied:
                ev.synchronize()
            decision = self._meter.on_record(p.step, sum(s.nbytes for s in p.specs),
                                             self._sink.stats())
            if decision is not None:  # auto mode changed (F, B): apply, record why
                p.extra["tuning"] = decision
                self.snapshot_every = self._meter.snapshot_every
                if self._sink.batch != self._meter.batch:
                    self._sink.set_batch(self._meter.batch)
            bufs = p.release
            pool = self._pool
            self._sink.append(p.step, p.specs, kind=self.mode, side=p.side, extra=p.extra,
                              done=(lambda: pool.give(bufs)) if bufs else None)
            self._stats["diff_bytes"] += sum(s.nbytes for s in p.specs)
        if p.base is not None:
            assert p.base_meta is not None
            tensors, meta = p.base, p.base_meta
            if self._start is not None:  # base 0 refers to initial_base's tensors
                tensors, meta = self._start.base(tensors, meta)
                self._start = None
            self._sink.write_base(p.step, tensors, meta)
            self._stats["bases"] += 1
            self._meter.publish()
        if self._bg is not None:
            self._poll_background()
        self._stats["finalize_s"] += time.perf_counter() - t0

    def _poll_background(self, results: list[dict[str, Any]] | None = None) -> None:
        """Hand durable base requests to the worker; account for the bases it made."""
        bg = self._bg
        assert bg is not None
        if results is None:
            results = bg.poll(self._sink.durable_step)
        for r in results:
            n = float(r.get("replayed", 0.0))
            self._meter.on_worker_base(float(r.get("load_s", 0.0)),
                                       float(r["replay_s"]) / n if n else None,
                                       float(r.get("write_s", 0.0)))
            self._stats["bases"] += 1
        if results:
            self._meter.publish()

    # ------------------------------------------------------------------ public API

    @property
    def step(self) -> int:
        """The last step captured (complete once the scheduler has stepped)."""
        return self._step

    @property
    def durable_step(self) -> int:
        """Newest step durable on disk with every step before it (-1: none yet)."""
        d = self._sink.durable_step
        return -1 if d is None else d

    def flush(self) -> int:
        """Complete the current step (call it after ``scheduler.step()``), then wait until
        every step so far is durable. Returns :attr:`durable_step`."""
        self._check_open()
        self._finalize()
        self._sink.flush()
        if self._bg is not None:
            self._poll_background()
        return self.durable_step

    def stats(self) -> dict[str, float]:
        """Counters: ``steps``, ``skipped`` steps, ``diff_bytes`` (encoded, before zstd),
        ``bases``, foreground seconds spent in the hooks (``capture_s``, ``finalize_s``),
        ``snapshot_every`` and ``batch`` in force, the writer's stats prefixed ``writer_``
        (see ``AsyncLogWriter.stats``) and, with background bases, the worker's prefixed
        ``background_`` (see ``BackgroundBases.stats``)."""
        out = dict(self._stats)
        out["snapshot_every"] = self.snapshot_every
        out["batch"] = self._sink.batch
        out.update({f"writer_{k}": v for k, v in self._sink.stats().items()})
        if self._bg is not None:
            out.update({f"background_{k}": v for k, v in self._bg.stats().items()})
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

    def close(self) -> None:
        """Flush, then detach every hook (the compressor too). Idempotent."""
        if self._closed:
            return
        try:
            self._gstage.wait()  # a copy in flight (a step that raised) ends first
            self._finalize()
        finally:
            self._closed = True
            self._detach()
            self._finalizer.detach()
            try:
                self._close_extras()
            finally:
                self._sink.close()

    def _close_extras(self) -> None:
        """Wait for the background bases of the steps so far, stop the worker, record the
        final measurements."""
        try:
            self._sink.flush()
            if self._bg is not None:
                self._poll_background(self._bg.close(self._sink.durable_step))
            self._meter.close(self._sink.stats())
        finally:
            if self._bg is not None:
                self._bg.abort()

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("the checkpointer is closed", reason=Reason.WRITER_CLOSED,
                              path=self.path)

    def __enter__(self) -> DiffCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------- helpers


class _AttrRestore:
    """Undo an instance attribute we set (``scaler.step``) if it is still ours."""

    def __init__(self, obj: Any, name: str, value: Any) -> None:
        self.obj, self.name, self.value = obj, name, value

    def remove(self) -> None:
        if self.obj.__dict__.get(self.name) is self.value:
            del self.obj.__dict__[self.name]


def _layer_hook(ref: weakref.ref[DiffCheckpointer], name: str) -> Callable[[torch.Tensor], None]:
    def hook(p: torch.Tensor) -> None:
        me = ref()
        if me is not None:
            me._stage_layer(name, p)
    return hook


def _drop(sink: Sink, handles: list[Any]) -> None:
    """The checkpointer was garbage-collected without close(): detach and close quietly
    (the step still pending is lost, as in a crash)."""
    for h in handles:
        try:
            h.remove()
        except Exception:
            pass
    sink.close_quietly()


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


__all__ = ["DEFAULTS", "DiffCheckpointer"]
