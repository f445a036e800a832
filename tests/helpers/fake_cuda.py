"""Run torch code on *fake* CUDA tensors on a machine without a GPU, and record every place
it would cross the host-device boundary (issue 33, item 4: guards that fail on CPU).

``FakeTensorMode`` lets tensors claim ``device="cuda"`` with no GPU and no data; a dispatch
mode above it sees every ATen call. :class:`Boundary` records the calls that on a real GPU
make the host wait for the device or copy between them: a copy between host and device
(``_to_copy`` / ``copy_`` across devices), a read of a device value (``_local_scalar_dense``:
``.item()``, ``float(t)``, ``bool(t)``), a data-dependent shape (``nonzero``,
``masked_select``, ``unique``), an op that takes a host tensor with dimensions beside device
tensors, and a host value written into a device tensor through an index (``t[idx] = 0``:
torch copies the scalar to the device and waits, which a CPU-only build refuses outright:
"not linked with support for cuda devices").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

#: ops whose output shape depends on device values: the host waits for the device
DATA_DEPENDENT = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default,
                  aten.unique_consecutive.default, aten.unique_dim.default,
                  aten._local_scalar_dense.default}


class Boundary(TorchDispatchMode):
    """Records (in :attr:`crossings`) each ATen call that crosses the host-device boundary."""

    def __init__(self) -> None:
        super().__init__()
        self.crossings: list[str] = []
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        self.calls += 1
        flat, _ = tree_flatten((args, kwargs))
        ts = [t for t in flat if isinstance(t, torch.Tensor)]
        devs = {t.device.type for t in ts}
        if func in DATA_DEPENDENT and "cuda" in devs:
            self.crossings.append(f"{func} reads a device value")
        elif func in (aten._to_copy.default, aten.copy_.default):
            dst = kwargs.get("device")
            if func is aten.copy_.default:
                dst = args[0].device
            src = args[1].device if func is aten.copy_.default else args[0].device
            if dst is not None and torch.device(dst).type != src.type:
                self.crossings.append(f"{func} {src.type} -> {torch.device(dst).type}")
        elif "cuda" in devs and any(t.device.type == "cpu" and t.dim() > 0 for t in ts):
            self.crossings.append(f"{func} takes a host tensor beside device tensors")
        return func(*args, **kwargs)


@contextmanager
def fake_cuda() -> Iterator[Boundary]:
    """``with fake_cuda() as b:`` tensors made with ``device="cuda"`` inside are fake;
    ``b.crossings`` lists the boundary crossings of what ran inside (a host value written
    through an index raises in a CPU-only build: recorded as a crossing)."""
    b = Boundary()
    # ``Tensor.copy_``'s binding takes a CUDA device guard before dispatch (a CPU-only build
    # refuses it): the op itself is dispatched instead, so the fake mode sees it
    real_copy = torch.Tensor.copy_

    def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False
              ) -> torch.Tensor:
        return torch.ops.aten.copy_.default(self, src, non_blocking)  # type: ignore[no-any-return]

    torch.Tensor.copy_ = copy_  # type: ignore[method-assign,assignment]
    try:
        with _fake(b):
            yield b
    finally:
        torch.Tensor.copy_ = real_copy  # type: ignore[method-assign]


@contextmanager
def _fake(b: Boundary) -> Iterator[None]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        with b:
            try:
                yield
            except RuntimeError as e:
                if "not linked with support for cuda" not in str(e):
                    raise
                import traceback

                at = [f for f in traceback.extract_tb(e.__traceback__)
                      if "lowdiff_store" in f.filename][-1:]
                where = f" at {at[0].filename.split('lowdiff_store')[-1]}:{at[0].lineno}" \
                    if at else ""
                b.crossings.append(f"a host value copied to the device{where}: {e}")
