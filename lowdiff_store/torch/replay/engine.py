"""The replay engine: from the nearest base at or before step N, the diffs up to N.

Grad mode runs the recorded gradients through the optimizer (:class:`GradApply`); delta mode
applies weight diffs (:class:`DeltaApply`). What the side channel carries from step to step
(hyperparameters, scheduler, scaler, extra state, RNG states, residuals) is folded into one
:class:`Carried`; of the digests recorded every K steps, the last one on the way is checked
(:class:`DigestCheck`; all of them, to name the first divergent step, when it does not
match).

:class:`Replayer` reads a single log (:class:`LogReader`) or the shards of a job merged into
one view (:class:`~lowdiff_store.log.shardset.MergedReader`) through the same interface.
Whether a path is sharded is decided in :mod:`lowdiff_store.torch.api`, never here. The
functions that open a log and hand it to the engine are in :mod:`.restore`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from ... import codecs
from ...errors import (
    ConfigError,
    FormatError,
    LowdiffError,
    Reason,
    ReplayError,
    StepNotFoundError,
)
from ...format.dtypes import storage_dtype
from ...log import LogReader
from ...log.base import BaseFile, CrcQueue
from ...log.reader import BasePlan
from ...log.shardset import MergedReader, combine_digests
from ...log.streamed import StreamedBase
from ...progress import ProgressFn
from ...torchmeta import (
    BaseMeta,
    LogMeta,
    OptLayout,
    check_record_meta,
    parse,
    parse_base,
    parse_streamed,
)
from ..core import schema as L
from ..core.hook_records import hook_grads
from ..core.numerics import current as current_numerics
from ..core.numerics import prepare_replay
from ..core.optimizers import step_reads_grads_only
from ..core.tensors import (
    DTYPE_OF,
    from_bits,
    lend_bits,
    like_param,
    memory_of,
    state_like_params,
    tag_of,
    write_bits,
)
from ..core.typed_msgpack import unpack
from .prefault import Prefault
from .result import RestoreResult

#: what replay reads from: one log, or the shards of a job merged into one view
Reader = LogReader | MergedReader
#: a record as replay sees it: a log's ``Record``, a ``MergedRecord``, or either seen
#: through :class:`~lowdiff_store.torch.core.hook_records.HookGrads`
Record = Any
#: reconstructed tensors of delta mode: name -> (dtype tag, bits)
State = dict[str, tuple[str, np.ndarray]]


@dataclass
class Objects:
    """What replay writes into."""

    names: list[str]                  # optimizer-order parameter names
    params: list[torch.Tensor]
    model: dict[str, torch.Tensor]    # canonical model tensors (params and buffers)
    optimizer: torch.optim.Optimizer | None
    scheduler: Any = None
    scaler: Any = None


@dataclass(slots=True)
class Carried:
    """What the side channel carries from the base through the records, folded in step by
    step (:meth:`fold`): the packed hyperparameters the next step starts from, the packed
    scheduler/scaler/extra state, the optimizer layout (delta mode), the RNG states and
    error-feedback residuals last logged, and (``sent``, when residuals are approximated)
    every gradient entry sent since the base. After the last step: what a base needs."""

    hyper: list[Any]
    sched: Any
    scaler: Any
    extra: Any
    layout: OptLayout
    rng: dict[str, np.ndarray]
    ef: dict[str, tuple[str, np.ndarray]]
    sent: dict[str, np.ndarray] | None = None

    def fold(self, rec: Record, side: Mapping[str, Any], names: Sequence[str],
             live: Callable[[str, int], bool] | None = None) -> None:
        """Take what record ``rec`` (side channel ``side``, tensors ``names``) changes;
        ``live(name, step)`` False: a tensor a streamed base holds at a later step (its
        record entries are older than it)."""
        for n in names:
            if live is not None and not live(n, rec.step):
                continue
            if n.startswith(L.RNG):
                self.rng[n] = rec.tensor(n)
            elif n.startswith(L.EF):
                self.ef[n[len(L.EF):]] = (rec.entry(n).dtype, rec.tensor(n))
            elif self.sent is not None and n.startswith(L.GRAD):
                self._mark_sent(rec, n, self.sent)
        self.sched = side.get("sched", self.sched)
        self.scaler = side.get("scaler", self.scaler)
        self.extra = side.get("extra", self.extra)

    @staticmethod
    def _mark_sent(rec: Record, key: str, sent: dict[str, np.ndarray]) -> None:
        entry = rec.entry(key)
        if entry.codec != "sparse":
            return
        name = key[len(L.GRAD):]
        idx, _v = codecs.sparse_entries(entry.params, rec.parts(key), entry.numel)
        mask = sent.get(name)
        if mask is None:
            mask = sent[name] = np.zeros(entry.numel, dtype=bool)
        mask[idx] = True


@dataclass
class Outcome:
    """What a replay produced: the result, the error-feedback residuals (a log with a
    compressor), the optimizer state built in delta mode, what the side channel carried
    to the last step (:class:`Carried`: what a base needs) and, in delta mode, the
    reconstructed state."""

    result: RestoreResult
    residuals: dict[str, torch.Tensor] | None = None
    opt_state: dict[str, Any] | None = None
    final: Carried | None = None
    state: State = field(default_factory=dict)
    # the digest of the live parameters and optimizer state (grad mode, one log) when the
    # last replayed step's was checked: the objects are unchanged since
    live_digest: int | None = None


# ---------------------------------------------------------------------- opening a log


def log_meta(reader: LogReader) -> LogMeta:
    """The torch-level metadata of a log, parsed (ConfigError if it has none or a newer
    schema; FormatError(bad_metadata) naming the manifest if it is malformed or declares
    a dtype this build of torch lacks)."""
    meta = reader.meta.get("torch")
    if not isinstance(meta, dict) or not isinstance(meta.get("schema"), int):
        raise ConfigError("this log was not written by lowdiff_store.torch (no torch "
                          "metadata)", reason=Reason.STATE_MISMATCH, path=reader.path)
    if meta["schema"] > L.SCHEMA:
        raise ConfigError(f"torch metadata schema {meta['schema']} is newer than this build "
                          f"reads ({L.SCHEMA})", reason=Reason.UNSUPPORTED_VERSION,
                          path=reader.path)
    parsed = parse(meta, os.path.join(reader.path, "MANIFEST"))
    for n, tag, _shape in parsed.model:
        if tag not in DTYPE_OF:
            raise FormatError(f"meta.torch: model tensor {n!r} has dtype {tag}, which this "
                              f"build of torch lacks", reason=Reason.BAD_METADATA,
                              path=os.path.join(reader.path, "MANIFEST"))
    return parsed


def base_torch_meta(base: Any, meta: LogMeta) -> BaseMeta:
    """A base's ``meta["torch"]``, parsed against the log metadata ``meta`` and, for an
    unsharded log, against the tensors the base file holds (names, dtypes, shapes)."""
    tensors = None if meta.shard is not None else {n: base.info(n) for n in base.names}
    return parse_base(base.meta().get("torch"), meta, path=base.path, tensors=tensors,
                      step=getattr(base, "step", None))


def base_hyper(reader: Reader, step: int, meta: LogMeta) -> list[Any]:
    """The checked hyperparameters of the base replay of ``step`` starts from (a streamed
    base's: its first slice's; a log may hold no consistent base before ``step``)."""
    with open_start(reader, start_plan(reader, step), meta) as base:
        return base_torch_meta(base, meta).hyper


def start_plan(reader: Reader, step: int) -> BasePlan:
    """Where a replay of ``step`` by ``reader`` starts (a consistent base, or a streamed
    base's slices)."""
    if isinstance(reader, LogReader):
        return reader.start_for(step)
    return reader.chain_from(step)[0]


def open_start(reader: Reader, plan: BasePlan, meta: LogMeta) -> Any:
    """The base ``plan`` starts from, opened: a streamed base read as one
    (:func:`streamed_base`; a reader of several logs merges its own,
    ``reader.open_start``), else the base file."""
    if not plan.streamed:
        return reader.base(plan.first)
    if isinstance(reader, LogReader):
        return streamed_base(reader, plan, meta)
    return reader.open_start(plan)


def streamed_base(reader: LogReader, plan: BasePlan, meta: LogMeta) -> StreamedBase:
    """The streamed base of ``plan`` opened as one base, its slices' metadata checked and
    merged (:func:`~lowdiff_store.torchmeta.parse_streamed`: each slice's at its own step,
    every parameter's optimizer state and residual in the slice holding the parameter):
    :meth:`StreamedBase.meta` is the first slice's non-tensor state with the optimizer
    layout of every slice."""
    base = StreamedBase(reader, plan)
    try:
        base.set_meta(parse_streamed(base.metas(), meta, slices=plan.slices,
                                     held={n: base.step_of(n) for n in base.names},
                                     paths=[reader.slice_path(s) for s in plan.slices]))
    except BaseException:
        base.close()
        raise
    return base


@contextlib.contextmanager
def recorded(what: str, path: str | None, step: int | None = None) -> Iterator[None]:
    """Run torch code on recorded state (``load_state_dict``, an optimizer step, RNG
    states): an error it raises for the values (checked metadata can still hold values
    the object refuses) becomes one ``bad_metadata`` FormatError naming the file."""
    try:
        yield
    except LowdiffError as e:
        if e.path is None and path is not None:
            e.path = path
            Exception.__init__(e, str(e))
        raise
    except torch.OutOfMemoryError:
        raise  # the machine, not the file
    except (TypeError, ValueError, KeyError, IndexError, RuntimeError, AttributeError) as e:
        at = f"step {step}: " if step is not None else ""
        raise FormatError(f"{at}{what} refused the recorded state ({type(e).__name__}: "
                          f"{e})", reason=Reason.BAD_METADATA, path=path) from e


@contextlib.contextmanager
def at_record(rec: Record) -> Iterator[None]:
    """Apply or decode the record ``rec``: a LowdiffError naming no file (a stored tensor
    that does not fit the objects) gets the record's file, offset and step."""
    try:
        yield
    except LowdiffError as e:
        if e.path is None:
            e.path, e.offset = rec.path, rec.offset
            e.detail = f"step {rec.step}: {e.detail}"
            Exception.__init__(e, str(e))
        raise


def target_step(reader: LogReader, step: int | None) -> int:
    """The step a replay of ``reader`` to ``step`` (None: the newest durable step) ends
    at: StepNotFoundError when the log has no base yet or ``step`` is past it."""
    # Checked against the durable step before anything is built: the work and memory of a
    # replay follow the log, never the requested number (step=10**12 is refused at once).
    if step is not None and (type(step) is not int or step < 0):
        raise ConfigError(f"step={step!r} must be a non-negative int")
    d = reader.durable_step
    if d is None:
        raise StepNotFoundError("the log has no base yet: nothing to restore",
                                reason=Reason.NO_BASE, path=reader.path)
    if step is None:
        return d
    if step > d:
        raise StepNotFoundError(f"step {step} is past the newest durable step ({d})",
                                path=reader.path)
    return step


# ---------------------------------------------------------------------- replay


def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (Linux with glibc only), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return cast("Callable[[int], int]", fn)


_malloc_trim = _load_malloc_trim()


def _return_freed_memory() -> None:
    """Give the pages of freed heap blocks back to the system. glibc keeps a freed block
    inside its heap resident and, for blocks the size of a gradient, was not seen to
    reuse them for the optimizer state allocated next: without this the gradients dropped
    before a base is loaded stay in the process beside the new state."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def load_tensor(base: Any, name: str, dst: torch.Tensor, checks: CrcQueue | None = None
                ) -> None:
    """Put the base's tensor ``name`` into ``dst`` in place (ConfigError(state_mismatch)
    where its dtype or shape does not fit). A base that can (``read_into``: a base file,
    or shards of them) reads it straight into ``dst``'s memory when that is one span of
    this process, CRC checked there: one pass over the file and no copy of the state on
    the side (with ``checks``, a base file's CRCs run on that queue's thread while the
    next tensor is read). Otherwise the checked bits are copied (:func:`write_bits`)."""
    tag, shape = base.info(name)
    read_into = getattr(base, "read_into", None)
    if read_into is not None:
        mem = memory_of(dst, tag, shape, name)
        if mem is not None:
            if checks is not None and isinstance(base, BaseFile):
                base.read_into(name, mem, checks=checks)
            else:
                read_into(name, mem)
            return
    write_bits(dst, tag, base.tensor(name), name)


def owned_array(base: Any, name: str) -> np.ndarray:
    """The bits of the base's tensor ``name`` in a new array of its storage dtype, read
    into it as :func:`load_tensor` does."""
    tag, shape = base.info(name)
    read_into = getattr(base, "read_into", None)
    if read_into is None:
        return np.array(base.tensor(name))
    arr = np.empty(shape, dtype=storage_dtype(tag))
    read_into(name, arr)
    return arr


def empty_for(base: Any, name: str) -> torch.Tensor:
    """A new CPU tensor of the dtype and shape of the base's tensor ``name`` (contents
    undefined), to :func:`load_tensor` it into."""
    tag, shape = base.info(name)
    return torch.empty(shape, dtype=DTYPE_OF[tag])


def _raw_step(opt: torch.optim.Optimizer) -> None:
    """``opt.step()`` without step hooks (a compressor's or checkpointer's hooks must not
    act on replayed gradients) and without the LR scheduler's call counter."""
    step = type(opt).step
    inner = getattr(step, "__wrapped__", None)
    if getattr(step, "hooked", False) and inner is not None:
        inner(opt)
        return
    pre, post = opt._optimizer_step_pre_hooks, opt._optimizer_step_post_hooks
    opt._optimizer_step_pre_hooks, opt._optimizer_step_post_hooks = OrderedDict(), \
        OrderedDict()
    try:
        step(opt)
    finally:
        opt._optimizer_step_pre_hooks, opt._optimizer_step_post_hooks = pre, post


