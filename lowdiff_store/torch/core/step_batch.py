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
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from ... import codecs
from ...codecs.batch import (
    HostBatch,
    LastBits,
    Layout,
    Recipe,
    Slot,
    SparseSlot,
    encode_bits,
    encode_changed,
    spread_arrays,
)
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
        #: since :meth:`trim`, buffers given back are freed, not kept (until a :meth:`take`)
        self.lean = False
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
            self.lean = False
            lst = self._free.get(key)
            if lst:
                return lst.pop()
            self.misses += 1
        return torch.empty(shape, dtype=dtype, pin_memory=pin)

    def give(self, bufs: list[torch.Tensor]) -> None:
        """Return buffers (the writer no longer reads them); after :meth:`trim` they are
        dropped instead (freed once nothing else holds them)."""
        with self._lock:
            if self.lean:
                return
            for b in bufs:
                key = (b.dtype, tuple(b.shape), b.is_pinned())
                self._free.setdefault(key, []).append(b)

    def trim(self) -> None:
        """Free the buffers not in use (nothing will be copied into them for a while:
        the gradients are lent to their records), and those given back from now on
        (the records of copies made before lending took over), until a :meth:`take`; a
        later :meth:`take` allocates again."""
        with self._lock:
            self._free = {}
            self.lean = True


#: a host buffer of a step batch: (device, dtype, "" or the group of sorted top-k pairs it
#: belongs to, named by their values' dtype)
Key = tuple[torch.device, torch.dtype, str]


class Message(Protocol):
    """A compressor's message for one tensor, split at the host boundary."""

    def ship(self, batch: StepBatch) -> None:
        """On the training thread: add the device tensors to ``batch`` (keep the slots)."""

    def encode(self, batch: StepBatch) -> codecs.Encoded | None:
        """On the encoder thread, after ``batch.wait()``: the stored form (None: left out
        of the record, see :class:`ChangedBitsMessage`)."""


class BatchedMessage(Message, Protocol):
    """A message whose stored form is a function of its slots alone: its *recipe*
    (:mod:`lowdiff_store.codecs.batch`), which the writer process can run on the batch's
    arrays in the ring; :meth:`encode` runs the same function here."""

    def recipe(self) -> Recipe:
        """(op, slots, params) after :meth:`ship`."""


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
        self._host: dict[Key, torch.Tensor] = {}
        #: CUDA events after the copies of this step (its own and the dense gradients')
        self.events: list[Any] = []
        #: the host buffers the record holds (back to :attr:`pool` once written)
        self.buffers: list[torch.Tensor] = []
        #: the CUDA devices the batch copied from (set by :meth:`ship`)
        self.devices: set[torch.device] = set()
        self.shipped = False
        self._hostbatch: HostBatch | None = None
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
        return Spec(name, tag, shape, BatchEncoding(lambda: self._encode(msg), nbytes,
                                                    self, msg), zstd)

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
        self.host.prepare()

    @property
    def host(self) -> HostBatch:
        """The host half (:class:`~lowdiff_store.codecs.batch.HostBatch`), once the step's
        copies ended (waited for here, once)."""
        if self._hostbatch is None:
            with self._lock:
                if self._hostbatch is None:
                    self._hostbatch = HostBatch(*self.layout(wait=True))
        return self._hostbatch

    def layout(self, wait: bool = False) -> tuple[
            dict[Any, np.ndarray], list[tuple[Any, Any, Layout]], dict[Any, Layout],
            dict[Any, Any]]:
        """What a :class:`~lowdiff_store.codecs.batch.HostBatch` of this batch is made of:
        the host buffers viewed as numpy (in their storage dtype), the groups of pairs to
        sort on the host, the layout of every sorted group, the pool's constants. Read
        after the step's copies ended (``wait``: wait for them here; the arrays are the
        buffers, not copies)."""
        if wait:
            self.wait_copies()
        arrays = {key: bits_tensor(h)[1].numpy() for key, h in self._host.items()}
        sorts: list[tuple[Any, Any, Layout]] = [
            ((dev, torch.int64, f"host-sorted {dt}"), (dev, dt, f"host-sorted {dt}"), lay)
            for (dev, dt), lay in self._host_sort.items()]
        return arrays, sorts, dict(self._layouts), self.pool.constants

    def wait_copies(self) -> None:
        """Wait for the step's device-to-host copies (CUDA events; nothing on CPU)."""
        for ev in self.events:
            ev.synchronize()

    def array(self, slot: Slot) -> np.ndarray:
        """The host copy of a slot's tensor (flat; valid until the record is released)."""
        return self.host.array(slot)

    def sparse(self, slot: SparseSlot) -> tuple[np.ndarray, np.ndarray]:
        """The (indices ascending, values) of top-k pairs."""
        return self.host.sparse(slot)

    def sparse_stored(self, slot: SparseSlot, numel: int
                      ) -> tuple[str, np.ndarray, np.ndarray] | None:
        """The ``sparse`` codec's stored form of top-k pairs (see
        :meth:`~lowdiff_store.codecs.batch.HostBatch.sparse_stored`)."""
        return self.host.sparse_stored(slot, numel)

    def _encode(self, msg: Message) -> codecs.Encoded | None:
        self.wait()
        return msg.encode(self)


