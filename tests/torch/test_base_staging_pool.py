"""Staging memory is never made inside a step (issue 34, item 1): the buffers a base is
copied into are allocated, faulted in (and on CUDA registered as pinned) on the helper
thread, ahead of the base; a base that meets a pool not ready yet is put off, never waited
for, and the training thread allocates nothing."""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import pytest
import torch

from lowdiff_store.format.constants import BASE_NAME
from lowdiff_store.log import LogReader
from lowdiff_store.log.base import BaseFile
from lowdiff_store.torch import DiffCheckpointer
from lowdiff_store.torch.capture.bases import copy as base_copy
from tests.helpers.slow_staging import slow_staging

pytestmark = pytest.mark.consistent_bases  # consistent bases' steps and files (tests/conftest.py)


def objects() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_a_step_meeting_a_pool_not_ready_allocates_nothing_and_puts_the_base_off(
        tmp_path: Any, monkeypatch: Any) -> None:
    calls: list[tuple[str, str]] = []  # (what, thread name)
    gate = threading.Event()
    new_slot, populate = base_copy.new_slot, base_copy.populate

    def counted_new_slot(capacity: int, pinned: bool) -> base_copy.Slot:
        calls.append(("allocate", threading.current_thread().name))
        assert gate.wait(60), "the allocation was waited for"
        return new_slot(capacity, pinned)

    def counted_populate(buf: np.ndarray) -> bool:
        calls.append(("fault-in", threading.current_thread().name))
        return populate(buf)

    monkeypatch.setattr(base_copy, "new_slot", counted_new_slot)
    monkeypatch.setattr(base_copy, "populate", counted_populate)
    path = tmp_path / "log"
    model, opt = objects()
    ckpt = DiffCheckpointer(path, model, opt, snapshot_every=2)
    main = threading.current_thread().name
    seen: dict[int, dict[str, bytes]] = {}
    deferred_at: dict[int, float] = {}
    for t in range(1, 9):
        opt.zero_grad()
        model(torch.randn(4, 32)).pow(2).mean().backward()
        opt.step()
        seen[t] = {n: p.detach().numpy().tobytes() for n, p in model.named_parameters()}
        deferred_at[t] = ckpt.stats()["base_deferred"]
        if t == 3:  # the helper thread may make the memory now (a slow allocation)
            gate.set()
        if t >= 3 and t % 2:  # the next base finds its memory made and free
            ckpt.flush()
            assert ckpt._out.stager.area.wait_made(60)
    ckpt.close()
    assert calls, "no staging memory was made"
    assert [c for c in calls if c[1] == main] == []  # nothing on the training thread
    assert all(c[1].startswith("lowdiff-stage") for c in calls), calls  # the helper's
    assert [w for w, _t in calls].count("fault-in") >= 1
    assert deferred_at[2] == 1  # step 2's base met the pool not ready: put off
    got = bases(path)
    assert 2 not in got
    assert {4, 6, 8} <= set(got)
    for s in (4, 6, 8):  # the bases taken are the state after their step
        b = BaseFile(os.path.join(path, BASE_NAME.format(s)))
        try:
            for n, want in seen[s].items():
                assert np.array(b.tensor(n)).tobytes() == want, (s, n)
        finally:
            b.close()


def bases(path: Any) -> list[int]:
    with LogReader(path) as r:
        return list(r.bases)


