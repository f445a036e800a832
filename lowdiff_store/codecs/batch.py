"""The host half of a step batch: one optimizer step's compressor messages, laid out in a few
flat host arrays, turned into the codecs' stored form (numpy only; never imports torch).

The torch adapter packs a step's messages (top-k indices and values, TernGrad / QSGD codes
with their scales or norms, DeMo's signs, module buffers, residuals) into flat buffers, one
per device and dtype (``lowdiff_store.torch.core.step_batch.StepBatch``); every message
knows where its tensors lie as :class:`Slot`\\ s (offsets known from shapes and ``k``). What
remains is host work on those arrays, the same wherever it runs: on the writer's encoder
thread in the training process, or in the writer process, which reads the arrays from the
ring (``format_spec/ring.md``, section 3.1). It is here, once:

- :class:`HostBatch`: the arrays by key, the batched sort of every top-k pair that was not
  sorted on the device (all of a group's pairs at once: ``_sort_pairs``), and the codec's
  index part of every sorted group at once (``_delta_indices``; see "Keys" in the torch
  module's docstring for why keys are offset by each tensor's *base*);
- a *recipe* per message: ``(op, slots, params)``, a name from :data:`RECIPES`, the slots it
  reads and a few plain values; :func:`run_recipe` makes the tensor's
  :class:`~lowdiff_store.codecs.Encoded` from it, byte for byte what the message's
  ``encode`` makes (which calls the same function).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..format.dtypes import storage_dtype
from . import encode_qsgd, encode_signs, encode_sparse, encode_ternary, sparse_index_tag
from ._core import Encoded, Part

#: (numel, k) of each tensor whose top-k pairs a sorted group holds, in the order added
Layout = Sequence[tuple[int, int]]


class Slot(NamedTuple):
    """Where a tensor lies in its flat host buffer: the buffer's key, offset, elements."""

    key: Any
    offset: int
    numel: int


class SparseSlot(NamedTuple):
    """Top-k pairs: indices (int64) and values, the base added to the indices by a batched
    sort (subtracted on the host), and whether a batched sort orders them (else
    :meth:`HostBatch.sparse` does, per tensor)."""

    idx: Slot
    values: Slot
    base: int
    sorted: bool


class HostBatch:
    """The host arrays of one step batch, read on the encoder side.

    Args:
        arrays: flat arrays by buffer key (the int64 indices of a group of top-k pairs are
            keys: each index plus its tensor's base, see ``sorts``).
        sorts: ``(indices key, values key, layout)`` of each group of pairs still to sort
            (on the first read, once: :meth:`prepare`); sorting changes those arrays.
        layouts: the layout of every sorted group, by its indices' key (for
            :meth:`sparse_stored`).
        constants: a cache of per-layout arrays, kept by the caller across steps.
    """

    def __init__(self, arrays: Mapping[Any, np.ndarray], sorts: Sequence[tuple[Any, Any, Layout]],
                 layouts: Mapping[Any, Layout], constants: dict[Any, Any]) -> None:
        self.arrays = dict(arrays)
        self._sorts = list(sorts)
        self._layouts = dict(layouts)
        self.constants = constants
        self._stored: dict[Hashable, _StoredIndices | None] = {}
        self._lock = threading.Lock()
        self._ready = not self._sorts

    def prepare(self) -> None:
        """The batched sorts (once, thread-safe): per group, every pair at once, the keys
        clamped to their tensor's range and offset by its base; a few numpy calls on whole
        arrays (which release the GIL), not an argsort and two gathers per tensor."""
        if self._ready:
            return
        with self._lock:
            if self._ready:
                return
            for ikey, vkey, lay in self._sorts:
                keys, vals = self.arrays[ikey], self.arrays[vkey]
                spread, limits = _host_spread(self.constants, tuple(n for n, _k in lay),
                                              tuple(k for _n, k in lay))
                np.clip(keys, -1, limits, out=keys)
                keys += spread
                _sort_pairs(keys, vals, sum(n + 2 for n, _k in lay))
            self._ready = True

    def array(self, slot: Slot) -> np.ndarray:
        """A slot's elements (a flat view)."""
        self.prepare()
        out: np.ndarray = self.arrays[slot.key][slot.offset:slot.offset + slot.numel]
        return out

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
        views of arrays made for the group's pairs at once on first use. None when the
        group's pairs fail the codec's checks (or were not sorted as a group): then
        ``encode_sparse`` of :meth:`sparse` names the fault."""
        self.prepare()
        si, sv = slot.idx, slot.values
        if not slot.sorted:
            return None
        if si.key not in self._stored:  # (few calls per tensor: each one holds the GIL)
            with self._lock:
                if si.key not in self._stored:
                    layout = self._layouts.get(si.key)
                    self._stored[si.key] = None if layout is None else _delta_indices(
                        self.constants, self.arrays[si.key], layout)
        stored = self._stored[si.key]
        if stored is None:
            return None
        tag = sparse_index_tag(numel)
        arr = stored.i32 if tag == "I32" else stored.i64
        assert arr is not None
        return (tag, arr[si.offset:si.offset + si.numel],
                self.arrays[sv.key][sv.offset:sv.offset + sv.numel])


# ------------------------------------------------------------------------------ recipes

#: a message's recipe: (op, the slots it reads, plain params); see :data:`RECIPES`
Recipe = tuple[str, tuple[Any, ...], tuple[Any, ...]]
#: the last bits logged per name, for ``changed`` (name -> (tag, bytes))
LastBits = dict[str, tuple[str, np.ndarray]]


def _as_storage(arr: np.ndarray, tag: str) -> np.ndarray:
    want = storage_dtype(tag)
    return arr if arr.dtype == want else arr.view(want)


def encode_bits(b: HostBatch, slot: Slot, tag: str) -> Encoded:
    """``bits``: a tensor's bits logged ``raw`` (bf16 / fp8 carried as integers)."""
    return Encoded("raw", {}, (Part(tag, _as_storage(b.array(slot), tag)),))


