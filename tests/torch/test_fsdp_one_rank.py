"""FSDP2 on a one-rank mesh (``fully_shard`` with world size 1, as torchtitan applies it even
to a single rank): the parameters and Adam's moments are DTensors, the log is a single
(unsharded) log of their local tensors, and ``restore`` puts gradients and optimizer state
back as DTensors, so the fused AdamW step replays. Restored bitwise, training continues
bitwise. In a subprocess (one gloo process group of one rank)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.helpers.dist import NEEDS_GLOO, free_port

pytestmark = NEEDS_GLOO

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import os, sys
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from lowdiff_store.torch import DiffCheckpointer, restore
    from tests.helpers.tiny import bits_differ

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1,
                            init_method="tcp://127.0.0.1:" + sys.argv[2])
    path = sys.argv[1]

    def job():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        fully_shard(m)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)

    def train(m, opt, steps, start=0):
        for s in range(start, start + steps):
            g = torch.Generator().manual_seed(s)
            x = torch.randn(5, 8, generator=g)
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()

    def state(m, opt):
        # copies: on one rank full_tensor() may be the parameter's own memory
        out = {k: v.full_tensor().clone() for k, v in m.state_dict().items()}
        for i, st in enumerate(opt.state.values()):
            for k, v in st.items():
                out[f"opt{i}.{k}"] = (v.full_tensor() if hasattr(v, "full_tensor")
                                      else v).clone()
        return out

    m, opt = job()
    assert type(next(m.parameters())).__name__ == "DTensor"
    with DiffCheckpointer(path, m, opt, snapshot_every=3):
        train(m, opt, 5)
    at5 = state(m, opt)
    train(m, opt, 3, start=5)
    ref = state(m, opt)

    m2, opt2 = job()
    res = restore(path, m2, opt2)
    assert res.step == 5, res.step
    assert not bits_differ(at5, state(m2, opt2)), bits_differ(at5, state(m2, opt2))
    assert all(type(v).__name__ == "DTensor" for st in opt2.state.values()
               for k, v in st.items() if k != "step")
    with DiffCheckpointer(path, m2, opt2, snapshot_every=3):
        train(m2, opt2, 3, start=5)
    assert not bits_differ(ref, state(m2, opt2))
    dist.destroy_process_group()
    print("OK")
""")


def test_one_rank_fsdp2_restores_and_continues_bitwise(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "ck"),
                          str(free_port())], env=env, capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.split()[-1] == "OK", out.stdout
