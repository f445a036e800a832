"""Module buffers of a model on a device are logged without reading them back on the
training thread (issue 33): the side channel used to copy every buffer to the host after
every step to compare it with the last logged value, a synchronization per buffer per step
(21 ms per step for the 4 MiB attention mask of the 0.94B benchmark LM on an H100).

A device buffer now goes out every step in the step's batch (one non-blocking copy) and is
compared with the last logged bits on the writer's encoder thread, which leaves it out of
the record when unchanged. (Its version counter would not do: batch norm's running
statistics change in place without moving it.) CI has no GPU: the device path is forced
for CPU buffers (``SideChannel.on_host``), and the tests check what reaches the log, that
restores are bitwise, and that the training thread makes no host copy of a buffer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lowdiff_store import ConfigError, LogReader
from lowdiff_store.torch import DiffCheckpointer, restore
from lowdiff_store.torch.capture import side_channel
from lowdiff_store.torch.capture.side_channel import SideChannel
from tests.helpers.tiny import Counting

STEPS = 10


class Net(nn.Module):
    """Batch norm (running statistics changed in place by every forward, without moving
    their version counters), ``nconst`` buffers never changed, one changed in place at
    some steps."""

    def __init__(self, nconst: int) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        for i in range(nconst):
            self.register_buffer(f"const{i}", torch.randn(64))
        self.register_buffer("bumped", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x))


def _build(nconst: int = 3) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = Net(nconst)
    return net, torch.optim.SGD(net.parameters(), lr=0.1)


def _step(net: Net, opt: torch.optim.Optimizer, step: int, data_write: bool = False
          ) -> dict[str, torch.Tensor]:
    """One step; the state it logs (after the optimizer step). Then, outside the step
    (logged with the next one): a buffer changed in place, and with ``data_write`` one
    written through ``.data`` (no version change)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=g)
    opt.zero_grad(set_to_none=True)
    net(x).square().mean().backward()
    opt.step()
    state = _state(net)
    with torch.no_grad():
        if step % 3 == 0:
            net.bumped.add_(1.0)  # in place: the version counter moves
    if data_write:
        net.const0.data.add_(1.0)
    return state


