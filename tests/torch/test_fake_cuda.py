"""The compressors' device work crosses no host-device boundary (issue 33, item 1), checked
on fake CUDA tensors without a GPU (``tests/helpers/fake_cuda.py``).

On a real GPU, one host crossing per tensor is one synchronization per tensor on the
training thread: a 0.94B model's top-1% step did 368 of them (``t[idx] = 0`` copies the
scalar 0 to the device and waits, bench/RESULTS.md, "GPU"). Each compressor compresses
the gradients of a few parameters on fake CUDA tensors; every ATen call is recorded, and
none may copy between host and device, read a device value or take a host array.
"""

from __future__ import annotations

import pytest
import torch

from lowdiff_store.torch import (
    DeMoCompressor,
    QSGDCompressor,
    TernGradCompressor,
    TopKCompressor,
)
from lowdiff_store.torch.compressors import demo
from lowdiff_store.torch.compressors.topk import GradCompressor
from tests.helpers.fake_cuda import fake_cuda

SHAPES = [(64, 32), (32,), (16, 8, 3), (4096,)]


def _compress_on_fake_cuda(comp: GradCompressor, dtype: torch.dtype = torch.float32,
                           steps: int = 2) -> tuple[list[str], int, int]:
    """Crossings, ATen calls and messages of ``steps`` compress() calls (the first warms:
    caches made once per layout and device are allowed there)."""
    calls = -1
    with fake_cuda() as b:
        params = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=dtype))
                  for s in SHAPES]
        opt = torch.optim.SGD(params, lr=0.1)
        comp.attach(opt)
        for step in range(steps):
            for p in params:
                p.grad = torch.randn_like(p)
            if step == steps - 1:
                b.crossings.clear()
                b.calls = 0
            comp.compress(opt)
        calls = b.calls
    return b.crossings, calls, len(comp.last)


@pytest.fixture(autouse=True)
def _device_free_generators(monkeypatch: pytest.MonkeyPatch) -> None:
    # a CUDA generator needs a CUDA build; fake tensors draw without one
    monkeypatch.setattr(GradCompressor, "generator",
                        staticmethod(lambda optimizer, seed, device="cpu": None))
    # DeMo caches its DCT matrices per size and device: fake ones must not outlive the
    # test (a later real DeMo step in this process would read them)
    monkeypatch.setattr(demo, "_DCT", {})


@pytest.mark.parametrize("make", [
    lambda: TopKCompressor(ratio=0.05),
    lambda: TopKCompressor(ratio=0.05, error_feedback=False),
    lambda: TernGradCompressor(min_numel=1),
    lambda: QSGDCompressor(min_numel=1),
    lambda: DeMoCompressor(),
], ids=["topk", "topk-no-ef", "terngrad", "qsgd", "demo"])
def test_compress_crosses_no_boundary(make: object) -> None:
    comp = make()  # type: ignore[operator]
    crossings, calls, messages = _compress_on_fake_cuda(comp)
    assert crossings == []
    assert calls > 0
    assert messages == len(SHAPES)


def test_topk_bf16_crosses_no_boundary() -> None:
    crossings, _calls, messages = _compress_on_fake_cuda(TopKCompressor(ratio=0.05),
                                                         torch.bfloat16)
    assert messages == len(SHAPES)
    assert crossings == []


def test_the_guard_sees_a_scalar_written_through_an_index() -> None:
    """What the top-k compressor did before: ``flat[idx] = 0`` (one sync per tensor)."""
    with fake_cuda() as b:
        x = torch.randn(1000, device="cuda")
        idx = torch.topk(x.abs(), 10, sorted=False).indices
        x[idx] = 0
    assert len(b.crossings) == 1
    assert "host value copied to the device" in b.crossings[0]
    with fake_cuda() as b:
        x = torch.randn(1000, device="cuda")
        idx = torch.topk(x.abs(), 10, sorted=False).indices
        x.index_fill_(0, idx, 0)
        y = x.cpu()
    assert b.crossings == ["aten._to_copy.default cuda -> cpu"]
    assert y.device.type == "cpu"
