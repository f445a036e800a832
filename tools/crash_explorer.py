"""Crash-state explorer: what a power cut can leave, checked state by state.

SIGKILL keeps the page cache, so a test that kills a process never sees a write that was
not fsynced go missing, or a rename that reached the disk before the data it names. This
explorer, in the spirit of ALICE and CrashMonkey, does:

1. **record** the file-system operations of a short workload run in this process (every
   ``os`` call that changes a file under the workload's directory: ``open`` with ``O_CREAT``
   / ``O_TRUNC``, ``write``/``writev``/``pwrite``/``pwritev``, ``ftruncate``,
   ``fsync``/``fdatasync`` of files and directories, ``rename``/``replace``, ``link``,
   ``unlink``, ``mkdir``/``rmdir``), on inodes, plus the steps the workload was told are
   durable (``ack``);
2. **generate** every crash state the persistence model allows at every point of the run:
   a file's data is durable once the file is fsynced; a directory entry (creation, rename,
   link, unlink) once its directory is fsynced. What is not yet durable may be lost: whole
   (nothing after the last barrier), in part (metadata operations survive as an ordered
   prefix, as a journal keeps them; any one unsynced data write may be lost while later ones
   survive; the last unsynced write may be torn);
3. **check** each state: it opens, ``verify`` finds no corruption, and it restores, bit for
   bit, to a step at or after the last one acknowledged durable before the cut; then a
   writer opening it (which cuts torn tails and collects garbage) leaves it so.

Workloads: ``writer`` (LogWriter: create, base, appends, a segment roll, a second base,
``truncate_after``), ``diffwriter`` (the batched asynchronous writer, acks from
``on_durable``), ``compaction`` (a new base and retention on an existing log),
``torch`` (DiffCheckpointer on a tiny model, restore compared with the live run),
``torch-process`` (the same with ``writer_process=True``: the operations are recorded in
the writer process, which this file then runs as, ``--record-writer``; a step counts as
acknowledged the moment the writer process publishes it to the ring, before the trainer
can read it).

    python tools/crash_explorer.py [--workload NAME ...] [--stride N] [--json]

prints the number of crash states checked per workload and every failure (exit 1).
The test suite runs a strided subset (``tests/test_crash_states.py``); the full enumeration
is behind the ``slow`` marker.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# ---------------------------------------------------------------------- recording


@dataclass
class Op:
    """One recorded operation (inodes are the recorder's numbers, not the kernel's)."""

    kind: str           # creat mkdir write trunc sync dsync rename link unlink rmdir ack
    ino: int = -1       # file ops, sync, dsync (a directory's inode), link source
    off: int = 0        # write
    data: bytes = b""   # write
    size: int = 0       # trunc
    parent: int = -1    # directory operations: the directory
    name: str = ""
    parent2: int = -1   # rename / link: the destination directory
    name2: str = ""
    step: int = -1      # ack


_PATCHED = ("open", "close", "write", "writev", "pwrite", "pwritev", "ftruncate", "fsync",
            "fdatasync", "rename", "replace", "link", "unlink", "remove", "mkdir", "rmdir")


class Recorder:
    """Records the operations under ``root`` while installed (``with Recorder(root):``).

    The directory's content when recording starts is the durable starting state. Calls
    are serialized by a lock, so the order recorded is the order they happened in."""

    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root)
        self.ops: list[Op] = []
        self._lock = threading.RLock()
        self._next = 1
        self._path_ino: dict[str, int] = {}   # current name -> inode, under root
        self._dirs: set[int] = set()
        self._fds: dict[int, int] = {}        # open fd -> inode
        self._orig: dict[str, Any] = {}
        self.initial = self._snapshot()

    # -- namespace

    def _new(self, is_dir: bool) -> int:
        ino = self._next
        self._next += 1
        if is_dir:
            self._dirs.add(ino)
        return ino

    def _snapshot(self) -> dict[str, tuple[int, bytes | None]]:
        """{relative path: (inode, bytes, or None for a directory)}; assigns inodes."""
        self._path_ino[self.root] = self._new(True)
        out: dict[str, tuple[int, bytes | None]] = {"": (self._path_ino[self.root], None)}
        for dirpath, dirnames, filenames in os.walk(self.root):
            for d in sorted(dirnames):
                p = os.path.join(dirpath, d)
                self._path_ino[p] = self._new(True)
                out[os.path.relpath(p, self.root)] = (self._path_ino[p], None)
            for f in sorted(filenames):
                p = os.path.join(dirpath, f)
                self._path_ino[p] = self._new(False)
                with open(p, "rb") as fh:
                    out[os.path.relpath(p, self.root)] = (self._path_ino[p], fh.read())
        return out

    def _abs(self, path: Any) -> str | None:
        """The absolute path (parent resolved) when it lies under the root, else None."""
        p = os.path.abspath(os.fspath(path))
        parent = os.path.realpath(os.path.dirname(p))
        p = os.path.join(parent, os.path.basename(p))
        return p if p == self.root or p.startswith(self.root + os.sep) else None

    def _split(self, p: str) -> tuple[int, str]:
        return self._path_ino[os.path.dirname(p)], os.path.basename(p)

    def _add(self, op: Op) -> None:
        self.ops.append(op)

    def ack(self, step: int, *, lower: bool = False) -> None:
        """The workload was told ``step`` is durable (``lower``: the steps after it were
        discarded on purpose, e.g. by ``truncate_after``)."""
        with self._lock:
            self._add(Op("ack", step=int(step), size=int(lower)))

    # -- wrappers

    def _wrap_open(self, path: Any, flags: int, mode: int = 0o777, *, dir_fd: Any = None
                   ) -> int:
        with self._lock:
            p = self._abs(path) if dir_fd is None else None
            existed = p is not None and os.path.lexists(p)
            fd: int = self._orig["open"](path, flags, mode, dir_fd=dir_fd)
            if p is None:
                return fd
            if not existed or p not in self._path_ino:
                if not existed and flags & os.O_CREAT:
                    ino = self._new(False)
                    parent, name = self._split(p)
                    self._add(Op("creat", ino=ino, parent=parent, name=name))
                    self._path_ino[p] = ino
                elif os.path.isdir(p):
                    ino = self._path_ino.setdefault(p, self._new(True))
                else:
                    ino = self._path_ino.setdefault(p, self._new(False))
            else:
                ino = self._path_ino[p]
            if flags & os.O_TRUNC and ino not in self._dirs:
                self._add(Op("trunc", ino=ino, size=0))
            self._fds[fd] = ino
            return fd

    def _wrap_close(self, fd: int) -> None:
        with self._lock:
            self._orig["close"](fd)
            self._fds.pop(fd, None)

    def _record_write(self, fd: int, off: int, data: bytes) -> None:
        ino = self._fds.get(fd)
        if ino is not None and data:
            self._add(Op("write", ino=ino, off=off, data=data))

    def _wrap_write(self, fd: int, data: Any) -> int:
        with self._lock:
            off = os.lseek(fd, 0, os.SEEK_CUR) if fd in self._fds else 0
            n: int = self._orig["write"](fd, data)
            self._record_write(fd, off, bytes(memoryview(data).cast("B")[:n]))
            return n

    def _wrap_writev(self, fd: int, bufs: Sequence[Any]) -> int:
        with self._lock:
            off = os.lseek(fd, 0, os.SEEK_CUR) if fd in self._fds else 0
            n: int = self._orig["writev"](fd, bufs)
            if fd in self._fds:
                self._record_write(fd, off, b"".join(bytes(memoryview(b).cast("B"))
                                                     for b in bufs)[:n])
            return n

    def _wrap_pwrite(self, fd: int, data: Any, off: int) -> int:
        with self._lock:
            n: int = self._orig["pwrite"](fd, data, off)
            self._record_write(fd, off, bytes(memoryview(data).cast("B")[:n]))
            return n

    def _wrap_pwritev(self, fd: int, bufs: Sequence[Any], off: int, *flags: Any) -> int:
        with self._lock:
            n: int = self._orig["pwritev"](fd, bufs, off, *flags)
            if fd in self._fds:
                self._record_write(fd, off, b"".join(bytes(memoryview(b).cast("B"))
                                                     for b in bufs)[:n])
            return n

    def _wrap_ftruncate(self, fd: int, size: int) -> None:
        with self._lock:
            self._orig["ftruncate"](fd, size)
            ino = self._fds.get(fd)
            if ino is not None:
                self._add(Op("trunc", ino=ino, size=int(size)))

    def _sync(self, name: str, fd: int) -> None:
        with self._lock:
            self._orig[name](fd)
            ino = self._fds.get(fd)
            if ino is not None:
                self._add(Op("dsync" if ino in self._dirs else "sync", ino=ino))

    def _wrap_fsync(self, fd: int) -> None:
        self._sync("fsync", fd)

    def _wrap_fdatasync(self, fd: int) -> None:
        self._sync("fdatasync", fd)

    def _rename(self, name: str, src: Any, dst: Any) -> None:
        with self._lock:
            self._orig[name](src, dst)
            s, d = self._abs(src), self._abs(dst)
            if s is None or d is None:
                return
            ino = self._path_ino.pop(s, None)
            if ino is None:
                return
            ps, ns = self._split(s)
            pd, nd = self._split(d)
            self._add(Op("rename", ino=ino, parent=ps, name=ns, parent2=pd, name2=nd))
            self._path_ino[d] = ino

    def _wrap_rename(self, src: Any, dst: Any) -> None:
        self._rename("rename", src, dst)

    def _wrap_replace(self, src: Any, dst: Any) -> None:
        self._rename("replace", src, dst)

    def _wrap_link(self, src: Any, dst: Any, **kw: Any) -> None:
        with self._lock:
            self._orig["link"](src, dst, **kw)
            s, d = self._abs(src), self._abs(dst)
            if s is None or d is None or s not in self._path_ino:
                return
            ino = self._path_ino[s]
            pd, nd = self._split(d)
            self._add(Op("link", ino=ino, parent2=pd, name2=nd))
            self._path_ino[d] = ino

    def _remove(self, name: str, path: Any, kind: str) -> None:
        with self._lock:
            self._orig[name](path)
            p = self._abs(path)
            if p is None or p not in self._path_ino:
                return
            ino = self._path_ino.pop(p)
            parent, n = self._split(p)
            self._add(Op(kind, ino=ino, parent=parent, name=n))

    def _wrap_unlink(self, path: Any, **kw: Any) -> None:
        self._remove("unlink", path, "unlink")

    def _wrap_remove(self, path: Any, **kw: Any) -> None:
        self._remove("remove", path, "unlink")

    def _wrap_rmdir(self, path: Any, **kw: Any) -> None:
        self._remove("rmdir", path, "rmdir")

    def _wrap_mkdir(self, path: Any, mode: int = 0o777, **kw: Any) -> None:
        with self._lock:
            self._orig["mkdir"](path, mode, **kw)
            p = self._abs(path)
            if p is None:
                return
            ino = self._new(True)
            parent, n = self._split(p)
            self._add(Op("mkdir", ino=ino, parent=parent, name=n))
            self._path_ino[p] = ino

    def __enter__(self) -> Recorder:
        for name in _PATCHED:
            self._orig[name] = getattr(os, name)
            setattr(os, name, getattr(self, "_wrap_" + name))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._orig.items():
            setattr(os, name, fn)


# ---------------------------------------------------------------------- the model

_DIRENT = ("creat", "mkdir", "rename", "link", "unlink", "rmdir")
_DATA = ("write", "trunc")


@dataclass
class State:
    """A crash state: directories (inode -> {name: inode}) and file contents."""

    dirs: dict[int, dict[str, int]] = field(default_factory=dict)
    files: dict[int, bytearray] = field(default_factory=dict)

    def apply(self, op: Op, torn: int | None = None) -> None:
        k = op.kind
        if k == "creat":
            self.dirs.setdefault(op.parent, {})[op.name] = op.ino
            self.files.setdefault(op.ino, bytearray())
        elif k == "mkdir":
            self.dirs.setdefault(op.parent, {})[op.name] = op.ino
            self.dirs.setdefault(op.ino, {})
        elif k == "write":
            data = op.data if torn is None else op.data[:torn]
            f = self.files.setdefault(op.ino, bytearray())
            end = op.off + len(data)
            if len(f) < end:
                f.extend(bytes(end - len(f)))
            f[op.off:end] = data
        elif k == "trunc":
            f = self.files.setdefault(op.ino, bytearray())
            if op.size < len(f):
                del f[op.size:]
            else:
                f.extend(bytes(op.size - len(f)))
        elif k == "rename":
            src = self.dirs.setdefault(op.parent, {})
            ino = src.get(op.name)
            if ino is not None:   # its creation may not have survived
                del src[op.name]
                self.dirs.setdefault(op.parent2, {})[op.name2] = ino
        elif k == "link":
            self.dirs.setdefault(op.parent2, {})[op.name2] = op.ino
        elif k in ("unlink", "rmdir"):
            self.dirs.setdefault(op.parent, {}).pop(op.name, None)

    def materialize(self, root_ino: int, dest: str) -> None:
        """Write the tree reachable from ``root_ino`` under ``dest``."""
        os.makedirs(dest, exist_ok=True)
        for name, ino in self.dirs.get(root_ino, {}).items():
            p = os.path.join(dest, name)
            if ino in self.dirs:
                self.materialize(ino, p)
            else:
                with open(p, "wb") as fh:
                    fh.write(self.files.get(ino, b""))

    def digest(self, root_ino: int) -> str:
        h = hashlib.sha256()

        def walk(ino: int, prefix: str) -> None:
            for name in sorted(self.dirs.get(ino, {})):
                child = self.dirs[ino][name]
                h.update((prefix + name).encode() + b"\0")
                if child in self.dirs:
                    h.update(b"D")
                    walk(child, prefix + name + "/")
                else:
                    h.update(hashlib.sha256(bytes(self.files.get(child, b""))).digest())
        walk(root_ino, "")
        return h.hexdigest()


def _initial_state(rec: Recorder) -> tuple[State, int]:
    st = State()
    ino_of = {rel: ino for rel, (ino, _c) in rec.initial.items()}
    for rel, (ino, content) in rec.initial.items():
        if content is None:
            st.dirs.setdefault(ino, {})
        else:
            st.files[ino] = bytearray(content)
        if rel:
            parent = ino_of[os.path.dirname(rel)]
            st.dirs.setdefault(parent, {})[os.path.basename(rel)] = ino
    return st, ino_of[""]


def _dirs_of(op: Op) -> tuple[int, ...]:
    if op.kind == "rename":
        return (op.parent, op.parent2)
    if op.kind == "link":
        return (op.parent2,)
    return (op.parent,)


@dataclass
class CrashState:
    """One crash state: the point of the cut, how it was made, what was acknowledged."""

    point: int
    variant: str
    acked: int
    keep: frozenset[int]
    torn: tuple[int, int] | None = None


def crash_states(ops: Sequence[Op], stride: int = 1) -> Iterator[CrashState]:
    """Every crash state of the model (see the module docstring) at every ``stride``-th
    point of the run (the points where something was acknowledged are always included)."""
    n = len(ops)
    acked = -1
    ack_at: list[int] = []
    for op in ops:
        ack_at.append(acked)
        if op.kind == "ack":
            acked = op.step if op.size else max(acked, op.step)
    ack_at.append(acked)
    ack_points = {i + 1 for i, op in enumerate(ops) if op.kind == "ack"}
    for k in range(n + 1):
        if k % stride and k not in ack_points and k != n:
            continue
        prefix = ops[:k]
        forced: set[int] = set()
        last_sync: dict[int, int] = {}
        last_dsync: dict[int, int] = {}
        for i, op in enumerate(prefix):
            if op.kind == "sync":
                last_sync[op.ino] = i
            elif op.kind == "dsync":
                last_dsync[op.ino] = i
        meta: list[int] = []
        data: list[int] = []
        for i, op in enumerate(prefix):
            if op.kind in _DATA:
                if last_sync.get(op.ino, -1) > i:
                    forced.add(i)
                else:
                    data.append(i)
            elif op.kind in _DIRENT:
                if all(last_dsync.get(d, -1) > i for d in _dirs_of(op)):
                    forced.add(i)
                else:
                    meta.append(i)
        a = ack_at[k]
        everything = frozenset(forced | set(meta) | set(data))
        yield CrashState(k, "all", a, everything)
        if not meta and not data:
            continue
        yield CrashState(k, "synced", a, frozenset(forced))
        for m in range(len(meta)):   # metadata survives as an ordered prefix
            yield CrashState(k, f"meta-prefix-{m}", a, frozenset(forced | set(meta[:m]) |
                                                                  set(data)))
            yield CrashState(k, f"meta-prefix-{m}-nodata", a,
                             frozenset(forced | set(meta[:m])))
        for d in data:               # any one unsynced write lost, the later ones kept
            yield CrashState(k, f"drop-{d}", a, everything - {d})
        if data:
            last = data[-1]
            if len(ops[last].data) > 1:
                yield CrashState(k, f"torn-{last}", a, everything,
                                 (last, len(ops[last].data) // 2))


def build(rec: Recorder, cs: CrashState) -> tuple[State, int]:
    """The file-system state of a crash state."""
    st, root = _initial_state(rec)
    for i in sorted(cs.keep):
        op = rec.ops[i]
        if op.kind in _DATA or op.kind in _DIRENT:
            st.apply(op, cs.torn[1] if cs.torn is not None and cs.torn[0] == i else None)
    return st, root


# ---------------------------------------------------------------------- workloads


def _w(step: int, n: int = 256) -> np.ndarray:
    """The weights after ``step`` (every value distinct per step)."""
    return (np.arange(n, dtype=np.float32) * 0.5 + step * 1000.0).astype(np.float32)


@dataclass
class Workload:
    """A recorded run: what to check and how. ``run`` may return the recording to explore
    instead of the one it was given (made in another process)."""

    name: str
    prepare: Callable[[str], None]
    run: Callable[[str, Recorder], Recorder | None]
    check: Callable[[str, int], str | None]
    log: str = "log"


def _prepare_nothing(root: str) -> None:
    pass


def _run_writer(root: str, rec: Recorder) -> None:
    from lowdiff_store import LogWriter, tensor_input

    w = LogWriter(os.path.join(root, "log"), segment_bytes=4096)  # rolls every few records
    w.write_base(0, {"w": ("F32", _w(0))})
    rec.ack(0)
    for t in range(1, 9):
        w.append(t, [tensor_input("w", _w(t), "F32")], kind="weight")
        if t % 2 == 0:
            w.sync()
            rec.ack(t)
        if t == 4:
            w.write_base(4, {"w": ("F32", _w(4))})
    rec.ack(6, lower=True)  # asking for the cut gives up steps 7 and 8
    w.truncate_after(6)     # they are cut, then logged again with the same values
    for t in (7, 8):
        w.append(t, [tensor_input("w", _w(t), "F32")], kind="weight")
    w.sync()
    rec.ack(8)
    w.close()


def _run_diffwriter(root: str, rec: Recorder) -> None:
    from lowdiff_store.writer import AsyncLogWriter, TensorSpec

    box: list[AsyncLogWriter] = []

    def on_durable(step: int) -> None:
        # the writer's durable step is "fsynced"; a step is restorable once a base is
        # published too (what DiffCheckpointer.durable_step reports)
        if box and box[0].log.manifest.bases:
            rec.ack(step)

    with AsyncLogWriter(os.path.join(root, "log"), batch=2, segment_bytes=4096,
                    on_durable=on_durable) as w:
        box.append(w)
        w.write_base(0, {"w": ("F32", _w(0))})
        for t in range(1, 7):
            w.append(t, [TensorSpec("w", "F32", _w(t))], kind="weight")
        d = w.flush()
        if d is not None:
            rec.ack(d)


def _prepare_compaction(root: str) -> None:
    from lowdiff_store import LogWriter, tensor_input

    with LogWriter(os.path.join(root, "log"), segment_bytes=4096) as w:
        w.write_base(0, {"w": ("F32", _w(0))})
        for t in range(1, 9):
            w.append(t, [tensor_input("w", _w(t), "F32")], kind="weight")
        w.sync()


def _run_compaction(root: str, rec: Recorder) -> None:
    from lowdiff_store.compaction import compact

    rec.ack(8)   # everything was durable before the run

    def materializer(reader: Any, step: int) -> Any:
        return {"w": ("F32", np.array(reader.record(step).tensor("w")))}, {}

    compact(os.path.join(root, "log"), step=6, keep_bases=1, materializer=materializer)


def _check_weights(path: str, acked: int) -> str | None:
    """Opens, verifies, and every reachable step holds its weights, up to at least
    ``acked``; then a writer's open leaves it so."""
    from lowdiff_store import LogReader, LogWriter
    from lowdiff_store.errors import LowdiffError
    from lowdiff_store.verify import verify_log

    if not os.path.exists(os.path.join(path, "MANIFEST")):
        return None if acked < 0 else f"no MANIFEST although step {acked} was acknowledged"
    for phase in ("as found", "after a writer's open"):
        rep = verify_log(path)
        if not rep.ok:
            return f"{phase}: verify: {rep.problems[0]}"
        try:
            with LogReader(path) as r:
                d = r.durable_step
                if acked >= 0 and (d is None or d < acked):
                    return f"{phase}: durable step {d} < acknowledged {acked}"
                if d is None:
                    return None
                b, diffs = r.chain(d)
                with r.base(b) as base:
                    if not np.array_equal(base.tensor("w"), _w(b)):
                        return f"{phase}: base {b} holds other weights"
                for t in diffs:
                    if not np.array_equal(r.record(t).tensor("w"), _w(t)):
                        return f"{phase}: step {t} holds other weights"
        except LowdiffError as e:
            return f"{phase}: {e}"
        if phase == "as found":
            try:
                LogWriter(path).close()
            except LowdiffError as e:
                return f"a writer cannot open it: {e}"
    return None


