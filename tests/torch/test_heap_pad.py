"""Training's heap while gradients are lent (``heap_pad``, ``lowdiff_store/torch/capture/
heap.py``): counted in minor page faults of the training thread per step, never timed.

Each run is a fresh process (the pad is process-wide and glibc's heap is the process's):
a model with one 12 MiB parameter (AdamW's temporaries of it are what glibc trimmed and
training faulted in again at every step) trains dense with the checkpointer, and the
training thread's minor faults (``getrusage(RUSAGE_THREAD)``) per step are counted after
the warm-up steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="glibc's malloc and RUSAGE_THREAD are Linux's")

WORKER = r"""
import json, os, resource, statistics, sys
import torch
from lowdiff_store.torch import DiffCheckpointer
torch.manual_seed(0)
torch.set_num_threads(1)
path, how = sys.argv[1], sys.argv[2]
model = torch.nn.Sequential(torch.nn.Embedding(8192, 384), torch.nn.Linear(384, 384),
                            torch.nn.Linear(384, 8192))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ckpt = None
if how != "none":
    ckpt = DiffCheckpointer(path, model, opt, snapshot_every=10**6, heap_pad=how == "pad")
faults = []
for step in range(14):
    x = torch.randint(0, 8192, (4, 16), generator=torch.Generator().manual_seed(step))
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    opt.zero_grad()
    model(x).float().pow(2).mean().backward()
    opt.step()
    faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
    if ckpt is not None:
        ckpt.flush()  # (each step written: the heap as a disk keeping up leaves it)
stats = ckpt.stats() if ckpt is not None else {}
if ckpt is not None:
    ckpt.close()
grads = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"faults": statistics.median(faults[6:]), "grad_pages": grads // 4096,
                  "pad": stats.get("heap_top_pad", 0), "lent": stats.get("lent_grads", 0),
                  "grads": grads}))
"""


def _run(tmp_path, how: str, env: dict[str, str] | None = None) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    e.update(env or {})
    out = subprocess.run([sys.executable, "-c", WORKER, str(tmp_path / how), how],
                         capture_output=True, text=True, timeout=300, env=e, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_lent_gradients_leave_the_training_threads_faults_as_without_a_checkpointer(tmp_path):
    """With the pad, the training thread faults in (almost) no page per step while it
    lends every gradient: at most a tenth of the gradients' pages (measured: 0; without
    the pad 12224, and 20160 without the checkpointer in a process that never freed a
    large block, glibc still mapping each one); the pad is twice the gradients' bytes,
    rounded up to MiB."""
    padded = _run(tmp_path, "pad")
    assert padded["lent"] > 0  # (the condition that moved the heap)
    assert padded["pad"] == -(-2 * padded["grads"] // (1 << 20)) << 20
    assert padded["faults"] <= padded["grad_pages"] // 10, padded


def test_without_the_pad_nothing_is_set(tmp_path):
    """``heap_pad=False`` sets nothing (``heap_top_pad`` 0) and still lends."""
    out = _run(tmp_path, "nopad")
    assert out["pad"] == 0
    assert out["lent"] > 0


def test_a_users_malloc_tuning_is_left_alone(tmp_path):
    """``MALLOC_TOP_PAD_`` in the environment: the checkpointer sets no pad."""
    out = _run(tmp_path, "pad", {"MALLOC_TOP_PAD_": str(1 << 20)})
    assert out["pad"] == 0
    assert out["lent"] > 0


def test_pad_heap_keeps_the_larger_pad_and_caps_it():
    """In a fresh process: the pad is rounded up to MiB, a smaller later pad keeps the
    larger, and no pad exceeds MAX_PAD; a user's tuning in GLIBC_TUNABLES sets none."""
    code = ("from lowdiff_store.torch.capture import heap as h;"
            "print(h.pad_heap(3 << 20 | 1), h.pad_heap(1 << 20), h.pad_heap(1 << 40),"
            " h.heap_pad(), h.MAX_PAD)")
    e = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    e.pop("GLIBC_TUNABLES", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=e, check=True).stdout.split()
    first, second, big, now, most = map(int, out)
    assert (first, second) == (4 << 20, 4 << 20)
    assert big == now == most == 1 << 30
    e["GLIBC_TUNABLES"] = "glibc.malloc.top_pad=1048576"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=e, check=True).stdout.split()
    assert out[:4] == ["0", "0", "0", "0"]


@pytest.mark.parametrize(("key", "value", "tuned"), [
    ("MALLOC_TRIM_THRESHOLD_", "1", True), ("MALLOC_MMAP_THRESHOLD_", "1", True),
    ("GLIBC_TUNABLES", "glibc.malloc.top_pad=1", True),
    ("GLIBC_TUNABLES", "glibc.rtld.nns=2", False),
    ("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", True),
    ("LD_PRELOAD", "/opt/lib/libfoo.so:/usr/lib/libtcmalloc_minimal.so.4", True),
    ("LD_PRELOAD", "/opt/lib/libfoo.so", False)])
def test_user_tuned_sees_a_users_allocator_settings(monkeypatch, key, value, tuned):
    from lowdiff_store.torch.capture import heap

    for k in (*heap.USER_TUNING, "GLIBC_TUNABLES", "LD_PRELOAD"):
        monkeypatch.delenv(k, raising=False)
    assert heap.user_tuned() is False
    monkeypatch.setenv(key, value)
    assert heap.user_tuned() is tuned