def test_device_copies_stay_inside_one_pinned_piece() -> None:
    """A device copy into a staging buffer pinned in pieces is cut at the pieces' bounds
    (the driver refuses an async copy spanning two registrations): every span lies inside
    one piece, and the spans tile the range exactly."""
    from lowdiff_store.torch.capture.bases.copy import pin_spans

    piece = 256
    for lo, n in [(0, 256), (0, 257), (10, 1000), (255, 2), (256, 256), (300, 0), (1, 1)]:
        spans = pin_spans(lo, n, piece)
        assert sum(b - a for a, b in spans) == n
        assert all(a // piece == (b - 1) // piece for a, b in spans)
        assert [a for a, _b in spans] == ([lo] + [b for _a, b in spans[:-1]] if n else [])
    assert pin_spans(10, 1000, piece) == [(10, 256), (256, 512), (512, 768), (768, 1010)]


def test_staging_is_faulted_in_and_registered_in_paced_pieces(monkeypatch: Any) -> None:
    """Each madvise and each cudaHostRegister covers at most one piece, and the helper
    thread pauses after each at least as long as the piece took (the training thread's
    allocations and launches wait for the locks those calls hold: 5-12 s stalls on an
    H100 with 12 GB made in 256 MiB pieces back to back)."""
    import itertools
    import time

    from lowdiff_store.torch.capture.bases import copy as base_copy

    piece = 1 << 20
    monkeypatch.setattr(base_copy, "PIN_PIECE", piece)
    calls: list[tuple[str, int, float, float]] = []

    def slow(kind: str, n: int) -> None:
        t0 = time.perf_counter()
        time.sleep(0.01)
        calls.append((kind, n, t0, time.perf_counter()))

    def fake_populate(buf: Any) -> bool:
        slow("populate", buf.nbytes)
        return True

    class FakeCudart:
        @staticmethod
        def cudaHostRegister(ptr: int, n: int, flags: int) -> int:
            slow("register", n)
            return 0

        @staticmethod
        def cudaHostUnregister(ptr: int) -> int:
            return 0

    monkeypatch.setattr(base_copy, "populate", fake_populate)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart)
    slot = base_copy.new_slot(4 * piece + 4096, pinned=True)
    base_copy.StagingArea.touch(slot)
    base_copy.pin(slot)
    for kind in ("populate", "register"):
        mine = [c for c in calls if c[0] == kind]
        assert [n for _k, n, _a, _b in mine] == [piece] * 4 + [4096]
        for (_k, _n, a0, b0), (_k2, _n2, a1, _b1) in itertools.pairwise(mine):
            assert a1 - b0 >= base_copy.PACE * (b0 - a0) * 0.99  # the pause after each
    assert len(slot.registered) == 5


def _train(ckpt: DiffCheckpointer, model: torch.nn.Module, opt: torch.optim.Optimizer,
           steps: range) -> None:
    for _t in steps:
        opt.zero_grad()
        model(torch.randn(4, 32)).pow(2).mean().backward()
        opt.step()


def test_a_slow_pool_puts_a_base_off_by_default_so_exact_base_steps_flake(
        tmp_path: Any, monkeypatch: Any) -> None:
    """What a loaded machine does to a single-rank checkpointer, made certain: the
    staging memory (made on the helper thread) is not ready when the base of step 4 is
    due, so that base is put off, and a test asserting bases [0, 4] fails."""
    gate = threading.Event()
    made = slow_staging(monkeypatch, 0.0, gate)
    model, opt = objects()
    ckpt = DiffCheckpointer(tmp_path / "log", model, opt, snapshot_every=4)
    _train(ckpt, model, opt, range(1, 7))  # the base of step 4 is due, then owed
    assert ckpt.stats()["base_deferred"] == 1
    assert made == []
    gate.set()
    ckpt.flush()
    assert ckpt._out.stager.area.wait_made(60)  # made now (a test's private wait)
    assert made == [0.0]
    _train(ckpt, model, opt, range(7, 8))  # the owed base, at the first step after
    ckpt.close()
    assert bases(tmp_path / "log") == [0, 7]  # not [0, 4]


def test_exact_bases_wait_for_a_slow_pool_and_fall_on_their_steps(
        tmp_path: Any, monkeypatch: Any) -> None:
    """``exact_bases=True``: the same slow pool; the base of step 4 waits for its memory
    (ready only when a timer opens the gate, whenever the loaded machine runs it), and
    every base is on its step, holding the state after it."""
    gate = threading.Event()
    made = slow_staging(monkeypatch, 0.0, gate)
    opener = threading.Timer(0.3, gate.set)
    model, opt = objects()
    ckpt = DiffCheckpointer(tmp_path / "log", model, opt, snapshot_every=4,
                            exact_bases=True)
    opener.start()
    seen: dict[int, bytes] = {}
    for t in range(1, 13):
        _train(ckpt, model, opt, range(t, t + 1))
        seen[t] = model[0].weight.detach().numpy().tobytes()
    ckpt.close()
    opener.join()
    assert made  # the memory was made late, on the gate
    assert ckpt.stats()["base_deferred"] == 0
    assert bases(tmp_path / "log") == [0, 4, 8, 12]
    for s in (4, 8, 12):
        b = BaseFile(os.path.join(tmp_path / "log", BASE_NAME.format(s)))
        try:
            assert np.array(b.tensor("0.weight")).tobytes() == seen[s], s
        finally:
            b.close()