def _run_torch(root: str, rec: Recorder, writer_process: bool = False) -> None:
    import torch

    from lowdiff_store.torch import DiffCheckpointer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref = _TORCH_REF
    ref.clear()
    ckpt = DiffCheckpointer(os.path.join(root, "log"), model, opt, snapshot_every=3,
                            segment_bytes=8192, writer_process=writer_process)
    ref[0] = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(16, 8)
    seen = -1
    for step in range(1, 8):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref[step] = {k: v.clone() for k, v in model.state_dict().items()}
        d = ckpt.durable_step
        if d is not None and d > seen and not writer_process:
            rec.ack(d)
            seen = d
    ckpt.flush()
    if not writer_process:
        rec.ack(ckpt.durable_step)
    ckpt.close()


_TORCH_REF: dict[int, dict[str, Any]] = {}


def _run_torch_process(root: str, rec: Recorder) -> Recorder:
    """``_run_torch`` with a writer process that records its own operations (and acks
    each durable step as it publishes it); returns that recording. The training process
    records too, to show it writes nothing under ``root`` beyond what its open does before
    the writer process starts (the log's directory and ``LOCK``); its advisory manifest
    update (the measurements, ``CostMeter.publish``) is left out, since two processes'
    recordings cannot be ordered into one."""
    import functools

    from lowdiff_store.torch.capture import cost_meter, process_sink
    from lowdiff_store.writer.ring_client import RingClient

    out = os.path.join(os.path.dirname(root), "writer-ops")
    command = (sys.executable, os.path.abspath(__file__), "--record-writer", root, out)
    saved = process_sink.RingClient, cost_meter.CostMeter.publish
    process_sink.RingClient = functools.partial(  # type: ignore[misc]
        RingClient, command=command)
    cost_meter.CostMeter.publish = lambda self, wait=False: None  # type: ignore[method-assign]
    try:
        _run_torch(root, rec, writer_process=True)
    finally:
        process_sink.RingClient, cost_meter.CostMeter.publish = saved  # type: ignore[misc]
    mine = [(op.kind, op.name) for op in rec.ops if op.kind not in ("sync", "dsync")]
    if mine != [("mkdir", "log"), ("creat", "LOCK")]:
        raise AssertionError(f"the training process wrote under the log: {mine}")
    with open(out, "rb") as f:
        return Recorded.unpack(f.read())