#: a step's decoded gradients by name, and the names of those lent (views of the record)
Prepared = tuple[dict[str, torch.Tensor], set[str]]


class _Recheck(Exception):
    """A digest check replay skipped may have named an earlier first divergent step (or
    none was made): replay again checking every digest."""

    def __init__(self, step: int, *, mismatch: bool) -> None:
        super().__init__(step)
        self.step = step
        self.mismatch = mismatch


class _Prefetch:
    """``(step, record, prepared)`` for each step of ``diffs``, produced by ``item(step, k)``
    on a background thread from the moment this is created, so the next step is read,
    CRC-checked and decoded while the caller runs the current one (and the first while
    the caller loads the base). Replay is then bound by ``optimizer.step()``, not by I/O
    and decoding (the spare core does those). A context manager: leaving it stops the
    thread.

    ``k`` alternates between two buffer sets: the thread prepares into one only after the
    caller is done with the step that used it (a token goes back when the next item is
    taken), so a buffer is never written while the optimizer reads it. Under two steps,
    everything runs on the caller's thread as it iterates.
    """

    def __init__(self, item: Callable[[int, int], tuple[Record, Prepared | None]],
                 diffs: Sequence[int]) -> None:
        self._item = item
        self._diffs = diffs
        self._worker: threading.Thread | None = None
        if len(diffs) < 2:
            return
        self._items: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._tokens: queue.Queue[int] = queue.Queue()
        for k in (0, 1):
            self._tokens.put(k)
        self._stop = threading.Event()
        self._worker = threading.Thread(target=self._produce, daemon=True,
                                        name="lowdiff-replay-prefetch")
        self._worker.start()

    def _produce(self) -> None:
        try:
            for t in self._diffs:
                k = self._tokens.get()
                if self._stop.is_set():
                    return
                self._items.put((t, *self._item(t, k), k))
            self._items.put(None)
        except BaseException as e:  # surfaces in the caller's thread
            self._items.put(e)

    def __iter__(self) -> Iterator[tuple[int, Record, Prepared | None]]:
        if self._worker is None:
            for t in self._diffs:
                yield (t, *self._item(t, 0))
            return
        held: int | None = None
        while True:
            got = self._items.get()
            if held is not None:
                self._tokens.put(held)  # the previous step is done with its buffers
                held = None
            if got is None:
                return
            if isinstance(got, BaseException):
                raise got
            t, rec, prepared, held = got
            yield t, rec, prepared

    def __enter__(self) -> _Prefetch:
        return self

    def __exit__(self, *exc: object) -> None:
        worker = self._worker
        if worker is None:
            return
        self._stop.set()
        self._tokens.put(0)
        self._tokens.put(1)
        while worker.is_alive():  # unblock a producer waiting to put
            try:
                self._items.get(timeout=0.05)
            except queue.Empty:
                pass
        worker.join()


