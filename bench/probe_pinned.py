#!/usr/bin/env python3
"""Device-to-host copy speed into the kinds of host memory a base can be staged in (for the
multi-second stall of issue 34 on an H100: the first base staged into a freshly registered
16 GB buffer; bench/RESULTS.md, "GPU, second session").

Copies ``--gib`` GiB of device tensors (pieces of ``--tensor-mib`` MiB) to the host, timed
with the device synchronized, into:

  alloc        torch's pinned allocator (``pin_memory=True``: cudaHostAlloc)
  registered   ``torch.empty`` + ``cudaHostRegister`` in pieces of ``--piece-mib`` MiB, copies
               cut at the pieces' bounds (as ``lowdiff_store``'s staging area does)
  pageable     plain ``torch.empty`` (what a buffer the driver refused would give)

each twice (cold: first copy into fresh memory; warm), and the time to register and to
unregister the buffer. Run on a GPU machine: ``python bench/probe_pinned.py --gib 4``.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch


def _timed(fn: Any) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--tensor-mib", type=int, default=36)
    ap.add_argument("--piece-mib", type=int, default=64)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    n = int(args.gib * (1 << 30))
    t = args.tensor_mib << 20
    src = [torch.empty(min(t, n - o), dtype=torch.uint8, device="cuda")
           for o in range(0, n, t)]
    out: dict[str, Any] = {"gib": args.gib, "tensor_mib": args.tensor_mib,
                           "piece_mib": args.piece_mib,
                           "device": torch.cuda.get_device_name()}
    piece = args.piece_mib << 20

    def copy_into(buf: torch.Tensor, cut: bool) -> None:
        off = 0
        for s in src:
            lo, hi = off, off + s.numel()
            while lo < hi:
                end = min(hi, (lo // piece + 1) * piece) if cut else hi
                buf[lo:end].copy_(s[lo - off:end - off], non_blocking=True)
                lo = end
            off = hi

    for kind in ("alloc", "registered", "pageable"):
        if kind == "alloc":
            buf = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        else:
            buf = torch.empty(n, dtype=torch.uint8)
            buf.numpy()[::4096] = 0  # faulted in
        reg: list[int] = []
        if kind == "registered":
            cudart = torch.cuda.cudart()
            t0 = time.perf_counter()
            for lo in range(0, n, piece):
                if int(cudart.cudaHostRegister(buf.data_ptr() + lo, min(piece, n - lo), 0)):
                    break
                reg.append(buf.data_ptr() + lo)
            out["register_s"] = time.perf_counter() - t0
            out["registered_pieces"] = len(reg)
        cold = _timed(lambda b=buf, k=kind: copy_into(b, k == "registered"))
        warm = _timed(lambda b=buf, k=kind: copy_into(b, k == "registered"))
        out[kind] = {"cold_s": cold, "warm_s": warm, "warm_gib_s": args.gib / warm}
        if reg:
            t0 = time.perf_counter()
            for p in reg:
                torch.cuda.cudart().cudaHostUnregister(p)
            out["unregister_s"] = time.perf_counter() - t0
        del buf
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