def _record_writer(argv: list[str]) -> int:
    """``--record-writer ROOT OUT WRITER-ARGS...``: run the writer process under a
    :class:`Recorder` of ``ROOT`` (its starting state: what is there when it starts) and
    write the recording to ``OUT``. A step is acked when the ring's words make it the
    producer's ``durable_step`` (``durable``, once ``base`` says a base is published)."""
    import msgpack

    from lowdiff_store.writer import ring as R
    from lowdiff_store.writer.process import main as writer_main

    root, out, args = argv[0], argv[1], argv[2:]
    rec = Recorder(root)
    set_word = R.Ring.set

    def set_and_ack(ring: Any, word: Any, value: int) -> None:
        set_word(ring, word, value)
        if word in (R.Word.DURABLE, R.Word.BASE) and ring.get(R.Word.BASE) >= 0 \
                and ring.get(R.Word.DURABLE) >= 0:
            rec.ack(ring.get(R.Word.DURABLE))
    R.Ring.set = set_and_ack  # type: ignore[method-assign]
    with rec:
        rc = writer_main(args)
    with open(out, "wb") as f:
        f.write(msgpack.packb({"initial": {k: list(v) for k, v in rec.initial.items()},
                               "ops": [list(op.__dict__.values()) for op in rec.ops]}))
    return rc