def _state(net: Net) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _count_host_copies(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names the side channel copies to the host with ``to_bits`` from now on."""
    copied: list[str] = []
    real = side_channel.to_bits

    def to_bits(t: torch.Tensor, what: str = "tensor") -> object:
        copied.append(what)
        return real(t, what)
    monkeypatch.setattr(side_channel, "to_bits", to_bits)
    return copied


@pytest.fixture
def device_path(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every buffer takes the device path; the names copied to the host by ``to_bits`` on
    the side channel's buffer path after the checkpointer is made are listed."""
    monkeypatch.setattr(SideChannel, "on_host", staticmethod(lambda t: False))
    return _count_host_copies(monkeypatch)


def _train(path: Path, net: Net, opt: torch.optim.Optimizer, copied: list[str],
           data_write: bool = False) -> dict[int, dict[str, torch.Tensor]]:
    states = {}
    with DiffCheckpointer(path, net, opt, snapshot_every=1000) as ck:
        copied.clear()  # (the checkpointer's start reads every buffer once)
        for step in range(1, STEPS + 1):
            states[step] = _step(net, opt, step, data_write)
        ck.flush()
    return states


def test_device_buffers_are_logged_when_they_change(tmp_path: Path,
                                                    device_path: list[str]) -> None:
    net, opt = _build()
    _train(tmp_path / "log", net, opt, device_path)
    assert device_path == []  # no buffer was copied to the host on the buffer path
    with LogReader(tmp_path / "log") as r:
        for step in range(1, STEPS + 1):
            names = {n for n in r.record(step).names if n.startswith(("bn.", "const",
                                                                      "bumped"))}
            want = {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
            # a buffer changed after step s's optimizer step is logged with step s + 1
            if (step - 1) % 3 == 0 and step > 1:
                want.add("bumped")
            assert names == want, step


@pytest.mark.parametrize("data_write", [False, True], ids=["in-place", "through-data"])
def test_restores_of_device_buffers_are_bitwise(tmp_path: Path, device_path: list[str],
                                               data_write: bool) -> None:
    """Every step restores to the logged state, buffers included; a buffer written
    through ``.data`` (no version change) is logged too: the encoder compares bits."""
    net, opt = _build()
    states = _train(tmp_path / "log", net, opt, device_path, data_write)
    assert device_path == []
    for step in range(1, STEPS + 1):
        fresh, fopt = _build()
        res = restore(tmp_path / "log", fresh, fopt, step=step)
        assert res.step == step
        got = _state(fresh)
        assert got.keys() == states[step].keys()
        for k, v in states[step].items():
            assert torch.equal(got[k], v), (step, k)
    with LogReader(tmp_path / "log") as r:
        logged = ["const0" in r.record(s).names for s in range(1, STEPS + 1)]
    assert logged == [False] + [data_write] * (STEPS - 1)


def test_the_host_path_compares_bits_every_step(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU buffers keep the exact bit comparison (a write through ``.data`` is seen), so
    the counter above can fail: here every buffer is copied every step."""
    copied = _count_host_copies(monkeypatch)
    net, opt = _build(nconst=3)
    with DiffCheckpointer(tmp_path / "log", net, opt, snapshot_every=1000) as ck:
        copied.clear()
        for step in range(1, 4):
            _step(net, opt, step, data_write=True)
        ck.flush()
    per_step = len(list(net.buffers()))
    assert copied.count("const1") == 3
    assert len(copied) == 3 * per_step
    with LogReader(tmp_path / "log") as r:
        assert all("const0" in r.record(s).names for s in (2, 3))


@pytest.mark.parametrize("path_kind", ["host", "device", "delta"])
def test_a_buffer_replaced_by_assignment_is_followed(tmp_path: Path, path_kind: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Records and bases log the buffer the model holds now, not the one it dropped:
    before, the checkpointer kept the tensor it found at creation, and every restore gave
    the buffer's value at that moment (a silent wrong answer)."""
    if path_kind == "device":
        monkeypatch.setattr(SideChannel, "on_host", staticmethod(lambda t: False))
    torch.manual_seed(0)
    net = Counting()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    states = {}
    mode = "delta" if path_kind == "delta" else "grad"
    with DiffCheckpointer(tmp_path / "log", net, opt, mode=mode, snapshot_every=4) as ck:
        for step in range(1, STEPS + 1):
            opt.zero_grad(set_to_none=True)
            net(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))) \
                .square().mean().backward()
            opt.step()
            states[step] = _state(net)
        ck.flush()
    assert states[STEPS]["count"].item() == STEPS
    for step in (1, 3, 4, 5, STEPS):
        torch.manual_seed(1)
        fresh = Counting()
        fopt = torch.optim.SGD(fresh.parameters(), lr=0.1)
        res = restore(tmp_path / "log", fresh, fopt, step=step)
        assert res.step == step
        got = _state(fresh)
        for k, v in states[step].items():
            assert torch.equal(got[k], v), (path_kind, step, k)


def test_a_buffer_replaced_by_another_shape_is_refused_in_one_line(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = Counting()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with DiffCheckpointer(tmp_path / "log", net, opt) as ck:
        net(torch.randn(4, 8)).sum().backward()
        opt.step()
        net.ema = torch.zeros(3)
        opt.zero_grad()
        net.lin(torch.randn(4, 8)).sum().backward()
        with pytest.raises(ConfigError) as e:
            opt.step()
        ck.close()
    msg = str(e.value)
    assert "\n" not in msg
    assert "buffer 'ema'" in msg
    assert "(8,)" in msg
    assert "(3,)" in msg


class Flipping(nn.Module):
    """Batch norm and a buffer the training loop sets to 0 or 1 after each step (changed,
    then changed back to the value logged before the last one)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.register_buffer("flip", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x))


def _flipping() -> tuple[Flipping, torch.optim.Optimizer, torch.amp.GradScaler]:
    torch.manual_seed(0)
    net = Flipping()
    return (net, torch.optim.SGD(net.parameters(), lr=0.1),
            torch.amp.GradScaler("cpu", init_scale=2.0 ** 4))


def _flip_step(net: Flipping, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
               seed: int) -> dict[str, torch.Tensor]:
    """One step (every fourth an inf loss: the scaler skips ``optimizer.step()``, batch
    norm's statistics moved in the forward all the same); the state it logs; then the
    flip."""
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(seed))
    opt.zero_grad(set_to_none=True)
    loss = net(x).square().mean()
    if seed % 4 == 3:
        loss = loss * float("inf")
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    state = _state(net)
    with torch.no_grad():
        net.flip.fill_(float(seed // 2 % 2))
    return state


def _restores_exactly(path: Path, states: dict[int, dict[str, torch.Tensor]]) -> None:
    for step, want in states.items():
        net, opt, scaler = _flipping()
        assert restore(path, net, opt, scaler=scaler, step=step).step == step
        got = _state(net)
        for k, v in want.items():
            assert torch.equal(got[k], v), (step, k)


def test_device_buffers_through_skips_flushes_and_a_truncate(tmp_path: Path,
                                                             device_path: list[str]) -> None:
    """The encoder thread's "last logged" bits stay those of the records written, in
    order: skipped scaler steps (their records carry the buffers batch norm moved), a
    buffer changed and changed back, a flush mid-run, bases every 3 steps; then a
    restore of step 4, ``resume="truncate"`` and new steps (the first record states every
    buffer again). Every step restores bitwise, before and after the truncate."""
    path = tmp_path / "log"
    net, opt, scaler = _flipping()
    states = {}
    with DiffCheckpointer(path, net, opt, scaler=scaler, snapshot_every=3) as ck:
        device_path.clear()  # (the checkpointer's start reads every buffer once)
        for step in range(1, 9):
            states[step] = _flip_step(net, opt, scaler, step)
            if step == 5:
                ck.flush()
        ck.flush()
        assert ck.stats()["skipped"] == 2
        assert device_path == []  # no buffer was read back on the training thread
    with LogReader(path) as r:  # 0 -> 1 after step 2, back to 0 after 4, 1 after 6
        assert [s for s in range(1, 9) if "flip" in r.record(s).names] == [3, 5, 7]
    _restores_exactly(path, states)
    net, opt, scaler = _flipping()
    restore(path, net, opt, scaler=scaler, step=4)
    after = {4: _state(net)}
    with DiffCheckpointer(path, net, opt, scaler=scaler, snapshot_every=3,
                          resume="truncate") as ck:
        for step in range(5, 10):
            after[step] = _flip_step(net, opt, scaler, 100 + step)
        ck.flush()
    with LogReader(path) as r:
        assert "flip" in r.record(5).names  # (stated again after the restore)
    _restores_exactly(path, after)
