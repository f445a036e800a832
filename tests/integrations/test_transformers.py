"""Hugging Face Trainer + ``LowDiffCallback`` against the real library: a run SIGKILLed at a
random step and run again ends bitwise equal to an uninterrupted run (weights, optimizer
state, learning rate, every logged loss); without a crash the callback changes nothing."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from lowdiff_store import ConfigError, Reason, latest_step

from . import hf_worker

pytestmark = pytest.mark.filterwarnings("ignore")  # the library's own deprecation notes
WORKER = Path(hf_worker.__file__)


def _load(p: Path) -> dict[str, np.ndarray]:
    with np.load(p, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _assert_same(ref: dict[str, np.ndarray], got: dict[str, np.ndarray], why: str) -> None:
    keys = set(ref) - {"resumed"}
    assert keys == set(got) - {"resumed"}
    bad = sorted(k for k in keys if not np.array_equal(ref[k], got[k]))
    assert not bad, f"{why}: differ in {bad}"


def _kill_and_resume(tmp_path: Path, variant: str, ref: dict[str, np.ndarray]) -> None:
    steps = int(hf_worker.VARIANTS[variant]["max_steps"])
    seed = random.randrange(1 << 30)
    kill_at = random.Random(seed).randrange(2, steps - 1)
    why = f"{variant}, killed in step {kill_at + 1} (seed {seed})"
    ckpt = tmp_path / f"ckpt-{variant}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, str(WORKER), str(tmp_path / "killed.npz"),
                           str(ckpt), variant, str(kill_at)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-3000:]
    durable = latest_step(ckpt)
    assert durable is not None, why
    assert 0 <= durable <= kill_at, why
    hf_worker.run(str(tmp_path / "resumed.npz"), str(ckpt), variant)  # the same script again
    got = _load(tmp_path / "resumed.npz")
    assert int(got["resumed"]) == durable, why
    _assert_same(ref, got, why)


def test_hf_trainer_killed_and_rerun_is_bitwise_the_uninterrupted_run(tmp_path: Path) -> None:
    hf_worker.run(str(tmp_path / "ref.npz"), "-", "plain")
    ref = _load(tmp_path / "ref.npz")
    assert len(ref["losses"]) == hf_worker.VARIANTS["plain"]["max_steps"]
    # without a crash the callback changes nothing
    hf_worker.run(str(tmp_path / "cb.npz"), str(tmp_path / "nocrash"), "plain")
    _assert_same(ref, _load(tmp_path / "cb.npz"), "callback, no crash")
    assert latest_step(tmp_path / "nocrash") == hf_worker.VARIANTS["plain"]["max_steps"]
    _kill_and_resume(tmp_path, "plain", ref)


def test_hf_trainer_with_streamed_bases_killed_and_rerun_is_bitwise(tmp_path: Path) -> None:
    from lowdiff_store.log import LogReader

    hf_worker.run(str(tmp_path / "ref.npz"), "-", "streamed")
    ref = _load(tmp_path / "ref.npz")
    hf_worker.run(str(tmp_path / "cb.npz"), str(tmp_path / "nocrash"), "streamed")
    _assert_same(ref, _load(tmp_path / "cb.npz"), "streamed bases, no crash")
    with LogReader(tmp_path / "nocrash") as r:
        assert r.streamed == [(4, (3, 4)), (8, (7, 8)), (12, (11, 12))]
    _kill_and_resume(tmp_path, "streamed", ref)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["accum", "bf16"])
def test_hf_trainer_accumulation_clipping_bf16(tmp_path: Path, variant: str) -> None:
    hf_worker.run(str(tmp_path / "ref.npz"), "-", variant)
    _kill_and_resume(tmp_path, variant, _load(tmp_path / "ref.npz"))


def test_resume_never_refuses_an_existing_log(tmp_path: Path) -> None:
    from lowdiff_store.integrations.transformers import LowDiffCallback

    ckpt = tmp_path / "c"
    hf_worker.run(str(tmp_path / "a.npz"), str(ckpt), "plain")
    trainer: Any = hf_worker.Trainer(
        model=hf_worker.model(), train_dataset=hf_worker.dataset(),
        args=hf_worker.TrainingArguments(output_dir=str(tmp_path), max_steps=2,
                                         report_to=[], use_cpu=True, save_strategy="no"),
        callbacks=[LowDiffCallback(ckpt, resume="never")])
    with pytest.raises(ConfigError) as err:
        trainer.train()
    assert err.value.reason is Reason.HISTORY_CONFLICT
    with pytest.raises(ConfigError):
        LowDiffCallback(ckpt, resume="sometimes")
