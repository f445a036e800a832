"""The TernGrad and QSGD DDP communication hooks with 2 gloo processes on CPU: training
through the wrapped hook, stopped at 12, restored in fresh processes (each rank's stream
positions come back with the hook state) and continued to 20, bitwise equal to the
uninterrupted run (scenario() of test_distributed.py checks every claim); plus the hook's
result against a direct computation in one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_distributed import scenario

from lowdiff_store.torch.compressors.quantized import qsgd_message, terngrad_message
from lowdiff_store.torch.compressors.topk import decode_message

pytestmark = pytest.mark.skipif(not torch.distributed.is_available()
                                or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is needed")


# qsgd runs the same all-gather path as terngrad (its message is checked in one process
# below): slow only, to keep CI short
@pytest.mark.parametrize("hook", ["terngrad", pytest.param("qsgd", marks=pytest.mark.slow)])
def test_quantized_hook_stop_restore_continue(hook: str, tmp_path: Path) -> None:
    res = scenario(tmp_path, "--hook", hook, "--end", "crash", "--every", "5",
                   "--flush-at", "12")
    assert res[0]["step"] == 12


class _Bucket:
    """What the hooks read of a DDP GradBucket."""

    def __init__(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        self.buf = torch.cat([g.reshape(-1) for g in grads])
        self.params = params
        offs = [0]
        for g in grads:
            offs.append(offs[-1] + g.numel())
        self.grads = [self.buf[a:b].view(g.shape) for a, b, g in
                      zip(offs, offs[1:], grads, strict=False)]

    def buffer(self) -> torch.Tensor:
        return self.buf

    def parameters(self) -> list[torch.Tensor]:
        return self.params

    def gradients(self) -> list[torch.Tensor]:
        return self.grads


@pytest.mark.parametrize("hook", ["terngrad", "qsgd"])
def test_single_rank_hook_is_the_decoded_message(hook: str, tmp_path: Path) -> None:
    import torch.distributed as dist

    from lowdiff_store.torch import QSGDState, TernGradState, qsgd_hook, terngrad_hook

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0,
                            world_size=1)
    try:
        g = torch.Generator().manual_seed(5)
        params = [torch.zeros(40, 50), torch.zeros(10)]
        grads = [torch.randn(40, 50, generator=g), torch.randn(10, generator=g)]
        state: Any = TernGradState(min_numel=100, seed=2) if hook == "terngrad" else \
            QSGDState(min_numel=100, seed=2, levels=3, bucket=64)
        fn: Any = terngrad_hook if hook == "terngrad" else qsgd_hook
        b = _Bucket(params, grads)
        out = fn(state, b).wait()
        gen = torch.Generator().manual_seed(((2 * 1_000_003 + 0) * 1_000_003 + 0) % 2 ** 63)
        msg = terngrad_message(grads[0].reshape(-1), gen, 2.5) if hook == "terngrad" else \
            qsgd_message(grads[0].reshape(-1), gen, 3, 64)
        want = decode_message(msg, (2000,))
        assert torch.equal(out[:2000], want)
        assert torch.equal(out[2000:], grads[1])   # small: sent in fp32
        assert state.steps[params[0]] == 1
        assert params[1] not in state.steps
    finally:
        dist.destroy_process_group()
