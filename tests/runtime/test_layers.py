"""The layers of the package (`scripts/layers.py`): no import runs upward but the few `ALLOWED` lists, and
each of those still exists (the list shrinks as they are removed, and never hides a fixed one)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from tests.helpers import REPO

_spec = importlib.util.spec_from_file_location("layers", REPO / "scripts" / "layers.py")
assert _spec is not None and _spec.loader is not None
layers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layers)


def test_no_import_runs_upward_but_the_allowed_ones():
    found = layers.upward(layers.imports())
    assert [edge for edge in found if edge not in layers.ALLOWED] == []
    assert [edge for edge in layers.ALLOWED if edge not in found] == []  # fixed: take it off the list


def test_the_runtime_imports_nothing_of_the_compiler_and_goes_up_once():
    """No module of the runtime imports the IR, front end, passes, code generators or pipeline; its one import
    above itself is the interpreter's (`runtime.backends` -> `cortexc.reference`), lazily."""
    compiler = ("cortexc.ir", "cortexc.frontend", "cortexc.passes", "cortexc.codegen", "cortexc.pipeline")
    edges = layers.imports()
    assert {(a, b) for a, b in edges if a.startswith("cortexc.runtime") and b.startswith(compiler)} == set()
    assert [edge for edge in layers.upward(edges) if edge[0].startswith("cortexc.runtime")] == [
        ("cortexc.runtime.backends", "cortexc.reference")
    ]
    assert len(layers.ALLOWED) <= 1  # at most one arrow runs upward


def test_every_module_is_in_a_layer_and_the_script_prints_the_graph():
    for importer, imported in layers.imports():
        layers.layer_of(importer), layers.layer_of(imported)
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "layers.py")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "runtime   -> base" in done.stdout and "upward imports:" in done.stdout


def test_relative_imports_count():
    """A target folder's modules import each other relatively; those imports are edges too (`from .host
    import ...`, `from . import threads`)."""
    edges = set(layers.imports())
    assert ("cortexc.targets.cuda.executor", "cortexc.targets.cuda.host") in edges
    assert ("cortexc.targets.c.executor", "cortexc.targets.c.threads") in edges