def _scaled(side: Mapping[str, Any]) -> bool:
    """The step of this side channel got a grad scaler's scale (``amp.grad_scale``)."""
    amp = side.get("amp") if isinstance(side, Mapping) else None
    return isinstance(amp, Mapping) and "grad_scale" in amp


class DigestCheck:
    """The digests of one pass: a record's recorded digest is checked against the state
    after its step, except those before ``check_from`` (None: every one), which are passed
    and remembered. A mismatch after a passed digest, or no digest checked at all while
    some were passed, asks for a second pass checking every digest (:class:`_Recheck`);
    a mismatch with none passed is the first divergent step (ReplayError)."""

    def __init__(self, res: RestoreResult, apply: GradApply | DeltaApply, *, verify: bool,
                 check_from: int | None, path: str, floor: int = -1) -> None:
        self.res, self.apply, self.verify = res, apply, verify
        self.check_from, self.path = check_from, path
        #: digests before this step are not of the state replay holds (a streamed base's
        #: tensors are at different steps until it is complete): never compared
        self.floor = floor
        self.skipped: int | None = None  # the last digest passed unchecked
        self.last: tuple[int | None, int] = (None, 0)  # (step, digest) last checked

    def record(self, t: int, digest: Any) -> None:
        """Check the digest recorded at step ``t`` (an int, or absent) where it is due."""
        if not self.verify or not isinstance(digest, int) or t < self.floor:
            return
        if self.check_from is not None and t < self.check_from:
            self.skipped = t
            return
        got = self.apply.digest()
        if got != digest:
            if self.skipped is not None:  # name the first step that diverged
                raise _Recheck(t, mismatch=True)
            res = self.res
            last = res.verified[-1] if res.verified else res.base_step
            raise ReplayError(
                f"replay diverged at step {t} (last verified step {last}): state "
                f"digest {got:08x} != recorded {digest:08x}; the replayed optimizer "
                f"or device differs from training, or the log was altered"
                f"{self._unrecorded()}", path=self.path)
        self.res.verified.append(t)
        self.last = (t, got)

    def _unrecorded(self) -> str:
        """What a divergence of a log that records no numerics may come from."""
        if self.apply.rp.meta.numerics:
            return ""
        here = current_numerics(self.apply.rp.objs.params[0].device
                                if self.apply.rp.objs.params else "cpu")
        return (f" (the log records no numerics, as logs of earlier versions do; if it was "
                f"trained on another machine: here is {here.where()}; docs/torch.md, "
                f"'Exactness across machines')")

    def finish(self) -> None:
        """After the last step: digests were passed and none checked (the log's digests
        are not at its ``digest_every``): check them as they come, in a second pass."""
        if self.skipped is not None and not self.res.verified:
            raise _Recheck(self.skipped, mismatch=False)

    def at(self, step: int) -> int | None:
        """The digest checked at ``step``, or None."""
        return self.last[1] if self.last[0] == step else None


