"""The step batch encodes a step's top-k messages as one batch (issue 33, item 2): the
``sparse`` codec's index part of every tensor is made with a few whole-array numpy calls
(``StepBatch.sparse_stored``), and the parts are byte for byte ``codecs.encode_sparse``'s,
on the host-sorted (CPU) path and on the device-sorted path (``sort_on_device=True`` runs
the batched ``torch.sort`` on CPU tensors). Pairs the codec refuses still raise its error."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowdiff_store import codecs
from lowdiff_store.errors import CodecError, Reason
from lowdiff_store.format.dtypes import storage_dtype
from lowdiff_store.torch.compressors.topk import TopKMessage
from lowdiff_store.torch.core.step_batch import HostPool, StepBatch
from lowdiff_store.torch.core.tensors import bits_tensor

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: a numel beyond the int32 index bound, held only as a number (the indices are few)
_BIG = 2**31 + 5


def _tensor_case(rng: np.random.Generator, numel: int, k: int, dtype: str
                 ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Unique indices in [0, numel) in random order (extremes included when k allows),
    and random values (NaN, -0.0 and subnormal bit patterns come from random bits)."""
    if k == 0:
        idx = np.empty(0, np.int64)
    elif numel <= 1 << 20:
        idx = rng.permutation(numel)[:k].astype(np.int64)
    else:
        edges = (0, numel - 1, 2**31 - 1, 2**31)
        picked = {i for i in edges if i < numel} if k >= 4 else set()
        while len(picked) < k:
            picked.add(int(rng.integers(0, numel)))
        idx = rng.permutation(np.array(sorted(picked)[:k], dtype=np.int64))
    bits = rng.integers(-(2**15), 2**15, size=k * 2, dtype=np.int16)
    vals = torch.from_numpy(bits.view(np.float32).copy())
    if dtype != "fp32":
        vals = torch.from_numpy(bits[:k].copy()).view(_DTYPES[dtype])
    return torch.from_numpy(idx), vals, numel


def _want(idx: torch.Tensor, vals: torch.Tensor, numel: int) -> codecs.Encoded:
    tag, bits = bits_tensor(vals, "values")
    v = bits.numpy()
    want = storage_dtype(tag)
    return codecs.encode_sparse(idx.numpy(), v if v.dtype == want else v.view(want), numel,
                                tag, delta=True)


def _same(got: codecs.Encoded | None, want: codecs.Encoded) -> None:
    assert got is not None
    assert got.codec == want.codec == "sparse"
    assert got.params == want.params
    assert [type(v) for v in got.params.values()] == [type(v) for v in want.params.values()]
    assert list(got.params) == list(want.params)
    assert len(got.parts) == len(want.parts) == 2
    for g, w in zip(got.parts, want.parts, strict=True):
        assert g.dtype == w.dtype
        assert g.data.dtype == w.data.dtype
        assert g.data.tobytes() == w.data.tobytes()


def _encode_batch(cases: list[tuple[torch.Tensor, torch.Tensor, int]], on_device: bool,
                  pool: HostPool | None = None) -> list[codecs.Encoded | None]:
    batch = StepBatch(pool or HostPool(), sort_on_device=on_device)
    msgs = [TopKMessage(i, v, n) for i, v, n in cases]
    for m in msgs:
        m.ship(batch)
    batch.ship()
    batch.wait()
    return [m.encode(batch) for m in msgs]


