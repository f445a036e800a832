"""Reconstruction: nearest base at or before step N, then the diffs up to N.

Grad mode runs the recorded gradients through the optimizer (the same object for
:func:`restore_log`; one rebuilt from an allow-list for :func:`replay_log_state`); delta mode
applies weight diffs. Of the digests recorded every K steps, the last one on the way is
checked (all of them, to name the first divergent step, when it does not match).

:class:`Replayer` is the one replay engine: it reads a single log (:class:`LogReader`) or
the shards of a job merged into one view (:class:`~lowdiff_store.log.shardset.MergedReader`)
through the same interface. Whether a path is sharded is decided in
:mod:`lowdiff_store.torch.api`, never here.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

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
from ...log import LogReader
from ...log.shardset import MergedReader, combine_digests
from ...progress import ProgressFn
from ...torchmeta import check_base_meta, check_log_meta, check_record_meta
from ..compressors.topk import GradCompressor
from ..core import schema as L
from ..core.hook_records import hook_grads
from ..core.optimizers import step_reads_grads_only
from ..core.registry import RestoreInfo, remember
from ..core.tensors import DTYPE_OF, from_bits, lend_bits, model_entries, tag_of, write_bits
from ..core.typed_msgpack import unpack

#: what replay reads from: one log, or the shards of a job merged into one view
Reader = LogReader | MergedReader
#: a record as replay sees it: a log's ``Record``, a ``MergedRecord``, or either seen
#: through :class:`~lowdiff_store.torch.distributed.hooks.HookGrads`
Record = Any


@dataclass
class RestoreResult:
    """What :func:`restore` put into the objects.

    Attributes:
        step: the step the objects now hold.
        extra: what ``extra_state()`` returned at that step, or None.
        base_step: the base replay started from.
        replayed: number of diffs replayed.
        verified: steps whose recorded digest was checked (and matched).
        exact: every piece of state is bit-exact; False only when an error-feedback
            residual had to be approximated (see ``notes`` and docs/torch.md).
        notes: human-readable remarks (approximations, state not restored).
        info: what a :class:`DiffCheckpointer` created next on the objects continues from
            (pass this result as ``DiffCheckpointer(..., restored=)``; without it the
            checkpointer finds it by the optimizer, see
            :mod:`~lowdiff_store.torch.core.registry`).
    """

    step: int
    extra: Any = None
    base_step: int = 0
    replayed: int = 0
    verified: list[int] = field(default_factory=list)
    exact: bool = True
    notes: list[str] = field(default_factory=list)
    info: RestoreInfo | None = field(default=None, repr=False, compare=False)


@dataclass
class Objects:
    """What replay writes into."""

    names: list[str]                  # optimizer-order parameter names
    params: list[torch.Tensor]
    model: dict[str, torch.Tensor]    # canonical model tensors (params and buffers)
    optimizer: torch.optim.Optimizer | None
    scheduler: Any = None
    scaler: Any = None


@dataclass
class Outcome:
    result: RestoreResult
    residuals: dict[str, torch.Tensor] | None = None
    opt_state: dict[str, Any] | None = None
    # the packed side state after the last step (hyper, sched, scaler, extra), the RNG
    # states, and in delta mode the state arrays and layout: what a base needs
    final: dict[str, Any] = field(default_factory=dict)
    # the digest of the live parameters and optimizer state (grad mode, one log) when the
    # last replayed step's was checked: the objects are unchanged since
    live_digest: int | None = None


# ---------------------------------------------------------------------- opening a log


def log_meta(reader: LogReader) -> dict[str, Any]:
    """The torch-level metadata of a log (ConfigError if it has none)."""
    meta = reader.meta.get("torch")
    if not isinstance(meta, dict) or not isinstance(meta.get("schema"), int):
        raise ConfigError("this log was not written by lowdiff_store.torch (no torch "
                          "metadata)", reason=Reason.STATE_MISMATCH, path=reader.path)
    if meta["schema"] > L.SCHEMA:
        raise ConfigError(f"torch metadata schema {meta['schema']} is newer than this build "
                          f"reads ({L.SCHEMA})", reason=Reason.UNSUPPORTED_VERSION,
                          path=reader.path)
    check_log_meta(meta, os.path.join(reader.path, "MANIFEST"))
    for n, tag, _shape in meta["model"]:
        if tag not in DTYPE_OF:
            raise FormatError(f"meta.torch: model tensor {n!r} has dtype {tag}, which this "
                              f"build of torch lacks", reason=Reason.BAD_METADATA,
                              path=os.path.join(reader.path, "MANIFEST"))
    return {**meta, "optimizer": L.current_class_name(meta["optimizer"])}


def base_torch_meta(base: Any, meta: Mapping[str, Any]) -> dict[str, Any]:
    """A base's ``meta["torch"]``, checked against the log metadata ``meta`` and, for an
    unsharded log, against the tensors the base file holds (names, dtypes, shapes)."""
    tensors = None if "shard" in meta else {n: base.info(n) for n in base.names}
    return check_base_meta(base.meta().get("torch"), meta, path=base.path, tensors=tensors,
                           step=getattr(base, "step", None))


def base_hyper(reader: Reader, step: int, meta: Mapping[str, Any]) -> list[Any]:
    """The checked hyperparameters of the base replay of ``step`` starts from."""
    with reader.base(reader.base_for(step)) as base:
        hyper: list[Any] = base_torch_meta(base, meta)["hyper"]
    return hyper


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


def target_step(reader: LogReader, step: int | None) -> int:
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


def check_objects(meta: Mapping[str, Any], objs: Objects, path: str) -> None:
    want = [[n, t, list(s)] for n, t, s in meta["model"]]
    have = [[n, tag_of(t, n), list(t.shape)] for n, t in objs.model.items()]
    if want != have:
        diff = next((f"{w} vs {h}" for w, h in zip(want, have, strict=False) if w != h),
                    f"{len(want)} tensors vs {len(have)}")
        raise ConfigError(f"the model does not match the log's ({diff})",
                          reason=Reason.STATE_MISMATCH, path=path)
    if objs.names != list(meta["params"]):
        raise ConfigError("the optimizer's parameters (order or names) differ from the log's",
                          reason=Reason.STATE_MISMATCH, path=path)
    opt = objs.optimizer
    if opt is not None:
        if L.class_name(opt) != meta["optimizer"]:
            raise ConfigError(f"the log was written with {meta['optimizer']}, the optimizer "
                              f"is {L.class_name(opt)}", reason=Reason.STATE_MISMATCH,
                              path=path)
        if [len(g["params"]) for g in opt.param_groups] != list(meta["groups"]):
            raise ConfigError("the optimizer's param groups differ from the log's",
                              reason=Reason.STATE_MISMATCH, path=path)
    check_classes(meta, objs.scheduler, objs.scaler, path)


def check_classes(meta: Mapping[str, Any], scheduler: Any, scaler: Any, path: str) -> None:
    """The scheduler and the GradScaler are of the classes the log was written with (or
    subclasses of them): their state means something else in another class. A log that
    recorded no class name (a scaler recorded as a bool, by earlier versions) is not
    checked."""
    for what, obj, key in (("scheduler", scheduler, "scheduler"),
                           ("GradScaler", scaler, "scaler")):
        recorded_cls = meta.get(key)
        if obj is None or not isinstance(recorded_cls, str):
            continue
        if recorded_cls not in {f"{c.__module__}.{c.__qualname__}"
                                for c in type(obj).__mro__}:
            raise ConfigError(f"the log was written with the {what} {recorded_cls}, the "
                              f"{what} is {L.class_name(obj)}", reason=Reason.STATE_MISMATCH,
                              path=path)


def objects_for(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                scaler: Any) -> Objects:
    """Names of live objects, as the checkpointer records them."""
    tensors, _aliases, buffers, _order = model_entries(model)
    by_id = {id(t): n for n, t in tensors.items() if n not in buffers}
    params = L.params_of(optimizer)
    try:
        names = [by_id[id(p)] for p in params]
    except KeyError:
        raise ConfigError("the optimizer holds a parameter that is not in the model",
                          reason=Reason.STATE_MISMATCH) from None
    return Objects(names, params, tensors, optimizer, scheduler, scaler)


# ---------------------------------------------------------------------- replay


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


class Replayer:
    #: set the process's RNG generators to the replayed states (off to build a base)
    apply_rng = True

    def __init__(self, reader: Reader, meta: Mapping[str, Any], objs: Objects, *,
                 verify: bool, progress: ProgressFn | None,
                 shard_owned: Sequence[Collection[str]] | None = None) -> None:
        """``reader``: one log, or several shards merged (:class:`MergedReader`); then
        ``shard_owned`` lists the parameters each shard logged, and a step's digest is
        checked as the combination of the shards' digests."""
        self.reader = reader
        self.params_meta = {n: (t, tuple(s)) for n, t, s in meta["model"]}
        pos = {n: i for i, n in enumerate(objs.names)}
        self._per_shard = None if shard_owned is None else [
            [objs.params[pos[n]] for n in objs.names if n in owned] for owned in shard_owned]
        self.meta = meta
        self.objs = objs
        self.verify = verify
        self.progress = progress
        self.mode = meta["mode"]
        self.buffers = set(meta["buffers"])
        self.grads: dict[str, torch.Tensor] = {}
        self._scaled: dict[str, torch.Tensor] = {}  # clipped copies of lent gradients
        self._owned: dict[str, torch.Tensor] = {}  # copies of lent gradients (see _step)
        comp = meta.get("compressor") or {}
        self.ef = bool(comp.get("error_feedback"))
        self.ef_logged = comp.get("ef_state") == "step"

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
            try:
                return self._run(step, every=False)
            except _Recheck as late:
                out = self._run(step, every=True)
                if late.mismatch:
                    out.result.notes.append(
                        f"the state at step {late.step} did not match its recorded digest in "
                        f"a first replay and matched in a second one: replay is not "
                        f"deterministic here; the objects hold the second replay's state")
                return out
        except BaseException:
            if self.mode == "grad":
                for p in self.objs.params:
                    p.grad = None
            raise

    def _run(self, step: int, *, every: bool) -> Outcome:
        r = self.reader
        b, diffs = r.chain(step)
        # the first diffs are read and decoded beside the base load
        with self._prefetched(r, diffs) as feed:
            return self._replay(step, b, diffs, feed, every)

    def _check_from(self, step: int, every: bool) -> int | None:
        """The first step whose digest is checked: the last multiple of the log's
        ``digest_every`` up to ``step``; None: check every digest."""
        k = self.meta.get("digest_every")
        if every or type(k) is not int or k <= 0:
            return None
        return step - step % k

    def _replay(self, step: int, b: int, diffs: Sequence[int], feed: _Prefetch,
                every: bool) -> Outcome:
        r = self.reader
        res = RestoreResult(step=step, base_step=b, replayed=len(diffs))
        with r.base(b) as base:
            bmeta = base_torch_meta(base, self.meta)
            rng = {n: base.tensor(n) for n in base.names if n.startswith("@rng/")}
            ef = {n[len(L.EF):]: (base.info(n)[0], base.tensor(n)) for n in base.names
                  if n.startswith(L.EF)}
            state: dict[str, tuple[str, np.ndarray]] = {}
            latest: dict[str, tuple[str, np.ndarray]] = {}
            if self.mode == "grad":
                self._load_base(base, bmeta)
            else:
                state = {n: (base.info(n)[0], np.array(base.tensor(n))) for n in base.names
                         if not n.startswith(("@rng/", L.EF))}
        layout = bmeta.get("opt") or {"tensors": {}, "values": {}}
        carry: list[Any] = bmeta["hyper"]
        current = carry
        sched, scaler, extra = bmeta.get("sched"), bmeta.get("scaler"), bmeta.get("extra")
        sent: dict[str, np.ndarray] = {}
        approx_ef = self.ef and not self.ef_logged and (step != b
                                                         or bool(bmeta.get("ef_approx")))
        total = len(diffs)
        last_digest: tuple[int | None, int] = (None, 0)
        check_from = self._check_from(step, every)
        skipped: int | None = None  # the last digest passed unchecked
        if self.progress is not None:
            self.progress(0, total)
        opt = self.objs.optimizer
        for i, (t, rec, prepared) in enumerate(feed):
            names = rec.names
            raw = rec.meta if "side" in rec.meta else {**rec.meta, "side": rec.side}
            side = check_record_meta(raw, self.meta, names,
                                     path=rec.path, offset=rec.offset, step=t)
            if self.mode == "grad":
                assert opt is not None
                if not side.get("skipped"):
                    used = side.get("hyper", carry)
                    if used is not current:
                        with recorded("the optimizer's param groups", rec.path, t):
                            L.set_hyper(opt, used)
                        current = used
                    with recorded("the optimizer step", rec.path, t):
                        self._step(rec, side, names, prepared)
                    carry = used
                carry = side.get("hyper_after", carry)
                for n in names:
                    if n in self.buffers:
                        latest[n] = (rec.entry(n).dtype, rec.tensor(n))
            else:
                self._apply_diffs(rec, names, state)
                layout = side.get("opt_layout", layout)
                carry = side.get("hyper_after", side.get("hyper", carry))
            for n in names:
                if n.startswith("@rng/"):
                    rng[n] = rec.tensor(n)
                elif n.startswith(L.EF):
                    ef[n[len(L.EF):]] = (rec.entry(n).dtype, rec.tensor(n))
                elif approx_ef and n.startswith(L.GRAD):
                    self._mark_sent(rec, n, sent)
            sched = side.get("sched", sched)
            scaler = side.get("scaler", scaler)
            extra = side.get("extra", extra)
            digest = rec.meta.get("digest")
            if self.verify and isinstance(digest, int):
                if check_from is not None and t < check_from:
                    skipped = t
                    digest = None
            if self.verify and isinstance(digest, int):
                if self.mode != "grad":
                    self._check_layout(state, layout)
                got = self._digest(state, layout)
                if got != digest:
                    if skipped is not None:  # name the first step that diverged
                        raise _Recheck(t, mismatch=True)
                    last = res.verified[-1] if res.verified else b
                    raise ReplayError(
                        f"replay diverged at step {t} (last verified step {last}): state "
                        f"digest {got:08x} != recorded {digest:08x}; the replayed optimizer "
                        f"or device differs from training, or the log was altered",
                        path=r.path)
                res.verified.append(t)
                last_digest = (t, got)
            if self.progress is not None:
                self.progress(i + 1, total)
        if skipped is not None and not res.verified:
            # the log's digests are not at its digest_every: check them as they come
            raise _Recheck(skipped, mismatch=False)
        out = Outcome(res)
        if self.mode == "grad" and self._per_shard is None and last_digest[0] == step:
            out.live_digest = last_digest[1]
        if self.mode == "grad":
            assert opt is not None
            if current is not carry:
                with recorded("the optimizer's param groups", r.path):
                    L.set_hyper(opt, carry)
            for p in self.objs.params:
                p.grad = None
            for n, (tag, arr) in latest.items():
                write_bits(self.objs.model[n], tag, arr, n)
        else:
            out.opt_state = self._finish_delta(state, layout, carry)
        if self.apply_rng:
            with recorded("the RNG state", r.path):
                res.notes += L.set_rng_states(rng)
        out.final = {"hyper": carry, "sched": sched, "scaler": scaler, "extra": extra,
                     "rng": rng, "state": state, "layout": layout}
        res.extra = unpack(extra) if extra is not None else None
        self._finish_sched_scaler(sched, scaler, res)
        if self.ef:
            out.residuals = self._residuals(ef, sent, approx_ef, res)
        return out

    # -- grad mode

    def _load_base(self, base: Any, bmeta: Mapping[str, Any]) -> None:
        objs = self.objs
        for n, t in objs.model.items():
            write_bits(t, base.info(n)[0], base.tensor(n), n)
        opt = objs.optimizer
        assert opt is not None
        lay = bmeta.get("opt") or {"tensors": {}, "values": {}}
        with recorded("the optimizer's param groups", base.path):
            L.check_hyper(opt, bmeta["hyper"])
        tensors = {n: {k: from_bits(base.info(L.opt_name(n, k))[0],
                                    base.tensor(L.opt_name(n, k)))
                       for k in keys} for n, keys in lay["tensors"].items()}
        with recorded("the optimizer's load_state_dict", base.path):
            opt.load_state_dict(L.build_optimizer_state(objs.names, self.meta["groups"],
                                                        bmeta["hyper"], tensors,
                                                        lay["values"]))

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
            if key not in have:
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
            p.grad = by_name.get(name)
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

    def _mark_sent(self, rec: Record, key: str, sent: dict[str, np.ndarray]) -> None:
        entry = rec.entry(key)
        if entry.codec != "sparse":
            return
        name = key[len(L.GRAD):]
        idx, _v = codecs.sparse_entries(entry.params, rec.parts(key), entry.numel)
        mask = sent.get(name)
        if mask is None:
            mask = sent[name] = np.zeros(entry.numel, dtype=bool)
        mask[idx] = True

    def _residuals(self, ef: Mapping[str, tuple[str, np.ndarray]],
                   sent: Mapping[str, np.ndarray], approx: bool, res: RestoreResult
                   ) -> dict[str, torch.Tensor]:
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
            if approx and name in sent:
                r.view(-1)[torch.from_numpy(np.flatnonzero(sent[name])).to(p.device)] = 0
            out[name] = r
        if approx:
            res.exact = False
            res.notes.append(
                f"error-feedback residuals are approximate: step {res.step} is not a base "
                f"(the newest is {res.base_step}) and residuals are logged only in bases "
                f"(ef_state='base'); restored = the residual of base {res.base_step} with every "
                f"entry sent since then zeroed. Weights and optimizer state are exact; "
                f"training continued from here is not bitwise the original run")
        return out

    # -- delta mode

    def _apply_diffs(self, rec: Record, names: Sequence[str],
                     state: dict[str, tuple[str, np.ndarray]]) -> None:
        for n in names:
            if n.startswith(("@rng/", L.EF)):
                continue
            entry = rec.entry(n)
            if entry.codec == "raw":
                state[n] = (entry.dtype, np.array(rec.tensor(n)))
                continue
            old = state.get(n)
            if old is None:
                raise ConfigError(f"step {rec.step}: diff of {n} has nothing to apply to",
                                  reason=Reason.STATE_MISMATCH, path=rec.path)
            # np.asarray: a codec may hand back a numpy scalar for a 0-d tensor
            if entry.codec == "xor":
                state[n] = (old[0], np.asarray(rec.tensor(n, ref=old[1])))
            else:
                state[n] = (old[0], L.apply_delta(old[0], old[1], np.asarray(rec.tensor(n))))

    def _finish_delta(self, state: dict[str, tuple[str, np.ndarray]],
                      layout: Mapping[str, Any], hyper: Sequence[Any]) -> dict[str, Any]:
        objs = self.objs
        self._check_layout(state, layout)
        for n, t in objs.model.items():
            tag, arr = state[n]
            write_bits(t, tag, arr, n)
        tensors = {n: {k: from_bits(*state[L.opt_name(n, k)]) for k in keys}
                   for n, keys in layout["tensors"].items()}
        sd = L.build_optimizer_state(objs.names, self.meta["groups"], hyper, tensors,
                                     layout["values"])
        if objs.optimizer is not None:
            with recorded("the optimizer's load_state_dict", self.reader.path):
                objs.optimizer.load_state_dict(sd)
        return sd

    def _check_layout(self, state: Mapping[str, tuple[str, np.ndarray]],
                      layout: Mapping[str, Any]) -> None:
        """Delta mode: every model tensor and every optimizer state tensor the layout
        names is in the reconstructed state."""
        need = [n for n in self.objs.model] + [L.opt_name(n, k) for n, keys in
                                               layout["tensors"].items() for k in keys]
        missing = next((n for n in need if n not in state), None)
        if missing is not None:
            raise FormatError(f"the optimizer layout or model names {missing!r}, which "
                              f"neither the base nor the diffs hold",
                              reason=Reason.BAD_METADATA, path=self.reader.path)

    def _digest(self, state: Mapping[str, tuple[str, np.ndarray]],
                layout: Mapping[str, Any]) -> int:
        if self.mode == "grad":
            opt = self.objs.optimizer
            assert opt is not None
            if self._per_shard is not None:
                return combine_digests(L.digest_objects(ps, opt) for ps in self._per_shard)
            return L.digest_objects(self.objs.params, opt)
        return L.digest_parts(
            (state[n][1], [(k, state[L.opt_name(n, k)][1])
                           for k in layout["tensors"].get(n, [])]
             + list(layout["values"].get(n, {}).items()))
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


def hand_residuals(out: Outcome, objs: Objects, compressor: GradCompressor | None
                   ) -> dict[torch.Tensor, torch.Tensor] | None:
    """Error-feedback residuals of a replay, keyed by parameter: put into ``compressor``
    when given (then None is returned), else returned for the next compressor attached."""
    if out.residuals is None:
        return None
    by_name = dict(zip(objs.names, objs.params, strict=True))
    residuals = {by_name[n]: r for n, r in out.residuals.items()}
    if compressor is not None:
        compressor.residuals = residuals
        return None
    return residuals


def restore_log(path: str | os.PathLike[str], model: torch.nn.Module,
                optimizer: torch.optim.Optimizer, *, scheduler: Any = None, scaler: Any = None,
                step: int | None = None, compressor: GradCompressor | None = None,
                verify: bool = True, progress: ProgressFn | None = None) -> RestoreResult:
    """:func:`~lowdiff_store.torch.restore` of one (unsharded) log."""
    p = os.fspath(path)
    with LogReader(p, mode="private") as reader:  # gradients lent, not copied
        meta = log_meta(reader)
        target = target_step(reader, step)
        objs = objects_for(model, optimizer, scheduler, scaler)
        check_objects(meta, objs, p)
        out = Replayer(reader, meta, objs, verify=verify, progress=progress).run(target)
        log_id = reader.log_id
    res = out.result
    residuals = hand_residuals(out, objs, compressor)
    digest = out.live_digest if out.live_digest is not None else \
        L.digest_objects(objs.params, optimizer)
    res.info = RestoreInfo(os.path.realpath(p), log_id, res.step, digest, res.exact,
                           residuals, list(res.notes))
    remember(optimizer, res.info)
    return res


def replay_log_state(path: str | os.PathLike[str], step: int | None = None, *,
                     with_optimizer: bool = False,
                     optimizer_factory: Callable[[list[dict[str, Any]]],
                                                 torch.optim.Optimizer] | None = None,
                     progress: ProgressFn | None = None, verify: bool = True
                     ) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """:func:`~lowdiff_store.torch.replay_state` of one (unsharded) log."""
    p = os.fspath(path)
    with LogReader(p, mode="private") as reader:
        meta = log_meta(reader)
        target = target_step(reader, step)
        hyper = base_hyper(reader, target, meta)  # checks shapes against the base first
        model = {n: torch.zeros(shape, dtype=DTYPE_OF[tag]) for n, tag, shape in meta["model"]}
        names = list(meta["params"])
        params = [model[n] for n in names]
        opt = None
        if meta["mode"] == "grad":
            opt = build_optimizer(meta, params, hyper, optimizer_factory, p)
        objs = Objects(names, params, model, opt)
        out = Replayer(reader, meta, objs, verify=verify, progress=progress).run(target)
    aliases = meta.get("aliases") or {}
    order = meta.get("state_dict") or [n for n, _t, _s in meta["model"]] + list(aliases)
    state = {n: model[aliases.get(n, n)] for n in order}
    if not with_optimizer:
        return state, None
    opt_state = opt.state_dict() if opt is not None else out.opt_state
    assert opt_state is not None
    for g in opt_state["param_groups"]:  # torch's convention for naming group params
        g["param_names"] = [names[i] for i in g["params"]]
    return state, opt_state


def build_optimizer(meta: Mapping[str, Any], params: list[torch.Tensor], hyper: Sequence[Any],
                     factory: Callable[[list[dict[str, Any]]], torch.optim.Optimizer] | None,
                     path: str) -> torch.optim.Optimizer:
    groups: list[dict[str, Any]] = []
    start = 0
    for n, h in zip(meta["groups"], hyper, strict=True):
        g = unpack(h)
        g["params"] = params[start:start + n]
        start += n
        groups.append(g)
    if factory is not None:
        return factory(groups)
    cls = L.allowed_optimizer(meta["optimizer"])
    if cls is None:
        raise ConfigError(
            f"optimizer {meta['optimizer']} is not in the allow-list "
            f"({', '.join(L.ALLOWED_OPTIMIZERS)} from torch.optim): pass "
            f"optimizer_factory=... to replay it", reason=Reason.NOT_ALLOWED, path=path)
    with recorded(f"the allow-listed optimizer {meta['optimizer']}", path):
        return cls(groups)


__all__ = ["Reader", "RestoreResult", "base_hyper", "base_torch_meta", "check_classes",
           "log_meta", "objects_for", "recorded", "replay_log_state", "restore_log"]