class GradApply:
    """Grad mode: the base loaded into the live objects, then each record's gradients run
    through the optimizer with the step's hyperparameters; buffers take the last values
    logged."""

    def __init__(self, rp: Replayer, base: Any, bmeta: BaseMeta, carried: Carried) -> None:
        self.rp, self.carried = rp, carried
        opt = rp.objs.optimizer
        assert opt is not None
        self.opt: torch.optim.Optimizer = opt
        rp._load_base(base, bmeta)
        self.current = carried.hyper  # the hyperparameters in the optimizer now
        self.latest: State = {}  # buffers, as last logged

    def apply(self, rec: Record, side: Mapping[str, Any], names: Sequence[str],
              prepared: Prepared | None) -> None:
        """Run the step of ``rec`` (unless training skipped it), carrying its
        hyperparameters."""
        c = self.carried
        if not side.get("skipped"):
            used = side.get("hyper", c.hyper)
            if used is not self.current:
                with recorded("the optimizer's param groups", rec.path, rec.step):
                    L.set_hyper(self.opt, used)
                self.current = used
            with recorded("the optimizer step", rec.path, rec.step):
                self.rp._step(rec, side, names, prepared)
            c.hyper = used
        c.hyper = side.get("hyper_after", c.hyper)
        buffers, live = self.rp.buffers, self.rp.live
        for n in names:
            if n in buffers and live(n, rec.step):
                self.latest[n] = (rec.entry(n).dtype, rec.tensor(n))
        self.rp.after_step(rec.step, rec, names)

    def digest(self) -> int:
        """The digest of the live state."""
        return self.rp._digest({}, self.carried.layout)

    def finish(self, out: Outcome, check: DigestCheck) -> None:
        """Leave the objects as training left them after the last step: its
        hyperparameters, no gradients, the buffers last logged."""
        rp, c = self.rp, self.carried
        if rp.per_shard is None:
            out.live_digest = check.at(out.result.step)
        if self.current is not c.hyper:
            with recorded("the optimizer's param groups", rp.reader.path):
                L.set_hyper(self.opt, c.hyper)
        for p in rp.objs.params:
            p.grad = None
        for n, (tag, arr) in self.latest.items():
            write_bits(rp.objs.model[n], tag, arr, n)


