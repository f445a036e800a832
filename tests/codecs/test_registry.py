"""The codec registry: each entry's declared options match its encoder, and its name is the
one its encoder writes, so a new codec module cannot drift from its registry line."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from lowdiff_store.codecs import CODECS, REGISTRY, decode, encode


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_options_are_the_encoders_keyword_parameters(name: str) -> None:
    c = REGISTRY[name]
    kw = {p.name: p for p in inspect.signature(c.encode).parameters.values()
          if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert set(kw) == c.options
    assert {k for k, p in kw.items() if p.default is inspect.Parameter.empty} == c.required


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_name_is_the_one_written_and_read(name: str) -> None:
    x = np.linspace(-1, 1, 12, dtype=np.float32)
    ref = np.zeros_like(x) if REGISTRY[name].ref else None
    options = dict.fromkeys(REGISTRY[name].required, 2)
    enc = encode(name, x, "F32", ref=ref, **options)
    assert enc.codec == name
    out = decode(name, enc.params, [p.data for p in enc.parts], "F32", (12,), ref=ref)
    assert out.shape == (12,)
    assert out.dtype == np.float32


def test_codecs_lists_the_registry() -> None:
    assert frozenset(REGISTRY) == CODECS
    assert [n for n, c in REGISTRY.items() if c.ref] == ["xor"]
