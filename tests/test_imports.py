"""The dependency direction (docs/design.md, section 2): lower layers never import higher ones, and
only ``lowdiff_store/torch/`` and the layer above it, ``lowdiff_store/integrations/`` (its
leaf modules, which import their trainer), import torch. Checked twice: by importing the
package in a fresh interpreter, and statically, by parsing every module's imports with
``ast``."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "lowdiff_store"

#: Rank of every module group (docs/design.md, section 2); a module may import only from its own
#: group or a lower-ranked one, lazy imports (inside functions) included. Every module of the
#: package must fall in a group: a new top-level module fails ``test_every_module_has_a_layer``
#: until it is placed here. ``lowdiff_store`` itself (the package root) is the core's public
#: face over the log and the writer.
LAYERS = {
    "errors": 0, "progress": 0, "threads": 0,
    "format": 1,
    "codecs": 2,
    "storage": 3,
    "log": 4,
    "writer": 5,
    "": 6,  # the package root, lowdiff_store/__init__.py
    "compaction": 6, "tuning": 6, "tuning_from_log": 6, "verify": 6,
    "torchmeta": 6, "deep_check": 6,  # the torch metadata schema, checked without torch
    "report": 6,  # the HTML report: reads logs through the log layer, torch-free
    "outputs": 6,  # publish_output: every output file, never inside a log
    "torch": 7,
    "integrations": 8,
    "cli": 9, "__main__": 9,
}
#: the core layers (kept for the parametrized test names)
LOWER_LAYERS = {k: v for k, v in LAYERS.items() if k and v <= 4}

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
    ``from .x import y`` also yields ``pkg.x.y`` (y may be a module). Parsed once per file
    content (the layer tests walk every module's imports many times)."""
    return list(_imports_of(path, pkg, path.read_text()))


@functools.cache
def _imports_of(path: Path, pkg: Path, text: str) -> tuple[tuple[str, int, bool], ...]:
    tree = ast.parse(text, str(path))
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
    return tuple(out)


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "lowdiff_store":
        return None
    return parts[1] if len(parts) > 1 else ""


def _module_paths() -> dict[str, Path]:
    return {_module_name(p): p for p in _modules()}


def _edges() -> dict[str, set[tuple[str, int]]]:
    """module -> {(package module it loads, line)}, every import (lazy ones too). An import
    ``from pkg import x`` loads ``pkg.x`` when that is a module, else ``pkg`` (``x`` is a
    name defined there)."""
    mods = _module_paths()
    out: dict[str, set[tuple[str, int]]] = {}
    for name, path in mods.items():
        raw = _imports(path)
        got: set[tuple[str, int]] = set()
        for mod, line, _top in raw:
            if mod not in mods or mod == name:
                continue
            subs = [m for m, l2, _t in raw if l2 == line and _parent_of(m) == mod]
            if subs and all(m in mods for m in subs):
                continue  # `from pkg import sub1, sub2`: the submodules are the edges
            got.add((mod, line))
        out[name] = got
    return out


def _parent_of(module: str) -> str:
    return module.rpartition(".")[0]


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


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(n for n in _module_paths() if _layer(n) not in LAYERS)
    assert not unplaced, f"modules outside every layer of LAYERS: {unplaced}"


@pytest.mark.parametrize("layer", sorted(LAYERS, key=lambda k: (LAYERS[k], k)))
def test_no_module_imports_a_higher_layer(layer: str) -> None:
    """Lazy imports (inside functions) count: an upward import waits for the first call
    but is still an upward import."""
    rank = LAYERS[layer]
    offenders = []
    for name, deps in _edges().items():
        if _layer(name) != layer:
            continue
        for mod, line in sorted(deps):
            target = _layer(mod)
            if target is not None and target != layer and LAYERS.get(target, 99) > rank:
                offenders.append(f"{name}:{line}: {layer} (rank {rank}) imports {mod} "
                                 f"({target}, rank {LAYERS.get(target)})")
    assert not offenders, "\n".join(offenders)


