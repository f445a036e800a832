"""A small model trained deterministically, and the one-thread fixture body, shared by the
torch tests and the red-team tests (each step's batch is seeded by its step number)."""

from __future__ import annotations

from collections.abc import Iterator

import torch


def build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A 4-layer model and its AdamW, the same for the same seed."""
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.ReLU(),
                            torch.nn.Linear(5, 3))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01)


def train(m: torch.nn.Module, opt: torch.optim.Optimizer, start: int, stop: int) -> None:
    """Steps ``start`` to ``stop - 1``, each with its own seeded batch."""
    for t in range(start, stop):
        g = torch.Generator().manual_seed(t)
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()


def one_thread() -> Iterator[None]:
    """torch on one thread (the other core is the engine's) with the global RNG state put
    back afterwards: the body of the torch tests' autouse fixture."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    state = torch.get_rng_state()
    yield
    torch.set_rng_state(state)
    torch.set_num_threads(threads)


class Counting(torch.nn.Module):
    """A module that replaces its buffer by assignment every step (``count = count + 1``
    rebinds the name to a new tensor), as some training code does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        with torch.no_grad():
            self.count = self.count + 1
            self.ema = 0.9 * self.ema + 0.1 * y.mean(0)
        return y


def bits_differ(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensors differ between the two maps (missing on one side, or
    another dtype, shape or bit pattern); empty when they are bitwise the same."""
    bad = sorted(set(got) ^ set(want))
    for k in sorted(set(got) & set(want)):
        a, b = got[k], want[k]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(
                a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            bad.append(k)
    return bad
