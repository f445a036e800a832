"""What the multi-process torch tests share: the gloo skip marker and a free port for a
rendezvous on 127.0.0.1."""

from __future__ import annotations

import socket

import pytest
import torch

#: skip a module whose ranks need torch.distributed with the gloo backend
NEEDS_GLOO = pytest.mark.skipif(not torch.distributed.is_available()
                                or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is needed")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