def test_an_owed_base_waiting_for_its_memory_costs_no_listing_of_the_state(
        tmp_path: Any, monkeypatch: Any) -> None:
    """While a base is owed and its staging memory is still being made, each step puts it
    off without listing the state's arrays: on an H100 at 940M (1,100 tensors) that
    listing cost 0.02-0.2 s on every such step. Once the memory is made, the base is taken
    and holds the state after its step."""
    from lowdiff_store.torch.capture.bases.stager import BaseStager

    gate = threading.Event()
    slow_staging(monkeypatch, delay=0.0, gate=gate)
    listed: list[int] = []
    real = BaseStager._arrays

    def counted(self: BaseStager, *a: Any, **k: Any) -> Any:
        listed.append(1)
        return real(self, *a, **k)
    monkeypatch.setattr(BaseStager, "_arrays", counted)
    path = tmp_path / "log"
    model, opt = objects()
    ckpt = DiffCheckpointer(path, model, opt, snapshot_every=2)
    seen: dict[int, dict[str, bytes]] = {}
    owed_listings = []
    for t in range(1, 9):
        opt.zero_grad()
        model(torch.randn(4, 32)).pow(2).mean().backward()
        before = len(listed)
        opt.step()
        seen[t] = {n: p.detach().numpy().tobytes() for n, p in model.named_parameters()}
        if 3 <= t <= 6:  # a base is owed (due at 2) and its memory is being made
            owed_listings.append(len(listed) - before)
        if t == 6:
            gate.set()
            assert ckpt._out.stager.area.wait_made(60)
    ckpt.close()
    assert ckpt.stats()["base_deferred"] >= 1
    assert owed_listings == [0, 0, 0, 0]
    got = bases(path)
    assert [s for s in got if 0 < s < 7] == []  # put off while the memory was made
    taken = [s for s in got if s >= 7]
    assert taken  # the owed base, at the first step after the memory was made
    b = BaseFile(os.path.join(path, BASE_NAME.format(taken[0])))
    try:
        for n, want in seen[taken[0]].items():
            assert np.array(b.tensor(n)).tobytes() == want, n
    finally:
        b.close()


def test_staging_memory_that_cannot_be_made_is_said_and_tried_again(
        tmp_path: Any, monkeypatch: Any, caplog: Any) -> None:
    """The helper thread cannot make a base's staging memory (the host is out of memory):
    the bases are put off, which must be said (a warning naming the bytes and the
    error), not swallowed with the helper's result (main: no word, and a run took no
    base after base 0); once memory can be made, the next base is taken."""
    new_slot = base_copy.new_slot
    fail = threading.Event()
    fail.set()
    tries: list[int] = []

    def failing_new_slot(capacity: int, pinned: bool) -> base_copy.Slot:
        tries.append(capacity)
        if fail.is_set():
            raise MemoryError("no room for the staging buffer (test)")
        return new_slot(capacity, pinned)

    monkeypatch.setattr(base_copy, "new_slot", failing_new_slot)
    path = tmp_path / "log"
    model, opt = objects()
    ckpt = DiffCheckpointer(path, model, opt, snapshot_every=2)
    area = ckpt._out.stager.area
    caplog.set_level("WARNING", logger="lowdiff_store.torch.capture.bases.copy")
    for t in range(1, 11):
        opt.zero_grad()
        model(torch.randn(4, 32)).pow(2).mean().backward()
        opt.step()
        assert area.wait_made(60)
        if t == 6:
            ckpt.flush()
            assert bases(path) == [0]  # every base since put off
            fail.clear()  # memory can be made from now on
    ckpt.close()
    said = [r.getMessage() for r in caplog.records if "staging" in r.getMessage()]
    assert said, "the failure to make staging memory was not said"
    assert "no room for the staging buffer (test)" in said[0]
    assert str(tries[0]) in said[0]  # the bytes asked for
    assert len(said) == 1  # said once, not at every try
    assert len(tries) >= 3  # tried again at later steps
    assert set(bases(path)) - {0}, "no base once memory could be made"


def test_a_larger_buffer_replaces_two_smaller_free_ones() -> None:
    # Slots compared by content (a dataclass's __eq__ over numpy buffers) made list.remove
    # raise inside provide() once two buffers of different sizes were free: the job died,
    # the request stayed recorded, and a base waiting for memory waited forever.
    from lowdiff_store.torch.capture.bases.copy import StagingArea

    area = StagingArea(1 << 20)
    for need in (4096, 1024):
        assert area.want(need, False)
        area.provide()
        slot = area.acquire(need, False)
        assert slot is not None
    held = [s for s in area._slots]
    for s in held:
        area.release(s)
    assert area.want(8192, False)
    area.provide()
    assert [s.capacity >= 8192 for s in area._slots] == [True]
    assert area._wanted is None
    assert area.acquire(8192, False) is not None
