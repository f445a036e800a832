#!/usr/bin/env python3
"""What each golden log gives under every MKL branch and ATen capability this CPU takes.

    .venv/bin/python tools/golden_matrix.py            # the table (one process per cell)

For each ``MKL_CBWR`` in AUTO, COMPATIBLE, AVX2 and each ``ATEN_CPU_CAPABILITY`` in
default, avx2, avx512 (where this CPU has it), a fresh process restores the newest step of
every golden case on disk (``tests/golden``) into fresh objects and compares it with the
golden state: ``bitwise``, or the error's reason (``numerics_mismatch``: refused before the
replay; ``replay_diverged``: a log of an earlier version, which records no numerics).
Issue 48's bar: every cell is ``bitwise`` or a documented refusal (docs/torch.md,
"Exactness across machines"), never another state.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BRANCHES = ("AUTO", "COMPATIBLE", "AVX2")
CAPS = ("default", "avx2", "avx512")


def one() -> dict[str, str]:
    sys.path.insert(0, ROOT)
    import torch

    from lowdiff_store.errors import LowdiffError
    from lowdiff_store.torch import restore
    from lowdiff_store.torch.core.numerics import current
    from tests.golden import recipes as R

    torch.set_num_threads(1)
    golden = os.path.join(ROOT, "tests", "golden")
    with open(os.path.join(golden, "expected.json")) as f:
        cases = json.load(f)["cases"]
    out: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in sorted(cases):
            exp = cases[name]
            if exp["kind"] == "s3":
                continue
            path = os.path.join(tmp, name)
            shutil.copytree(os.path.join(golden, "logs", name), path)
            o = R.build(exp["recipe"], layout="plain")
            try:
                res = restore(path, o.model, o.optimizer, scheduler=o.scheduler,
                              scaler=o.scaler, compressor=o.compressor)
            except LowdiffError as e:
                out[name] = str(e.reason)
                continue
            ok = R.digest(R.live_entries(o)) == exp["steps"][str(res.step)]["sha256"]
            out[name] = "bitwise" if ok else "OTHER STATE"
    n = current("cpu")
    out["_here"] = f"{n.aten_cpu}, MKL {n.mkl_vml}"
    return out


def main() -> int:
    if "--one" in sys.argv:
        print(json.dumps(one()))
        return 0
    rows = {}
    for branch in BRANCHES:
        for cap in CAPS:
            env = {**os.environ, "MKL_CBWR": branch, "ATEN_CPU_CAPABILITY": cap}
            r = subprocess.run([sys.executable, __file__, "--one"], env=env,
                               capture_output=True, text=True, check=False)
            if r.returncode != 0:
                print(f"{branch} {cap}: failed: {r.stderr.strip().splitlines()[-1:]}")
                continue
            rows[(branch, cap)] = json.loads(r.stdout.strip().splitlines()[-1])
    cases = sorted(k for k in next(iter(rows.values())) if k != "_here")
    print("| case | " + " | ".join(f"{b} / {c} ({rows[(b, c)]['_here']})"
                                    for b, c in rows) + " |")
    print("| --- |" + " --- |" * len(rows))
    for name in cases:
        print(f"| {name} | " + " | ".join(rows[k][name] for k in rows) + " |")
    bad = [(k, n) for k in rows for n in cases if rows[k][n] == "OTHER STATE"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