_layouts = st.lists(
    st.tuples(st.one_of(st.integers(0, 3000), st.just(_BIG)), st.floats(0.0, 1.0),
              st.sampled_from(sorted(_DTYPES))),
    min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(layout=_layouts, seed=st.integers(0, 2**32 - 1), on_device=st.booleans())
def test_batched_parts_equal_encode_sparse_byte_for_byte(
        layout: list[tuple[int, float, str]], seed: int, on_device: bool) -> None:
    """Random layouts (numels from 0 to past the int32 index bound, k from 0 to numel,
    fp32/bf16/fp16 values mixed in one step): every tensor's batched parts are
    ``encode_sparse``'s, on both sorting paths."""
    rng = np.random.default_rng(seed)
    cases = [_tensor_case(rng, n, min(n, int(frac * min(n, 400))), dt)
             for n, frac, dt in layout]
    got = _encode_batch(cases, on_device)
    for (i, v, n), enc in zip(cases, got, strict=True):
        _same(enc, _want(i, v, n))


@pytest.mark.parametrize("on_device", [False, True])
def test_the_batch_does_not_call_the_per_tensor_codec(monkeypatch: pytest.MonkeyPatch,
                                                      on_device: bool) -> None:
    """Valid pairs never reach ``codecs.encode_sparse`` (its validation and packing are
    ~15 small numpy calls per tensor), and the batched index parts are made once per
    group, whatever the number of tensors."""
    calls: list[int] = []
    real = codecs.encode_sparse

    def counting(*a: Any, **kw: Any) -> codecs.Encoded:
        calls.append(1)
        return real(*a, **kw)

    import lowdiff_store.codecs.batch as sb
    made: list[int] = []
    real_delta = sb._delta_indices

    def counting_delta(*a: Any, **kw: Any) -> Any:
        made.append(1)
        return real_delta(*a, **kw)

    rng = np.random.default_rng(7)
    cases = [_tensor_case(rng, 500 + 37 * j, 20 + j, "fp32" if j % 3 else "bf16")
             for j in range(40)]
    want = [_want(i, v, n) for i, v, n in cases]
    monkeypatch.setattr(sb, "encode_sparse", counting)
    monkeypatch.setattr(sb, "_delta_indices", counting_delta)
    got = _encode_batch(cases, on_device)
    assert calls == []
    assert len(made) == 2  # one per values dtype (fp32, bf16)
    for g, w in zip(got, want, strict=True):
        _same(g, w)


@pytest.mark.parametrize("on_device", [False, True])
@pytest.mark.parametrize("fault", ["duplicate", "out of range", "negative"])
def test_pairs_the_codec_refuses_fail_with_its_error(on_device: bool, fault: str) -> None:
    """A duplicate, an index >= numel or a negative index fails the record with the codec's
    own error (the same reason and text ``encode_sparse`` gives), found by the one
    vectorized check; the tensors before the bad one encode as ``encode_sparse`` would."""
    rng = np.random.default_rng(11)
    cases = [_tensor_case(rng, 100, 10, "fp32") for _ in range(4)]
    bad_idx = cases[2][0].clone()
    bad_idx[3] = {"duplicate": int(bad_idx[5]), "out of range": 100,
                  "negative": -1}[fault]
    bad = (bad_idx, cases[2][1], 100)
    with pytest.raises(CodecError) as ref:
        _want(*bad)
    cases[2] = bad
    batch = StepBatch(HostPool(), sort_on_device=on_device)
    msgs = [TopKMessage(i, v, n) for i, v, n in cases]
    for m in msgs:
        m.ship(batch)
    batch.ship()
    for m, case in zip(msgs[:2], cases[:2], strict=True):
        if fault == "duplicate":  # (out of range pairs move between tensors in the sort)
            _same(m.encode(batch), _want(*case))
    errors = []
    for m in msgs:
        try:
            m.encode(batch)
        except CodecError as e:
            errors.append(e)
    assert errors, "a bad pair was encoded"
    assert all(e.reason == Reason.BAD_CODEC_PARAMS for e in errors)
    if fault == "duplicate":
        assert len(errors) == 1
        assert str(errors[0]) == str(ref.value)
    else:
        assert all("out of range" in str(e) for e in errors)
        assert ref.value.reason == Reason.BAD_CODEC_PARAMS


def test_the_stored_indices_are_made_once_per_layout_and_reused() -> None:
    """The segment bounds of a layout are constants of the pool (made at the first step),
    and a second step with the same layout encodes to its own bytes."""
    pool = HostPool()
    rng = np.random.default_rng(5)
    first = [_tensor_case(rng, 300, 9, "fp16") for _ in range(5)]
    second = [(torch.from_numpy(rng.permutation(n)[:9].astype(np.int64)), v, n)
              for _i, v, n in first]
    for g, (i, v, n) in zip(_encode_batch(first, False, pool), first, strict=True):
        _same(g, _want(i, v, n))
    consts = {k for k in pool.constants if isinstance(k, tuple) and k[0] == "stored segments"}
    assert len(consts) == 1
    for g, (i, v, n) in zip(_encode_batch(second, False, pool), second, strict=True):
        _same(g, _want(i, v, n))
    assert {k for k in pool.constants
            if isinstance(k, tuple) and k[0] == "stored segments"} == consts


def _outcome(enc: Any) -> Any:
    """What encoding gave: the error's (reason, text), or the parts' bytes."""
    try:
        got = enc()
    except CodecError as e:
        return ("error", e.reason, str(e))
    return ("parts", got.codec, dict(got.params),
            [(p.dtype, p.data.dtype.str, p.data.tobytes()) for p in got.parts])


def _batched_outcomes(cases: list[tuple[torch.Tensor, torch.Tensor, int]],
                      on_device: bool) -> list[Any]:
    """Each case's outcome (bytes or error) when the step's messages go through one
    batch, as the encoder thread makes them."""
    batch = StepBatch(HostPool(), sort_on_device=on_device)
    msgs = [TopKMessage(i, v, n) for i, v, n in cases]
    for m in msgs:
        m.ship(batch)
    batch.ship()
    return [_outcome(lambda m=m: m.encode(batch)) for m in msgs]


@pytest.mark.parametrize("on_device", [False, True])
def test_pairs_out_of_range_never_move_to_a_neighbour(on_device: bool) -> None:
    """Out-of-range indices of one tensor and of the next can make the step's one sort
    hand a pair to the other tensor so that every range still looks right: (1, 12) and
    (-5, 7) of two tensors of 10 elements were stored as (1, 5) and (2, 7), a silently
    wrong record, where ``encode_sparse`` refuses both. Each tensor's outcome is
    ``encode_sparse``'s on its own pairs: its error, or its bytes."""
    cases = [(torch.tensor([1, 12]), torch.tensor([1.0, 2.0]), 10),
             (torch.tensor([-5, 7]), torch.tensor([3.0, 4.0]), 10),
             (torch.tensor([4, 0, 9]), torch.tensor([5.0, 6.0, 7.0]), 10)]
    got = _batched_outcomes(cases, on_device)
    want = [_outcome(lambda c=c: _want(*c)) for c in cases]
    assert got == want
    assert [g[0] for g in got] == ["error", "error", "parts"]


@settings(max_examples=40, deadline=None)
@given(layout=st.lists(st.tuples(st.integers(1, 200), st.integers(0, 6),
                                 st.sampled_from(["ok", "high", "negative", "far"])),
                       min_size=1, max_size=8),
       seed=st.integers(0, 2**32 - 1), on_device=st.booleans())
def test_each_tensor_gets_its_own_outcome(layout: list[tuple[int, int, str]], seed: int,
                                          on_device: bool) -> None:
    """Random steps where some tensors hold an index past their end, a negative one or
    one far out of range (past the whole step, near the int64 bound): every tensor's
    outcome is ``encode_sparse``'s on its own pairs."""
    rng = np.random.default_rng(seed)
    cases = []
    for numel, k, fault in layout:
        i, v, n = _tensor_case(rng, numel, min(k, numel), "fp32")
        if fault != "ok" and i.numel():
            j = int(rng.integers(0, i.numel()))
            i[j] = {"high": numel + int(rng.integers(0, 30)),
                    "negative": -1 - int(rng.integers(0, 30)),
                    "far": 2**63 - 1 - int(rng.integers(0, 1000))}[fault]
        cases.append((i, v, n))
    got = _batched_outcomes(cases, on_device)
    assert got == [_outcome(lambda c=c: _want(*c)) for c in cases]
