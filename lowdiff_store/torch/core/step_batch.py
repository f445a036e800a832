"""The step batch: how one optimizer step's gradient messages reach host memory without
the training thread waiting for the device or the host (``docs/design.md``, "capture").

Per step, every compressor message (top-k indices and values, TernGrad / QSGD codes with
their scales or norms, DeMo's signs) is a :class:`Message`: it puts its device tensors into
the step's :class:`StepBatch` (:meth:`StepBatch.add`, :meth:`StepBatch.add_sparse`) and
gets back :class:`Slot`\\ s, offsets that are Python ints known from shapes and ``k``, never
read back from the device. :meth:`StepBatch.ship` then, per device and dtype:

1. concatenates the step's tensors into one flat device buffer (one ``torch.cat``); the
   top-k pairs of all tensors are sorted by index with one batched ``torch.sort`` on a CUDA
   device (each tensor's indices offset by its *base*, so one sort orders every tensor's
   range and keeps the ranges in place; see "Keys" below);
2. makes ONE non-blocking copy into a flat buffer of :class:`HostPool` (pinned under CUDA;
   made at the first step, reused after), and records a CUDA event after it.

The training thread returns there. The record's tensors are
:class:`~lowdiff_store.writer.deferred.DeferredEncoding`\\ s (:meth:`StepBatch.spec`): on the
writer's encoder thread each waits for the event (:meth:`StepBatch.wait`), takes numpy
views of its slots and encodes them with the codecs (the gaps of sorted indices, bit
packing, zstd, the CRC). On CPU there is nothing to wait for and the copy is the
``torch.cat`` into the pooled buffer; the sort that a GPU runs as one kernel runs on the
encoder thread instead, batched the same way: every pair of the step packed (key and
value bits in one uint64) and sorted with one ``np.sort`` (:meth:`StepBatch.wait`), calls
on whole buffers that release the GIL, where an argsort and two gathers per tensor were
small calls that hold it (the encoder thread shares the GIL with the training thread).

Then the codec's index part for every top-k tensor of the step at once
(:meth:`StepBatch.sparse_stored`, :func:`_delta_indices`): per group of sorted pairs, the
gaps with one ``np.subtract`` over the whole key array (each tensor's first entry its first
index, i.e. its first key minus its base), one cast to the index dtype (int32 when the
tensor has at most ``2**31 - 1`` elements, the codec's rule), and the codec's checks made
once: keys strictly ascending across the whole array (so each tensor's indices ascend and
are unique) and, at the segment bounds, each tensor's first key >= its base and last key <
its base + numel. Each :class:`~lowdiff_store.torch.compressors.topk.TopKMessage` then only
slices views of those arrays: a few whole-array numpy calls per step (which release the
GIL) instead of ~15 small ones per tensor in ``codecs.encode_sparse`` (which hold it). The
parts are byte for byte those of ``encode_sparse``; pairs that fail the checks go to
``encode_sparse`` per tensor, which raises the codec's error naming the fault.

Keys: a tensor's pairs are sorted by key = index + base, where the tensors' key ranges
are disjoint with a free key on each side: tensor i of ``n_i`` elements has base ``b_i = 1 +
sum over j < i of (n_j + 2)`` and its keys are clamped (before the sort, one whole-array
call) to ``[b_i - 1, b_i + n_i]``. A valid index keeps its key; an index out of ``[0, n_i)``
becomes its tensor's ``-1`` or ``n_i`` and stays in its own range. Without the clamp, an
index past one tensor's end and a negative one of the next could trade places in the sort
and leave every range looking valid: a silently wrong record where ``encode_sparse``
refuses both. With it, the segment checks above fail exactly for the tensors whose pairs
``encode_sparse`` refuses, and the fallback raises its error (the codec names the range,
not the index, so the clamped index gives its very text). The numels per pair are a
second constant of the layout beside the bases (on a GPU: 8 more bytes of device memory
per top-k pair, made once).

The host buffers go back to the pool once the record is written (the record's ``done``).
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from ... import codecs
from ...format.dtypes import storage_dtype
from ...writer.deferred import DeferredEncoding
from .specs import Spec
from .tensors import bits_tensor, local_of


class HostPool:
    """Reusable host buffers for captured tensors (pinned when copying from CUDA).
    :attr:`misses` counts buffers allocated because none was free (after warm-up, a step
    that allocates is a defect: the guards of ``tests/torch/test_host_sync.py``)."""

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, tuple[int, ...], bool], list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.misses = 0
        #: device tensors and host arrays made once per layout and reused every step (the
        #: offsets of a batched sort): static across steps, like the buffers
        self.constants: dict[Any, Any] = {}

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """A host buffer of ``like``'s dtype and shape (its local shard for a DTensor)."""
        like = local_of(like)
        return self.take_shape(like.dtype, tuple(like.shape), like.device.type == "cuda")

    def take_shape(self, dtype: torch.dtype, shape: tuple[int, ...], pin: bool
                   ) -> torch.Tensor:
        """A host buffer of ``dtype`` and ``shape`` (pinned with ``pin``)."""
        key = (dtype, shape, pin)
        with self._lock:
            lst = self._free.get(key)
            if lst:
                return lst.pop()
            self.misses += 1
        return torch.empty(shape, dtype=dtype, pin_memory=pin)

    def give(self, bufs: list[torch.Tensor]) -> None:
        """Return buffers (the writer no longer reads them)."""
        with self._lock:
            for b in bufs:
                key = (b.dtype, tuple(b.shape), b.is_pinned())
                self._free.setdefault(key, []).append(b)

    def trim(self) -> None:
        """Free the buffers not in use (nothing will be copied into them for a while:
        the gradients are lent to their records); a later :meth:`take` allocates again."""
        with self._lock:
            self._free = {}


