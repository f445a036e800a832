"""One process of ``test_mkl_paths.py``: every optimizer of the replay's allow-list, in each
implementation its class has (single-tensor, foreach, fused) and in float32 and bfloat16,
stepped 7 times on fixed inputs; prints one JSON line: per path the hash of the result
and whether a step dispatched an op whose CPU float32/float64 kernel is MKL's (its
environment's ``MKL_CBWR`` picks MKL's branch), and the process's MKL branch."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import sys
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))))

from lowdiff_store.torch.core.numerics import mkl_vml_branch
from lowdiff_store.torch.core.schema import ALLOWED_OPTIMIZERS

#: ATen ops whose CPU float32/float64 kernels are MKL's vector math (measured: their bits
#: follow MKL_CBWR; rsqrt, reciprocal, sigmoid, log1p, expm1, sin do not)
MKL_OPS = frozenset({"sqrt", "exp", "log", "tanh", "erf", "mm", "bmm", "matmul", "addmm"})
_MKL_DTYPES = (torch.float32, torch.float64)


def _float_cpu(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return x.device.type == "cpu" and x.dtype in _MKL_DTYPES
    return isinstance(x, (list, tuple)) and any(_float_cpu(y) for y in x)


class MklOps(TorchDispatchMode):
    """Records the MKL-backed ops dispatched on float32/float64 CPU tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        name = func.overloadpacket.__name__.removeprefix("_foreach_").rstrip("_")
        if name in MKL_OPS and any(_float_cpu(a) for a in args):
            self.seen.add(name)
        return func(*args, **(kwargs or {}))


def paths() -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for name in ALLOWED_OPTIMIZERS:
        cls = getattr(torch.optim, name)
        sig = inspect.signature(cls.__init__).parameters
        impls = [("single", {"foreach": False})]
        if "foreach" in sig:
            impls.append(("foreach", {"foreach": True}))
        if "fused" in sig:
            impls.append(("fused", {"fused": True}))
        for dtype in (torch.float32, torch.bfloat16):
            for impl, kw in impls:
                g = torch.Generator().manual_seed(0)
                ps = [torch.nn.Parameter(torch.randn(n, generator=g).to(dtype))
                      for n in (257, 1031)]
                extra = {"momentum": 0.9} if name in ("SGD", "RMSprop") else {}
                try:
                    opt = cls(ps, lr=0.01, **kw, **extra)
                except (RuntimeError, ValueError):  # e.g. no fused kernel for this dtype
                    continue
                rec = MklOps()
                with rec:
                    for _ in range(7):
                        for p in ps:
                            p.grad = (torch.randn(p.shape, generator=g) * 1e-2).to(dtype)
                        opt.step()
                h = hashlib.sha256()
                for p in ps:
                    h.update(p.detach().float().numpy().tobytes())
                out[f"{name}/{impl}/{str(dtype).removeprefix('torch.')}"] = [
                    h.hexdigest()[:16], sorted(rec.seen), cls.__module__ + "." + name]
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps({"paths": paths(), "mkl_vml": mkl_vml_branch()}))