class DeltaApply:
    """Delta mode: the base's tensors, then each record's weight diffs applied to them; at
    the end the model and the optimizer state are written from the reconstructed state."""

    def __init__(self, rp: Replayer, base: Any, bmeta: BaseMeta, carried: Carried) -> None:
        self.rp, self.carried = rp, carried
        self.state: State = {n: (base.info(n)[0], owned_array(base, n))
                             for n in base.names if not n.startswith((L.RNG, L.EF))}

    def apply(self, rec: Record, side: Mapping[str, Any], names: Sequence[str],
              prepared: Prepared | None) -> None:
        """Apply the diffs of ``rec``; take its optimizer layout and hyperparameters."""
        state, live = self.state, self.rp.live
        for n in names:
            if n.startswith((L.RNG, L.EF)) or not live(n, rec.step):
                continue
            entry = rec.entry(n)
            if entry.codec == "raw":
                state[n] = (entry.dtype, np.array(rec.tensor(n)))
                continue
            old = state.get(n)
            if old is None:
                raise ConfigError(f"step {rec.step}: diff of {n} has nothing to apply to",
                                  reason=Reason.STATE_MISMATCH, path=rec.path)
            if tuple(entry.shape) != old[1].shape:
                # a lossy diff would be added with numpy broadcasting, every entry moved
                raise ConfigError(f"the diff of {n} has shape {list(entry.shape)}, the "
                                  f"tensor {list(old[1].shape)}",
                                  reason=Reason.STATE_MISMATCH)
            # np.asarray: a codec may hand back a numpy scalar for a 0-d tensor
            if entry.codec == "xor":
                state[n] = (old[0], np.asarray(rec.tensor(n, ref=old[1])))
            else:
                state[n] = (old[0], L.apply_delta(old[0], old[1], np.asarray(rec.tensor(n))))
        c = self.carried
        if "opt_layout" in side:
            c.layout = OptLayout.of(side["opt_layout"])
        c.hyper = side.get("hyper_after", side.get("hyper", c.hyper))

    def digest(self) -> int:
        """The digest of the reconstructed state."""
        self.check_layout()
        return self.rp._digest(self.state, self.carried.layout)

    def check_layout(self) -> None:
        """Every model tensor and every optimizer state tensor the layout names is in the
        reconstructed state."""
        layout = self.carried.layout
        need = [n for n in self.rp.objs.model] + [L.opt_name(n, k) for n, keys in
                                                  layout.tensors.items() for k in keys]
        missing = next((n for n in need if n not in self.state), None)
        if missing is not None:
            raise FormatError(f"the optimizer layout or model names {missing!r}, which "
                              f"neither the base nor the diffs hold",
                              reason=Reason.BAD_METADATA, path=self.rp.reader.path)

    def finish(self, out: Outcome, check: DigestCheck) -> None:
        """Write the model and the optimizer state (built from the layout and the
        hyperparameters carried) from the reconstructed state."""
        rp, state, c = self.rp, self.state, self.carried
        objs = rp.objs
        self.check_layout()
        for n, t in objs.model.items():
            tag, arr = state[n]
            write_bits(t, tag, arr, n)
        tensors = {n: {k: from_bits(*state[L.opt_name(n, k)]) for k in keys}
                   for n, keys in c.layout.tensors.items()}
        sd = L.build_optimizer_state(objs.names, rp.meta.groups, c.hyper, tensors,
                                     c.layout.values)
        if objs.optimizer is not None:
            with recorded("the optimizer's load_state_dict", rp.reader.path):
                objs.optimizer.load_state_dict(state_like_params(sd, objs.params))
        out.opt_state = sd
        out.state = state


