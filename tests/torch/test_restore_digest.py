"""Restore at disk speed (issue 34, item 4): the base's CRCs are checked on a thread of their
own beside the reads, and the digest check copies device tensors through two reused
windows, never one ``.cpu()`` per tensor (on CPU the device path is forced to guard it)."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch

from lowdiff_store.errors import CorruptRecordError
from lowdiff_store.format.constants import BASE_NAME
from lowdiff_store.log.base import BaseFile
from lowdiff_store.torch import DiffCheckpointer, restore
from lowdiff_store.torch.core import schema as L
from lowdiff_store.torch.core import state_digest
from lowdiff_store.torch.core.tensors import bytes_of
from lowdiff_store.torch.core.typed_msgpack import pack

pytestmark = pytest.mark.consistent_bases  # consistent bases' steps and files (tests/conftest.py)


def objects(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(24, 24) for _ in range(6)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def trained(path: Any, steps: int = 5) -> dict[str, bytes]:
    model, opt = objects()
    with DiffCheckpointer(path, model, opt, snapshot_every=3, digest_every=1,
                          exact_bases=True):  # the base of step 3, on a busy machine too
        for t in range(1, steps + 1):
            opt.zero_grad()
            model(torch.full((2, 24), 0.1 * t)).pow(2).mean().backward()
            opt.step()
    return {n: p.detach().numpy().tobytes() for n, p in model.named_parameters()}


def old_digest(params: list[torch.Tensor], opt: torch.optim.Optimizer) -> int:
    """The digest as the log format defines it, one buffer per tensor."""
    def items() -> Any:
        for p in params:
            st = opt.state.get(p, {})
            yield bytes_of(p), [(str(k), bytes_of(v) if isinstance(v, torch.Tensor)
                                 else pack(v)) for k, v in st.items()]
    return L.digest_parts(items())


@pytest.mark.parametrize("window", [64, 1000, 1 << 20])
def test_windowed_digest_is_the_digest(window: int, monkeypatch: Any) -> None:
    model, opt = objects()
    model(torch.ones(3, 24)).sum().backward()
    opt.step()
    params = list(model.parameters())
    monkeypatch.setattr(state_digest, "WINDOW", window)
    monkeypatch.setattr(state_digest._Windows, "_local", threading.local())
    want = old_digest(params, opt)
    assert state_digest.digest_state(params, opt) == want
    assert state_digest.digest_state(params, opt, staged=lambda t: True) == want
    with torch.no_grad():
        params[2].view(-1)[5] += 1.0
    assert state_digest.digest_state(params, opt, staged=lambda t: True) != want


def test_the_digest_check_makes_no_per_tensor_host_copies(tmp_path: Any,
                                                          monkeypatch: Any) -> None:
    path = tmp_path / "log"
    want = trained(path)
    cpu_calls = []
    copies = []
    orig_cpu, orig_copy = torch.Tensor.cpu, torch.Tensor.copy_

    def counted_cpu(self: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
        cpu_calls.append(tuple(self.shape))
        return orig_cpu(self, *a, **k)

    def counted_copy(self: torch.Tensor, src: torch.Tensor, *a: Any, **k: Any) -> Any:
        if threading.current_thread() is threading.main_thread() and staging[0]:
            copies.append(src.numel())
        return orig_copy(self, src, *a, **k)

    staging = [False]

    def staged(t: torch.Tensor) -> bool:  # every tensor takes the device path
        staging[0] = True
        return True

    monkeypatch.setattr(state_digest, "on_device", staged)
    monkeypatch.setattr(torch.Tensor, "cpu", counted_cpu)
    monkeypatch.setattr(torch.Tensor, "copy_", counted_copy)
    model, opt = objects(1)
    res = restore(path, model, opt)
    assert res.exact
    assert res.verified == [5]  # the digest of the last step was checked, and matched
    assert cpu_calls == []
    assert copies  # the tensors went through the windows (one copy into the window each)
    assert {n: p.detach().numpy().tobytes() for n, p in model.named_parameters()} == want


def test_base_crcs_are_checked_beside_the_reads(tmp_path: Any, monkeypatch: Any) -> None:
    path = tmp_path / "log"
    trained(path, steps=3)
    threads = []
    orig = BaseFile._check

    def check(self: BaseFile, name: str, mv: memoryview, offset: int) -> None:
        threads.append(threading.current_thread().name)
        orig(self, name, mv, offset)

    monkeypatch.setattr(BaseFile, "_check", check)
    model, opt = objects(1)
    res = restore(path, model, opt, step=3)
    assert res.base_step == 3
    assert threads
    assert all(t.startswith("lowdiff-crc") for t in threads)


def test_a_corrupt_base_tensor_is_named_with_its_offset(tmp_path: Any) -> None:
    path = tmp_path / "log"
    trained(path, steps=3)
    name = os.path.join(path, BASE_NAME.format(3))
    b = BaseFile(name)
    tensor = "5.weight"  # read straight into the model, its CRC on the CRC thread
    assert tensor in b.names
    off = b.data_start + b._entries[tensor][2]
    b.close()
    with open(name, "r+b") as f:
        f.seek(off)
        byte = f.read(1)
        f.seek(off)
        f.write(bytes([byte[0] ^ 0xFF]))
    model, opt = objects(1)
    with pytest.raises(CorruptRecordError) as e:
        restore(path, model, opt, step=3)
    assert e.value.path == name
    assert e.value.offset == off
    assert tensor in str(e.value)
