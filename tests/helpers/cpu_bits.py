"""The bits of AdamW's CPU ops on fixed inputs, as ``shared/tools/cpu_bits.py`` measures
them (the same inputs and hashes), and the table measured with it on both CPU vendors.

``python tests/helpers/cpu_bits.py`` prints this process's row as JSON (its MKL branch and
ATen capability are what its environment gives it: ``MKL_CBWR``, ``ATEN_CPU_CAPABILITY``).
:data:`MEASURED` is what real machines gave (torch 2.13.0+cpu): the numerics tests check
this machine against its vendor's rows, and the numerics rule against every pair of rows.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

#: (vendor, MKL VML branch, capability class) -> the hashes measured there. Capability
#: class "vector" is AVX2 and AVX512 (the same bits for every op here), "DEFAULT" the
#: scalar kernels. None: not measured. Intel Xeon VM (AVX-512), measured again on the
#: development VM of 2026-11-28; AMD EPYC VM (AVX-512) of 2026-11-27, where MKL accepts
#: only AUTO and COMPATIBLE and both run its generic branch.
MEASURED: dict[tuple[str, int, str], dict[str, str | None]] = {
    ("Intel", 5, "vector"): {"sqrt": "4c906518bad2", "adamw_single": "8f783ef1c764",
                             "adamw_fused": "0dab75d7bd18"},
    ("Intel", 5, "DEFAULT"): {"sqrt": "4c906518bad2", "adamw_single": "306556c71b4b",
                              "adamw_fused": "48653081c950"},
    ("Intel", 0, "vector"): {"sqrt": "7019bfb13f5c", "adamw_single": "354b9b7b351a",
                             "adamw_fused": "0dab75d7bd18"},
    ("Intel", 0, "DEFAULT"): {"sqrt": "7019bfb13f5c", "adamw_single": "67cc34b5eff0",
                              "adamw_fused": "48653081c950"},
    ("Intel", 3, "vector"): {"sqrt": "ce013531d470", "adamw_single": "0dab75d7bd18",
                             "adamw_fused": "0dab75d7bd18"},
    ("Intel", 3, "DEFAULT"): {"sqrt": "ce013531d470", "adamw_single": "48653081c950",
                              "adamw_fused": "48653081c950"},
    ("AMD", 0, "vector"): {"sqrt": "7d9f39fb0a36", "adamw_single": "04e6e28e7c02",
                           "adamw_fused": None},
    ("AMD", 0, "DEFAULT"): {"sqrt": "7d9f39fb0a36", "adamw_single": "0938feb75b02",
                            "adamw_fused": None},
}


def capability_class(cap: str) -> str:
    """``"vector"`` for AVX2/AVX512, else the capability itself."""
    return "vector" if cap in ("AVX2", "AVX512") else cap


def row() -> dict[str, Any]:
    """This process's hashes (``shared/tools/cpu_bits.py``'s ``one()``, the same inputs)."""
    import torch

    from lowdiff_store.torch.core.numerics import cpu_vendor, mkl_vml_branch

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    n = 100003
    p = torch.randn(n, generator=g)
    gr = torch.randn(n, generator=g) * 1e-3
    torch.randn(n, generator=g)  # m: drawn as cpu_bits.py draws it
    v = torch.rand(n, generator=g) * 1e-6

    def h(t: torch.Tensor) -> str:
        return hashlib.sha256(t.detach().numpy().tobytes()).hexdigest()[:12]

    out: dict[str, Any] = {"sqrt": h(v.sqrt())}
    for name, kw in (("single", {"foreach": False}), ("foreach", {"foreach": True}),
                     ("fused", {"fused": True})):
        x = torch.nn.Parameter(p.clone())
        x.grad = gr.clone()
        opt = torch.optim.AdamW([x], lr=0.01, weight_decay=0.1, **kw)
        for _ in range(3):
            opt.step()
        out[f"adamw_{name}"] = h(x)
    out.update(vendor=cpu_vendor(), mkl_vml=mkl_vml_branch(),
               capability=torch.backends.cpu.get_cpu_capability())
    return out


if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])
    print(json.dumps(row()))
