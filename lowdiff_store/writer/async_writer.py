"""The batched asynchronous writer: training-safe staging, group commit, explicit durability,
back-pressure under a memory budget, and error propagation to where the caller waits.

Stages of one diff record (named as in the stats)::

    caller's thread          encoder thread                    committer thread
    ---------------          -------------------------------   -------------------------------
    stage: copy arrays  -->  encode: codecs, zstd, layout  -->  write: one writev per group
    into writer-owned        and CRC (LogWriter.build)          fsync: one fdatasync per group
    staging buffers          batch: close the group at          ack: futures in step order,
                             ``batch`` records,                      durable_step, on_durable
                             ``max_batch_bytes``, or
                             ``max_delay_s`` after its first

The encoder works on the next group while the committer writes and fsyncs this one. Bases
(:meth:`AsyncLogWriter.write_base`) are staged the same way and written on a third thread, so a
large base never stalls the diff log.

Durability contract. A step is *durable* when its record and every record appended before it
are fsynced. :attr:`AsyncLogWriter.durable_step` only moves forward (except through the explicit
:meth:`AsyncLogWriter.truncate_after`); each append's future resolves to its step once durable,
in step order. A sync request (``append(..., sync=True)``) closes its group at once: it is
never folded into a later group. A store that makes synced bytes durable later (an ``s3://``
log without a write-ahead directory uploads at most every ``upload_interval_s``) holds the
acknowledgements back until the log says the bytes are durable: the committer wakes at the
log's ``flush_due`` when no new group comes, and ``flush``, ``close``, ``write_base`` and
``sync=True`` make everything durable at once.

Memory. Staged bytes (copies not yet handed to the kernel, plus a free list of recycled
staging buffers) are kept within ``memory_budget`` (default 1 GiB); an append that would
exceed it blocks until the background frees enough (``blocked_s`` in the stats). The budget
in force for a record is at least twice its size (``staging.budget_for``): a record larger
than half the budget is admitted beside one other in flight, so large records still overlap
(one written while the next is handed over) and at most two of them are held. Host memory
that a :class:`~lowdiff_store.writer.deferred.DeferredEncoding` holds counts too.
Staging buffers are recycled, most recently freed first (size classes of 1/8 of a power of
two), so a copy lands in pages already touched and still in cache.

Failures. Any exception in the background (ENOSPC, EIO, EACCES, an encoding error) poisons
the writer: the futures of the steps that were not durable fail with :class:`CommitError`
naming the failing step (``__cause__`` is the original error); the next ``append``,
``flush`` or ``write_base`` raises it, and :meth:`AsyncLogWriter.close` raises it once if no
call has yet. Nothing is synced after a failure (the log is abandoned): a partially written
record is a torn tail that the next open cuts; every record durable before stays readable.

Threads, not a process: the background work is C code that releases the GIL (crc32c, zstd,
``os.writev``, ``os.fdatasync``); the measurements behind the choice are in
``docs/design.md`` (section 4).

Threading contract: ``append``, ``write_base``, ``flush``, ``truncate_after`` and ``close``
are meant to be called from the training thread (they are serialized by a lock if not);
``durable_step``, ``last_step``, ``wait`` and ``stats`` may be called from any thread.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import operator
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

import msgpack
import numpy as np

from .. import codecs
from ..errors import (
    ConfigError,
    FormatError,
    LowdiffError,
    Reason,
    WriterClosedError,
)
from ..format.constants import MAX_NAME_BYTES, MAX_STEP, MAX_TENSORS_PER_RECORD
from ..format.dtypes import STORAGE_DTYPE, storage_dtype
from ..format.record import RecordBytes, TensorInput
from ..log.base import RESERVED_PREFIX, BaseBuilder, BaseTensors
from ..log.tensors import from_encoded, tensor_input
from ..log.writer import DEFAULT_SEGMENT_BYTES, LogWriter, is_slice
from ..storage import AppendFile, StoreLike
from .deferred import DeferredEncoding
from .ledger import DurabilityLedger
from .staging import StagingPool

_log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------- tunables
#: Records per group commit (one write, one fsync). 1 = fsync every step.
DEFAULT_BATCH: Final = 1
#: A group is closed once its records reach this many bytes.
DEFAULT_MAX_BATCH_BYTES: Final = 64 << 20
#: A group is closed this long after its first record was appended, even if not full.
DEFAULT_MAX_DELAY_S: Final = 0.05
#: Staged bytes (copies waiting to be written, plus recycled staging buffers) kept within this;
#: 1 GiB holds ~500 top-1% diffs of a 25M-parameter model (2 MB each), ~13 of a
#: 1B-parameter one (80 MB), or one base of an ~80M-parameter model with Adam state. A record
#: or base larger than this is admitted alone. For records of tens of MiB a few records of
#: headroom is enough and keeps staging buffers recycled (bench/RESULTS_writer.md).
DEFAULT_MEMORY_BUDGET: Final = 1 << 30


@dataclass
class TensorSpec:
    """One tensor of a step, as handed to :meth:`AsyncLogWriter.append`.

    Give either ``array`` (the bits in the storage dtype of ``dtype``; encoded in the
    background with ``codec`` and ``options``, ``ref`` being the reference of ``xor``) or
    ``encoded`` (parts already encoded, e.g. a compressor's top-k indices and values from
    :func:`lowdiff_store.codecs.encode_sparse`, or a :class:`~lowdiff_store.writer.deferred.
    DeferredEncoding` that makes them on the encoder thread) together with the tensor's
    ``shape``.
    ``options`` go to the codec with ``array`` (``shuffle`` to the zstd stage) and are
    ignored with ``encoded``. ``zstd``: compress every part at this level (``None``: raw,
    zero-copy readable).
    """

    name: str
    dtype: str
    array: np.ndarray | None = None
    encoded: codecs.Encoded | DeferredEncoding | None = None
    shape: tuple[int, ...] | None = None
    codec: str = "raw"
    options: dict[str, Any] = field(default_factory=dict)
    ref: np.ndarray | None = None
    zstd: int | None = None


class _Tensor(NamedTuple):
    """A tensor frozen at append time (its arrays are staged separately, in order: the
    array then the ref, or the encoded parts)."""

    name: str
    dtype: str
    codec: str
    options: dict[str, Any]  # codec options, or the encoded tensor's params
    zstd: int | None
    shape: tuple[int, ...] | None  # None: the array's own shape
    parts: tuple[codecs.Part, ...] | None  # encoded parts (dtype tags; data is staged)
    has_ref: bool
    deferred: DeferredEncoding | None = None  # parts made on the encoder thread


class _Item:
    """One appended step on its way to the log."""

    __slots__ = ("arrays", "buffer", "cost", "extra", "future", "kind", "release", "side",
                 "step", "sync", "t_append", "tensors")

    def __init__(self, step: int, tensors: list[_Tensor], arrays: list[np.ndarray], kind: str,
                 side: bytes | None, extra: bytes | None, sync: bool, cost: int,
                 buffer: np.ndarray | None, future: concurrent.futures.Future[int],
                 t_append: float, release: Callable[[], None] | None = None) -> None:
        self.step = step
        self.tensors = tensors
        self.arrays = arrays
        self.kind = kind
        self.side = side
        self.extra = extra
        self.sync = sync
        self.cost = cost
        self.buffer = buffer
        self.future = future
        self.t_append = t_append
        self.release = release

    def forget(self) -> None:
        """The record is written (or failed): drop its staged bytes' accounting and every
        reference to its arrays, the deferred encodings' too (they may hold the caller's
        arrays, which the caller frees once released, not once acknowledged)."""
        self.cost, self.buffer, self.arrays, self.tensors = 0, None, [], []



_FLUSH: Final = object()  # queue marker: commit the open group now, make everything durable
_DEADLINE: Final = object()  # (encoder) the open group's first record waited max_delay_s
_FORCE: Final = object()  # committer queue: make every committed record durable now
_STOP: Final = object()  # queue marker: commit the open group and exit
_RESIZE: Final = object()  # (encoder) the batch changed: close the open group if it is full
_POISON: Final = object()  # committer queue: (_POISON, item, error) of an encoding error


def _new_future() -> concurrent.futures.Future[int]:
    fut: concurrent.futures.Future[int] = concurrent.futures.Future()
    fut.set_running_or_notify_cancel()  # an appended record cannot be cancelled
    return fut


def freeze_map(obj: Mapping[str, Any] | None, what: str) -> bytes | None:
    """Snapshot a metadata map (msgpack): later changes by the caller cannot reach the
    record, and a value msgpack cannot store fails here, not in the background."""
    if not obj:
        return None
    try:
        out: bytes = msgpack.packb(dict(obj), use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ConfigError(f"{what} cannot be stored as msgpack: {e}") from e
    return out


def thaw_map(blob: bytes | None) -> dict[str, Any] | None:
    """The map :func:`freeze_map` froze (None for None)."""
    if blob is None:
        return None
    out: dict[str, Any] = msgpack.unpackb(blob, raw=False, strict_map_key=False)
    return out


def plan_record(tensors: Sequence[TensorSpec]
                ) -> tuple[list[_Tensor], list[np.ndarray], int]:
    """Validate what the background cannot fix; freeze each tensor's scalars and list
    the arrays to stage, and the host bytes deferred encodings hold. (Lean on purpose: it
    runs on the training thread, usually with cold caches.)"""
    if len(tensors) > MAX_TENSORS_PER_RECORD:
        raise ConfigError(f"{len(tensors)} tensors exceed the per-record limit",
                          reason=Reason.LIMIT_EXCEEDED)
    recipe: list[_Tensor] = []
    arrays: list[np.ndarray] = []
    held = 0
    for spec in tensors:
        name, dtype, codec, enc = spec.name, spec.dtype, spec.codec, spec.encoded
        if type(name) is not str or not name or (
                len(name) > MAX_NAME_BYTES // 4 and len(name.encode()) > MAX_NAME_BYTES):
            raise ConfigError(f"bad tensor name {name!r}")
        want = STORAGE_DTYPE.get(dtype) if type(dtype) is str else None
        if want is None:
            raise FormatError(f"tensor {name!r}: unknown dtype tag {dtype!r}",
                              reason=Reason.BAD_DTYPE)
        if enc is not None:
            if spec.array is not None or spec.ref is not None:
                raise ConfigError(f"tensor {name!r}: give either array or encoded")
            if spec.shape is None:
                raise ConfigError(f"tensor {name!r}: encoded needs shape")
            if isinstance(enc, DeferredEncoding):
                recipe.append(_Tensor(name, dtype, "", {}, spec.zstd, tuple(spec.shape), None,
                                      False, enc))
                held += enc.nbytes
                continue
            parts = enc.parts  # a tuple of frozen Parts: only their data is staged
            recipe.append(_Tensor(name, dtype, enc.codec, dict(enc.params), spec.zstd,
                                  tuple(spec.shape), parts, False))
            for p in parts:
                arrays.append(p.data)  # noqa: PERF401 - a comprehension is a call
            continue
        a, ref = spec.array, spec.ref
        if type(a) is not np.ndarray and not isinstance(a, np.ndarray):
            raise ConfigError(f"tensor {name!r}: array must be a numpy array")
        if a.dtype != want:
            raise FormatError(f"tensor {name!r}: array dtype {a.dtype} does not hold "
                              f"{dtype}", reason=Reason.BAD_DTYPE)
        if codec != "raw":
            if codec not in codecs.CODECS:
                raise ConfigError(f"tensor {name!r}: unknown codec {codec!r}",
                                  reason=Reason.UNKNOWN_CODEC)
            if (codec == "xor") != (ref is not None):
                raise ConfigError(f"tensor {name!r}: codec 'xor' and only it takes a ref")
        arrays.append(a)
        if ref is not None:
            if not isinstance(ref, np.ndarray) or ref.dtype != want:
                raise FormatError(f"tensor {name!r}: ref does not hold {dtype}",
                                  reason=Reason.BAD_DTYPE)
            arrays.append(ref)
        recipe.append(_Tensor(name, dtype, codec, dict(spec.options) if spec.options else {},
                              spec.zstd, None, None, ref is not None))
    if len(recipe) > 1 and len({t.name for t in recipe}) != len(recipe):
        names = [t.name for t in recipe]
        dup = next(n for i, n in enumerate(names) if n in names[:i])
        raise ConfigError(f"duplicate tensor name {dup!r}")
    return recipe, arrays, held


def encode_item(item: _Item) -> RecordBytes:
    """Codecs, compression and record layout of one staged step."""
    inputs: list[TensorInput] = []
    arrays = iter(item.arrays)
    for t in item.tensors:
        if t.deferred is not None:
            assert t.shape is not None
            made = t.deferred.encode()
            if made is not None:  # (None: unchanged, left out; see DeferredEncoding)
                inputs.append(from_encoded(t.name, t.dtype, tuple(map(int, t.shape)), made,
                                           zstd=t.zstd))
        elif t.parts is not None:
            assert t.shape is not None
            enc = codecs.Encoded(t.codec, t.options,
                                 tuple(codecs.Part(p.dtype, next(arrays)) for p in t.parts))
            inputs.append(from_encoded(t.name, t.dtype, tuple(map(int, t.shape)), enc,
                                       zstd=t.zstd))
        else:
            a = next(arrays)
            ref = next(arrays) if t.has_ref else None
            inputs.append(tensor_input(t.name, a, t.dtype, t.codec, ref=ref, zstd=t.zstd,
                                       **t.options))
    return LogWriter.build(item.step, inputs, kind=item.kind, side=thaw_map(item.side),
                           extra=thaw_map(item.extra))


def check_base_tensors(tensors: Mapping[str, tuple[str, np.ndarray]]
                       ) -> tuple[list[str], list[np.ndarray]]:
    """The names and arrays of a base's tensors, each name allowed and each array holding
    its dtype tag (ConfigError / FormatError otherwise)."""
    names = list(tensors)
    arrays = []
    for n in names:
        dt, a = tensors[n]
        if type(n) is not str or not n or n.startswith(RESERVED_PREFIX):
            raise ConfigError(f"bad base tensor name {n!r}", reason=Reason.UNSAFE_NAME)
        if not isinstance(a, np.ndarray) or a.dtype != storage_dtype(dt):
            raise FormatError(f"base tensor {n!r}: array does not hold {dt}",
                              reason=Reason.BAD_DTYPE)
        arrays.append(a)
    return names, arrays


def _stage_base(staging: StagingPool, tensors: BaseTensors, owned: bool,
                release: Callable[[], None] | None
                ) -> tuple[BaseTensors, int, np.ndarray | None]:
    """A base's tensors as the base thread writes them, with the staging cost and buffer
    to give back: copied into ``staging`` unless ``owned`` or ``release`` (the caller's
    memory); a :class:`BaseBuilder` (written already, published by the base thread) as
    it is, with ``release`` only."""
    if isinstance(tensors, BaseBuilder):
        if release is None:
            raise ConfigError("a built base is written with release=")
        return tensors, 0, None
    names, arrays = check_base_tensors(tensors)
    copies, cost, buf = (arrays, 0, None) if release is not None else \
        staging.stage(arrays, owned)
    return {n: (tensors[n][0], c) for n, c in zip(names, copies, strict=True)}, cost, buf


def flush_log(log: LogWriter) -> None:
    """Make every record written to ``log`` durable now (``flush``, ``sync=True``). An
    object store that does not answer leaves the log going on (nothing was lost, see
    LogWriter.flush): a sync takes the records, and the log's ``flush_due`` brings the
    committer back to retry the upload."""
    try:
        log.flush()
    except LowdiffError as e:
        if e.reason is not Reason.STORE_UNAVAILABLE:
            raise
        log.sync()


class _EncodeStage:
    """The encoder thread of an :class:`AsyncLogWriter`: encodes queued items, forms groups
    (closed at ``batch`` records, ``max_batch_bytes`` or ``max_delay_s``) and hands each
    closed group to the committer, so that encoding the next group overlaps the write and
    fsync of this one. It reads the writer's queues, limits and ledger."""

    def __init__(self, writer: AsyncLogWriter) -> None:
        self.w = writer

    def run(self) -> None:
        """The encoder thread. A bug in it must fail waiters loudly, never hang them."""
        w = self.w
        try:
            self._loop()
        except BaseException as e:  # anything here is a bug: report it
            w._ledger.poison(w._last_diff, e)
            while (obj := w._q.get()) is not _STOP:
                if isinstance(obj, _Item):
                    w._fail_items([obj])
            w._cq.put(_STOP)

    def _loop(self) -> None:
        """Encode queued items and form groups; hand each closed group to the committer,
        so that encoding the next group overlaps the write and fsync of this one."""
        w = self.w
        group: list[_Item] = []
        records: list[RecordBytes] = []
        nbytes = 0
        deadline = 0.0
        failed = False  # an encoding error was handed to the committer
        while True:
            if group:
                left = deadline - time.perf_counter()
                try:
                    obj = w._q.get(timeout=left) if left > 0 else w._q.get_nowait()
                except queue.Empty:
                    obj = _DEADLINE  # the oldest record waited max_delay_s
            else:
                obj = w._q.get()
            if not isinstance(obj, _Item):
                if obj is _RESIZE and len(group) < w.batch:
                    continue
                if group:
                    w._cq.put((group, records))
                    group, records, nbytes = [], [], 0
                if obj is _STOP:
                    w._cq.put(_STOP)
                    return
                if obj is _FLUSH:
                    w._cq.put(_FORCE)
                continue
            if failed or w._ledger.error is not None:
                w._cq.put(([obj], []))  # the committer fails it, in order
                continue
            t0 = time.perf_counter()
            try:
                rec = encode_item(obj)
            except BaseException as e:  # encoding errors poison too; earlier records commit
                if group:
                    w._cq.put((group, records))
                    group, records, nbytes = [], [], 0
                w._cq.put((_POISON, obj, e))
                failed = True
                continue
            w._stats["encode_s"] += time.perf_counter() - t0
            if not group:
                deadline = obj.t_append + w.max_delay_s
            group.append(obj)
            records.append(rec)
            nbytes += rec.length
            sync = obj.sync
            del obj, rec  # (an idle encoder holds no record: its arrays are freed once written)
            if sync or len(group) >= w.batch or nbytes >= w.max_batch_bytes:
                w._cq.put((group, records))
                group, records, nbytes = [], [], 0