def _cycles(edges: dict[str, set[tuple[str, int]]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w, _line in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_loops() -> None:
    """No two modules import each other, directly or through others, lazy imports
    included (the sharded/single decision lives in one front module per layer)."""
    assert _cycles(_edges()) == []


def test_the_loop_check_can_fail() -> None:
    edges = {"a": {("b", 1)}, "b": {("c", 2)}, "c": {("a", 3)}, "d": {("a", 4)}}
    assert _cycles(edges) == [["a", "b", "c"]]
    assert _cycles({"a": {("b", 1)}, "b": set()}) == []


def test_the_layer_check_can_fail(tmp_path: Path) -> None:
    bad = tmp_path / "lowdiff_store" / "format" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("from ..log import reader\nimport torch\n")
    mods = {m for m, _l, _t in _imports(bad, tmp_path / "lowdiff_store")}
    assert {"lowdiff_store.log", "lowdiff_store.log.reader", "torch"} <= mods
    assert _layer("lowdiff_store.log.reader") == "log"
    assert LOWER_LAYERS["log"] > LOWER_LAYERS["format"]  # so format importing it fails


#: The rooms of the torch layer (``lowdiff_store/torch/<room>/``) in import order: a room may
#: import its own modules and lower rooms only, lazy imports included. ``api`` is the one
#: front door and the package root re-exports it.
TORCH_ROOMS = {
    "core": 0,          # what a torch log holds: schema, tensors, optimizers, hook records
    "compressors": 1,   # what training consumes and the log stores
    "replay": 2,        # recovery
    "capture": 3,       # training: the checkpointer and its parts
    "distributed": 4,   # one log per rank
    "api": 5,
    "": 6,              # lowdiff_store/torch/__init__.py
}


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["lowdiff_store", "torch"]:
        return None
    return parts[2] if len(parts) > 2 else ""


def test_every_torch_module_has_a_room() -> None:
    unplaced = sorted(n for n in _module_paths() if _room(n) not in (None, *TORCH_ROOMS))
    assert not unplaced, f"torch modules outside every room of TORCH_ROOMS: {unplaced}"
    assert all(not (PKG / "torch" / f"{m}.py").exists() for m in TORCH_ROOMS if m != "api"), \
        "a loose module of lowdiff_store/torch/ shares a room's name"


def _upward_room_imports(edges: dict[str, set[tuple[str, int]]]) -> list[str]:
    offenders = []
    for name, deps in edges.items():
        room = _room(name)
        if room is None:
            continue
        for mod, line in sorted(deps):
            target = _room(mod)
            if target is not None and target != room and TORCH_ROOMS[target] > TORCH_ROOMS[room]:
                offenders.append(f"{name}:{line}: room {room!r} imports {mod} (room {target!r})")
    return offenders


def test_no_torch_room_imports_a_higher_room() -> None:
    assert _upward_room_imports(_edges()) == []


def test_the_room_check_can_fail() -> None:
    edges = {"lowdiff_store.torch.core.schema": {("lowdiff_store.torch.replay.engine", 3)},
             "lowdiff_store.torch.replay.engine": {("lowdiff_store.torch.core.schema", 4)}}
    assert _upward_room_imports(edges) == [
        "lowdiff_store.torch.core.schema:3: room 'core' imports "
        "lowdiff_store.torch.replay.engine (room 'replay')"]


def _private_imports(path: Path, pkg: Path = PKG) -> list[str]:
    """``from M import _x`` where M is another module of the package (a package may import
    its own private submodules: ``from . import _impl`` inside ``pkg/__init__.py``)."""
    name = _module_name(path, pkg)
    tree = ast.parse(path.read_text(), str(path))
    imports = _imports(path, pkg)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        mods = [(m, ln) for m, ln, _t in imports if ln == node.lineno]
        source = mods[0][0] if mods else ""
        if not source.startswith("lowdiff_store") or source == name:
            continue
        for a in node.names:
            if a.name.startswith("_") and not a.name.startswith("__"):
                out.append(f"{name}:{node.lineno}: imports {a.name} from {source}")
    return out


def test_no_private_name_is_imported_from_another_module() -> None:
    """A name with a leading underscore stays in its module: a module that needs it from
    another is importing that module's insides, and the name should be made public (or
    the two modules are really one)."""
    offenders = [o for p in _modules() for o in _private_imports(p)]
    assert not offenders, "\n".join(offenders)


def test_the_private_import_check_can_fail(tmp_path: Path) -> None:
    bad = tmp_path / "lowdiff_store" / "log" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("from .reader import _helper, Public\nfrom . import _own\n")
    assert _private_imports(bad, tmp_path / "lowdiff_store") == [
        "lowdiff_store.log.bad:1: imports _helper from lowdiff_store.log.reader",
        "lowdiff_store.log.bad:2: imports _own from lowdiff_store.log"]


def test_only_the_integrations_import_the_integrations() -> None:
    """The trainer integrations are the top adapter layer: no other module imports them."""
    for path in _modules():
        if (PKG / "integrations") in path.parents:
            continue
        mods = {m for m, _l, _t in _imports(path)}
        assert not any(m.startswith("lowdiff_store.integrations") for m in mods), path


def test_nothing_imports_the_cli() -> None:
    """Only the CLI package itself and ``__main__`` import ``lowdiff_store.cli``."""
    for path in _modules():
        if _layer(_module_name(path)) in ("cli", "__main__"):
            continue
        mods = {m for m, _l, _t in _imports(path)}
        assert not {m for m in mods if m == "lowdiff_store.cli"
                    or m.startswith("lowdiff_store.cli.")}, path


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