class Replayer:
    """Replays one log (or a job's shards merged) into :class:`Objects`: see the module
    docstring. ``apply_rng``: set the process's RNG generators to the replayed states (off
    to build a base)."""

    #: set the process's RNG generators to the replayed states (off to build a base)
    apply_rng = True

    def __init__(self, reader: Reader, meta: LogMeta, objs: Objects, *,
                 verify: bool, progress: ProgressFn | None,
                 shard_owned: Sequence[Collection[str]] | None = None) -> None:
        """``reader``: one log, or several shards merged (:class:`MergedReader`); then
        ``shard_owned`` lists the parameters each shard logged, and a step's digest is
        checked as the combination of the shards' digests."""
        self.reader = reader
        self.params_meta = {n: (t, s) for n, t, s in meta.model}
        pos = {n: i for i, n in enumerate(objs.names)}
        self.per_shard = None if shard_owned is None else [
            [objs.params[pos[n]] for n in objs.names if n in owned] for owned in shard_owned]
        self.meta = meta
        self.objs = objs
        self.verify = verify
        self.progress = progress
        self.mode = meta.mode
        self.buffers = frozenset(meta.buffers)
        self.grads: dict[str, torch.Tensor] = {}
        self._scaled: dict[str, torch.Tensor] = {}  # clipped copies of lent gradients
        self._owned: dict[str, torch.Tensor] = {}  # copies of lent gradients (see _step)
        comp = meta.compressor
        self.ef = comp is not None and comp.error_feedback
        self.ef_logged = comp is not None and comp.ef_state == "step"
        #: a streamed base: the step after which it holds each tensor (see :meth:`live`)
        self.held: dict[str, int] = {}

    def live(self, name: str, step: int) -> bool:
        """Whether a record entry ``name`` (a tensor, or ``@grad/`` of a parameter) of
        ``step`` applies: always from a base; from a streamed base, only at the steps
        after the slice holding the tensor (the entries of earlier steps are in it)."""
        if not self.held:
            return True
        if name.startswith(L.GRAD):
            name = name[len(L.GRAD):]
        return self.held.get(name, -1) < step

    def run(self, step: int) -> Outcome:
        """Replay to ``step``. On failure the parameters' gradients are cleared, as on
        success: they are replay's (lent views of the log's records, or its buffers), and
        a caller going on after the error must not find them, or keep the records' map
        alive through them.

        Digests (``verify``): where the log records them every ``digest_every`` steps, only
        those at or after the last such step on the way are checked. A match there proves
        the replayed state is training's, bit for bit; the earlier checks could add nothing
        to that, and each costs a pass over the whole state. On a mismatch, the chain is
        replayed again checking every digest, to name the first step that diverged."""
        try:
            notes, exact = self._numerics(step)
            try:
                out = self._run(step, every=False)
            except _Recheck as late:
                out = self._run(step, every=True)
                if late.mismatch:
                    out.result.notes.append(
                        f"the state at step {late.step} did not match its recorded digest in "
                        f"a first replay and matched in a second one: replay is not "
                        f"deterministic here; the objects hold the second replay's state")
            out.result.notes[:0] = notes
            out.result.exact = out.result.exact and exact
            return out
        except BaseException:
            if self.mode == "grad":
                for p in self.objs.params:
                    p.grad = None
            raise

    def _numerics(self, step: int) -> tuple[list[str], bool]:
        """Before a grad-mode replay: the numerics its steps were trained under, made this
        process's where they can be, or the replay refused before it starts
        (:func:`~lowdiff_store.torch.core.numerics.prepare_replay`)."""
        if self.mode != "grad" or not self.meta.numerics:
            return [], True
        b = self._plan(step)[0].first
        device = self.objs.params[0].device if self.objs.params else "cpu"
        return prepare_replay(self.meta.numerics, b + 1, step, device, verify=self.verify,
                              path=self.reader.path)

    def _plan(self, step: int) -> tuple[BasePlan, list[int]]:
        """Where replay of ``step`` starts and the diffs it replays: the newest base or
        complete streamed base (a job's merged shards: the newest base)."""
        return self.reader.chain_from(step)

    def _run(self, step: int, *, every: bool) -> Outcome:
        plan, diffs = self._plan(step)
        with open_start(self.reader, plan, self.meta) as base:
            # (before the prefetch thread decodes a record: it leaves out what is held)
            self.held = {n: base.step_of(n) for n in base.names} if plan.streamed else {}
            # the first diffs are read and decoded beside the base load
            with self._prefetched(self.reader, diffs) as feed:
                return self._replay(step, plan, base, diffs, feed, every)

    def _check_from(self, step: int, every: bool) -> int | None:
        """The first step whose digest is checked: the last multiple of the log's
        ``digest_every`` up to ``step``; None: check every digest."""
        k = self.meta.digest_every
        if every or k is None or k <= 0:
            return None
        return step - step % k

    def _replay(self, step: int, plan: BasePlan, base: Any, diffs: Sequence[int],
                feed: _Prefetch, every: bool) -> Outcome:
        res = RestoreResult(step=step, base_step=plan.complete, replayed=len(diffs),
                            base_slices=list(plan.slices) if plan.streamed else [])
        apply, carried = self._open_base(base, plan, step)
        live = self.live if self.held else None
        check = DigestCheck(res, apply, verify=self.verify,
                            check_from=self._check_from(step, every), path=self.reader.path,
                            floor=plan.complete)
        total = len(diffs)
        if self.progress is not None:
            self.progress(0, total)
        for i, (t, rec, prepared) in enumerate(feed):
            names = rec.names
            meta = rec.meta
            side = check_record_meta(meta, self.meta, names,
                                     side=None if "side" in meta else rec.side,
                                     path=rec.path, offset=rec.offset, step=t)
            with at_record(rec):
                apply.apply(rec, side, names, prepared)
                carried.fold(rec, side, names, live)
            check.record(t, meta.get("digest"))
            if self.progress is not None:
                self.progress(i + 1, total)
        check.finish()
        return self._finish(res, apply, carried, check)

    def _open_base(self, base: Any, plan: BasePlan, step: int
                   ) -> tuple[GradApply | DeltaApply, Carried]:
        """The base of ``plan`` read: the objects (grad mode) or the state (delta mode)
        loaded, and what it carries into the records. A streamed base is read as one base
        (:class:`~lowdiff_store.log.streamed.StreamedBase`) whose non-tensor state is its
        first slice's, and :attr:`held` says at which step each of its tensors is."""
        bmeta = base_torch_meta(base, self.meta)
        approx_ef = self.ef and not self.ef_logged and (step != plan.first or bmeta.ef_approx)
        carried = Carried(
            bmeta.hyper, bmeta.sched, bmeta.scaler, bmeta.extra, bmeta.opt,
            {n: base.tensor(n) for n in base.names if n.startswith(L.RNG)},
            {n[len(L.EF):]: (base.info(n)[0], base.tensor(n)) for n in base.names
             if n.startswith(L.EF)},
            {} if approx_ef else None)
        kind = GradApply if self.mode == "grad" else DeltaApply
        return kind(self, base, bmeta, carried), carried

    def _finish(self, res: RestoreResult, apply: GradApply | DeltaApply, carried: Carried,
                check: DigestCheck) -> Outcome:
        out = Outcome(res, final=carried)
        apply.finish(out, check)
        if self.apply_rng:
            with recorded("the RNG state", self.reader.path):
                res.notes += L.set_rng_states(carried.rng)
        res.extra = unpack(carried.extra) if carried.extra is not None else None
        self._finish_sched_scaler(carried.sched, carried.scaler, res)
        if self.ef:
            out.residuals = self._residuals(carried, res)
        return out

    # -- grad mode

    def after_step(self, t: int, rec: Record, names: Sequence[str]) -> None:
        """Seam for events a record holds beyond the optimizer step (local-update
        training's synchronizations: :mod:`lowdiff_store.torch.distributed.local_sgd`),
        applied after step ``t``'s optimizer step and before its digest is checked."""

    def _load_base(self, base: Any, bmeta: BaseMeta) -> None:
        """The base into the live objects, in the file's order, each tensor read straight
        into its destination (:func:`load_tensor`): the model's own tensors, and new
        optimizer state tensors, made resident on a helper thread while the model's are
        read (:class:`~.prefault.Prefault`), the CRCs of a base file's tensors on a thread of
        their own while the next tensor is read. The parameters' gradients are dropped first
        (replay leaves none): their memory is free before the optimizer state is built."""
        objs = self.objs
        if any(p.grad is not None for p in objs.params):
            for p in objs.params:
                p.grad = None
            _return_freed_memory()
        opt = objs.optimizer
        assert opt is not None
        lay = bmeta.opt
        names = [L.opt_name(n, k) for n, keys in lay.tensors.items() for k in keys]
        fresh = [empty_for(base, n) for n in names]
        with Prefault(fresh) as touch, CrcQueue() as checks:
            for n, t in objs.model.items():
                load_tensor(base, n, t, checks)
            with recorded("the optimizer's param groups", base.path):
                L.check_hyper(opt, bmeta.hyper)
            for i, (n, t) in enumerate(zip(names, fresh, strict=True)):
                touch.ready(i)
                load_tensor(base, n, t, checks)
            checks.wait()  # (the last tensors' CRCs: every one is checked before use)
        it = iter(fresh)
        tensors = {n: {k: next(it) for k in keys} for n, keys in lay.tensors.items()}
        with recorded("the optimizer's load_state_dict", base.path):
            opt.load_state_dict(state_like_params(L.build_optimizer_state(
                objs.names, self.meta.groups, bmeta.hyper, tensors, lay.values), objs.params))

    def _record(self, t: int) -> Record:
        # hook messages (PowerSGD factors, fp16/bf16 buffers) read as plain gradients
        rec: Record = hook_grads(self.reader.record(t), self.params_meta)
        return rec

    def _prefetched(self, r: Reader, diffs: Sequence[int]) -> _Prefetch:
        """The diffs' records, each with its decoded gradients (grad mode), read ahead: see
        :class:`_Prefetch`."""
        grad_mode = self.mode == "grad"
        sets: list[dict[str, torch.Tensor]] = [self.grads, {}]

        def item(t: int, k: int) -> tuple[Record, Prepared | None]:
            rec = self._record(t)
            with at_record(rec):
                return rec, (self._decode_grads(rec, sets[k]) if grad_mode else None)

        return _Prefetch(item, diffs)

    def _decode_grads(self, rec: Record, bufs: dict[str, torch.Tensor]) -> Prepared:
        """Decode the record's gradients into ``bufs`` (allocated on first use).

        A dense gradient whose decoded array is writable memory of the right dtype and
        shape (a raw part of a copy-on-write mapped record, or a freshly decompressed one)
        is lent to the optimizer as it is, with no copy, when its step only reads
        gradients (:func:`~.optim_wrap.step_reads_grads_only`): the copy of every gradient
        byte was a third of replay's memory traffic beside the optimizer. Replay's own
        clips go to its own buffers. Returns the gradients by name and the names of the
        lent ones.
        """
        have = set(rec.names)
        # A gradient naming no parameter of the log would be passed over, its parameter
        # (when it took that one's place) never stepped: a state that is not training's
        for key in have:
            if key.startswith(L.GRAD) and (key[len(L.GRAD):] not in self.params_meta
                                           or key[len(L.GRAD):] in self.buffers):
                raise FormatError(f"the record holds {key!r}, the gradient of no parameter "
                                  f"of the log", reason=Reason.BAD_METADATA)
        out: dict[str, torch.Tensor] = {}
        lent_names: set[str] = set()
        # Lend the log's mapped gradients only to a step that never writes them (a write
        # would change this process's private map, which a second pass reads again). A
        # hint from the param groups as they are now, on the prefetch thread: _step
        # decides with the step's own hyperparameters and copies what it must.
        opt = self.objs.optimizer
        lend = opt is not None and step_reads_grads_only(opt, grad_scale=_scaled(rec.side))
        for name, p in zip(self.objs.names, self.objs.params, strict=True):
            key = L.GRAD + name
            if key not in have or not self.live(name, rec.step):
                continue
            entry = rec.entry(key)
            if entry.codec != "sparse":
                arr = rec.tensor(key)
                lent = lend_bits(entry.dtype, arr, p) if lend else None
                if lent is not None:
                    out[name] = lent
                    lent_names.add(name)
                    continue
            g = bufs.get(name)
            if g is None:
                g = bufs[name] = torch.empty_like(p, memory_format=torch.contiguous_format)
            if entry.codec == "sparse":
                if entry.dtype != tag_of(p) or tuple(entry.shape) != tuple(p.shape):
                    raise ConfigError(f"step {rec.step}: gradient {name} does not fit the "
                                      f"parameter", reason=Reason.STATE_MISMATCH,
                                      path=rec.path)
                idx, vals = codecs.sparse_entries(entry.params, rec.parts(key), entry.numel)
                with torch.no_grad():
                    g.zero_()
                    g.view(-1)[torch.from_numpy(idx).to(g.device)] = \
                        from_bits(entry.dtype, vals, g.device)
            else:
                write_bits(g, entry.dtype, arr, key)
            out[name] = g
        return out, lent_names

    def _step(self, rec: Record, side: Mapping[str, Any], names: Sequence[str],
              prepared: Prepared | None = None) -> None:
        opt = self.objs.optimizer
        assert opt is not None
        by_name, lent = prepared if prepared is not None else \
            self._decode_grads(rec, self.grads)
        lent = set(lent)  # still views of the log's map
        by_name = dict(by_name)
        clip = side.get("clip")
        if clip is not None:
            coef = unpack(clip["scale"])
            with torch.no_grad():
                # A lent (mapped) gradient is scaled into a buffer of our own in one pass
                # (the same product as the in-place multiply of training's clip); the
                # others in place, as clip_grad_norm_ does.
                by_dev: dict[torch.device, list[torch.Tensor]] = {}
                for n in clip["params"]:
                    if n not in by_name and not self.live(n, rec.step):
                        continue  # (held by a streamed base at a later step)
                    g = by_name[n]
                    if n in lent:
                        buf = self._scaled.get(n)
                        if buf is None:
                            buf = self._scaled[n] = torch.empty_like(g)
                        torch.mul(g, coef.to(g.device), out=buf)
                        by_name[n] = buf
                        lent.discard(n)
                        continue
                    by_dev.setdefault(g.device, []).append(g)
                for dev, lst in by_dev.items():
                    torch._foreach_mul_(lst, coef.to(dev))
        amp = side.get("amp")
        if lent and not step_reads_grads_only(opt, grad_scale=_scaled(side)):
            # the step, with the hyperparameters now in place (the base's, this record's),
            # may write its gradients: it gets copies, never the log's map
            for n in lent:
                buf = self._owned.get(n)
                if buf is None:
                    buf = self._owned[n] = torch.empty_like(by_name[n])
                buf.copy_(by_name[n])
                by_name[n] = buf
        for name, p in zip(self.objs.names, self.objs.params, strict=True):
            p.grad = like_param(by_name.get(name), p)
        dev = self.objs.params[0].device if self.objs.params else torch.device("cpu")
        if amp:
            for k, v in amp.items():
                setattr(opt, k, unpack(v).to(dev))
        try:
            _raw_step(opt)
        finally:
            if amp:
                for k in amp:
                    if hasattr(opt, k):
                        delattr(opt, k)

    def _residuals(self, carried: Carried, res: RestoreResult) -> dict[str, torch.Tensor]:
        """The error-feedback residuals after the last step: the last logged; when they
        are logged only in bases and this is not one (``carried.sent``), the base's with
        every entry sent since zeroed (then ``res`` says it is approximate)."""
        ef, sent = carried.ef, carried.sent
        out: dict[str, torch.Tensor] = {}
        for name, p in zip(self.objs.names, self.objs.params, strict=True):
            if name not in ef:
                continue
            tag, arr = ef[name]
            if tuple(arr.shape) != tuple(p.shape):
                raise FormatError(f"the error-feedback residual of {name} has shape "
                                  f"{list(arr.shape)}, the parameter {list(p.shape)}",
                                  reason=Reason.BAD_METADATA, path=self.reader.path)
            r = from_bits(tag, arr, p.device)
            if sent is not None and name in sent:
                r.view(-1)[torch.from_numpy(np.flatnonzero(sent[name])).to(p.device)] = 0
            out[name] = r
        if sent is not None:
            res.exact = False
            res.notes.append(
                f"error-feedback residuals are approximate: step {res.step} is not a base "
                f"(the newest is {res.base_step}) and residuals are logged only in bases "
                f"(ef_state='base'); restored = the residual of base {res.base_step} with every "
                f"entry sent since then zeroed. Weights and optimizer state are exact; "
                f"training continued from here is not bitwise the original run")
        return out

    def _digest(self, state: Mapping[str, tuple[str, np.ndarray]], layout: OptLayout) -> int:
        """The state digest: of the live objects (grad mode; per shard, combined, for a
        job's shards merged) or of the reconstructed ``state`` under ``layout``."""
        if self.mode == "grad":
            opt = self.objs.optimizer
            assert opt is not None
            if self.per_shard is not None:
                return combine_digests(L.digest_objects(ps, opt) for ps in self.per_shard)
            return L.digest_objects(self.objs.params, opt)
        return L.digest_parts(
            (state[n][1], [(k, state[L.opt_name(n, k)][1])
                           for k in layout.tensors.get(n, [])]
             + list(layout.values.get(n, {}).items()))
            for n in self.objs.names)

    def _finish_sched_scaler(self, sched: Any, scaler: Any, res: RestoreResult) -> None:
        objs = self.objs
        if sched is not None:
            if objs.scheduler is not None:
                with recorded("the scheduler's load_state_dict", self.reader.path):
                    objs.scheduler.load_state_dict(unpack(sched))
            elif objs.optimizer is not None:
                res.notes.append("the log holds scheduler state; no scheduler was given")
        if scaler is not None:
            if objs.scaler is not None:
                with recorded("the GradScaler's load_state_dict", self.reader.path):
                    objs.scaler.load_state_dict(unpack(scaler))
            elif objs.optimizer is not None:
                res.notes.append("the log holds GradScaler state; no scaler was given")


# ---------------------------------------------------------------------- public functions


__all__ = ["Carried", "DeltaApply", "DigestCheck", "GradApply", "Objects", "Outcome",
           "Reader", "Replayer", "RestoreResult", "base_hyper", "base_torch_meta", "log_meta",
           "open_start", "recorded", "start_plan", "target_step"]
