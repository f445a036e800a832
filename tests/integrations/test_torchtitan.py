"""torchtitan + ``LowDiffCheckpointManager`` against the real package (0.3.0), on one CPU
rank and on two (FSDP2, gloo): the debug model trained by torchtitan's own ``Trainer``,
SIGKILLed in the middle of a checkpoint interval, run again, ends bitwise equal to an
uninterrupted run of torchtitan's own checkpoint manager (every logged loss and gradient
norm, learning rate, weights, optimizer state, ``train_state``, data loader position, on
every rank); and what the manager does not support is refused when it is built. The CPU
adjustments live in ``titan_cpu.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install "
                    "'lowdiff-store[torchtitan]')")

from lowdiff_store import ConfigError, Reason, latest_step
from tests.helpers.dist import NEEDS_GLOO, check_exits, free_port, run_ranks

from . import titan_cpu

pytestmark = pytest.mark.filterwarnings("ignore")  # torchtitan's and torchdata's notes
WORKER = Path(__file__).with_name("titan_worker.py")
STEPS, INTERVAL = 10, 5


def _run(tmp: Path, dump: str, out: str, mode: str, kill_at: int | None = None) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(sys.path)}
    argv = [sys.executable, str(WORKER), str(tmp / "assets"), str(tmp / dump),
            str(tmp / out), mode, str(STEPS), str(INTERVAL)]
    if kill_at is not None:
        argv.append(str(kill_at))
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == (-9 if kill_at is not None else 0), proc.stderr[-4000:]
    return proc.returncode


def _run_2(tmp: Path, dump: str, out: str, mode: str, kill_at: int | None = None) -> None:
    """The worker on two ranks (FSDP2, gloo); rank r writes ``OUT-r<r>.*``. With
    ``kill_at`` both ranks SIGKILL themselves inside step ``kill_at + 1``: rank 1 before its
    optimizer step, rank 0 after it, once step ``kill_at`` is durable in its shard (see
    ``titan_worker.py``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    port = free_port()

    def argv(rank: int) -> list[str]:
        return [sys.executable, str(WORKER), str(tmp / "assets"), str(tmp / dump),
                str(tmp / f"{out}-r{rank}"), mode, str(STEPS), str(INTERVAL),
                "-" if kill_at is None else str(kill_at), str(rank), "2", str(port)]

    exits = run_ranks(argv, 2, env=env, timeout=900)
    if kill_at is None:
        check_exits(exits)
    else:
        for e in exits:
            assert not e.timed_out, str(e)
            assert e.returncode == -9, str(e)


def _losses(p: Path) -> dict[int, dict[str, Any]]:
    return {e["step"]: e for e in map(json.loads, p.read_text().splitlines())}


def _final(tmp: Path, name: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    with np.load(tmp / f"{name}.npz", allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    return arrays, json.loads((tmp / f"{name}.json").read_text())


def test_killed_mid_interval_resumes_from_the_log_bitwise(tmp_path: Path) -> None:
    titan_cpu.make_assets(tmp_path / "assets")
    _run(tmp_path, "dump-ref", "ref", "dcp")
    ref_losses = _losses(tmp_path / "ref.losses.jsonl")
    assert sorted(ref_losses) == list(range(1, STEPS + 1))
    kill_at = STEPS - 2  # killed inside step 9: torchtitan's newest checkpoint is step 5
    _run(tmp_path, "dump", "killed", "log", kill_at)
    assert sorted(os.listdir(tmp_path / "dump" / "checkpoint")) == [f"step-{INTERVAL}"]
    durable = latest_step(tmp_path / "dump" / "lowdiff")
    assert durable is not None
    # step 8's record is completed by step 9's optimizer step, which never ran
    assert INTERVAL < durable <= kill_at - 1, durable
    killed = _losses(tmp_path / "killed.losses.jsonl")
    assert sorted(killed) == list(range(1, kill_at + 1))
    assert all(killed[s] == ref_losses[s] for s in killed)  # the log changes nothing
    _run(tmp_path, "dump", "resumed", "log")  # the same script again
    resumed = _losses(tmp_path / "resumed.losses.jsonl")
    assert sorted(resumed) == list(range(durable + 1, STEPS + 1))
    bad = [s for s in resumed if resumed[s] != ref_losses[s]]
    assert not bad, f"losses, grad norms or lr differ at steps {bad}"
    ref_arrays, ref_json = _final(tmp_path, "ref")
    got_arrays, got_json = _final(tmp_path, "resumed")
    assert set(ref_arrays) == set(got_arrays)
    differ = sorted(k for k in ref_arrays if not np.array_equal(ref_arrays[k], got_arrays[k]))
    assert not differ, differ
    assert got_json["resumed"] == durable
    assert got_json["train_state"] == ref_json["train_state"]
    assert got_json["dataloader"] == ref_json["dataloader"]


@NEEDS_GLOO
def test_two_fsdp2_ranks_killed_mid_interval_resume_from_the_log_bitwise(tmp_path: Path
                                                                         ) -> None:
    titan_cpu.make_assets(tmp_path / "assets")
    _run_2(tmp_path, "dump-ref", "ref", "dcp")
    ref = [_losses(tmp_path / f"ref-r{r}.losses.jsonl") for r in range(2)]
    assert sorted(ref[0]) == list(range(1, STEPS + 1))
    assert ref[0] == ref[1]  # the global loss, the same on both ranks
    kill_at = STEPS - 2  # killed inside step 9: torchtitan's newest checkpoint is step 5
    _run_2(tmp_path, "dump", "killed", "log", kill_at)
    assert sorted(os.listdir(tmp_path / "dump" / "checkpoint")) == [f"step-{INTERVAL}"]
    log = tmp_path / "dump" / "lowdiff"
    assert sorted(os.listdir(log)) == ["SHARDS", "rank-00000", "rank-00001"]
    durable = latest_step(log)  # the newest step durable on both shards
    assert durable is not None
    assert INTERVAL < durable <= kill_at - 1, durable
    # rank 0's shard holds step 8 (completed by its step 9), rank 1's does not
    assert latest_step(log / "rank-00000") == kill_at
    assert latest_step(log / "rank-00001") == durable
    for r in range(2):
        killed = _losses(tmp_path / f"killed-r{r}.losses.jsonl")
        assert sorted(killed) == list(range(1, kill_at + 1))
        assert all(killed[s] == ref[r][s] for s in killed)  # the log changes nothing
    from lowdiff_store.torch import describe_log

    info = describe_log(log)
    assert (info["layout"], info["world_size"], info["mesh"]["shape"]) == ("fsdp", 2, [2])
    wqkv = "layers.0.attention.qkv_linear.wqkv.weight"  # each rank logs its half
    assert info["placements"][wqkv] == {"placements": [["S", 0]], "global_shape": [768, 256]}
    assert [s["pieces"][wqkv] for s in info["shards"]] == [
        {"offset": [0, 0], "shape": [384, 256]}, {"offset": [384, 0], "shape": [384, 256]}]

    _run_2(tmp_path, "dump", "resumed", "log")  # the same job again
    loaders = []
    for r in range(2):
        resumed = _losses(tmp_path / f"resumed-r{r}.losses.jsonl")
        assert sorted(resumed) == list(range(durable + 1, STEPS + 1))
        bad = [s for s in resumed if resumed[s] != ref[r][s]]
        assert not bad, f"rank {r}: losses, grad norms or lr differ at steps {bad}"
        ref_arrays, ref_json = _final(tmp_path, f"ref-r{r}")
        got_arrays, got_json = _final(tmp_path, f"resumed-r{r}")
        assert set(ref_arrays) == set(got_arrays)
        assert any(k.startswith("opt/") for k in got_arrays)
        differ = sorted(k for k in ref_arrays
                        if not np.array_equal(ref_arrays[k], got_arrays[k]))
        assert not differ, (r, differ)
        assert got_json["resumed"] == durable
        assert got_json["train_state"] == ref_json["train_state"]
        assert got_json["dataloader"] == ref_json["dataloader"]
        loaders.append(got_json["dataloader"])
    assert loaders[0] != loaders[1]  # each rank resumed its own data loader position
    # rank 0 dropped its step 8 and logged again from the job's step
    assert latest_step(log / "rank-00000") == latest_step(log / "rank-00001") == STEPS
    # a job of one rank does not resume the two ranks' log (their data loader positions)
    one = _manager(base_folder=str(tmp_path / "dump"))
    with pytest.raises(ConfigError) as err:
        one.load()
    assert err.value.reason is Reason.STATE_MISMATCH
    assert "written by 2 data parallel ranks, this job has 1" in str(err.value)
    assert one.checkpointer is None


# ---------------------------------------------------------------------- refusals


def _manager(monkeypatch: pytest.MonkeyPatch | None = None, *, world: int = 1,
             optimizers: int = 1, parts: int = 1, loader: Any = "ok", dp: int = 1,
             base_folder: str = "/nonexistent-never-written", **config: Any) -> Any:
    import torch
    from torchtitan.components.dataloader import ParallelAwareDataloader

    from lowdiff_store.integrations.torchtitan import LowDiffCheckpointManager

    if monkeypatch is not None:
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: world)
    if loader == "ok":
        loader = ParallelAwareDataloader(torch.utils.data.TensorDataset(torch.zeros(4)),
                                         dp_rank=0, dp_world_size=dp, batch_size=1)
    model = torch.nn.Linear(2, 2)
    opts = [torch.optim.AdamW(model.parameters()) for _ in range(optimizers)]
    cfg = LowDiffCheckpointManager.Config(**{"enable": True, **config})
    return LowDiffCheckpointManager(
        cfg, dataloader=loader, model_parts=[model] * parts,
        optimizers=SimpleNamespace(optimizers=opts),
        lr_schedulers=SimpleNamespace(schedulers=[
            torch.optim.lr_scheduler.LambdaLR(o, lambda _s: 1.0) for o in opts]),
        states={"train_state": object()},
        sd_adapter=None, base_folder=base_folder)


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"optimizers": 2}, "2 optimizers"),
    ({"parts": 2}, "2 model parts"),
    ({"async_mode": "async"}, "async_mode"),
    ({"load_step": 3}, "load_step"),
    ({"exclude_from_loading": ["dataloader"]}, "exclude_from_loading"),
    ({"load_only": True}, "load_only"),
    ({"loader": None}, "ParallelAwareDataloader"),
])
def test_what_is_not_supported_is_refused_when_built(kwargs: dict[str, Any],
                                                     words: str) -> None:
    with pytest.raises(ConfigError) as err:
        _manager(**kwargs)
    assert err.value.reason is Reason.NOT_ALLOWED
    assert words in str(err.value)
    assert "\n" not in str(err.value)
    assert not os.path.exists("/nonexistent-never-written")


