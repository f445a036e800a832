"""Quantized gradient messages (TernGrad, QSGD, DeMo signs): bit packing and decoding.

A compressed gradient of parameter NAME is logged as raw ``U8`` / ``F32`` tensors:

=========================  ======================================================
``@cgrad/NAME/tern``       2-bit codes, 4 per byte, entry i in bits ``2*(i%4)`` of byte
                           ``i//4``: 0 -> 0, 1 -> +1, 2 -> -1 (3 is invalid)
``@cgrad/NAME/sign``       1 bit per entry, entry i in bit ``i%8`` of byte ``i//8``:
                           0 -> +1, 1 -> -1
``@cgrad/NAME/qsgd``       ``b = 1 + ceil(log2(s+1))`` bits per entry, little-endian bit
                           stream (entry i's bit j is stream bit ``i*b + j``); the top
                           bit is the sign, the low ``b-1`` bits the level 0..s
``@cgrad/NAME/scale``      F32: the scale of ``tern`` / ``sign`` (absent: 1), or QSGD's
                           norm per bucket of ``d`` entries (the last one may be short)
=========================  ======================================================

Decoded values (float32, in the parameter's shape): ``scale * t`` for ternary and signs;
``norm * level / s``, negated when the sign bit is set, for QSGD. Training consumes
exactly :func:`decode` of the message it logged (the compressors build the consumed
gradient with this function), so replay rebuilds it bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..errors import ConfigError, Reason

CGRAD = "@cgrad/"
#: message parts, in the order a record holds them
PARTS = ("tern", "sign", "qsgd", "scale")

_SHIFTS8 = torch.arange(8, dtype=torch.uint8)


def qsgd_bits(levels: int) -> int:
    """Bits per entry of a QSGD message with ``levels`` levels: 1 + ceil(log2(s+1))."""
    return 1 + max(1, (int(levels)).bit_length())


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes`` (uint8, each < 2**bits) as a little-endian stream of ``bits``-bit fields."""
    n = codes.numel()
    if 8 % bits == 0:
        per = 8 // bits
        pad = (-n) % per
        c = torch.nn.functional.pad(codes, (0, pad)) if pad else codes
        c = c.view(-1, per)
        out = c[:, 0].clone()
        for j in range(1, per):
            out |= c[:, j] << (bits * j)
        return out
    stream = ((codes.unsqueeze(1) >> _SHIFTS8[:bits]) & 1).reshape(-1)
    return pack_bits(stream, 1)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The ``n`` uint8 codes of :func:`pack_bits` output."""
    if 8 % bits == 0:
        per = 8 // bits
        mask = (1 << bits) - 1
        c = (packed.unsqueeze(1) >> (_SHIFTS8[:per] * bits)) & mask
        return c.reshape(-1)[:n]
    stream = unpack_bits(packed, 1, n * bits).view(n, bits)
    out = stream[:, 0].clone()
    for j in range(1, bits):
        out |= stream[:, j] << j
    return out


def tern_codes(values: torch.Tensor) -> torch.Tensor:
    """2-bit codes of a tensor of -1/0/+1 (any dtype)."""
    return (values > 0).to(torch.uint8) | ((values < 0).to(torch.uint8) << 1)


def _ternary(codes: torch.Tensor) -> torch.Tensor:
    if bool((codes == 3).any()):
        raise ConfigError("ternary code 3 is invalid", reason=Reason.STATE_MISMATCH)
    return (codes == 1).to(torch.float32) - (codes == 2).to(torch.float32)


def decode(parts: Mapping[str, torch.Tensor], numel: int, config: Mapping[str, Any]
           ) -> torch.Tensor:
    """The flat float32 gradient of a message (``parts``: suffix -> tensor)."""
    scale = parts.get("scale")
    if "qsgd" in parts:
        if scale is None:
            raise ConfigError("a QSGD message needs its norms", reason=Reason.STATE_MISMATCH)
        s = int(config["levels"])
        d = int(config["bucket"])
        b = qsgd_bits(s)
        codes = unpack_bits(parts["qsgd"], b, numel)
        level = (codes & ((1 << (b - 1)) - 1)).to(torch.float32)
        if bool((level > s).any()) or scale.numel() != -(-numel // d):
            raise ConfigError("QSGD message does not fit its parameter",
                              reason=Reason.STATE_MISMATCH)
        norm = scale.repeat_interleave(d)[:numel] if numel else scale[:0]
        out = norm * level / float(s)
        neg = (codes >> (b - 1)).bool()
        return torch.where(neg, -out, out)
    if "tern" in parts:
        t = _ternary(unpack_bits(parts["tern"], 2, numel))
    elif "sign" in parts:
        t = 1.0 - 2.0 * unpack_bits(parts["sign"], 1, numel).to(torch.float32)
    else:
        raise ConfigError("compressed gradient without codes", reason=Reason.STATE_MISMATCH)
    return t * scale if scale is not None else t


def parts_of(has: Callable[[str], bool], name: str) -> list[str]:
    """The message parts a record holds for parameter ``name`` (``has(tensor_name)``)."""
    return [s for s in PARTS if has(f"{CGRAD}{name}/{s}")]


__all__ = ["CGRAD", "PARTS", "decode", "pack_bits", "parts_of", "qsgd_bits", "tern_codes",
           "unpack_bits"]
