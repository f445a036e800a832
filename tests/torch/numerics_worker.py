"""One process of the numerics tests (``test_numerics.py``): it writes, continues or
restores a small AdamW log on CPU under the numerics its environment gives it
(``ATEN_CPU_CAPABILITY``, ``MKL_CBWR``), and prints one JSON line: the process's numerics
and what happened.

    numerics_worker.py write LOG STEPS [--fused]
    numerics_worker.py continue LOG STEPS [--fused]   (restore, then train on to STEPS)
    numerics_worker.py restore LOG [--fused] [--mkl-first] [--no-verify] [--pin]
    numerics_worker.py bits                           (tests/helpers/cpu_bits.py's row)
    numerics_worker.py --serve                        (a fork server of the above)

AdamW runs its single-tensor step (it reaches MKL's ``sqrt``), or its fused one with
``--fused`` (no MKL op). ``--mkl-first`` runs a matrix product before restoring (MKL
initialized: its branch can no longer be pinned); ``--pin`` calls ``pin_numerics(LOG)``
first. Each batch is a pure function of the step, so every process trains the same steps.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))))

from lowdiff_store.errors import LowdiffError
from lowdiff_store.torch import DiffCheckpointer, pin_numerics, restore
from lowdiff_store.torch.core.numerics import current


def build(fused: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1,
                                    fused=fused or None)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, first: int, last: int) -> None:
    """Steps ``first..last``: the gradient of step t is a pure function of t and the weights
    (no matrix product, so the gradients do not depend on MKL's branch: the optimizer's
    own bits are what the tests are about)."""
    for t in range(first, last + 1):
        g = torch.Generator().manual_seed(t)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g) * 1e-2 + p.detach() * 1e-3
        opt.step()


def state_sha(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for t in [*model.parameters(), *(v for s in opt.state.values() for v in s.values()
                                     if torch.is_tensor(v))]:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str]) -> dict[str, object]:
    torch.set_num_threads(1)
    cmd, path = argv[0], argv[1]
    out: dict[str, object] = {}
    if "--mkl-first" in argv:
        (torch.ones(4, 4) @ torch.ones(4, 4)).sum()
    if "--pin" in argv:
        try:
            out["pinned"] = pin_numerics(path)
        except LowdiffError as e:
            out["pin_error"] = str(e.reason)
    model, opt = build("--fused" in argv)
    if cmd == "write":
        ckpt = DiffCheckpointer(path, model, opt, snapshot_every=1000, batch=1, digest_every=1)
        train(model, opt, 1, int(argv[2]))
        ckpt.close()
    else:
        try:
            res = restore(path, model, opt, verify="--no-verify" not in argv)
        except LowdiffError as e:
            out.update(error=str(e.reason), message=str(e))
            res = None
        if res is not None:
            out.update(step=res.step, exact=res.exact, notes=res.notes,
                       verified=res.verified)
            if cmd == "continue":
                ckpt = DiffCheckpointer(path, model, opt, snapshot_every=1000, batch=1,
                                        digest_every=1)
                train(model, opt, res.step + 1, int(argv[2]))
                ckpt.close()
    out["sha"] = state_sha(model, opt)
    n = current("cpu")
    out["here"] = {"aten_cpu": n.aten_cpu, "mkl_vml": n.mkl_vml, "vendor": n.vendor}
    return out


def one(argv: list[str]) -> None:
    """One command line: its JSON line on stdout (``bits``: this process's row of
    ``tests/helpers/cpu_bits.py``)."""
    if argv == ["bits"]:
        from tests.helpers.cpu_bits import row

        print(json.dumps(row()))
    else:
        print(json.dumps(main(argv)))


def serve() -> None:
    """A fork server (``tests/helpers/fork_server.py``) of this environment's runs: the
    imports made once (torch._dynamo too: an optimizer's first ``add_param_group`` imports
    it), nothing run that reaches a kernel or MKL (each run still picks its capability and
    MKL branch as a fresh process would, from the environment the server started with)."""
    import gc

    import torch._dynamo  # noqa: F401

    import tests.helpers.cpu_bits  # noqa: F401
    from tests.helpers.fork_server import serve as fork_serve

    gc.freeze()
    fork_serve(one)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        one(sys.argv[1:])