@pytest.mark.parametrize(("dp", "words"), [
    (1, "2 ranks with a data parallel degree of 1"),   # tensor / pipeline parallelism
    (2, "2 ranks, parameter weight is not a DTensor"),  # not torchtitan's FSDP2
])
def test_several_ranks_other_than_fsdp2_are_refused(monkeypatch: pytest.MonkeyPatch, dp: int,
                                                    words: str) -> None:
    with pytest.raises(ConfigError) as err:
        _manager(monkeypatch, world=2, dp=dp)
    assert err.value.reason is Reason.NOT_ALLOWED
    assert words in str(err.value)
    assert "only FSDP2 data parallel sharding over every rank" in str(err.value)
    assert "\n" not in str(err.value)
    assert not os.path.exists("/nonexistent-never-written")


def test_config_builds_the_manager_and_checks_its_fields() -> None:
    from lowdiff_store.integrations.torchtitan import LowDiffCheckpointManager

    cfg = LowDiffCheckpointManager.Config(enable=True, interval=500)
    assert cfg._owner is LowDiffCheckpointManager
    assert (cfg.log_folder, cfg.snapshot_every, cfg.log_batch) == ("lowdiff", 100, 1)
    with pytest.raises(ConfigError):
        LowDiffCheckpointManager.Config(snapshot_every=0)
    with pytest.raises(ConfigError):
        LowDiffCheckpointManager.Config(log_resume="sometimes")
    # a disabled manager checks nothing and does nothing, as torchtitan's own
    assert _manager(optimizers=2, enable=False).checkpointer is None