@dataclass(frozen=True)
class BatchEncoding(DeferredEncoding):
    """A message's encoding deferred to the encoder thread, with the batch and message it
    comes from (the writer process runs the message's recipe on the batch's arrays
    instead: ``lowdiff_store.torch.capture.process_sink``)."""

    batch: StepBatch | None = None
    msg: Message | None = None


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

    def recipe(self) -> Recipe:
        """``bits`` (:mod:`lowdiff_store.codecs.batch`)."""
        assert self.slot is not None
        return "bits", (self.slot,), (self.tag,)

    def encode(self, batch: StepBatch) -> codecs.Encoded:
        """The ``raw`` tensor (on the encoder thread)."""
        assert self.slot is not None
        return encode_bits(batch.host, self.slot, self.tag)


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

    def __init__(self, t: torch.Tensor, name: str, last: LastBits) -> None:
        self.bits = BitsMessage(t, name)
        self.tag, self.shape, self.nbytes = self.bits.tag, self.bits.shape, self.bits.nbytes
        self.name, self.last = name, last

    def ship(self, batch: StepBatch) -> None:
        """Put the tensor's bits into ``batch``."""
        self.bits.ship(batch)

    def recipe(self) -> Recipe:
        """``changed`` (:mod:`lowdiff_store.codecs.batch`; the comparison's state is the
        encoder's: :attr:`last` here, the writer process's own there)."""
        assert self.bits.slot is not None
        return "changed", (self.bits.slot,), (self.tag, self.name)

    def encode(self, batch: StepBatch) -> codecs.Encoded | None:
        """The ``raw`` tensor, or None when its bits are the ones last logged."""
        assert self.bits.slot is not None
        return encode_changed(batch.host, self.bits.slot, self.tag, self.name, self.last)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached and flat; itself when it already is (a compressor's message, made
    under ``no_grad``: two view calls fewer per tensor on the training thread)."""
    return t if t.dim() == 1 and not t.requires_grad else t.detach().reshape(-1)


def _spread(pool: HostPool, dev: torch.device, numels: tuple[int, ...],
            counts: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per device and layout (numels and k of the tensors), each index's base and its
    tensor's numel: static across steps, so made once (non-blocking copies from pinned
    memory) and kept in ``pool.constants``."""
    key = ("spread", dev, numels, counts)
    ts = pool.constants.get(key)
    if ts is None:
        made = []
        for arr in spread_arrays(numels, counts):
            host = torch.from_numpy(arr)
            if dev.type == "cuda":
                host = host.pin_memory()
            made.append(host.to(dev, non_blocking=True))
        ts = pool.constants[key] = (made[0], made[1])
    return ts  # type: ignore[no-any-return]


__all__ = ["BatchEncoding", "BatchedMessage", "BitsMessage", "ChangedBitsMessage", "HostPool",
           "Key", "Message", "Slot", "SparseSlot", "StepBatch"]
