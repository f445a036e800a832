"""One writer node for tests/s3/test_s3_two_writers.py, run as its own process with its own
AWS credentials, write-ahead directory and LOWDIFF_NODE_NAME (from its environment).

    python -m tests.s3.writer_node URL FIRST_STEP

Opens a LogWriter on URL; prints ``GOT <durable step or -1>`` or ``ERR <one line>`` and exits
1; then appends a step every 0.05 s from FIRST_STEP (or the step after the log's last),
flushing each, printing ``DURABLE <step>``, until killed."""

from __future__ import annotations

import sys
import time

import numpy as np

from lowdiff_store import LogWriter, tensor_input
from lowdiff_store.errors import LowdiffError


def grad(step: int) -> np.ndarray:
    return np.full(64, step, dtype="<f4")


def main() -> int:
    url = sys.argv[1]
    try:
        w = LogWriter(url)
    except LowdiffError as e:
        print(f"ERR {e.reason} {e}", flush=True)
        return 1
    last = w.last_step
    print(f"GOT {last}", flush=True)
    step = last + 1
    while True:
        w.append(step, [tensor_input("g", grad(step), "F32")], kind="grad")
        print(f"DURABLE {w.flush()}", flush=True)
        step += 1
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