def encode_changed(b: HostBatch, slot: Slot, tag: str, name: str, last: LastBits
                   ) -> Encoded | None:
    """``changed``: :func:`encode_bits`, or None (left out of the record) when the bits are
    the ones last logged under ``name`` in ``last`` (which this updates)."""
    enc = encode_bits(b, slot, tag)
    now = np.ascontiguousarray(enc.parts[0].data).reshape(-1).view(np.uint8)
    prev = last.get(name)
    if prev is not None and prev[0] == tag and np.array_equal(prev[1], now):
        return None
    last[name] = (tag, now.copy())
    return enc


def encode_topk(b: HostBatch, slot: SparseSlot, numel: int, tag: str) -> Encoded:
    """``topk``: the ``sparse`` tensor (delta-coded indices) of top-k pairs; its index part
    made for the group's pairs at once (:meth:`HostBatch.sparse_stored`), byte for byte
    what ``encode_sparse`` makes; pairs the codec refuses go to ``encode_sparse``, which
    raises the codec's error."""
    stored = b.sparse_stored(slot, numel)
    if stored is None:
        idx, vals = b.sparse(slot)
        return encode_sparse(idx, _as_storage(vals, tag), numel, tag, delta=True)
    itag, index, vals = stored
    return Encoded("sparse", {"count": int(index.size), "index_dtype": itag, "delta": True},
                   (Part(itag, index), Part(tag, _as_storage(vals, tag))))


def encode_tern(b: HostBatch, codes: Slot, scale: Slot) -> Encoded:
    """``tern``: TernGrad's int8 codes and float32 scale, one block."""
    c = b.array(codes)
    return encode_ternary(c, b.array(scale), "F32", block=max(c.size, 1))


def encode_qsgd_msg(b: HostBatch, signed: Slot, norms: Slot, levels: int, bucket: int
                    ) -> Encoded:
    """``qsgd``: int8 ``sign * level`` per entry and the float32 norm of each bucket."""
    return encode_qsgd(b.array(signed), b.array(norms), "F32", levels=levels, bucket=bucket)


def encode_sign(b: HostBatch, codes: Slot) -> Encoded:
    """``sign``: DeMo's int8 codes in {-1, 0, +1} as a ``sign`` tensor, or ``tern`` when a
    code is 0 (which a sign bit cannot hold)."""
    c = b.array(codes)
    if bool((c == 0).any()):
        return encode_ternary(c, np.ones(1, np.float32), "F32", block=max(1, c.size))
    return encode_signs(c < 0, "F32")


