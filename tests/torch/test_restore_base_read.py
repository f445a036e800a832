"""restore() and replay_state() load the base by reading each tensor straight into its
destination (the model's own tensors, new optimizer state tensors), CRC checked there:
bitwise as before, a corrupted tensor in the middle of the base named with its file and
offset, the gradients gone, and a destination that cannot be read into (a
non-contiguous tensor) filled by a copy."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from lowdiff_store.errors import CorruptRecordError, Reason
from lowdiff_store.log.base import BaseFile
from lowdiff_store.torch import DiffCheckpointer, replay_state, restore
from lowdiff_store.torch.replay.engine import load_tensor

pytestmark = pytest.mark.consistent_bases  # consistent bases' steps and files (tests/conftest.py)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(32, 48)
        self.b = torch.nn.Linear(48, 8)
        self.register_buffer("count", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _objects(seed: int) -> tuple[Net, torch.optim.AdamW]:
    torch.manual_seed(seed)
    m = Net()
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def _train(m: Net, opt: torch.optim.Optimizer, steps: range) -> None:
    for t in steps:
        g = torch.Generator().manual_seed(t)
        x = torch.randn(16, 32, generator=g)
        opt.zero_grad()
        m(x).square().mean().backward()
        opt.step()


def _log(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor], dict[str, Any]]:
    path = tmp_path / "log"
    m, opt = _objects(0)
    with DiffCheckpointer(path, m, opt, snapshot_every=4, exact_bases=True):  # base 4
        _train(m, opt, range(1, 7))
    return path, {k: v.clone() for k, v in m.state_dict().items()}, opt.state_dict()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(
        torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def test_restore_is_bitwise_and_drops_gradients(tmp_path: Path) -> None:
    path, want, want_opt = _log(tmp_path)
    m, opt = _objects(1)
    _train(m, opt, range(100, 102))  # state and gradients to be replaced
    assert all(p.grad is not None for p in m.parameters())
    res = restore(path, m, opt)
    assert res.step == 6
    assert res.base_step == 4
    assert all(p.grad is None for p in m.parameters())
    for k, v in m.state_dict().items():
        assert _same(v, want[k]), k
    got = opt.state_dict()["state"]
    for i, st in want_opt["state"].items():
        for key, v in st.items():
            assert _same(got[i][key], v), (i, key)
    state, _ = replay_state(path)
    for k, v in want.items():
        assert _same(state[k], v), k


def _offset_of(base: Path, name: str) -> int:
    raw = base.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return 8 + n + json.loads(raw[8:8 + n])[name]["data_offsets"][0]


@pytest.mark.parametrize("victim", ["a.bias", "@opt/a.weight/exp_avg_sq"])
def test_corrupted_tensor_in_the_middle_of_the_base(tmp_path: Path, victim: str) -> None:
    path, _want, _ = _log(tmp_path)
    base = path / "base-0000000000000004.safetensors"
    with BaseFile(str(base)) as b:
        names = b.names
    assert victim in names
    assert names.index(victim) not in (0, len(names) - 1)
    off = _offset_of(base, victim)
    with open(base, "r+b") as f:
        f.seek(off + 5)
        byte = f.read(1)
        f.seek(off + 5)
        f.write(bytes([byte[0] ^ 0x01]))
    m, opt = _objects(1)
    _train(m, opt, range(100, 101))
    with pytest.raises(CorruptRecordError) as ei:
        restore(path, m, opt)
    assert ei.value.reason is Reason.CHECKSUM_MISMATCH
    assert ei.value.path == str(base)
    assert ei.value.offset == off
    assert repr(victim) in str(ei.value)
    assert all(p.grad is None for p in m.parameters())
    with pytest.raises(CorruptRecordError) as ei:
        replay_state(path)
    assert (ei.value.path, ei.value.offset) == (str(base), off)


def test_destination_that_cannot_be_read_into_gets_a_copy(tmp_path: Path) -> None:
    path, _want, _ = _log(tmp_path)
    with BaseFile(str(path / "base-0000000000000004.safetensors")) as b:
        want = torch.from_numpy(b.tensor("a.weight").copy())
        dst = torch.zeros(32, 48).t()  # (48, 32), not contiguous
        assert not dst.is_contiguous()
        load_tensor(b, "a.weight", dst)
        assert _same(dst.contiguous(), want)
        dst = torch.zeros(48, 32)
        load_tensor(b, "a.weight", dst)
        assert _same(dst, want)
        with pytest.raises(Exception) as ei:  # a tensor that does not fit: state_mismatch
            load_tensor(b, "a.weight", torch.zeros(48, 31))
        assert getattr(ei.value, "reason", None) is Reason.STATE_MISMATCH


@pytest.mark.parametrize("order", ["in_order", "caller_ahead"])
def test_prefault_never_writes_a_tensor_the_caller_filled(monkeypatch: pytest.MonkeyPatch,
                                                          order: str) -> None:
    from lowdiff_store.torch.replay import prefault

    monkeypatch.setattr(prefault, "MIN_BYTES", 0)  # a thread even for small tensors
    for _round in range(20):  # the thread and the caller race differently each time
        ts = [torch.full((50_000,), -1.0) for _ in range(12)]
        with prefault.Prefault(ts) as touch:
            idx = range(len(ts)) if order == "in_order" else [5, 11]
            for i in idx:
                touch.ready(i)
                ts[i].fill_(i + 1)
        for i, t in enumerate(ts):
            if order == "in_order" or i in (5, 11):
                assert bool((t == i + 1).all()), i
            else:
                assert bool(((t == 0) | (t == -1)).all()), i  # zeroed or untouched


def test_prefault_starts_no_thread_for_a_small_state() -> None:
    from lowdiff_store.torch.replay.prefault import Prefault

    ts = [torch.full((10,), 3.0)]
    with Prefault(ts) as touch:
        assert touch._thread is None
        touch.ready(0)
    assert bool((ts[0] == 3.0).all())  # not touched
