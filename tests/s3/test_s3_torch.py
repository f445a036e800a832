"""DiffCheckpointer, restore and replay_state on an ``s3://`` log, and a training process
SIGKILLed mid-run then restored bit for bit from the bucket."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from lowdiff_store import ConfigError, LogReader, cli  # noqa: E402
from lowdiff_store.torch import DiffCheckpointer, replay_state, restore  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_MODEL = textwrap.dedent("""
    import torch

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 4))
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    def train_step(model, opt, t):
        g = torch.Generator().manual_seed(t)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
""")
_ns: dict[str, Any] = {}
exec(compile(_MODEL, "<model>", "exec"), _ns)
build, train_step = _ns["build"], _ns["train_step"]


def reference(steps: int) -> dict[int, dict[str, Any]]:
    """State after each step of an uninterrupted run without a checkpointer."""
    model, opt = build()
    out = {}
    for t in range(1, steps + 1):
        train_step(model, opt, t)
        out[t] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def same(model: Any, state: dict[str, Any]) -> bool:
    return all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


@pytest.mark.consistent_bases  # (its bases' steps)
def test_checkpointer_restore_replay_cli_on_s3(s3_url: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    ref = reference(9)
    model, opt = build()
    with DiffCheckpointer(s3_url, model, opt, snapshot_every=4) as ckpt:
        for t in range(1, 9):
            train_step(model, opt, t)
        assert ckpt.flush() == 8
        with LogReader(s3_url) as r:  # flush uploaded it: in the bucket before close
            assert int(r.steps[-1]) == 8
    m2, o2 = build()
    res = restore(s3_url, m2, o2)
    assert res.step == 8
    assert res.exact
    assert same(m2, ref[8])
    state, _opt = replay_state(s3_url, 7)
    assert all(torch.equal(state[k], v) for k, v in ref[7].items())

    # the CLI on the same s3:// log
    assert cli.main(["inspect", "--json", s3_url]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["last_step"] == 8
    assert cli.main(["verify", "--json", s3_url]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    out = tmp_path / "w7.safetensors"
    assert cli.main(["replay", s3_url, "--to-step", "7", "--out", str(out)]) == 0
    from safetensors.torch import load_file

    assert all(torch.equal(load_file(str(out))[k], v) for k, v in ref[7].items())
    capsys.readouterr()
    assert cli.main(["tune", "--json", "--mtbf", "3600", s3_url]) == 0
    assert isinstance(json.loads(capsys.readouterr().out), dict)
    with LogReader(s3_url) as r:   # 0, 4 and 8, or 5 for 4: a base put off a step when
        older = [b for b in r.bases if b < 8]   # its staging memory was still being written
    assert older[0] == 0
    assert older[1:] in ([4], [5])
    assert cli.main(["compact", "--json", "--keep-bases", "1", s3_url]) == 0
    assert json.loads(capsys.readouterr().out)["delete_bases"] == older
    m3, o3 = build()
    with pytest.raises(ConfigError, match="already holds a log"):  # not restored first
        DiffCheckpointer(s3_url, m3, o3)
    assert restore(s3_url, m3, o3).step == 8
    assert same(m3, ref[8])
    with DiffCheckpointer(s3_url, m3, o3) as ckpt:  # restored: continues the same log
        train_step(m3, o3, 9)
        assert ckpt.flush() == 9
    assert same(m3, ref[9])


_TRAINER = _MODEL + textwrap.dedent("""
    import sys
    from lowdiff_store.torch import DiffCheckpointer

    model, opt = build()
    ckpt = DiffCheckpointer(sys.argv[1], model, opt, snapshot_every=10)
    seen = None
    for t in range(1, 100_000):
        train_step(model, opt, t)
        if ckpt.durable_step != seen:
            seen = ckpt.durable_step
            print("durable", seen, flush=True)
""")


@pytest.mark.slow  # ~30 s here; tests/s3/test_s3_log.py SIGKILLs a log writer in CI
def test_sigkill_trainer_restores_bitwise_from_the_bucket(s3_url: str) -> None:
    ref = reference(60)
    p = subprocess.Popen([sys.executable, "-c", _TRAINER, s3_url], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    durable = 0
    assert p.stdout is not None
    for line in p.stdout:
        if line.startswith("durable"):
            durable = int(line.split()[1])
            if durable >= 23:
                break
    p.send_signal(signal.SIGKILL)
    _out, err = p.communicate(timeout=30)
    assert durable >= 23, err
    m2, o2 = build()
    res = restore(s3_url, m2, o2)
    assert res.step >= durable  # nothing acknowledged is lost
    assert res.step <= 60
    assert same(m2, ref[res.step])


def test_streamed_bases_on_s3(s3_url: str) -> None:
    """Slices are published as create-only objects, named by the manifest object committed
    with the last one; a restore inside and after a window is bitwise."""
    ref = reference(11)
    model, opt = build()
    with DiffCheckpointer(s3_url, model, opt, snapshot_every=4, base_slices=2):
        for t in range(1, 12):
            train_step(model, opt, t)
    with LogReader(s3_url) as r:
        assert r.streamed == [(4, (3, 4)), (8, (7, 8))]
    for t in (7, 8, 11):
        m2, o2 = build()
        res = restore(s3_url, m2, o2, step=t)
        assert (res.base_step, res.exact) == (4 if t < 8 else 8, True)
        assert same(m2, ref[t])