class _BaseStage:
    """The base thread's job for one base of an :class:`AsyncLogWriter`: wait until every
    diff appended before the base is durable, write and publish the base, count it
    durable; a store that does not answer skips the base (the log stays valid)."""

    def __init__(self, writer: AsyncLogWriter, release: Callable[[], None] | None = None,
                 crcs: Mapping[str, int] | None = None, part: bool = False) -> None:
        self.w = writer
        self.release = release
        self.crcs = crcs
        self.part = part  # one slice of a streamed base: no step made durable

    def __call__(self, step: int, tensors: BaseTensors,
                  meta: bytes | None, after: int, cost: int, buf: np.ndarray | None) -> int:
        w = self.w
        try:
            # The log refuses a diff at or before its newest step: diffs appended before the
            # base must reach the log first. Waiting for durability (not only the write)
            # also makes the base's step durable the moment it is published.
            with w._ledger.cond:
                while w._ledger.error is None and w._ledger.diff_durable < after:
                    w._ledger.cond.wait()
                if w._ledger.error is not None:
                    raise w._ledger.fresh_error(step) from w._ledger.cause
            t0 = time.perf_counter()
            try:
                size = w.log.write_base(step, tensors, thaw_map(meta), self.crcs)
            except LowdiffError as e:
                if e.reason is not Reason.STORE_UNAVAILABLE:
                    w._ledger.poison(step, e)
                    raise w._ledger.fresh_error(step) from e
                # The store does not answer: this base is skipped (the log stays valid,
                # the diffs go on from the previous base); the next base is tried as usual.
                _log.warning("base at step %d skipped: %s", step, e)
                raise
            except BaseException as e:
                w._ledger.poison(step, e)
                raise w._ledger.fresh_error(step) from e
            del tensors
            w._stats["base_s"] += time.perf_counter() - t0
            w._stats["bases"] += 1
            w._stats["base_bytes"] += size
            w._ledger.base_ended(step, published=not self.part)
            return size
        finally:
            w._ledger.base_ended(step, published=False)  # (a no-op once published)
            w._staging.release(cost, buf)
            if self.release is not None:
                try:
                    self.release()
                except Exception:  # (as on_release: the base's bookkeeping must go on)
                    w._stats["callback_errors"] += 1
                    _log.exception("release of the base at step %d raised", step)
            with w._ledger.cond:
                w._ledger.bases_pending -= 1
                w._ledger.cond.notify_all()


