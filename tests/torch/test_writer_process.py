"""The writer as a process (``writer_process=True``, issue 49): the training setups of
``_cases`` log through the ring and the writer process; every record is the in-thread
writer's byte for byte (payload and metadata), restores are bitwise, a cut run continues
bitwise, a resume that truncates goes through the ring's META message, the training
thread's host calls per step do not grow with the parameter count, and the writer's
counters reach ``stats()``. The kills and the rest of the red team of the process boundary
are in ``test_writer_process_kills.py``."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch
from _cases import assert_same, build, ckpt_kwargs, reference, run, snapshot

from lowdiff_store import LogReader
from lowdiff_store.torch import DiffCheckpointer, TopKCompressor, restore

pytestmark = pytest.mark.consistent_bases  # consistent bases' steps and files (tests/conftest.py)

STEPS = 12


def _ckpt(path: Path, case: str, o: Any, **kw: Any) -> DiffCheckpointer:
    return DiffCheckpointer(path, o.model, o.optimizer, scheduler=o.scheduler, scaler=o.scaler,
                            compressor=o.compressor, extra_state=lambda: dict(o.extra),
                            **{**ckpt_kwargs(case), **kw})


def _restore(path: Path, o: Any, **kw: Any) -> Any:
    return restore(path, o.model, o.optimizer, scheduler=o.scheduler, scaler=o.scaler, **kw)


def _records(path: Path) -> list[tuple[int, bytes, dict[str, Any]]]:
    with LogReader(path) as r:
        return [(int(s), bytes(r.record(int(s))._payload), r.record(int(s)).meta)
                for s in r.steps]


@pytest.mark.parametrize("case", ["adamw", "adam_amp_bf16", "layerwise_clip", "delta",
                                  "topk_ef_step", "terngrad_ef_step", "qsgd", "demo"])
def test_records_are_the_thread_writers_byte_for_byte(case: str, tmp_path: Path) -> None:
    _, ref = reference(case, STEPS)
    logs = {}
    for wp in (False, True):
        o = build(case)
        ck = _ckpt(tmp_path / f"log-{wp}", case, o, snapshot_every=5, writer_process=wp)
        run(case, o, 0, STEPS, ck)
        assert ck.stats()["writer_process"] == float(wp)
        if wp:
            ck.flush()
            st = ck.stats()
            assert st["writer_records"] == STEPS  # the writer process's own counters
            assert st["writer_ring_puts"] == STEPS
        ck.close()
        logs[wp] = tmp_path / f"log-{wp}"
        o2 = build(case)
        res = _restore(logs[wp], o2)
        assert (res.step, res.exact) == (STEPS, True)
        assert_same(snapshot(o2), ref[STEPS])
    thread, process = _records(logs[False]), _records(logs[True])
    assert [s for s, _p, _m in process] == list(range(1, STEPS + 1))
    assert process == thread
    with LogReader(logs[True]) as r:
        assert list(r.bases) == [0, 5, 10]


@pytest.mark.parametrize("case", ["adamw", "topk"])
def test_cut_restore_and_continue_through_the_writer_process(case: str, tmp_path: Path
                                                           ) -> None:
    _, ref = reference(case, 20, at=(9,))
    path = tmp_path / "log"
    o = build(case)
    ck = _ckpt(path, case, o, writer_process=True)
    run(case, o, 0, 10, ck)
    pid = ck._out.sink.pid  # type: ignore[attr-defined]
    del ck, o  # dropped without close(): step 10 was never completed
    gc.collect()
    o2 = build(case)
    res = _restore(path, o2)
    assert (res.step, res.exact) == (9, True)
    assert_same(snapshot(o2), ref[9])
    ck2 = _ckpt(path, case, o2, writer_process=True)
    assert ck2._out.sink.pid != pid  # type: ignore[attr-defined]
    run(case, o2, 9, 20, ck2)
    ck2.close()
    assert_same(snapshot(o2), ref[20])
    o3 = build(case)
    assert _restore(path, o3).step == 20
    assert_same(snapshot(o3), ref[20])


def test_resume_truncate_goes_through_the_ring(tmp_path: Path) -> None:
    case = "sgd_bn"
    _, ref = reference(case, 16, at=(6,))
    path = tmp_path / "log"
    o = build(case)
    with _ckpt(path, case, o, writer_process=True, snapshot_every=4) as ck:
        run(case, o, 0, 12, ck)
    o2 = build(case)
    assert _restore(path, o2, step=6).step == 6
    with _ckpt(path, case, o2, writer_process=True, snapshot_every=4,
               resume="truncate") as ck:
        assert ck._out.sink.last_step == 6  # type: ignore[attr-defined]
        run(case, o2, 6, 16, ck)
    with LogReader(path) as r:
        assert list(r.steps) == list(range(1, 17))
        assert [b for b in r.bases if b <= 8] == [0, 4, 8]
    o3 = build(case)
    assert _restore(path, o3).step == 16
    assert_same(snapshot(o3), ref[16])


def _host_calls(n: int, comp: Any, path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    from test_host_sync import COUNTED, WARMUP, Net, counting

    torch.manual_seed(0)
    model = Net(n)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 24)
    with counting(monkeypatch) as calls:
        ck = DiffCheckpointer(path, model, opt, compressor=comp() if comp else None,
                              snapshot_every=1000, digest_every=0, writer_process=True)
        for step in range(WARMUP + COUNTED):
            calls.on = step >= WARMUP
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()
            ck.flush()
        calls.on = False
        st = ck.stats()
        ck.close()
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return calls.counts, st["writer_ring_bytes"] / st["writer_ring_puts"] / grad_bytes


@pytest.mark.parametrize("comp", [None, lambda: TopKCompressor(0.05)], ids=["dense", "topk"])
def test_host_calls_per_step_do_not_grow_with_the_parameters(
        comp: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small, _ = _host_calls(4, comp, tmp_path / "small", monkeypatch)
    large, copied = _host_calls(64, comp, tmp_path / "large", monkeypatch)
    assert small == large, (small, large)
    # bytes into the ring per step, against the gradients': one copy of the dense ones
    # (plus the RNG state, the table and alignment), a few percent of them for top-k
    assert (1.0 <= copied <= 1.25) if comp is None else (copied < 0.5), copied
    assert sum(large.values()) <= 6 * 3, large  # per step, not per tensor (64 x 3 = 192)
    for k in ("np.argsort", "np.sort", "HostPool miss"):
        assert large[k] == 0, (k, large)


def test_a_full_disk_in_the_writer_process_is_raised_and_the_durable_steps_restore(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import functools

    from lowdiff_store.errors import CommitError
    from lowdiff_store.torch.capture import process_sink
    from lowdiff_store.writer.ring_client import RingClient
    from tests.helpers.ring_writer import COMMAND, ENV

    monkeypatch.setenv(ENV, "enospc:6")  # the segment's header, then 4 records, then full
    monkeypatch.setattr(process_sink, "RingClient",
                        functools.partial(RingClient, command=COMMAND))
    case, path = "sgd_bn", tmp_path / "log"
    _, ref = reference(case, 12, at=tuple(range(1, 12)))
    o = build(case)
    ck = _ckpt(path, case, o, writer_process=True, batch=1)
    durable = -1
    with pytest.raises(CommitError) as ei:
        for t in range(1, 13):
            run(case, o, t - 1, t, ck)
            ck.flush()
            durable = ck.durable_step
    cause = ei.value.__cause__
    assert isinstance(cause, OSError)
    assert cause.errno == errno.ENOSPC
    assert "No space left on device" in str(ei.value.__cause__)
    assert durable >= 3
    del ck
    gc.collect()
    o2 = build(case)
    res = _restore(path, o2)
    assert res.exact
    assert res.step == durable
    assert_same(snapshot(o2), ref[durable])


# ------------------------------------------------------------------ the default: "auto"

@pytest.mark.parametrize(("option", "device", "process"), [
    ("auto", "cuda", True), ("auto", "cpu", False), ("auto", "mps", False),
    (True, "cpu", True), (True, "cuda", True), (False, "cuda", False), (False, "cpu", False)])
def test_writer_process_true_false_or_for_auto_the_device(option: Any, device: str,
                                                          process: bool) -> None:
    from lowdiff_store.torch.capture.opening import writer_in_process

    assert writer_in_process(option, device) is process


def test_auto_writes_a_cpu_model_in_thread_and_a_cuda_log_through_a_writer_process(
        tmp_path: Path) -> None:
    """The default (``"auto"``): the CPU model's log is written by the in-thread writer
    (stats ``writer_process`` 0, no ring); the same log metadata naming CUDA parameters
    (what ``open_sink`` decides on: no device is needed) opens a writer process."""
    from lowdiff_store.torch.capture.opening import open_sink
    from lowdiff_store.torch.capture.options import DEFAULTS, CheckpointerOptions
    from lowdiff_store.torch.capture.process_sink import ProcessSink
    from lowdiff_store.torch.capture.sink import Sink

    assert DEFAULTS["writer_process"] == "auto"
    case = "sgd_bn"
    _, ref = reference(case, 3)
    o = build(case)
    with _ckpt(tmp_path / "cpu", case, o) as ck:
        run(case, o, 0, 3, ck)
        assert isinstance(ck._out.sink, Sink)
        st = ck.stats()
        meta = ck._log_meta
    assert (st["writer_process"], "writer_ring_puts" in st) == (0.0, False)
    assert meta["device"] == "cpu"
    o2 = build(case)
    assert _restore(tmp_path / "cpu", o2).step == 3
    assert_same(snapshot(o2), ref[3])
    sink = open_sink(str(tmp_path / "cuda"), {**meta, "device": "cuda"},
                     CheckpointerOptions(), 1, 0, False)
    try:
        assert isinstance(sink, ProcessSink)
        assert sink.stats()["process"] == 1.0
    finally:
        sink.close()
    with LogReader(tmp_path / "cuda") as r:  # opened by the writer process, empty
        assert (r.last_step, list(r.bases)) == (None, [])

