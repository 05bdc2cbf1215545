"""The import graph of `cortexc` by layer, and the imports that run upward.

    python scripts/layers.py          # the layer graph, then every upward import; exit 1 on one not allowed

Layers, lowest first: a module may import its own layer and the ones below. The runtime is the ground floor
above the base: it imports nothing of the compiler, so a generated package runs without it. Imports under
`if TYPE_CHECKING:` do not count (they never run); imports inside functions do (they run when called).
`ALLOWED` lists the upward imports that remain, each with why; `tests/runtime/test_layers.py` fails on any other,
so the list only shrinks.
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "cortexc"

#: (layer, module prefixes), lowest first
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("cortexc.errors", "cortexc.version")),
    ("runtime", ("cortexc.runtime", "cortexc.targets")),
    ("options", ("cortexc.options",)),
    ("ir", ("cortexc.ir",)),
    ("frontend", ("cortexc.frontend",)),
    ("passes", ("cortexc.passes",)),
    ("codegen", ("cortexc.codegen", "cortexc.targets.*.target")),
    ("pipeline", ("cortexc.pipeline",)),
    (
        "api",
        (
            "cortexc.cli",
            "cortexc.__main__",
            "cortexc.export",
            "cortexc.reference",
            "cortexc.torch",
            "cortexc.train",
            "cortexc",
        ),
    ),
]

#: (importer, imported) -> why it runs upward: at most one such arrow (tests/runtime/test_layers.py)
ALLOWED: dict[tuple[str, str], str] = {
    ("cortexc.runtime.backends", "cortexc.reference"): "the interpreter: device='interp' and CellModel.cell need the "
    "IR, compiled from the package's source (the runtime's one way up, lazily, for that backend only)",
}


def layer_of(module: str) -> int:
    """The index in `LAYERS` of a module (the longest matching prefix; `*` matches one name: a target folder's
    compile side, `cortexc.targets.*.target`, is the code generator's, the rest of the folder the runtime's)."""
    best, index = -1, -1
    parts = module.split(".")
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            pattern = prefix.split(".")
            matches = len(parts) >= len(pattern) and all(p in ("*", q) for p, q in zip(pattern, parts))
            if matches and len(prefix) > best:
                best, index = len(prefix), i
    if index < 0:
        raise ValueError(f"{module} is in no layer: add it to LAYERS")
    return index


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_only(tree: ast.Module) -> set[int]:
    """The ids of the import nodes inside `if TYPE_CHECKING:` blocks."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            ids |= {id(n) for child in node.body for n in ast.walk(child)}
    return ids


def imports() -> list[tuple[str, str]]:
    """(importer, imported) for every import of a cortexc module that runs, in every module of the package."""
    edges = []
    for path in sorted(ROOT.rglob("*.py")):
        importer = _module_name(path)
        package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skipped = _type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:  # relative (a target folder's own modules): `from .host import` in its package
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    module = f"{base}.{module}" if module else base
                if module == "cortexc" or (node.level and not node.module):  # `from X import a`: submodules
                    edges += [(importer, f"{module}.{a.name}") for a in node.names]
                elif module.startswith("cortexc."):
                    edges.append((importer, module))
            elif isinstance(node, ast.Import):
                edges += [(importer, a.name) for a in node.names if a.name.startswith("cortexc")]
    return edges


def upward(edges: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return sorted({(a, b) for a, b in edges if layer_of(b) > layer_of(a)})


def main() -> int:
    edges = imports()
    counts = Counter((layer_of(a), layer_of(b)) for a, b in edges if layer_of(a) != layer_of(b))
    print("layer graph (importer -> imported: imports), lowest layer first:")
    for i, (name, _) in enumerate(LAYERS):
        targets = ", ".join(f"{LAYERS[j][0]} {n}" for (k, j), n in sorted(counts.items()) if k == i)
        print(f"  {name:<9} -> {targets or '-'}")
    bad = 0
    print("upward imports:")
    for a, b in upward(edges):
        why = ALLOWED.get((a, b))
        if why is None:
            bad += 1
        print(f"  {a} -> {b}: {why if why is not None else 'NOT ALLOWED'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
