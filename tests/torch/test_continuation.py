"""Bitwise continuation: an uninterrupted 30-step run versus a run cut at step 17, restored
into fresh objects and continued to 30 (issue 4's acceptance test), for every setup."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
import torch
from _cases import CASES, assert_same, build, ckpt_kwargs, reference, run, snapshot

from lowdiff_store.torch import DiffCheckpointer, restore
from tests.helpers.timing import scaled

HERE = os.path.dirname(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))


def _ckpt(path: Any, case: str, o: Any, **kw: Any) -> DiffCheckpointer:
    return DiffCheckpointer(path, o.model, o.optimizer, scheduler=o.scheduler, scaler=o.scaler,
                            compressor=o.compressor, extra_state=lambda: dict(o.extra),
                            **{**ckpt_kwargs(case), **kw})


def _restore(path: Any, o: Any, **kw: Any) -> Any:
    return restore(path, o.model, o.optimizer, scheduler=o.scheduler, scaler=o.scaler, **kw)


#: the setups whose logs are not also written by a writer process in
#: test_writer_process.py (byte for byte there), run here against it too
PROCESS_CASES = ("sgd_bn", "sgd_inplace", "adam_amp_fp16", "adam_amp_fused", "layerwise")


@pytest.mark.parametrize(("case", "writer"), [*((c, "thread") for c in CASES),
                                              *((c, "process") for c in PROCESS_CASES)])
def test_cut_at_17_restore_continue_to_30(case: str, writer: str, tmp_path: Any) -> None:
    _, ref = reference(case, 30, at=(16,))
    path = tmp_path / "log"
    o = build(case)
    ckpt = _ckpt(path, case, o, writer_process=writer == "process")
    run(case, o, 0, 17, ckpt)
    # crash: the objects are dropped without close(); step 17 was never completed (its
    # scheduler step ran, but no later hook or flush saw it), so 16 is the newest durable
    del ckpt, o
    gc.collect()

    o2 = build(case)
    res = _restore(path, o2)
    assert res.step == 16
    assert res.exact
    assert res.extra == {"batches": 16}
    assert res.verified == [16]  # a digest every step: the last one on the way is checked
    assert_same(snapshot(o2), ref[16])
    ckpt2 = _ckpt(path, case, o2, writer_process=writer == "process")  # the same log
    run(case, o2, 16, 30, ckpt2)
    ckpt2.close()
    assert_same(snapshot(o2), ref[30])

    # the continued log itself reproduces the end state
    o3 = build(case)
    assert _restore(path, o3).step == 30
    assert_same(snapshot(o3), ref[30])


def test_grad_scaler_skips_are_recorded(tmp_path: Any) -> None:
    from _cases import INF_STEPS

    from lowdiff_store import LogReader

    o = build("adam_amp_fp16")
    with _ckpt(tmp_path / "log", "adam_amp_fp16", o) as ckpt:
        run("adam_amp_fp16", o, 0, 30, ckpt)
        assert ckpt.stats()["skipped"] >= len(INF_STEPS)
    with LogReader(tmp_path / "log") as r:
        skipped = [t for t in r.steps if r.record(int(t)).side.get("skipped")]
    assert set(INF_STEPS) <= set(skipped)


_CHILD = textwrap.dedent("""
    import sys, time, torch
    sys.path.insert(0, {here!r})
    from _cases import build, ckpt_kwargs, train_step
    from lowdiff_store.torch import DiffCheckpointer
    torch.set_num_threads(1)
    case, path, process = sys.argv[1], sys.argv[2], sys.argv[3] == "process"
    o = build(case)
    ckpt = DiffCheckpointer(path, o.model, o.optimizer, scheduler=o.scheduler,
                            scaler=o.scaler, compressor=o.compressor,
                            extra_state=lambda: dict(o.extra), **ckpt_kwargs(case),
                            writer_process=process)
    for t in range(1, 31):
        train_step(case, o, t, ckpt)
        if t == 17:
            ckpt.flush()
            print("DURABLE", ckpt.durable_step, flush=True)
            time.sleep(60)
""")


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_sigkilled_subprocess_restore_continue(tmp_path: Any, writer: str) -> None:
    case = "adamw"
    _, ref = reference(case, 30)
    path = tmp_path / "log"
    env = dict(os.environ, PYTHONPATH=ROOT)
    child = subprocess.Popen([sys.executable, "-c", _CHILD.format(here=HERE), case, str(path),
                              writer], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert child.stdout is not None
        deadline = time.monotonic() + scaled(120)
        line = ""
        while time.monotonic() < deadline and not line.startswith("DURABLE"):
            line = child.stdout.readline()
            if not line and child.poll() is not None:
                break
        assert line.split() == ["DURABLE", "17"], line
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
    o = build(case)
    res = _restore(path, o)
    assert res.step == 17
    assert res.extra == {"batches": 17}
    with _ckpt(path, case, o, writer_process=writer == "process") as ckpt:  # lock gone
        run(case, o, 17, 30, ckpt)
    assert_same(snapshot(o), ref[30])


def test_restore_at_every_step_matches_reference(tmp_path: Any) -> None:
    case = "sgd_bn"
    steps = tuple(range(0, 31))
    _, ref = reference(case, 30, at=steps[1:])
    path = tmp_path / "log"
    o = build(case)
    ref[0] = snapshot(o)
    with _ckpt(path, case, o, snapshot_every=7) as ckpt:
        run(case, o, 0, 30, ckpt)
    for t in steps:
        o2 = build(case)
        res = _restore(path, o2, step=t)
        assert res.step == t
        assert res.base_step == t - t % 7
        assert_same(snapshot(o2), ref[t])


def test_checkpointing_does_not_change_training(tmp_path: Any) -> None:
    for case in ("adamw", "topk"):
        _, ref = reference(case, 12)
        o = build(case)
        with _ckpt(tmp_path / case, case, o, batch=4) as ckpt:
            run(case, o, 0, 12, ckpt)
        assert_same(snapshot(o), ref[12])


def test_ddp_wrapped_model(tmp_path: Any) -> None:
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        case = "sgd_bn"
        _, ref = reference(case, 10)
        o = build(case)
        o.model = torch.nn.parallel.DistributedDataParallel(o.model)
        with _ckpt(tmp_path / "log", case, o) as ckpt:
            run(case, o, 0, 10, ckpt)
        from lowdiff_store.torch import describe_log

        names = [t["name"] for t in describe_log(tmp_path / "log")["model_tensors"]]
        assert names[0] == "net.0.weight"
        assert not any(n.startswith("module.") for n in names)
        o2 = build(case)
        _restore(tmp_path / "log", o2)
        assert_same(snapshot(o2)["model"], ref[10]["model"])
        assert_same(snapshot(o2)["optimizer"], ref[10]["optimizer"])
    finally:
        dist.destroy_process_group()
