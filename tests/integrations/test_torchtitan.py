"""torchtitan + ``LowDiffCheckpointManager`` against the real package (0.3.0), on one CPU
rank: the debug model trained by torchtitan's own ``Trainer``, SIGKILLed in the middle of a
checkpoint interval, run again, ends bitwise equal to an uninterrupted run of torchtitan's
own checkpoint manager (every logged loss and gradient norm, learning rate, weights,
optimizer state, ``train_state``, data loader position); and what the manager does not
support is refused when it is built. The CPU adjustments live in ``titan_cpu.py``."""

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


# ---------------------------------------------------------------------- refusals


def _manager(monkeypatch: pytest.MonkeyPatch | None = None, *, world: int = 1,
             optimizers: int = 1, parts: int = 1, loader: Any = "ok",
             **config: Any) -> Any:
    import torch
    from torchtitan.components.dataloader import ParallelAwareDataloader

    from lowdiff_store.integrations.torchtitan import LowDiffCheckpointManager

    if monkeypatch is not None:
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: world)
    if loader == "ok":
        loader = ParallelAwareDataloader(torch.utils.data.TensorDataset(torch.zeros(4)),
                                         dp_rank=0, dp_world_size=1, batch_size=1)
    model = torch.nn.Linear(2, 2)
    opts = [torch.optim.AdamW(model.parameters()) for _ in range(optimizers)]
    cfg = LowDiffCheckpointManager.Config(**{"enable": True, **config})
    return LowDiffCheckpointManager(
        cfg, dataloader=loader, model_parts=[model] * parts,
        optimizers=SimpleNamespace(optimizers=opts),
        lr_schedulers=SimpleNamespace(schedulers=[]), states={"train_state": object()},
        sd_adapter=None, base_folder="/nonexistent-never-written")


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


def test_several_ranks_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="2 ranks"):
        _manager(monkeypatch, world=2)


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
