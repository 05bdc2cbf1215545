"""No target or device name is written outside the target folders: the CLI, `cortexc.load`, `cortexc.torch`,
export and the options read them from the registry (`cortexc.targets.NAMES`, `cortexc.runtime.backends`), so a
new target folder plus its one registration line is all that a target takes (issue 33)."""

from __future__ import annotations

import ast

from cortexc.runtime.backends import BACKENDS
from cortexc.targets import NAMES
from tests.helpers import REPO

#: the names no code outside cortexc/targets/ may spell: the targets' and their devices'
NAMES_OF_TARGETS = set(NAMES) | {device for device, b in BACKENDS.items() if b.target is not None}

#: (file, literal): where such a string means something else
ELSEWHERE = {
    ("cortexc/export.py", "c"): "the export templates' name for their context, not the target",
}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _torch_device_type(node: ast.Constant, parents: dict[int, ast.AST]) -> bool:
    """A torch device type ("cpu", "cuda"): compared with a `.type` or `.tensors` attribute, or passed to
    `torch.device(...)` or `backends_for(...)`, which take torch's names."""
    parent = parents.get(id(node))
    if isinstance(parent, ast.Compare):
        sides = [parent.left, *parent.comparators]
        return any(isinstance(side, ast.Attribute) and side.attr in ("type", "tensors") for side in sides)
    if isinstance(parent, ast.Call):
        func = parent.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return name in ("device", "backends_for")
    return False


def literals_in(rel: str, text: str) -> list[str]:
    """The target and device names spelt in module `rel` (its path under the checkout) of source `text`."""
    tree = ast.parse(text)
    docs = _docstrings(tree)
    parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and node.value in NAMES_OF_TARGETS) or id(node) in docs:
            continue
        if (rel, node.value) in ELSEWHERE or (rel.startswith("cortexc/torch/") and _torch_device_type(node, parents)):
            continue
        if rel == "cortexc/targets/__init__.py" and isinstance(parents.get(id(node)), ast.Tuple):
            continue  # the registry itself
        found.append(f"{rel}:{node.lineno}: {node.value!r}")
    return found


def literals_outside_targets() -> list[str]:
    found = []
    for path in sorted((REPO / "cortexc").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if not rel.startswith("cortexc/targets/") or rel == "cortexc/targets/__init__.py":
            found += literals_in(rel, path.read_text(encoding="utf-8"))
    return found


def test_no_target_or_device_name_outside_the_target_folders():
    assert literals_outside_targets() == []


def test_the_check_finds_a_name():
    """The check is not blind: names used as a device or a target are found, torch's device types are not."""
    code = 'DEVICE = "cuda-emu"\nTARGETS = ("c",)\ndef f(x):\n    """Runs on "cpu"."""\n    return x == "cuda"\n'
    assert literals_in("cortexc/runtime/x.py", code) == [
        "cortexc/runtime/x.py:1: 'cuda-emu'",
        "cortexc/runtime/x.py:2: 'c'",
        "cortexc/runtime/x.py:5: 'cuda'",
    ]
    torch_code = 'def f(device, b):\n    return device.type == "cuda", backends_for("cpu"), b == "cuda"\n'
    assert literals_in("cortexc/torch/x.py", torch_code) == ["cortexc/torch/x.py:2: 'cuda'"]