#: every recipe op: (slots it reads, params it takes after them)
RECIPES: Mapping[str, tuple[Callable[..., Encoded | None], int, int]] = {
    "bits": (encode_bits, 1, 1),          # slot; tag
    "changed": (encode_changed, 1, 2),    # slot; tag, name (and the LastBits)
    "topk": (encode_topk, 1, 2),          # sparse slot; numel, tag
    "tern": (encode_tern, 2, 0),          # codes, scale
    "qsgd": (encode_qsgd_msg, 2, 2),      # signed, norms; levels, bucket
    "sign": (encode_sign, 1, 0),          # codes
}


def run_recipe(b: HostBatch, recipe: Recipe, last: LastBits | None = None
               ) -> Encoded | None:
    """The stored form of one message from its recipe (``last``: for ``changed``)."""
    op, slots, params = recipe
    fn = RECIPES[op][0]
    if op == "changed":
        assert last is not None
        return fn(b, *slots, *params, last)
    return fn(b, *slots, *params)


# ------------------------------------------------------------------------------ sorting


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
    """Per layout of a group of sorted pairs (made once, in ``constants``): the positions
    of the first and last pair of each tensor with pairs, its base and its base + numel."""

    firsts: np.ndarray
    lasts: np.ndarray
    bases: np.ndarray
    limits: np.ndarray
    i32: bool  # some tensor is indexed by int32
    i64: bool  # some tensor is indexed by int64
    valid: bool  # numels non-negative ints whose sum fits int64


_INT64_MAX = 2**63 - 1


def _segments(constants: dict[Any, Any], layout: Layout) -> _Segments:
    key = ("stored segments", tuple(layout))
    seg = constants.get(key)
    if seg is None:
        numels = [n for n, _k in layout]
        counts = np.array([k for _n, k in layout], dtype=np.int64)
        valid = (all(isinstance(n, int) and n >= 0 for n in numels)
                 and sum(numels) + 2 * len(numels) < _INT64_MAX)
        tags = {sparse_index_tag(n) for n in numels} if valid else set()
        if not valid:
            numels = [0] * len(numels)
        bases_all = bases_of(numels)
        limits_all = bases_all + np.array(numels, dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.intp)
        has = counts > 0
        seg = constants[key] = _Segments(
            offsets[has], (offsets + counts - 1)[has].astype(np.intp), bases_all[has],
            limits_all[has], "I32" in tags, "I64" in tags, valid)
    return seg  # type: ignore[no-any-return]


def _delta_indices(constants: dict[Any, Any], keys: np.ndarray, layout: Layout
                   ) -> _StoredIndices | None:
    """The stored ``sparse`` indices of a group of sorted pairs (``keys``: each tensor's
    indices plus its base, in the order the tensors were added; see :func:`_segments`),
    or None when they fail the codec's checks: indices unique and in ``[0, numel)``.
    ``keys`` is sorted as a whole (one sort of the step's pairs), so a gap that wrapped
    around int64 is negative and fails the check like any other."""
    seg = _segments(constants, layout)
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


def bases_of(numels: Sequence[int]) -> np.ndarray:
    """Each tensor's base: ``1 + sum over the tensors before it of (numel + 2)`` (the free
    key on each side of a tensor's range keeps an out-of-range index in its own range)."""
    widths = np.array(numels, dtype=np.int64) + 2
    return np.concatenate([[1], 1 + np.cumsum(widths, dtype=np.int64)])[:len(numels)] \
        .astype(np.int64)


def spread_arrays(numels: tuple[int, ...], counts: tuple[int, ...]
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Each index's base and its tensor's numel (``counts``: the indices per tensor)."""
    return (np.repeat(bases_of(numels), counts),
            np.repeat(np.array(numels, dtype=np.int64), counts))


def _host_spread(constants: dict[Any, Any], numels: tuple[int, ...], counts: tuple[int, ...]
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Each index's base and its tensor's numel, for the host's batched sort (made once
    per layout)."""
    key = ("host spread", numels, counts)
    arrs = constants.get(key)
    if arrs is None:
        arrs = constants[key] = spread_arrays(numels, counts)
    return arrs  # type: ignore[no-any-return]


__all__ = ["RECIPES", "HostBatch", "LastBits", "Layout", "Recipe", "Slot", "SparseSlot",
           "bases_of", "encode_bits", "encode_changed", "encode_qsgd_msg", "encode_sign",
           "encode_tern", "encode_topk", "run_recipe", "spread_arrays"]
