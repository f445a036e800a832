"""The writer process: ``python -m lowdiff_store.writer.process --ring-fd R --channel-fd C
--parent-pid P``, started by :class:`~lowdiff_store.writer.ring_client.RingClient`. It
attaches to the ring, reads each message the producer publishes and hands it to an
:class:`~lowdiff_store.writer.AsyncLogWriter` without a copy (the record is written from
the ring), releases the message's slots once the log no longer reads them, and answers
through the ring's header words and a doorbell (``format_spec/ring.md``, sections 4-6).

Lifetime: it exits after a CLOSE request, or once the producer is gone (end of file on the
channel, or the parent's exit seen through a pidfd, or ``getppid()`` changing where pidfds
are unavailable), or on SIGTERM (a job's end, a preemption: the scheduler's grace period
is spent making the log durable): then it handles every request already received,
flushes, closes the log and exits, so every step handed over becomes durable unless the
log fails (after SIGTERM the producer's next call raises a ``CommitError`` saying so).
``SIGINT`` is ignored (a terminal's Ctrl-C reaches the whole process group; the producer decides).
Exit status: 0 closed, 1 the writer failed (the error reply says why), 2 the ring or the
arguments are unusable (one line on stderr).

Torch-free: it imports the writer layer and below only.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from .. import codecs
from ..codecs.batch import HostBatch, LastBits, run_recipe
from ..errors import CommitError, FormatError, LowdiffError, Reason
from ..format.constants import BASE_NAME, LOCK_NAME, SLICE_NAME
from ..log.base import BaseBuilder, BaseTensors
from ..log.writer import is_slice
from ..storage import LocalStore, StoreLike
from .async_writer import AsyncLogWriter, TensorSpec
from .deferred import DeferredEncoding
from .ring import (
    DOORBELL,
    FLAG_SYNC,
    REQUEST_SIZE,
    Kind,
    Message,
    More,
    Op,
    Ring,
    SlotBatch,
    SlotRecipe,
    State,
    Word,
    encode_reply,
    publish_failure,
    read_message,
    unpack_request,
)

#: how often the parent is checked where no pidfd can watch it
_PARENT_POLL_S = 0.5


class ParentWatch:
    """Whether the producer that started this process is still alive: a pidfd that
    becomes readable when it exits, or ``getppid()`` polled where pidfds are unavailable."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fd: int | None = None
        try:
            self.fd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # Python < 3.9, kernel < 5.3, or already gone
            self.fd = None
        if not self.alive():
            self.close()

    def alive(self) -> bool:
        """The parent has not exited (an orphan is re-parented: its ppid changes)."""
        return os.getppid() == self.pid

    def close(self) -> None:
        """Stop watching."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class Server:
    """One writer process's work over an attached ring and its channel."""

    def __init__(self, ring: Ring, channel: socket.socket, parent: ParentWatch,
                 lock_fd: int | None = None) -> None:
        self.ring = ring
        self.channel = channel
        self.parent = parent
        #: the log's ``LOCK``, locked by the producer before it started this process
        #: (section 1 of ring.md): adopted when the log is opened
        self.lock_fd = lock_fd
        self.writer: AsyncLogWriter | None = None
        self.cursor = 0  # the slot number of the next message
        self._lock = threading.Lock()  # released ranges, tail, durable, the failure
        self._released: dict[int, int] = {}  # start -> end of released runs past tail
        self._tail = 0
        self._durable = -1
        self._failed = False
        self._orphan = not parent.alive()
        #: the base whose PART messages are arriving (ring.md section 3.2)
        self._building: _Building | None = None
        #: per-layout arrays of the batched encodes, kept across steps
        self._constants: dict[Any, Any] = {}
        #: the last bits logged per name for ``changed`` recipes, and their generation
        self._last: tuple[int, LastBits] = (-1, {})
        #: SIGTERM was received (a job's end or preemption): what was sent is made
        #: durable, then the process exits; ``wake_fd`` wakes the wait for requests
        self.terminated = False
        self.wake_fd, self._wake_w = os.pipe()
        for fd in (self.wake_fd, self._wake_w):
            os.set_blocking(fd, False)

    def on_sigterm(self) -> None:
        """Install the SIGTERM handler (main thread): note it, wake the request wait."""
        def handler(_signum: int, _frame: object) -> None:
            self.terminated = True
        signal.set_wakeup_fd(self._wake_w)
        signal.signal(signal.SIGTERM, handler)

    # ------------------------------------------------------------------ answers

    def _ring_bell(self) -> None:
        try:
            self.channel.send(DOORBELL, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
        except OSError:  # full (unread doorbells wake the producer anyway) or gone
            pass

    def _release(self, start: int, end: int) -> None:
        """Slots [start, end) are free again; ``tail`` moves over the contiguous run."""
        with self._lock:
            self._released[start] = end
            moved = False
            while self._tail in self._released:
                self._tail = self._released.pop(self._tail)
                moved = True
            if moved:
                self.ring.set(Word.TAIL, self._tail)
        if moved:
            self._ring_bell()

    def _publish_durable(self, step: int | None) -> None:
        if step is None:
            return
        with self._lock:
            if step <= self._durable:
                return
            self._durable = step
            self._publish_stats()
            self.ring.set(Word.DURABLE, step)
        self._ring_bell()

    def _publish_stats(self) -> None:
        if self.writer is not None:
            self.ring.set_stats(self.writer.stats())

    def _fail(self, err: BaseException, step: int | None) -> None:
        """Publish the first failure (later ones are consequences of it)."""
        with self._lock:
            if self._failed:
                return
            self._failed = True
            publish_failure(self.ring, encode_reply(err, step))
        self._ring_bell()

    def _on_done(self, step: int, base: bool) -> Callable[[Future[int]], None]:
        def done(fut: Future[int]) -> None:
            e = fut.exception()
            if e is None:
                if base:
                    with self._lock:
                        if step > self.ring.get(Word.BASE):
                            self.ring.set(Word.BASE, step)
                    self._ring_bell()
                return
            if base and isinstance(e, LowdiffError) and e.reason is Reason.STORE_UNAVAILABLE:
                with self._lock:  # the base was skipped; the log goes on (AsyncLogWriter's
                    self.ring.set_more(More.SKIPPED, step)  # contract)
                self._ring_bell()
                return
            self._fail(e, step)
        return done

    # ------------------------------------------------------------------ requests

    def _next_request(self) -> tuple[Op, int] | None:
        """The next request, or ``None`` once the producer is gone and every request it
        sent is handled."""
        while True:
            try:
                if self._orphan:
                    data = self.channel.recv(REQUEST_SIZE, socket.MSG_DONTWAIT)
                else:
                    fds: list[socket.socket | int] = [self.channel, self.wake_fd]
                    if self.parent.fd is not None:
                        fds.append(self.parent.fd)
                    timeout = None if self.parent.fd is not None else _PARENT_POLL_S
                    ready, _w, _x = select.select(fds, [], [], timeout)
                    if self.terminated:  # SIGTERM: finish what was sent, as an orphan does
                        self._orphan = True
                        continue
                    if self.channel not in ready:
                        self._orphan = not self.parent.alive()
                        continue
                    data = self.channel.recv(REQUEST_SIZE)
            except BlockingIOError:  # (orphan) every request it sent is handled
                return None
            except ConnectionResetError:
                # The producer closed with doorbells unread: the kernel reports that once,
                # before the requests still queued, which must all be handled.
                self._orphan = True
                continue
            if not data:
                return None
            return unpack_request(data)

    def run(self) -> int:
        """Serve requests until CLOSE or the producer is gone; returns the exit status."""
        try:
            while (req := self._next_request()) is not None:
                op, arg = req
                if op is Op.PUBLISH:
                    self._take(arg)
                elif op is Op.FLUSH:
                    self._flush(arg)
                else:
                    break
        except Exception as e:  # a bad request or ring: the producer learns it from the reply
            self._fail(e, None)
        return self._close()

    def _take(self, head: int) -> None:
        """Hand over the messages up to slot number ``head``."""
        if not self.cursor <= head <= self._tail + self.ring.slot_count:
            raise LowdiffError(f"PUBLISH of head {head}: the writer is at slot {self.cursor}"
                               f", the ring holds up to {self._tail + self.ring.slot_count}",
                               reason=Reason.OUT_OF_BOUNDS)
        while self.cursor < head:
            if self._failed:  # nothing more is read: the producer must never wait on us
                self._release(self.cursor, head)
                self.cursor = head
                return
            msg = read_message(self.ring, self.cursor)
            if self.cursor + msg.span > head:
                raise LowdiffError(f"the message at slot {self.cursor} spans past the "
                                   f"published head {head}", reason=Reason.OUT_OF_BOUNDS)
            self.cursor += msg.span
            try:
                self._hand_over(msg)
            except Exception as e:
                self._release(msg.seq, msg.seq + msg.span)
                self._fail(e, msg.step)

    def _hand_over(self, msg: Message) -> None:
        start, end = msg.seq, msg.seq + msg.span
        if msg.kind is Kind.PAD:
            self._release(start, end)
        elif msg.kind is Kind.OPEN:
            self._open(msg)
            self._release(start, end)
        elif self.writer is None:
            raise LowdiffError(f"a {msg.kind.name} message before OPEN")
        elif msg.kind is Kind.META:
            self._meta(msg)
            self._release(start, end)
        elif msg.kind is Kind.DIFF:
            specs = [TensorSpec(t.name, t.dtype, shape=t.shape, zstd=t.zstd,
                                encoded=codecs.Encoded(t.codec, t.params, tuple(
                                    codecs.Part(p.dtype, self.ring.array(p)) for p in t.parts)))
                     for t in msg.tensors]
            if msg.batch is not None:
                specs = self._with_recipes(specs, msg.batch)
            fut = self.writer.append(msg.step, specs, kind=msg.record_kind, side=msg.side,
                                     extra=msg.extra, sync=bool(msg.flags & FLAG_SYNC),
                                     owned=True, on_release=lambda: self._release(start, end))
            fut.add_done_callback(self._on_done(msg.step, base=False))
        elif msg.kind is Kind.PART:
            self._part(msg)
            self._release(start, end)
        else:
            built, self._building = self._building, None
            if built is not None or msg.parts:
                tensors: BaseTensors = self._built(msg, built)
            else:
                tensors = {t.name: (t.dtype, self.ring.array(t.parts[0]).reshape(t.shape))
                           for t in msg.tensors}

            def release() -> None:
                self._release(start, end)
                if built is not None:
                    built.builder.abort()  # (no-op once published: else its temp file goes)
            fut = self.writer.write_base(msg.step, tensors, msg.meta, release=release)
            fut.add_done_callback(self._on_done(msg.step, base=True))

    def _part(self, msg: Message) -> None:
        """A PART message (ring.md section 3.2): its pieces written into the base being
        built (a local log: straight into the base's temp file; else this process's
        memory), so its slots are free again at once."""
        b = self._building
        if b is None:
            if msg.layout is None:
                raise FormatError(f"the first PART of the base at step {msg.step} carries "
                                  "no layout", reason=Reason.BAD_METADATA)
            assert self.writer is not None
            name = (SLICE_NAME if is_slice(msg.meta) else BASE_NAME).format(msg.step)
            b = self._building = _Building(BaseBuilder(
                self.writer.log.store, name, msg.step, msg.layout, msg.meta or {},
                self.writer.log.manifest.log_id))
        elif b.builder.step != msg.step or msg.layout is not None:
            self._drop_building()
            raise FormatError(f"a PART of the base at step {msg.step} while the base at "
                              f"step {b.builder.step} is not closed",
                              reason=Reason.BAD_METADATA)
        b.parts += 1
        try:
            for piece in msg.pieces:
                b.builder.add(piece.name, piece.at, self.ring.array(piece.part).data)
        except BaseException:
            self._drop_building()
            raise

    def _drop_building(self) -> None:
        b, self._building = self._building, None
        if b is not None:
            b.builder.abort()

    def _built(self, msg: Message, b: _Building | None) -> BaseBuilder:
        """The base the BASE ``msg`` closes: every PART it names arrived, and its tensors
        (none of its own) are all whole; :class:`FormatError` otherwise."""
        got = 0 if b is None else b.parts
        try:
            if b is None or b.builder.step != msg.step or msg.parts != got or msg.tensors:
                raise FormatError(
                    f"the BASE of step {msg.step} closes {msg.parts} PART message(s) and "
                    f"{len(msg.tensors)} tensor(s); {got} PART(s) of the base at step "
                    f"{msg.step if b is None else b.builder.step} arrived",
                    reason=Reason.BAD_METADATA)
            if (msg.meta or {}) != b.builder.meta:
                raise FormatError(f"the BASE of step {msg.step} names other metadata than "
                                  "its first PART", reason=Reason.BAD_METADATA)
            b.builder.check_complete()
        except BaseException:
            if b is not None:
                b.builder.abort()
            raise
        return b.builder

    def _with_recipes(self, specs: list[TensorSpec], batch: SlotBatch) -> list[TensorSpec]:
        """The record's tensors: ``specs`` in the places the recipes leave, and each recipe
        as an encoding deferred to the writer's encoder thread (section 3.1)."""
        hb = HostBatch({i: self.ring.array(p) for i, p in enumerate(batch.buffers)},
                       batch.sorts, dict(batch.layouts), self._constants)
        gen, last = self._last
        if batch.bits_gen != gen:  # a new comparison state, from the bits it was seeded with
            last = {n: (t, hb.arrays[b].reshape(-1).view("u1").copy())
                    for n, t, b in batch.seeds}
            self._last = (batch.bits_gen, last)

        def made(r: SlotRecipe) -> TensorSpec:
            enc = DeferredEncoding(lambda: run_recipe(hb, (r.op, r.slots, r.params), last), 0)
            return TensorSpec(r.name, r.dtype, shape=r.shape, zstd=r.zstd, encoded=enc)
        out: list[TensorSpec | None] = [None] * (len(specs) + len(batch.recipes))
        for r in batch.recipes:
            out[r.at] = made(r)
        rest = iter(specs)
        return [s if s is not None else next(rest) for s in out]

    def _meta(self, msg: Message) -> None:
        """A META message: truncate, merge metadata, set the group size (in that order)."""
        w = self.writer
        if w is None:
            raise LowdiffError("a META message before OPEN")
        if msg.truncate_after is not None:
            dropped = w.truncate_after(msg.truncate_after)
            bases = w.log.manifest.bases
            with self._lock:
                self._durable = -1 if w.durable_step is None else w.durable_step
                self.ring.set_more(More.TRUNCATED, dropped)
                self.ring.set(Word.LAST_STEP, w.last_step)
                self.ring.set(Word.LAST_BASE, bases[-1] if bases else -1)
                self.ring.set(Word.BASE, bases[-1] if bases else -1)
                self.ring.set(Word.DURABLE, self._durable)
        if msg.meta:
            w.update_meta(msg.meta)
        if msg.records_per_batch is not None:
            w.set_batch(msg.records_per_batch)

    def _open(self, msg: Message) -> None:
        if self.writer is not None:
            raise LowdiffError("a second OPEN message")
        where: StoreLike = msg.path
        if self.lock_fd is not None:  # (a local log: the producer took its LOCK)
            where = LocalStore(msg.path, held_locks={LOCK_NAME: self.lock_fd})
            self.lock_fd = None
        w = AsyncLogWriter(where, meta=msg.meta, on_durable=self._publish_durable,
                           **msg.options)
        self.writer = w
        bases = w.log.manifest.bases
        self.ring.set(Word.LAST_STEP, w.last_step)
        self.ring.set(Word.LAST_BASE, bases[-1] if bases else -1)
        self.ring.set(Word.BASE, bases[-1] if bases else -1)
        self.ring.set(Word.WRITER_PID, os.getpid())
        self._publish_durable(w.durable_step)
        self.ring.set(Word.STATE, State.READY)
        self._ring_bell()

    def _flush(self, token: int) -> None:
        if self.writer is not None and not self._failed:
            try:
                self._publish_durable(self.writer.flush())
            except LowdiffError as e:
                self._fail(e, None)
            with self._lock:
                self._publish_stats()
        self.ring.set(Word.FLUSHED, token)
        self._ring_bell()

    def _close(self) -> int:
        self._drop_building()  # (a base whose BASE never came: the producer died)
        if self.writer is not None:
            try:
                self.writer.close()
            except Exception as e:  # raised once, if no callback reported it already
                self._fail(e, None)
            self._publish_durable(self.writer.durable_step)
            with self._lock:
                self._publish_stats()
        if self.terminated and not self._failed:  # (the producer's next call says why)
            d = self.writer.durable_step if self.writer is not None else None
            self._fail(CommitError(f"the writer process received SIGTERM: it made every step "
                                   f"handed over durable (durable step {d}) and closed the "
                                   f"log"), None)
        if not self._failed:
            self.ring.set(Word.STATE, State.CLOSED)
        self._ring_bell()
        self.parent.close()
        return 1 if self._failed else 0


class _Building:
    """A base arriving in PART messages: its builder and the PARTs received."""

    def __init__(self, builder: BaseBuilder) -> None:
        self.builder, self.parts = builder, 0


def main(argv: Sequence[str] | None = None) -> int:
    """Attach to the ring and channel named by ``argv`` and serve; returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m lowdiff_store.writer.process",
                                description="lowdiff-store writer process (started by "
                                "RingClient; see format_spec/ring.md)")
    p.add_argument("--ring-fd", type=int, required=True)
    p.add_argument("--channel-fd", type=int, required=True)
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--nice", type=int, default=0, help="added to this process's niceness")
    p.add_argument("--lock-fd", type=int, default=None,
                   help="the log's LOCK file, already locked by the producer")
    args = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if args.nice:
        try:  # (below the trainer: waking this process never preempts the training thread)
            os.nice(args.nice)
        except OSError:
            pass
    try:
        ring = Ring.attach(args.ring_fd)
        os.close(args.ring_fd)
        channel = socket.socket(fileno=args.channel_fd)
    except (OSError, LowdiffError) as e:
        print(f"lowdiff-store writer process: {e}", file=sys.stderr)
        return 2
    server = Server(ring, channel, ParentWatch(args.parent_pid), args.lock_fd)
    server.on_sigterm()
    return server.run()


if __name__ == "__main__":
    sys.exit(main())