#: a host buffer of a step batch: (device, dtype, "" or the group of sorted top-k pairs it
#: belongs to, named by their values' dtype)
Key = tuple[torch.device, torch.dtype, str]


class Slot(NamedTuple):
    """Where a tensor added to a :class:`StepBatch` lies in its host buffer."""

    key: Key
    offset: int
    numel: int


class SparseSlot(NamedTuple):
    """Top-k pairs added to a :class:`StepBatch`: indices (int64) and values, and whether
    the batch sorts them by index (else :meth:`StepBatch.sparse` does, per tensor)."""

    idx: Slot
    values: Slot
    base: int  # added to the indices by a batched sort (subtracted on the host)
    sorted: bool


class Message(Protocol):
    """A compressor's message for one tensor, split at the host boundary."""

    def ship(self, batch: StepBatch) -> None:
        """On the training thread: add the device tensors to ``batch`` (keep the slots)."""

    def encode(self, batch: StepBatch) -> codecs.Encoded | None:
        """On the encoder thread, after ``batch.wait()``: the stored form (None: left out
        of the record, see :class:`ChangedBitsMessage`)."""


class StepBatch:
    """The host-bound tensors of one step (see the module docstring). Built on the
    training thread (:meth:`add`, :meth:`add_sparse`, :meth:`spec`, :meth:`ship`, then
    :attr:`buffers` go with the record); read on the encoder thread (:meth:`array` after
    :meth:`wait`). ``sort_on_device``: sort top-k pairs with one batched sort on their
    device (default: on CUDA devices only; on CPU the encoder thread's argsort is cheaper
    for the training thread)."""

    def __init__(self, pool: HostPool, sort_on_device: bool | None = None) -> None:
        self.pool = pool
        self.sort_on_device = sort_on_device
        self._groups: dict[Key, list[torch.Tensor]] = {}
        self._sizes: dict[Key, int] = {}
        # top-k pairs per device, sorted together at ship
        self._sparse: dict[tuple[torch.device, torch.dtype],
                           list[tuple[torch.Tensor, torch.Tensor, int]]] = {}
        # elements of the tensors whose pairs were added before, per sort
        self._bases: dict[tuple[str, torch.device, torch.dtype], int] = {}
        # top-k pairs sorted on the host: (numel, k) of each tensor, per device and dtype
        self._host_sort: dict[tuple[torch.device, torch.dtype], list[tuple[int, int]]] = {}
        # (numel, k) of each tensor whose pairs were added, per key of their indices' buffer
        self._layouts: dict[Key, list[tuple[int, int]]] = {}
        # the codec's stored indices per such buffer, made on first use (sparse_stored)
        self._stored: dict[Key, _StoredIndices | None] = {}
        self._host: dict[Key, torch.Tensor] = {}
        self._arrays: dict[Key, np.ndarray] = {}
        #: CUDA events after the copies of this step (its own and the dense gradients')
        self.events: list[Any] = []
        #: the host buffers the record holds (back to :attr:`pool` once written)
        self.buffers: list[torch.Tensor] = []
        #: the CUDA devices the batch copied from (set by :meth:`ship`)
        self.devices: set[torch.device] = set()
        self.shipped = False
        self._waited = False
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- training thread

    def add(self, t: torch.Tensor) -> Slot:
        """Queue ``t`` (any shape; read flat in C order) for the host; its :class:`Slot`."""
        t = t.detach()
        return self._put((t.device, t.dtype, ""), t.reshape(-1))

    def _put(self, key: Key, flat: torch.Tensor | None, n: int | None = None) -> Slot:
        assert not self.shipped, "the step batch was shipped"
        off = self._sizes.get(key, 0)
        n = flat.numel() if flat is not None else n
        assert n is not None
        if flat is not None:
            self._groups.setdefault(key, []).append(flat)
        self._sizes[key] = off + n
        return Slot(key, off, n)

    def add_sparse(self, idx: torch.Tensor, vals: torch.Tensor, numel: int) -> SparseSlot:
        """Queue top-k pairs of a tensor of ``numel`` elements (unique indices, any order)
        for the host, sorted by index with one sort for the whole step: on a CUDA device
        at :meth:`ship`, else on the host at :meth:`wait`."""
        dev = idx.device
        on_device = self.sort_on_device
        if not (dev.type == "cuda" if on_device is None else on_device):
            # sorted on the encoder thread, all the step's pairs at once (_sort_pairs)
            group = f"host-sorted {vals.dtype}"
            lay = self._host_sort.setdefault((dev, vals.dtype), [])
            base = self._bases.get(("host", dev, vals.dtype), 1)
            self._bases[("host", dev, vals.dtype)] = base + numel + 2  # (see "Keys")
            lay.append((numel, idx.numel()))
            si = self._put((dev, torch.int64, group), _flat(idx).long())
            sv = self._put((dev, vals.dtype, group), _flat(vals))
            self._layouts[si.key] = lay  # (the same list: one layout per sorted group)
            return SparseSlot(si, sv, base, True)
        group = f"sorted {vals.dtype}"  # (a cat of several dtypes would promote)
        pairs = self._sparse.setdefault((dev, vals.dtype), [])
        base = self._bases.get(("device", dev, vals.dtype), 1)
        self._bases[("device", dev, vals.dtype)] = base + numel + 2
        pairs.append((_flat(idx), _flat(vals), numel))
        # filled at ship by the step's sorted pairs, in the order they were added
        k = idx.numel()
        si = self._put((dev, torch.int64, group), None, k)
        sv = self._put((dev, vals.dtype, group), None, k)
        self._layouts.setdefault(si.key, []).append((numel, k))
        return SparseSlot(si, sv, base, True)

    def spec(self, name: str, tag: str, shape: tuple[int, ...], msg: Message,
             zstd: int | None, nbytes: int) -> Spec:
        """The record tensor of ``msg`` (its encoding deferred to the encoder thread);
        ``nbytes``: the host bytes it holds. ``msg.ship(self)`` is called here."""
        msg.ship(self)
        return Spec(name, tag, shape, DeferredEncoding(lambda: self._encode(msg), nbytes),
                    zstd)

    def ship(self, record: bool = True) -> None:
        """Make the step's one copy per device and dtype to host buffers (non-blocking under
        CUDA, then an event unless ``record`` is False: the caller records the events after
        copies of its own, in :attr:`events`); the batch takes no more tensors."""
        assert not self.shipped
        self.shipped = True
        self._sort_sparse()
        cuda: set[torch.device] = set()
        for key, ts in self._groups.items():
            dev, dtype, _group = key
            host = self.pool.take_shape(dtype, (self._sizes[key],), dev.type == "cuda")
            if dev.type == "cuda":
                host.copy_(ts[0] if len(ts) == 1 else torch.cat(ts), non_blocking=True)
                cuda.add(dev)
            elif len(ts) == 1:
                host.copy_(ts[0])
            else:
                torch.cat(ts, out=host)
            self._host[key] = host
            self.buffers.append(host)
        self._groups = {}
        self.devices = cuda
        for dev in cuda if record else ():
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(dev))
            self.events.append(ev)

    def _sort_sparse(self) -> None:
        """One sort per device of every top-k pair of the step (CUDA only): each tensor's
        indices offset by its base and clamped to its own key range (module docstring,
        "Keys"), so sorting the whole orders each tensor's pairs and keeps the tensors in
        the order they were added."""
        for (dev, dtype), pairs in self._sparse.items():
            numels = tuple(n for _i, _v, n in pairs)
            counts = tuple(i.numel() for i, _v, _n in pairs)
            spread, limits = _spread(self.pool, dev, numels, counts)
            keys = torch.cat([i for i, _v, _n in pairs])
            torch.clamp(keys, max=limits, out=keys)  # (indices: no int64 overflow)
            keys.clamp_(min=-1)
            keys += spread
            keys, order = torch.sort(keys)
            vals = torch.cat([v for _i, v, _n in pairs])[order]
            group = f"sorted {dtype}"
            self._groups[(dev, torch.int64, group)] = [keys]
            self._groups[(dev, dtype, group)] = [vals]
        self._sparse = {}

    # ---------------------------------------------------------------- encoder thread

    def wait(self) -> None:
        """Wait for the step's copies (on the encoder thread; nothing on CPU) and view the
        host buffers as numpy arrays (once)."""
        if self._waited:  # (set last, under the lock)
            return
        with self._lock:
            if self._waited:
                return
            for ev in self.events:
                ev.synchronize()
            for key, host in self._host.items():
                self._arrays[key] = bits_tensor(host)[1].numpy()
            self._sort_on_host()
            self._waited = True

    def _sort_on_host(self) -> None:
        """The host's batched sort (CPU tensors; on the encoder thread): per device and
        dtype, every top-k pair of the step sorted at once, the indices clamped to their
        tensor's key range and offset by its base (module docstring, "Keys"): a few numpy
        calls on the whole step (which release the GIL), not an argsort and two gathers
        per tensor (which hold it)."""
        for (dev, dtype), lay in self._host_sort.items():
            group = f"host-sorted {dtype}"
            keys = self._arrays[(dev, torch.int64, group)]
            vals = self._arrays[(dev, dtype, group)]
            spread, limits = _host_spread(self.pool, tuple(n for n, _k in lay),
                                          tuple(k for _n, k in lay))
            np.clip(keys, -1, limits, out=keys)
            keys += spread
            _sort_pairs(keys, vals, sum(n + 2 for n, _k in lay))

    def array(self, slot: Slot) -> np.ndarray:
        """The host copy of a slot's tensor (flat; valid until the record is released)."""
        self.wait()
        return self._arrays[slot.key][slot.offset:slot.offset + slot.numel]

    def sparse(self, slot: SparseSlot) -> tuple[np.ndarray, np.ndarray]:
        """The (indices ascending, values) of top-k pairs."""
        idx, vals = self.array(slot.idx), self.array(slot.values)
        if slot.sorted:
            return idx - slot.base, vals
        order = np.argsort(idx)  # unique indices: the unstable sort is exact
        return idx[order], vals[order]

    def sparse_stored(self, slot: SparseSlot, numel: int
                      ) -> tuple[str, np.ndarray, np.ndarray] | None:
        """The ``sparse`` codec's stored form (``delta``) of top-k pairs of a tensor of
        ``numel`` elements: (index dtype tag, the first index then the gaps, the values),
        views of arrays made for the step's whole group of pairs at once on first use (see
        the module docstring). None when the group's pairs fail the codec's checks (or
        were not sorted by the batch): then ``codecs.encode_sparse`` of :meth:`sparse`
        names the fault."""
        self.wait()
        si, sv = slot.idx, slot.values
        if not slot.sorted:
            return None
        if si.key not in self._stored:  # (few calls per tensor: each one holds the GIL)
            with self._lock:
                if si.key not in self._stored:
                    layout = self._layouts.get(si.key)
                    self._stored[si.key] = None if layout is None else _delta_indices(
                        self.pool, self._arrays[si.key], layout)
        stored = self._stored[si.key]
        if stored is None:
            return None
        tag = codecs.sparse_index_tag(numel)
        arr = stored.i32 if tag == "I32" else stored.i64
        assert arr is not None
        return (tag, arr[si.offset:si.offset + si.numel],
                self._arrays[sv.key][sv.offset:sv.offset + sv.numel])

    def _encode(self, msg: Message) -> codecs.Encoded | None:
        self.wait()
        return msg.encode(self)