@dataclass
class Recorded:
    """A recording made in another process (``initial`` and ``ops`` as a
    :class:`Recorder` holds them)."""

    initial: dict[str, tuple[int, bytes | None]]
    ops: list[Op]

    @classmethod
    def unpack(cls, data: bytes) -> Recorder:
        """The recording :func:`_record_writer` wrote, as a :class:`Recorder` to explore."""
        import msgpack

        d = msgpack.unpackb(data)
        rec = Recorder.__new__(Recorder)
        rec.initial = {k: (v[0], v[1]) for k, v in d["initial"].items()}
        rec.ops = [Op(*fields) for fields in d["ops"]]
        return rec


def _check_torch(path: str, acked: int) -> str | None:
    import torch

    from lowdiff_store.errors import LowdiffError
    from lowdiff_store.torch import replay_state
    from lowdiff_store.verify import verify_log

    if not os.path.exists(os.path.join(path, "MANIFEST")):
        return None if acked < 0 else f"no MANIFEST although step {acked} was acknowledged"
    rep = verify_log(path)
    if not rep.ok:
        return f"verify: {rep.problems[0]}"
    try:
        from lowdiff_store import LogReader

        with LogReader(path) as r:
            d = r.durable_step
        if acked >= 0 and (d is None or d < acked):
            return f"durable step {d} < acknowledged {acked}"
        if d is None:
            return None
        state, _opt = replay_state(path, d)
    except LowdiffError as e:
        return str(e)
    want = _TORCH_REF[d]
    for k, v in want.items():
        if not torch.equal(state[k], v):
            return f"step {d}: {k} differs from the live run"
    return None