class AsyncLogWriter:
    """Asynchronous, batched writer of one log (see the module docstring for the contract).

    Args:
        path: the log directory (created, or opened and recovered, by :class:`LogWriter`),
            or the :class:`~lowdiff_store.storage.Store` holding it.
        batch: records per group commit (one writev and one fsync per group).
        max_batch_bytes: a group is closed once it holds this many record bytes.
        max_delay_s: a group is closed this long after its first record was appended.
        memory_budget: bound on staged bytes; ``append`` blocks beyond it (at least room
            for two records of the size being appended).
        segment_bytes: size at which a segment is sealed and a new one started.
        meta: log-level metadata of a new log.
        on_durable: called with the new :attr:`durable_step` each time it advances, on a
            background thread, in increasing order. It must be quick and must not call
            the writer's blocking methods (``append``, ``write_base``, ``flush``, ``wait``,
            ``close``); the same holds for done-callbacks added to the futures.
            Exceptions it raises are logged and counted (``callback_errors``).
        file_factory: the :class:`AppendFile` class used for segments (fault injection).
    """

    def __init__(self, path: StoreLike, *, batch: int = DEFAULT_BATCH,
                 max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
                 max_delay_s: float = DEFAULT_MAX_DELAY_S,
                 memory_budget: int = DEFAULT_MEMORY_BUDGET,
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                 meta: Mapping[str, Any] | None = None,
                 on_durable: Callable[[int], None] | None = None,
                 file_factory: type[AppendFile] = AppendFile) -> None:
        if batch < 1:
            raise ConfigError(f"batch={batch} must be >= 1")
        if max_batch_bytes < 1:
            raise ConfigError(f"max_batch_bytes={max_batch_bytes} must be >= 1")
        if not max_delay_s >= 0:
            raise ConfigError(f"max_delay_s={max_delay_s} must be >= 0")
        if memory_budget < 1:
            raise ConfigError(f"memory_budget={memory_budget} must be >= 1")
        self.batch = batch
        self.max_batch_bytes = max_batch_bytes
        self.max_delay_s = float(max_delay_s)
        self.memory_budget = memory_budget
        self.log = LogWriter(path, meta=meta, segment_bytes=segment_bytes,
                             file_factory=file_factory)
        self.path = self.log.path

        # producer side (training thread), serialized by _plock
        self._plock = threading.Lock()
        self._last_step = self.log.last_step
        known = self.log.manifest.base_steps()
        self._last_base = known[-1] if known else -1
        self._last_diff = -1  # newest step handed to append()
        self._closed = False

        self._staging = StagingPool(memory_budget)

        self._stats: dict[str, float] = dict.fromkeys(
            ("stage_s", "encode_s", "write_s", "fsync_s", "base_s", "ack_latency_s"),
            0.0)
        self._stats.update(dict.fromkeys(
            ("appends", "bytes", "records", "batches", "last_batch_records",
             "last_batch_bytes", "max_batch_records", "bases", "base_bytes",
             "callback_errors"), 0))

        # durability and failure, shared by the threads
        self._ledger = DurabilityLedger(self.path, self.log.durable_step, on_durable,
                                        self._stats)

        # Futures are made ahead by the committer: building one costs the training thread
        # ~12 us with cold caches (measured), a tenth of the whole append of a 2 MB diff.
        self._futures: collections.deque[concurrent.futures.Future[int]] = collections.deque()
        self._futures_ahead = min(1024, max(32, 2 * batch))
        self._make_futures()
        self._q: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._base_pool: concurrent.futures.ThreadPoolExecutor | None = None
        # encoded groups waiting for the committer (bounded: encoded bytes are not staged
        # bytes, the budget does not count them)
        self._cq: queue.Queue[object] = queue.Queue(maxsize=2)
        # (committer) records written and synced, not yet durable: a store that makes
        # synced bytes durable later (an s3:// log uploads at intervals)
        self._unacked: collections.deque[_Item] = collections.deque()
        self._threads = [
            threading.Thread(target=_EncodeStage(self).run, name="lowdiff-encoder", daemon=True),
            threading.Thread(target=self._run_committer, name="lowdiff-committer", daemon=True)]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ properties

    @property
    def durable_step(self) -> int | None:
        """Newest step such that it and every step appended before it are fsynced (a base
        counts once published); ``None`` before anything is durable."""
        return self._ledger.durable

    @property
    def last_step(self) -> int:
        """Newest step appended or submitted as a base (-1 for an empty log)."""
        return self._last_step

    # ------------------------------------------------------------------ failure state

    def _check_usable(self) -> None:
        """Raise if the writer is closed (WriterClosedError) or failed (CommitError)."""
        if self._closed:
            led = self._ledger
            why = "" if led.error is None else f" (it failed at step {led.fail_step})"
            raise WriterClosedError("writer is closed" + why, path=self.path)
        if self._ledger.error is not None:
            self._ledger.reported = True
            raise self._ledger.fresh_error(None) from self._ledger.cause

    # ------------------------------------------------------------------ appending

    def append(self, step: int, tensors: Sequence[TensorSpec], *, kind: str,
               side: Mapping[str, Any] | None = None, extra: Mapping[str, Any] | None = None,
               sync: bool = False, owned: bool = False,
               on_release: Callable[[], None] | None = None
               ) -> concurrent.futures.Future[int]:
        """Stage the diff record of ``step`` and queue it; returns a future that resolves
        to ``step`` once the record (and every diff before it) is durable, or fails with
        :class:`CommitError` (:attr:`durable_step` also waits for a base submitted before).

        Every array (``array``, ``ref``, ``encoded`` parts) is copied into writer-owned
        staging before this returns, so the caller may reuse its buffers at once; with
        ``owned=True`` the caller hands the arrays over instead (no copy; it must never
        touch them again). ``side`` and ``extra`` are frozen (msgpack) at this point too.
        ``sync=True`` closes the group containing this record and makes it durable right
        away (for a store that defers durability, an upload). ``on_release`` is called (on
        a background thread) once the writer no longer reads the arrays: after the record
        is written, which may be before it is durable. Blocks only for back-pressure
        (staged bytes over ``memory_budget``).
        """
        t0 = time.perf_counter()
        with self._plock:
            if self._closed or self._ledger.error is not None:
                self._check_usable()
            if type(step) is not int:
                step = operator.index(step)
            if step <= self._last_step or step > MAX_STEP:  # also every step < 0
                if step > MAX_STEP or step < 0:
                    raise ConfigError(f"step {step} out of range", reason=Reason.OUT_OF_BOUNDS)
                raise ConfigError(f"step {step} does not follow step {self._last_step}",
                                  reason=Reason.STEP_OUT_OF_ORDER, path=self.path)
            if type(kind) is not str:
                raise ConfigError(f"kind must be a str, got {type(kind).__name__}")
            recipe, arrays, held = plan_record(tensors)
            frozen_side = freeze_map(side, "side") if side else None
            frozen_extra = freeze_map(extra, "extra") if extra else None
            copies, cost, buf = self._staging.stage(arrays, owned, held=held)
            if self._ledger.error is not None:  # failed while this append waited for memory
                self._staging.release(cost, None)
                self._check_usable()
            try:
                fut = self._futures.pop()
            except IndexError:
                fut = _new_future()
            now = time.perf_counter()
            self._q.put(_Item(step, recipe, copies, kind, frozen_side, frozen_extra, bool(sync),
                              cost, buf, fut, now, on_release))
            self._last_step = step
            self._last_diff = step
            self._stats["stage_s"] += now - t0
            self._stats["appends"] += 1
        return fut

    # ------------------------------------------------------------------ bases

    def write_base(self, step: int, tensors: BaseTensors,
                   meta: Mapping[str, Any] | None = None, *, owned: bool = False,
                   release: Callable[[], None] | None = None,
                   crcs: Mapping[str, int] | None = None
                   ) -> concurrent.futures.Future[int]:
        """Stage a base (the full state after ``step``) and write it on the base thread;
        the future resolves to the base's size in bytes once it is published (fsynced,
        renamed, directory fsynced). Arrays are copied before this returns unless
        ``owned`` (then counted in ``memory_budget`` until written) or ``release`` is given:
        then they are the caller's memory, not counted, and ``release()`` is called on the
        base thread once the writer is done with them (written, skipped or failed).
        ``crcs``: CRC32Cs of some arrays' bytes, computed by the copy that made them (only
        with ``release``: the caller's arrays do not change until released). The base is
        written after every diff appended before this call is durable, and then counts
        toward :attr:`durable_step`. ``tensors`` may be a
        :class:`~lowdiff_store.log.base.BaseBuilder` whose pieces have all arrived (the
        writer process's base in pieces), with ``release`` (which aborts it unless it was
        published)."""
        t0 = time.perf_counter()
        with self._plock:
            self._check_usable()
            step = operator.index(step)
            if not 0 <= step <= MAX_STEP:
                raise ConfigError(f"step {step} out of range", reason=Reason.OUT_OF_BOUNDS)
            if step <= self._last_base:
                raise ConfigError(f"base at step {step} is not newer than base "
                                  f"{self._last_base}", reason=Reason.STEP_OUT_OF_ORDER,
                                  path=self.path)
            frozen_meta = freeze_map(meta, "base meta")
            staged, cost, buf = _stage_base(self._staging, tensors, owned, release)
            if self._base_pool is None:
                self._base_pool = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="lowdiff-base")
            part = is_slice(meta)
            with self._ledger.cond:
                self._ledger.bases_pending += 1
                if not part:
                    self._ledger.hold(step, self._last_step)
            after = self._last_diff
            try:
                fut = self._base_pool.submit(_BaseStage(self, release,
                                                        crcs if release else None, part),
                                             step, staged, frozen_meta, after, cost, buf)
            except BaseException:
                with self._ledger.cond:
                    self._ledger.bases_pending -= 1
                self._ledger.base_ended(step, published=False)
                self._staging.release(cost, buf)
                if release is not None:
                    release()
                raise
            self._q.put(_FLUSH)  # the base waits for the diffs queued before it
            self._last_base = step
            if not part:
                self._last_step = max(self._last_step, step)
            self._stats["stage_s"] += time.perf_counter() - t0
        return fut

    # ------------------------------------------------------------------ background

    def _run_committer(self) -> None:
        """The committer thread (same safety net)."""
        try:
            while True:
                obj = self._next_committed()
                if self._ledger.error is not None and self._unacked:
                    self._fail_unacked()  # (a base failed meanwhile: nothing more is synced)
                if obj is _STOP:
                    break
                if obj is _FORCE or obj is _DEADLINE:
                    self._make_durable(obj is _FORCE)
                    continue
                assert isinstance(obj, tuple)
                if obj[0] is _POISON:
                    _marker, item, err = obj
                    self._ledger.poison(item.step, err)
                    self._fail_unacked()
                    self._fail_items([item])
                else:
                    self._commit(*obj)
        except BaseException as e:  # anything here is a bug: report it
            self._ledger.poison(self._last_diff, e)
            self._fail_unacked()
            while (obj := self._cq.get()) is not _STOP:
                if isinstance(obj, tuple):
                    self._fail_items([obj[1]] if obj[0] is _POISON else obj[0])

    def _next_committed(self) -> object:
        """The committer's next job; ``_DEADLINE`` when records written but not yet durable
        are due to be made durable (a store that uploads at intervals) and nothing came."""
        due = self.log.flush_due if self._unacked and self._ledger.error is None else None
        if due is None:
            return self._cq.get()
        try:
            return self._cq.get(timeout=max(0.0, due - time.monotonic()))
        except queue.Empty:
            return _DEADLINE

    def _fail_unacked(self) -> None:
        items = list(self._unacked)
        self._unacked.clear()
        self._fail_items(items)

    def _make_durable(self, force: bool) -> None:
        """Sync (``force``: flush) the log if records wait to be durable; acknowledge what
        became durable."""
        if not self._unacked or self._ledger.error is not None:
            return
        t0 = time.perf_counter()
        try:
            if force:
                flush_log(self.log)
            else:
                self.log.sync()
        except BaseException as e:
            self._ledger.poison(self._unacked[0].step, e)
            self._fail_unacked()
            return
        self._stats["fsync_s"] += time.perf_counter() - t0
        self._ack(time.perf_counter())

    def _commit(self, group: list[_Item], records: list[RecordBytes]) -> None:
        """Write a group with one writev, fsync it once, acknowledge it."""
        if self._ledger.error is not None:
            self._fail_items(group)
            return
        nbytes = sum(r.length for r in records)
        t0 = time.perf_counter()
        self._unacked.extend(group)
        try:
            self.log.write_records(records)
            t1 = time.perf_counter()
            records.clear()  # drop the views of the staging buffers before recycling them
            for it in group:
                self._staging.release(it.cost, it.buffer)
                it.forget()
                self._released(it)
            t2 = time.perf_counter()
            if any(it.sync for it in group):
                flush_log(self.log)
            else:
                self.log.sync()
            t3 = time.perf_counter()
        except BaseException as e:
            self._ledger.poison(group[0].step, e)
            self._fail_unacked()
            return
        s = self._stats
        s["write_s"] += t1 - t0
        s["fsync_s"] += t3 - t2
        s["batches"] += 1
        s["records"] += len(group)
        s["bytes"] += nbytes
        s["last_batch_records"] = len(group)
        s["last_batch_bytes"] = nbytes
        s["max_batch_records"] = max(s["max_batch_records"], len(group))
        self._ack(t3)
        self._make_futures()

    def _ack(self, now: float) -> None:
        """Acknowledge the written records the log now holds durable (all of them for a
        store whose sync is durable; with deferred durability, up to its ``durable_step``)."""
        durable = self.log.durable_step
        done: list[_Item] = []
        while self._unacked and durable is not None and self._unacked[0].step <= durable:
            done.append(self._unacked.popleft())
        if done:
            self._stats["ack_latency_s"] += sum(now - it.t_append for it in done)
            self._ledger.advance(done[-1].step, done)

    def _released(self, it: _Item) -> None:
        """Call the item's ``on_release`` once (the writer no longer reads its arrays)."""
        cb, it.release = it.release, None
        if cb is not None:
            try:
                cb()
            except Exception:
                self._stats["callback_errors"] += 1
                _log.exception("on_release of step %d raised", it.step)

    def _make_futures(self) -> None:
        while len(self._futures) < self._futures_ahead:
            self._futures.append(_new_future())

    def _fail_items(self, items: list[_Item]) -> None:
        """Fail the futures of items that will never be durable and free their staging."""
        for it in items:
            if it.cost:
                self._staging.release(it.cost, None)
            it.forget()
            self._released(it)
            it.future.set_exception(self._ledger.fresh_error(it.step))

    # ------------------------------------------------------------------ waiting

    def flush(self) -> int | None:
        """Block until every step appended and every base submitted so far is durable;
        returns :attr:`durable_step`. Raises the writer's failure if there is one."""
        with self._plock:
            self._check_usable()
            self._drain()
            self._check_usable()
            return self._ledger.durable

    def _drain(self) -> None:
        """Ask for a flush and wait until every diff appended so far and every pending
        base is durable, or the writer failed. The caller holds ``_plock``."""
        target = self._last_diff
        self._q.put(_FLUSH)
        with self._ledger.cond:
            while self._ledger.error is None and (self._ledger.diff_durable < target
                                           or self._ledger.bases_pending):
                self._ledger.cond.wait()

    def wait(self, step: int, timeout: float | None = None) -> None:
        """Block until :attr:`durable_step` >= ``step`` (which must have been appended).

        Raises :class:`CommitError` if the writer failed before ``step`` became durable,
        ``TimeoutError`` after ``timeout`` seconds. Does not hurry the group along: use
        ``append(..., sync=True)`` or :meth:`flush` for that.
        """
        if step > self._last_step:
            raise ConfigError(f"step {step} was not appended (last step {self._last_step})")
        end = None if timeout is None else time.monotonic() + timeout
        with self._ledger.cond:
            while self._ledger.durable is None or self._ledger.durable < step:
                if self._ledger.error is not None:
                    raise self._ledger.fresh_error(step) from self._ledger.cause
                if self._closed:
                    raise WriterClosedError(f"step {step} is not durable and the writer is "
                                            "closed", path=self.path)
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"step {step} not durable after {timeout} s")
                self._ledger.cond.wait(left)

    # ------------------------------------------------------------------ log operations

    def set_batch(self, batch: int) -> None:
        """Change the records per group commit from now on (the tuner's lever). The group
        being filled closes at the new size; nothing already written changes."""
        if type(batch) is not int or batch < 1:
            raise ConfigError(f"batch={batch!r} must be an int >= 1")
        self._futures_ahead = min(1024, max(32, 2 * batch))
        self.batch = batch  # read by the encoder per record (an int store is atomic)
        self._q.put(_RESIZE)  # a group already this full closes now

    def stats(self) -> dict[str, float]:
        """Per-stage seconds and counters (for the tuner).

        ``stage_s`` (foreground copies), ``encode_s``, ``write_s``, ``fsync_s``,
        ``blocked_s`` (appends waiting for memory), ``base_s``: cumulative seconds;
        ``bytes``, ``records``, ``batches`` (= fsyncs of groups), ``appends``: totals;
        ``last_batch_records``, ``last_batch_bytes``, ``max_batch_records``;
        ``staged_bytes`` (now), ``staged_bytes_peak``, ``pooled_bytes``, ``memory_budget``,
        ``staging_allocs`` (staging buffers allocated rather than recycled);
        ``ack_latency_s`` (sum over records of append-to-durable time), ``queued``,
        ``bases``, ``base_bytes``, ``callback_errors``, ``durable_step`` (-1 if none).
        """
        out = dict(self._stats)
        out.update(self._staging.stats())
        out["queued"] = out["appends"] - out["records"]
        out["durable_step"] = -1 if self._ledger.durable is None else self._ledger.durable
        return out

    def update_meta(self, meta: Mapping[str, Any]) -> None:
        """Merge keys into the log-level metadata and publish the manifest (synchronous)."""
        with self._plock:
            self._check_usable()
            self.log.update_meta(meta)

    def truncate_after(self, step: int) -> int:
        """Flush, then discard every diff and base after ``step`` (see
        :meth:`LogWriter.truncate_after`); returns the number of records dropped.
        :attr:`durable_step` and :attr:`last_step` move back to what remains."""
        try:
            step = operator.index(step)
        except TypeError:
            raise ConfigError(f"truncate_after: step {step!r} is not an int") from None
        self.flush()
        with self._plock:
            self._check_usable()
            try:
                dropped = self.log.truncate_after(step)
            except BaseException as e:
                self._ledger.poison(step, e)
                self._check_usable()
                raise
            self._last_step = self.log.last_step
            self._last_diff = min(self._last_diff, step)
            bases = self.log.manifest.bases
            self._last_base = bases[-1] if bases else -1
            self._ledger.reset(self.log.durable_step, step)
        return dropped

    def close(self) -> None:
        """Flush, stop the background threads, sync and close the log, release its lock.

        Idempotent. After a background failure nothing more is synced (the log is
        abandoned: a partial record stays a torn tail) and the failure is raised once,
        unless an earlier call already raised it.
        """
        with self._plock:
            if self._closed:
                return
            if self._ledger.error is None:
                self._drain()
            self._closed = True
            self._q.put(_STOP)
            for t in self._threads:
                t.join()
            if self._base_pool is not None:
                self._base_pool.shutdown(wait=True)
            self._staging.close()
            if self._ledger.error is None:
                try:
                    self.log.close()
                except BaseException as e:
                    self._ledger.poison(self._last_step, e)
            if self._ledger.error is not None:
                self.log.abandon()
                if not self._ledger.reported:
                    self._ledger.reported = True
                    raise self._ledger.fresh_error(None) from self._ledger.cause
            with self._ledger.cond:
                self._ledger.cond.notify_all()

    def __enter__(self) -> AsyncLogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["DEFAULT_BATCH", "DEFAULT_MAX_BATCH_BYTES", "DEFAULT_MAX_DELAY_S",
           "DEFAULT_MEMORY_BUDGET", "AsyncLogWriter", "TensorSpec", "freeze_map", "thaw_map"]