class BitsMessage:
    """A tensor's bits logged ``raw`` (an error-feedback residual): its device tensor goes
    into the batch at :meth:`ship` (reinterpreted, never converted: bf16/fp8 as unsigned
    integers), the ``raw`` part is a view of its slot on the encoder thread."""

    __slots__ = ("nbytes", "shape", "slot", "tag", "tensor")

    def __init__(self, t: torch.Tensor, what: str) -> None:
        self.tag, bits = bits_tensor(t, what)
        self.tensor: torch.Tensor | None = bits
        #: the shape of the bits logged (a DTensor's local shard)
        self.shape = tuple(bits.shape)
        #: host bytes of the message
        self.nbytes = bits.numel() * bits.element_size()
        self.slot: Slot | None = None

    def ship(self, batch: StepBatch) -> None:
        """Put the tensor's bits into ``batch`` (the message keeps no reference to it)."""
        assert self.tensor is not None
        self.slot, self.tensor = batch.add(self.tensor), None

    def encode(self, batch: StepBatch) -> codecs.Encoded:
        """The ``raw`` tensor (on the encoder thread)."""
        assert self.slot is not None
        arr = batch.array(self.slot)
        want = storage_dtype(self.tag)
        return codecs.Encoded("raw", {}, (codecs.Part(
            self.tag, arr if arr.dtype == want else arr.view(want)),))


