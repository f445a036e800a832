"""The producer side of the writer process: :class:`RingClient` makes the ring once, starts
``python -m lowdiff_store.writer.process`` with the ring and one end of the channel as its
only descriptors (and, for a local log, the log's ``LOCK``, taken here first), copies each
step into the ring and signals it (``format_spec/ring.md``).
Numpy only: the torch adapter builds on it.

What the training thread pays per step: checking the step and its tensors, one msgpack
table, one copy of the bytes into the ring, a CRC of the slot header and table, and one
16-byte ``send``. Encoding, compression, CRCs of the payload, writes and fsyncs run in the
writer process, off this process's GIL.

Errors. What the writer process would refuse (step order, names, dtypes, sizes) is checked
here and raised by the call. A failure in the writer process (a full disk, an I/O error)
is raised at the next call, as the class the writer met (usually ``CommitError`` with the
``StorageError`` as ``__cause__``); if the process died, ``CommitError`` says
``writer process died`` with its exit code or signal, from the first call after the kernel
closed the dead process's end of the channel (``format_spec/ring.md``, section 4).
:meth:`RingClient.close` raises a failure once if no call has. Threading: one thread calls
the methods (the training thread); :attr:`durable_step` may be read from any.
"""

from __future__ import annotations

import operator
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from ..errors import CommitError, ConfigError, LowdiffError, Reason, WriterClosedError
from ..format.constants import LOCK_NAME
from ..format.dtypes import STORAGE_DTYPE
from ..format.framing import align_up, pack_meta
from ..log.writer import is_slice
from ..storage import LocalStore
from .ring import (
    SLOT_HEADER_LEN,
    More,
    Op,
    Outgoing,
    Ring,
    RingBatch,
    RingTensor,
    State,
    Word,
    bytes_of,
    layout_base,
    layout_diff,
    layout_meta,
    layout_open,
    layout_part,
    pack_request,
    pad_message,
    read_failure,
    write_message,
)

#: slots of a ring and bytes per slot; a step takes as many slots as it needs, so a ring of
#: 64 x 1 MiB holds 64 small steps or one of up to 64 MiB
DEFAULT_SLOTS: Final = 64
DEFAULT_SLOT_SIZE: Final = 1 << 20
#: how long the writer process may take to open the log
DEFAULT_START_TIMEOUT_S: Final = 120.0
#: the command that runs the writer process (the client appends the descriptors)
WRITER_COMMAND: Final = (sys.executable, "-m", "lowdiff_store.writer.process")
#: the directory holding this lowdiff_store package: the writer process imports it first
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])

TensorArg = RingTensor | tuple[str, str, Sequence[int], Any]


def _tensor(t: TensorArg) -> RingTensor:
    if isinstance(t, RingTensor):
        return t
    if isinstance(t, tuple) and len(t) == 4:
        return RingTensor.raw(*t)
    raise ConfigError(f"a tensor is a RingTensor or (name, dtype, shape, data), got {t!r:.80}")


def _take_lock(path: str) -> int:
    """A locked descriptor of the ``LOCK`` of the local log at ``path`` (the directory made
    if needed), for the writer process to adopt; ``LowdiffError(locked)`` when another
    writer holds it (the refusal ``LogWriter`` makes)."""
    store = LocalStore(path)
    store.ensure_root()
    fd = store.lock_to_hand_over(LOCK_NAME)
    if fd is None:
        raise LowdiffError("another writer holds this log (LOCK is taken)",
                           reason=Reason.LOCKED, path=store.path_of(LOCK_NAME))
    return fd