WORKLOADS: dict[str, Workload] = {
    "writer": Workload("writer", _prepare_nothing, _run_writer, _check_weights),
    "diffwriter": Workload("diffwriter", _prepare_nothing, _run_diffwriter, _check_weights),
    "compaction": Workload("compaction", _prepare_compaction, _run_compaction, _check_weights),
    "torch": Workload("torch", _prepare_nothing, _run_torch, _check_torch),
    "torch-process": Workload("torch-process", _prepare_nothing, _run_torch_process,
                              _check_torch),
}


@dataclass
class Report:
    """What exploring one workload found."""

    workload: str
    ops: int
    states: int = 0
    distinct: int = 0
    failures: list[str] = field(default_factory=list)
    acked: int = -1  # the newest step acknowledged durable in the run

    def to_dict(self) -> dict[str, Any]:
        return {"workload": self.workload, "ops": self.ops, "states": self.states,
                "distinct_states": self.distinct, "acked": self.acked,
                "failures": self.failures}


def explore(name: str, *, stride: int = 1, limit: int | None = None,
            workdir: str | None = None) -> Report:
    """Record workload ``name``, then check its crash states (every ``stride``-th point;
    at most ``limit`` distinct states, spread over the run)."""
    wl = WORKLOADS[name]
    base = tempfile.mkdtemp(prefix=f"crash-{name}-", dir=workdir)
    try:
        root = os.path.join(base, "run")
        os.makedirs(root)
        wl.prepare(root)
        with Recorder(root) as rec:
            made = wl.run(root, rec)
        rec = made or rec
        rep = Report(name, len(rec.ops),
                     acked=max((op.step for op in rec.ops if op.kind == "ack"), default=-1))
        seen: dict[str, str | None] = {}
        todo: list[tuple[CrashState, State, int]] = []
        for cs in crash_states(rec.ops, stride):
            rep.states += 1
            st, root_ino = build(rec, cs)
            key = f"{st.digest(root_ino)}:{cs.acked}"
            if key in seen:
                continue
            seen[key] = None
            todo.append((cs, st, root_ino))
        if limit is not None and len(todo) > limit:
            step = len(todo) / limit
            todo = [todo[int(i * step)] for i in range(limit)]
        rep.distinct = len(todo)
        for i, (cs, st, root_ino) in enumerate(todo):
            dest = os.path.join(base, f"s{i}")
            st.materialize(root_ino, dest)
            why = wl.check(os.path.join(dest, wl.log), cs.acked)
            if why is not None:
                rep.failures.append(f"cut after op {cs.point} ({cs.variant}, acknowledged "
                                    f"{cs.acked}): {why}")
            shutil.rmtree(dest, ignore_errors=True)
        return rep
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", action="append", choices=sorted(WORKLOADS))
    ap.add_argument("--stride", type=int, default=1, help="check every N-th cut point")
    ap.add_argument("--limit", type=int, default=None, help="at most N distinct states each")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    reports = [explore(w, stride=args.stride, limit=args.limit)
               for w in (args.workload or sorted(WORKLOADS))]
    if args.json:
        print(json.dumps([r.to_dict() for r in reports], indent=1))
    else:
        for r in reports:
            print(f"{r.workload}: {r.ops} operations, {r.states} crash states, {r.distinct} "
                  f"distinct checked, {len(r.failures)} failures")
            for f in r.failures[:20]:
                print(f"  {f}")
    return 1 if any(r.failures for r in reports) else 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if sys.argv[1:2] == ["--record-writer"]:
        sys.exit(_record_writer(sys.argv[2:]))
    sys.exit(main())
