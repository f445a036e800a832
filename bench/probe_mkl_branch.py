"""What running MKL's compatible branch costs (docs/torch.md, "Exactness across machines").

``MKL_CBWR=COMPATIBLE`` (or ``pin_numerics(path)`` for a log trained under that branch)
moves torch's CPU ``sqrt`` and MKL's matrix products to its compatible code path. It does
not make logs portable across CPU vendors (issue 48: MKL's generic branch gives other bits
on AMD than on Intel; ``fused=True`` does, by reaching no MKL op); this measures what the
pin costs where a restore needs it. It times, in one process per mode and alternating modes
``--rounds`` times, on one torch thread: a 512x512 fp32 matmul, ``sqrt`` of 4M floats and one
AdamW step over 4M parameters; medians per mode and their ratio (compatible / native).

    python bench/probe_mkl_branch.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, time, torch
torch.set_num_threads(1)
from lowdiff_store.torch.core.numerics import mkl_vml_branch
g = torch.Generator().manual_seed(0)
a, b = torch.randn(512, 512, generator=g), torch.randn(512, 512, generator=g)
x = torch.rand(1 << 22, generator=g)
p = torch.nn.Parameter(torch.randn(1 << 22, generator=g))
p.grad = torch.randn(1 << 22, generator=g) * 1e-3
opt = torch.optim.AdamW([p], lr=1e-3)
def med(f, n):
    f()
    ts = []
    for _ in range(n):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2]
print(json.dumps({"branch": mkl_vml_branch(), "matmul": med(lambda: a @ b, 40),
                  "sqrt": med(lambda: x.sqrt(), 20), "adamw": med(opt.step, 10)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    base["PYTHONPATH"] = root + os.pathsep + base.get("PYTHONPATH", "")
    runs: dict[str, list[dict[str, float]]] = {"native": [], "compatible": []}
    for _ in range(args.rounds):
        for mode in runs:
            env = dict(base, **({"MKL_CBWR": "COMPATIBLE"} if mode == "compatible" else {}))
            out = subprocess.run([sys.executable, "-c", CHILD], env=env, check=True,
                                 capture_output=True, text=True).stdout
            runs[mode].append(json.loads(out.strip().splitlines()[-1]))
    print(f"MKL branch: native {runs['native'][0]['branch']}, "
          f"compatible {runs['compatible'][0]['branch']}")
    print("op       native ms  compatible ms  ratio")
    for op in ("matmul", "sqrt", "adamw"):
        n = statistics.median(r[op] for r in runs["native"]) * 1e3
        c = statistics.median(r[op] for r in runs["compatible"]) * 1e3
        print(f"{op:<8} {n:9.2f}  {c:13.2f}  {c / n:5.2f}")


if __name__ == "__main__":
    main()