class ChangedBitsMessage:
    """A device tensor's bits, logged only when they differ from the bits last logged
    under its name (a module buffer: changed in place by kernels that do not move its
    version counter, batch norm's running statistics among them). The training thread
    cannot compare without waiting for the device, so the tensor is shipped every step
    (a slice of the step's one copy, as a :class:`BitsMessage`) and compared on the
    encoder thread, which visits the records in step order: unchanged, :meth:`encode`
    returns None and the record leaves it out. ``last`` (name -> (tag, bytes)) is the
    comparison's state, read and written on the encoder thread only; a caller that must
    state every value again gives the next messages a new one."""

    __slots__ = ("bits", "last", "name", "nbytes", "shape", "tag")

    def __init__(self, t: torch.Tensor, name: str,
                 last: dict[str, tuple[str, np.ndarray]]) -> None:
        self.bits = BitsMessage(t, name)
        self.tag, self.shape, self.nbytes = self.bits.tag, self.bits.shape, self.bits.nbytes
        self.name, self.last = name, last

    def ship(self, batch: StepBatch) -> None:
        """Put the tensor's bits into ``batch``."""
        self.bits.ship(batch)

    def encode(self, batch: StepBatch) -> codecs.Encoded | None:
        """The ``raw`` tensor, or None when its bits are the ones last logged."""
        enc = self.bits.encode(batch)
        now = np.ascontiguousarray(enc.parts[0].data).reshape(-1).view(np.uint8)
        prev = self.last.get(self.name)
        if prev is not None and prev[0] == self.tag and np.array_equal(prev[1], now):
            return None
        self.last[self.name] = (self.tag, now.copy())
        return enc


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached and flat; itself when it already is (a compressor's message, made
    under ``no_grad``: two view calls fewer per tensor on the training thread)."""
    return t if t.dim() == 1 and not t.requires_grad else t.detach().reshape(-1)


def _sort_pairs(keys: np.ndarray, vals: np.ndarray, bound: int) -> None:
    """Sort the pairs (``keys`` unique, in ``[0, bound)``; int64) by key, in place. When a
    key and a value's bits fit in 64 bits together, one ``np.sort`` of the packed pairs
    (no argsort, no random gathers; bench/RESULTS.md, "the writer's share of the GIL");
    else an argsort and two gathers. Unique keys: either order is the only one."""
    vbits = vals.dtype.itemsize * 8
    if vbits <= 32 and bound <= 1 << (64 - vbits):
        ubits = vals.view(f"u{vals.dtype.itemsize}")
        packed = keys.view(np.uint64) << np.uint64(vbits)
        packed |= ubits
        packed.sort()
        ubits[...] = packed  # the low bits (a truncating cast)
        packed >>= np.uint64(vbits)
        keys[...] = packed.view(np.int64)
        return
    order = np.argsort(keys)
    keys[...] = keys[order]
    vals[...] = vals[order]


class _StoredIndices(NamedTuple):
    """A group's stored ``sparse`` indices (first index then gaps, per tensor): as int32
    for the tensors indexed by int32, as int64 for the others (None where none is)."""

    i32: np.ndarray | None
    i64: np.ndarray | None


class _Segments(NamedTuple):
    """Per layout of a group of sorted pairs (made once, in ``pool.constants``): the
    positions of the first and last pair of each tensor with pairs, its base (see the
    module docstring, "Keys") and its base + numel."""

    firsts: np.ndarray
    lasts: np.ndarray
    bases: np.ndarray
    limits: np.ndarray
    i32: bool  # some tensor is indexed by int32
    i64: bool  # some tensor is indexed by int64
    valid: bool  # numels non-negative ints whose sum fits int64


_INT64_MAX = 2**63 - 1


def _segments(pool: HostPool, layout: list[tuple[int, int]]) -> _Segments:
    key = ("stored segments", tuple(layout))
    seg = pool.constants.get(key)
    if seg is None:
        numels = [n for n, _k in layout]
        counts = np.array([k for _n, k in layout], dtype=np.int64)
        valid = (all(isinstance(n, int) and n >= 0 for n in numels)
                 and sum(numels) + 2 * len(numels) < _INT64_MAX)
        tags = {codecs.sparse_index_tag(n) for n in numels} if valid else set()
        if not valid:
            numels = [0] * len(numels)
        bases_all = _bases(numels)
        limits_all = bases_all + np.array(numels, dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.intp)
        has = counts > 0
        seg = pool.constants[key] = _Segments(
            offsets[has], (offsets + counts - 1)[has].astype(np.intp), bases_all[has],
            limits_all[has], "I32" in tags, "I64" in tags, valid)
    return seg


def _delta_indices(pool: HostPool, keys: np.ndarray, layout: list[tuple[int, int]]
                   ) -> _StoredIndices | None:
    """The stored ``sparse`` indices of a group of sorted pairs (``keys``: each tensor's
    indices plus its base, in the order the tensors were added; see :func:`_segments`),
    or None when they fail the codec's checks: indices unique and in ``[0, numel)``.
    ``keys`` is sorted as a whole (one sort of the step's pairs), so a gap that wrapped
    around int64 is negative and fails the check like any other."""
    seg = _segments(pool, layout)
    if not seg.valid:
        return None
    gaps = np.empty(keys.size, np.int64)
    if keys.size:
        np.subtract(keys[1:], keys[:-1], out=gaps[1:])
        firsts = keys[seg.firsts]
        if ((keys.size > 1 and int(gaps[1:].min()) < 1) or bool((firsts < seg.bases).any())
                or bool((keys[seg.lasts] >= seg.limits).any())):
            return None
        np.subtract(firsts, seg.bases, out=firsts)
        gaps[seg.firsts] = firsts
    # (a wrapping cast: the int32 gaps of tensors indexed by int64 are never read)
    return _StoredIndices(gaps.astype(np.int32) if seg.i32 else None,
                          gaps if seg.i64 else None)


def _bases(numels: list[int] | tuple[int, ...]) -> np.ndarray:
    """Each tensor's base: ``1 + sum over the tensors before it of (numel + 2)`` (module
    docstring, "Keys")."""
    widths = np.array(numels, dtype=np.int64) + 2
    return np.concatenate([[1], 1 + np.cumsum(widths, dtype=np.int64)])[:len(numels)] \
        .astype(np.int64)


def _spread_arrays(numels: tuple[int, ...], counts: tuple[int, ...]
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Each index's base and its tensor's numel (``counts``: the indices per tensor)."""
    return (np.repeat(_bases(numels), counts),
            np.repeat(np.array(numels, dtype=np.int64), counts))


def _host_spread(pool: HostPool, numels: tuple[int, ...], counts: tuple[int, ...]
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Each index's base and its tensor's numel, for the host's batched sort (made once
    per layout)."""
    key = ("host spread", numels, counts)
    arrs = pool.constants.get(key)
    if arrs is None:
        arrs = pool.constants[key] = _spread_arrays(numels, counts)
    return arrs  # type: ignore[no-any-return]


def _spread(pool: HostPool, dev: torch.device, numels: tuple[int, ...],
            counts: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per device and layout (numels and k of the tensors), each index's base and its
    tensor's numel: static across steps, so made once (non-blocking copies from pinned
    memory) and kept in ``pool.constants``."""
    key = ("spread", dev, numels, counts)
    ts = pool.constants.get(key)
    if ts is None:
        made = []
        for arr in _spread_arrays(numels, counts):
            host = torch.from_numpy(arr)
            if dev.type == "cuda":
                host = host.pin_memory()
            made.append(host.to(dev, non_blocking=True))
        ts = pool.constants[key] = (made[0], made[1])
    return ts  # type: ignore[no-any-return]


__all__ = ["BitsMessage", "ChangedBitsMessage", "HostPool", "Key", "Message", "Slot", "SparseSlot",
           "StepBatch"]
