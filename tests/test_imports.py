"""The dependency direction (design, section 3): lower layers never import higher ones, and
only ``lowdiff_store/torch/`` and the layer above it, ``lowdiff_store/integrations/`` (its
leaf modules, which import their trainer), import torch. Checked twice: by importing the
package in a fresh interpreter, and statically, by parsing every module's imports with
``ast``."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "lowdiff_store"

#: Rank of each layer; a module may import only from layers of its rank or below.
#: ``errors`` is the root every layer shares.
LOWER_LAYERS = {"errors": 0, "format": 1, "codecs": 2, "storage": 3, "log": 4}

#: Layers allowed to import torch (``integrations`` sits above ``torch``).
TORCH_LAYERS = ("torch", "integrations")


def _in_torch_layers(path: Path) -> bool:
    return any((PKG / d) in path.parents for d in TORCH_LAYERS)


def _modules() -> list[Path]:
    files = sorted(PKG.rglob("*.py"))
    assert len(files) > 20, files
    return files


def _module_name(path: Path, pkg: Path = PKG) -> str:
    rel = path.relative_to(pkg.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, pkg: Path = PKG) -> list[tuple[str, int, bool]]:
    """(absolute module imported, line, at module level) for every import in ``path``;
    ``from .x import y`` also yields ``pkg.x.y`` (y may be a module)."""
    tree = ast.parse(path.read_text(), str(path))
    name = _module_name(path, pkg)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top_level = {id(n) for n in tree.body}
    for n in tree.body:  # imports under `if TYPE_CHECKING:` / try: at module level count too
        if isinstance(n, (ast.If, ast.Try)):
            top_level |= {id(m) for m in ast.walk(n)}
    out: list[tuple[str, int, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, id(node) in top_level) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((mod, node.lineno, id(node) in top_level))
            out += [(f"{mod}.{a.name}", node.lineno, id(node) in top_level) for a in node.names]
    return out


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "lowdiff_store" else None


def test_the_import_parser_resolves_relative_imports() -> None:
    got = {m for m, _l, _t in _imports(PKG / "log" / "reader.py")}
    assert {"lowdiff_store.storage", "lowdiff_store.errors", "lowdiff_store.log.base",
            "numpy"} <= got
    got = {m for m, _l, _t in _imports(PKG / "log" / "tensors.py")}
    assert "lowdiff_store.codecs" in got  # `from .. import codecs`


def test_only_the_torch_layer_imports_torch() -> None:
    offenders = []
    for path in _modules():
        if _in_torch_layers(path) and path != PKG / "integrations" / "__init__.py":
            continue
        for mod, line, _top in _imports(path):
            if mod == "torch" or mod.startswith("torch."):
                offenders.append(f"{path.relative_to(PKG.parent)}:{line}: imports {mod}")
    assert not offenders, "\n".join(offenders)


def test_torch_layer_is_only_imported_lazily() -> None:
    """Outside ``torch/``, ``lowdiff_store.torch`` may only be imported inside a function
    (the CLI's optional commands), never when a module loads."""
    offenders = []
    for path in _modules():
        if _in_torch_layers(path) and path != PKG / "integrations" / "__init__.py":
            continue
        for mod, line, top in _imports(path):
            if top and (mod == "lowdiff_store.torch" or mod.startswith("lowdiff_store.torch.")):
                offenders.append(f"{path.relative_to(PKG.parent)}:{line}: imports {mod}")
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("layer", sorted(LOWER_LAYERS, key=LOWER_LAYERS.get))
def test_lower_layers_never_import_higher_ones(layer: str) -> None:
    rank = LOWER_LAYERS[layer]
    paths = [PKG / "errors.py"] if layer == "errors" else sorted((PKG / layer).rglob("*.py"))
    assert paths
    offenders = []
    for path in paths:
        for mod, line, _top in _imports(path):
            target = _layer(mod)  # `from .. import x` is checked as lowdiff_store.x
            if target is None or target == layer:
                continue
            if LOWER_LAYERS.get(target, 99) > rank:
                offenders.append(f"{path.relative_to(PKG.parent)}:{line}: {layer} imports {mod}")
    assert not offenders, "\n".join(offenders)


def test_the_layer_check_can_fail(tmp_path: Path) -> None:
    bad = tmp_path / "lowdiff_store" / "format" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("from ..log import reader\nimport torch\n")
    mods = {m for m, _l, _t in _imports(bad, tmp_path / "lowdiff_store")}
    assert {"lowdiff_store.log", "lowdiff_store.log.reader", "torch"} <= mods
    assert _layer("lowdiff_store.log.reader") == "log"
    assert LOWER_LAYERS["log"] > LOWER_LAYERS["format"]  # so format importing it fails


def test_only_the_integrations_import_the_integrations() -> None:
    """The trainer integrations are the top adapter layer: no other module imports them."""
    for path in _modules():
        if (PKG / "integrations") in path.parents:
            continue
        mods = {m for m, _l, _t in _imports(path)}
        assert not any(m.startswith("lowdiff_store.integrations") for m in mods), path


def test_nothing_imports_the_cli() -> None:
    for path in _modules():
        if path.name in ("cli.py", "__main__.py", "cli_extra.py"):
            continue
        mods = {m for m, _l, _t in _imports(path)}
        assert "lowdiff_store.cli" not in mods, path


def test_importing_the_core_does_not_import_torch() -> None:
    mods = sorted(_module_name(p) for p in _modules()
                  if _module_name(p) != "lowdiff_store.__main__"
                  and not _module_name(p).startswith(("lowdiff_store.torch",
                                                      "lowdiff_store.integrations.")))
    code = textwrap.dedent(f"""
        import importlib, sys
        import lowdiff_store
        import lowdiff_store.cli
        import lowdiff_store.verify
        import lowdiff_store.codecs
        assert "torch" not in sys.modules, "torch after the core imports"
        for m in {mods!r}:
            importlib.import_module(m)
        bad = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        print("TORCH" if bad else "CLEAN", len(sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=PKG.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "CLEAN", out.stdout
    assert "lowdiff_store.log" in mods
    assert "lowdiff_store.format.framing" in mods
    assert "lowdiff_store.integrations" in mods  # the package itself stays torch-free
    assert "lowdiff_store.log.latest" in mods