class RingClient:
    """A log written by a writer process, fed through a shared ring (module docstring).

    Args:
        path: the log directory (or URL), opened or created by the writer process.
        slots, slot_size: the ring: ``slots`` slots of ``slot_size`` bytes (a multiple of
            4096), allocated at open; a step larger than the ring is refused, a base larger
            than half of it goes in pieces (:meth:`put_base`).
        ring_dir: where the ring's file goes if ``memfd_create`` is unavailable.
        meta: log-level metadata of a new log.
        start_timeout_s: how long opening may take before the process is killed.
        nice: added to the writer process's niceness (e.g. 5: the kernel never lets
            waking it preempt the caller's thread; it runs on spare cycles).
        wait_ready: wait here until the writer process has opened the log (else the
            first call that needs the log's state waits: :meth:`wait_ready`; steps put
            meanwhile queue in the ring).
        command: the argv that runs the writer process (default :data:`WRITER_COMMAND`).
        options: ``AsyncLogWriter``'s ``batch``, ``max_batch_bytes``, ``max_delay_s``,
            ``memory_budget``, ``segment_bytes``.
    """

    def __init__(self, path: str | os.PathLike[str], *, slots: int = DEFAULT_SLOTS,
                 slot_size: int = DEFAULT_SLOT_SIZE,
                 ring_dir: str | os.PathLike[str] | None = None,
                 meta: Mapping[str, Any] | None = None,
                 start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
                 command: Sequence[str] = WRITER_COMMAND, wait_ready: bool = True,
                 nice: int = 0, **options: Any) -> None:
        t0 = time.perf_counter()
        path = os.fspath(path)
        self.path = path if "://" in path else os.path.abspath(path)
        opening = layout_open(self.path, options, meta)
        # A local log is this process's from here, as with a writer in this process: its
        # LOCK is taken now and handed to the writer process, which adopts it (a second
        # writer is refused here, whichever writer process would have started first).
        lock_fd = None if "://" in self.path else _take_lock(self.path)
        try:
            self._ring, fd = Ring.create(slots, slot_size, ring_dir)
        except BaseException:
            if lock_fd is not None:
                os.close(lock_fd)
            raise
        self._closed = False
        #: one caller at a time writes a message or waits on the channel (a base's PARTs
        #: may be put from another thread than the steps': each PART takes it alone)
        self._lock = threading.RLock()
        self._error: BaseException | None = None  # the failure, once seen
        self._reported = False
        self._head = 0  # slot number of the next message
        self._token = 0
        self._durable: int | None = None  # (after close, when the ring is gone)
        self._published_base = -1
        self._skipped = -1
        self._writer_stats: dict[str, float] = {}
        self._stats: dict[str, float] = dict.fromkeys(
            ("puts", "bases", "base_parts", "bytes", "pads", "ring_waits", "ring_wait_s",
             "put_s"), 0)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = mine
        try:
            self._write(opening, what="the OPEN message")
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(
                [_PACKAGE_ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
            argv = [*command, "--ring-fd", str(fd), "--channel-fd", str(theirs.fileno()),
                    "--parent-pid", str(os.getpid())] + (["--nice", str(nice)] if nice else [])
            fds = [fd, theirs.fileno()]
            if lock_fd is not None:
                argv += ["--lock-fd", str(lock_fd)]
                fds.append(lock_fd)
            self._proc = subprocess.Popen(argv, pass_fds=fds, stdin=subprocess.DEVNULL,
                                          cwd=_PACKAGE_ROOT, env=env)
        except BaseException:
            mine.close()
            self._ring.close()
            raise
        finally:
            os.close(fd)
            theirs.close()
            if lock_fd is not None:  # (the writer process's copy holds the lock now)
                os.close(lock_fd)
        self._t_spawn = t0
        self._start_timeout_s = start_timeout_s
        self._ready_by = time.monotonic() + start_timeout_s
        self._ready = False
        self._last_step = self._last_base = -1
        #: the process that made the ring (a fork's copy of this object must not use it)
        self._owner = os.getpid()
        try:
            self._send(Op.PUBLISH, self._head)  # (a writer already dead: raised here)
            if wait_ready:
                self.wait_ready()
        except BaseException:
            self._shut()
            raise

    def wait_ready(self) -> None:
        """Wait until the writer process has opened the log (raises its failure, or
        ``CommitError`` after ``start_timeout_s``, the process killed); then
        :attr:`last_step` is the log's. Called by every method that needs the log's
        state; :meth:`put_step` and :meth:`put_base` do not wait (their messages queue in
        the ring while the writer process starts)."""
        if self._ready:
            return
        with self._lock:
            self._wait_ready()

    def _wait_ready(self) -> None:
        if self._ready:
            return
        try:
            self._wait_until(self._started, self._ready_by)
        except TimeoutError:
            self._proc.kill()
            raise CommitError(f"the writer process did not open the log within "
                              f"{self._start_timeout_s} s", path=self.path) from None
        if self._failure() is not None:
            self._raise()

    def _started(self) -> bool:
        """Whether the writer process left ``starting`` (noting what it found then)."""
        if self._ready:
            return True
        if self._ring.get(Word.STATE) == State.STARTING:
            return False
        self._ready = True
        self._last_step = max(self._last_step, self._ring.get(Word.LAST_STEP))
        self._last_base = max(self._last_base, self._ring.get(Word.LAST_BASE))
        self._stats["start_s"] = time.perf_counter() - self._t_spawn
        return True

    # ------------------------------------------------------------------ properties

    @property
    def pid(self) -> int:
        """The writer process's id."""
        return int(self._proc.pid)

    @property
    def durable_step(self) -> int | None:
        """Newest step durable with every step handed over before it (as
        ``AsyncLogWriter.durable_step``); ``None`` before any."""
        if self._closed:
            return self._durable
        d = self._ring.get(Word.DURABLE)
        return None if d < 0 else d

    @property
    def last_step(self) -> int:
        """Newest step put (diff or base); -1 for an empty log (waits until the writer
        process has opened the log)."""
        if not self._closed:
            self.wait_ready()
        return self._last_step

    def stats(self) -> dict[str, float]:
        """Counters: ``puts``, ``bases``, ``bytes`` (message bytes put), ``pads``,
        ``ring_waits`` (puts that waited for free slots) and ``ring_wait_s``, ``put_s``
        (seconds in put calls, waits included), ``start_s`` (process start and log open:
        spawn to the first call that saw the writer ready, an upper bound when nothing
        waited for it), ``durable_step`` (-1 if none)."""
        out = dict(self._stats)
        d = self.durable_step
        out["durable_step"] = -1 if d is None else d
        return out

    # ------------------------------------------------------------------ failures

    def _failure(self) -> BaseException | None:
        """The writer process's failure, if it published one or died."""
        if self._error is None and self._ring.get(Word.STATE) == State.FAILED:
            self._error = read_failure(self._ring)
        return self._error

    def _raise(self) -> None:
        err = self._error
        assert err is not None
        self._reported = True
        raise err

    def _check_usable(self) -> None:
        if self._closed:
            raise WriterClosedError("writer is closed", path=self.path)
        if os.getpid() != self._owner:
            raise WriterClosedError(f"this writer belongs to process {self._owner}; a "
                                    "process forked from it cannot use it", path=self.path)
        if self._failure() is not None:
            self._raise()
        self._started()

    def _died(self) -> None:
        """The channel is closed: the process exited. Its reply says why, else its status."""
        if self._failure() is None:
            code = self._proc.wait()
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            if code < 0:
                try:
                    how += f" ({signal.Signals(-code).name})"
                except ValueError:
                    pass
            self._error = CommitError(
                f"writer process died ({how}); durable step {self.durable_step}",
                path=self.path)
        self._raise()

    def _send(self, op: Op, arg: int) -> None:
        try:
            self._sock.send(pack_request(op, arg), socket.MSG_NOSIGNAL)
        except (BrokenPipeError, ConnectionResetError):
            self._died()

    def _wait_until(self, ready: Callable[[], bool], deadline: float | None = None) -> None:
        """Wait on the doorbell until ``ready()``; raise the writer's failure or death, or
        ``TimeoutError`` past ``deadline``. While the writer process is still starting, a
        wait without a deadline also ends at the start's (:meth:`wait_ready` raises)."""
        while not ready():
            if self._failure() is not None:
                self._raise()
            limit = deadline
            if limit is None and not self._started():
                if time.monotonic() > self._ready_by:
                    self.wait_ready()  # (raises: the start timed out)
                limit = self._ready_by
            left = None if limit is None else limit - time.monotonic()
            if left is not None and left <= 0:
                if deadline is None:
                    continue  # (the start's deadline: raised above on the next turn)
                raise TimeoutError
            readable, _w, _x = select.select([self._sock], [], [], left)
            if not readable:
                continue
            while True:
                try:
                    bell = self._sock.recv(64, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                except ConnectionResetError:  # it died with requests unread
                    bell = b""
                if not bell:
                    if ready():  # (it answered, then exited: CLOSE)
                        return
                    self._died()

    # ------------------------------------------------------------------ putting

    def _write(self, msg: Outgoing, what: str) -> None:
        """Copy ``msg`` into the next free slots (waiting for them) and advance the head;
        the caller sends PUBLISH."""
        ring, n = self._ring, self._ring.slot_count
        span = msg.span(ring.slot_size)
        if span > n:
            raise ConfigError(f"{what} needs {msg.size} bytes, the ring holds "
                              f"{n * ring.slot_size} ({n} slots of {ring.slot_size}): open "
                              "a larger ring", reason=Reason.LIMIT_EXCEEDED)
        pad = n - self._head % n
        if pad < span:  # the step does not fit before the end: PAD to it, start at slot 0
            self._wait_free(pad)
            write_message(ring, self._head, pad_message(), pad)
            self._head += pad
            self._send(Op.PUBLISH, self._head)  # (its slots come back before the step's)
            self._stats["pads"] += 1
        self._wait_free(span)
        write_message(ring, self._head, msg)
        self._head += span
        self._stats["bytes"] += msg.size

    def _wait_free(self, slots: int) -> None:
        """Wait until the next ``slots`` slots are released (counted in the stats)."""
        need = self._head + slots - self._ring.slot_count
        if self._ring.get(Word.TAIL) < need:
            t0 = time.perf_counter()
            self._stats["ring_waits"] += 1
            self._wait_until(lambda: self._ring.get(Word.TAIL) >= need)
            self._stats["ring_wait_s"] += time.perf_counter() - t0

    def put_step(self, step: int, kind: str, tensors: Sequence[TensorArg], *,
                 side: Mapping[str, Any] | None = None,
                 extra: Mapping[str, Any] | None = None, sync: bool = False,
                 batch: RingBatch | None = None) -> None:
        """Copy the diff record of ``step`` into the ring and hand it to the writer
        process (``AsyncLogWriter.append``'s ``kind``, ``side``, ``extra``, ``sync``).
        ``tensors``: :class:`RingTensor`, or ``(name, dtype tag, shape, data)`` for a
        plain array (``data``: a numpy array or C-contiguous buffer holding the elements
        in the tag's storage dtype). The caller may reuse its buffers once this returns.
        Blocks while the ring is full (``ring_waits``), never drops a step. ``batch``:
        arrays the writer process encodes by their recipes (``format_spec/ring.md``,
        section 3.1), placed in the record among ``tensors``."""
        t0 = time.perf_counter()
        with self._lock:
            self._check_usable()
            step = operator.index(step)
            if step <= self._last_step:
                raise ConfigError(f"step {step} does not follow step {self._last_step}",
                                  reason=Reason.STEP_OUT_OF_ORDER, path=self.path)
            msg = layout_diff(step, kind, [_tensor(t) for t in tensors], side=side,
                              extra=extra, sync=sync, batch=batch)
            self._write(msg, f"step {step}")
            self._last_step = step
            self._send(Op.PUBLISH, self._head)
            self._stats["puts"] += 1
            self._stats["put_s"] += time.perf_counter() - t0

    def put_base(self, step: int, tensors: Mapping[str, tuple[str, Any]] | Sequence[TensorArg],
                 meta: Mapping[str, Any] | None = None) -> None:
        """Copy a base (the full state after ``step``: ``{name: (dtype tag, array)}`` or
        raw tensors) into the ring for ``AsyncLogWriter.write_base``. A base of more than
        :attr:`part_slots` slots goes as PART messages, the writer process building it
        (ring.md section 3.2), so a base of any size passes through a ring sized for the
        steps; blocks while the ring is full."""
        t0 = time.perf_counter()
        with self._lock:
            self._check_usable()
            step = operator.index(step)
            if step <= self._last_base:
                raise ConfigError(f"base at step {step} is not newer than base "
                                  f"{self._last_base}", reason=Reason.STEP_OUT_OF_ORDER,
                                  path=self.path)
            if isinstance(tensors, Mapping):
                items = [RingTensor.raw(n, tag, memoryview(a).shape or (), a)
                         for n, (tag, a) in tensors.items()]
            else:
                items = [_tensor(t) for t in tensors]
            msg = layout_base(step, items, meta)
            self._last_base = step  # (taken: the PARTs may let other messages in)
            if not is_slice(meta):
                self._last_step = max(self._last_step, step)  # (a slice may precede its diff)
        if msg.span(self._ring.slot_size) > self.part_slots:
            msg = layout_base(step, [], meta, parts=self._put_parts(step, items, meta))
        with self._lock:
            self._write(msg, f"the base at step {step}")
            self._send(Op.PUBLISH, self._head)
            self._stats["bases"] += 1
            self._stats["put_s"] += time.perf_counter() - t0

    @property
    def part_slots(self) -> int:
        """The most slots a BASE takes whole; a larger base goes as PART messages of at
        most this many slots each (ring.md section 3.2): half the ring, so a base's
        pieces stream through it while the writer process takes them out."""
        return max(1, self._ring.slot_count // 2)

    def _put_parts(self, step: int, items: Sequence[RingTensor],
                   meta: Mapping[str, Any] | None) -> int:
        """Send ``items`` (raw tensors of the base of ``step``) as PART messages of at most
        :attr:`part_slots` slots (:func:`_pieces`), each published at once (the writer
        process writes its pieces out and releases its slots); returns how many."""
        layout = [(t.name, t.dtype, t.shape) for t in items]
        sent = 0
        for pieces in _pieces(step, items, meta, self.part_slots * self._ring.slot_size):
            with self._lock:  # (one PART at a time holds the client: steps pass between)
                self._check_usable()
                self._write(layout_part(step, pieces, *((layout, meta) if sent == 0 else ())),
                            f"part {sent} of the base at step {step}")
                self._send(Op.PUBLISH, self._head)
            sent += 1
        with self._lock:
            self._stats["base_parts"] += sent
        return sent

    def put_meta(self, *, truncate_after: int | None = None,
                 meta: Mapping[str, Any] | None = None, batch: int | None = None) -> int:
        """Truncate the log after a step, merge keys into its metadata, set the records per
        group commit (``AsyncLogWriter.truncate_after``, ``update_meta``, ``set_batch``, in
        that order, after everything put before). A truncation or metadata is waited for
        (a flush); returns the records a truncation dropped (0 without one)."""
        with self._lock:
            return self._put_meta(truncate_after, meta, batch)

    def _put_meta(self, truncate_after: int | None, meta: Mapping[str, Any] | None,
                  batch: int | None) -> int:
        self._check_usable()
        self._write(layout_meta(truncate_after=truncate_after, meta=meta, batch=batch),
                    "the META message")
        self._send(Op.PUBLISH, self._head)
        if truncate_after is None and not meta:
            return 0
        self.flush()
        if truncate_after is None:
            return 0
        self._last_step = self._ring.get(Word.LAST_STEP)
        self._last_base = self._ring.get(Word.LAST_BASE)
        return self._ring.get_more(More.TRUNCATED)

    @property
    def published_base(self) -> int:
        """The newest base the log holds (published since open, or found at open); -1:
        none."""
        if self._closed:
            return self._published_base
        return self._ring.get(Word.BASE)

    @property
    def skipped_base(self) -> int:
        """The newest base the writer process skipped because the store did not answer
        (the log goes on from the previous base); -1: none."""
        return self._skipped if self._closed else self._ring.get_more(More.SKIPPED)

    def writer_stats(self) -> dict[str, float]:
        """The writer process's ``AsyncLogWriter`` counters as it last published them (at
        each durable step, flush and close)."""
        if self._closed:
            return dict(self._writer_stats)
        return self._ring.stats()

    # ------------------------------------------------------------------ waiting, closing

    def flush(self) -> int | None:
        """Block until everything put so far is durable; returns :attr:`durable_step`."""
        with self._lock:
            return self._flush()

    def _flush(self) -> int | None:
        self._check_usable()
        self._token += 1
        token = self._token
        self._send(Op.FLUSH, token)
        self._wait_until(lambda: self._ring.get(Word.FLUSHED) >= token)
        if self._failure() is not None:
            self._raise()
        return self.durable_step

    def close(self) -> None:
        """Flush, close the log, wait for the writer process to exit. Idempotent; raises
        the writer's failure once if no call has."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._closed:
            return
        if os.getpid() != self._owner:  # a fork's copy (at its exit): the writer process
            self._closed = True         # is its parent's; only this copy's ends close
            self._sock.close()
            self._ring.close()
            return
        reported = self._reported
        try:
            if self._failure() is None:
                self._send(Op.CLOSE, 0)
                self._wait_until(lambda: self._ring.get(Word.STATE) in (State.CLOSED,
                                                                       State.FAILED))
        except LowdiffError:
            pass  # (a death or failure: kept in _error, raised below unless reported)
        finally:
            self._shut()
        if self._error is not None and not reported:
            self._raise()

    def _shut(self) -> None:
        """Close the channel (a writer process still serving sees end of file, closes the
        log and exits), reap the process, keep the durable step, unmap the ring."""
        self._sock.close()
        self._proc.wait()
        self._failure()
        self._durable = self.durable_step
        self._published_base = self._ring.get(Word.BASE)
        self._skipped = self._ring.get_more(More.SKIPPED)
        self._writer_stats = self._ring.stats()
        self._closed = True
        self._ring.close()

    def __enter__(self) -> RingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



Piece = tuple[str, str, Sequence[int], int, memoryview]


def _pieces(step: int, items: Sequence[RingTensor], meta: Mapping[str, Any] | None,
            room: int) -> Iterator[list[Piece]]:
    """The pieces of each PART message of a base (ring.md section 3.2): the tensors'
    bytes in order, cut into whole elements so that a message, its table included (the
    first carries the layout and ``meta``), takes at most ``room`` bytes."""
    pieces: list[Piece] = []
    used = 0
    # table: a bound on the PART's table bytes (the first carries the layout and meta)
    table = sum(len(t.name.encode()) + 10 * len(t.shape) + 16 for t in items) + (
        len(pack_meta(dict(meta))) if meta else 0)
    for t in items:
        (tag, data), = t.parts
        mv = bytes_of(t.name, tag, data)
        item = STORAGE_DTYPE[tag].itemsize
        entry = len(t.name.encode()) + 10 * len(t.shape) + 64  # msgpack, generous
        at = 0
        while True:
            free = room - align_up(SLOT_HEADER_LEN + 16 + table + entry) - align_up(used)
            n = min(mv.nbytes - at, max(0, free) // item * item)
            if (n == 0 and mv.nbytes > at) or free < 0:  # (a 0-byte tensor needs no room)
                if not pieces:
                    raise ConfigError(f"tensor {t.name!r} of the base at step {step}: a "
                                      f"message of {room} bytes cannot carry a piece of it",
                                      reason=Reason.LIMIT_EXCEEDED)
                yield pieces
                pieces, table, used = [], 0, 0
                continue
            pieces.append((t.name, tag, t.shape, at, mv[at:at + n]))
            table += entry
            used = align_up(used) + n
            at += n
            if at >= mv.nbytes:
                break
    if pieces:
        yield pieces

__all__ = ["DEFAULT_SLOTS", "DEFAULT_SLOT_SIZE", "DEFAULT_START_TIMEOUT_S", "WRITER_COMMAND",
           "RingClient", "TensorArg"]
