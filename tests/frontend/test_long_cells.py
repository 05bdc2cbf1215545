"""Long cells: many chained statements and deeply nested expressions build (or fail with a located error).

The front end's walks recurse on expressions: the parser bounds their nesting with a `CellSyntaxError` at the
place; the IR stages and code generation take any length (a loop inlines at most `MAX_INLINE_DEPTH` levels).
"""

from __future__ import annotations

import numpy as np
import pytest

import cortexc
from cortexc import Forest
from cortexc.cli import main
from cortexc.errors import CellSyntaxError
from cortexc.frontend.parser import MAX_NESTING
from cortexc.passes.schedule import MAX_INLINE_DEPTH
from tests.helpers import random_inputs


def _cell(body: str, shape: str = "H") -> str:
    head = f"cell C on tree {{\n    dim H = 4\n    input x[{shape}]\n    param b[H]\n    state h[H]\n"
    return head + f"    node {{\n{body}\n    }}\n}}\n"


def _matches_the_interpreter(path, tmp_path, rng) -> None:
    module = cortexc.load(path, out_dir=tmp_path / "out")
    forest = Forest.random(3, rng=rng, max_children=3, max_nodes=6)
    compiled, interp = module.C(device="cpu", seed=1), module.C(device="interp", seed=1)
    inputs = random_inputs(interp.cell, forest, rng, scale=0.1)
    out_c, out_i = compiled(forest, grad=True, **inputs), interp(forest, grad=True, **inputs)
    assert np.allclose(out_c["h"], out_i["h"], rtol=1e-5, atol=1e-6)
    upstream = {"h": np.ones_like(out_i["h"])}
    grads_c, grads_i = compiled.backward(out_c, upstream), interp.backward(out_i, upstream)
    for name, expected in grads_i.items():
        assert np.allclose(grads_c[name], expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max()), name


def _chain(length: int) -> str:
    lines = ["        t0 = tanh(x) + b", *(f"        t{i} = tanh(t{i - 1}) + b" for i in range(1, length))]
    return _cell("\n".join([*lines, f"        h = t{length - 1}"]))


def _nesting(text: str) -> int:
    depth = deepest = 0
    for char in text:
        depth += {"(": 1, ")": -1}.get(char, 0)
        deepest = max(deepest, depth)
    return deepest


def test_a_long_chain_of_statements_compiles_to_shallow_code(tmp_path):
    """166 statements `t_i = tanh(t_{i-1}) + b`: one expression 332 levels deep if all were inlined. (Code
    generation only: gcc takes half a minute on the result.)"""
    path = tmp_path / "chain.cell"
    path.write_text(_chain(166), encoding="utf-8")
    assert main(["compile", str(path), "-o", str(tmp_path / "out"), "--target", "all"]) == 0
    for kernel in ("C.c", "C.cu"):
        assert _nesting((tmp_path / "out" / "chain" / kernel).read_text(encoding="utf-8")) < 3 * MAX_INLINE_DEPTH


@pytest.mark.slow
def test_a_chain_deeper_than_the_inline_depth_matches_the_interpreter(tmp_path, rng):
    path = tmp_path / "chain.cell"
    path.write_text(_chain(MAX_INLINE_DEPTH // 2 + 4), encoding="utf-8")
    _matches_the_interpreter(path, tmp_path, rng)


def test_an_expression_just_within_the_nesting_limit_compiles(tmp_path):
    depth = MAX_NESTING - 10
    path = tmp_path / "deep.cell"
    path.write_text(_cell("        h = " + "tanh(" * depth + "x" + ")" * depth + " + b"), encoding="utf-8")
    assert main(["compile", str(path), "-o", str(tmp_path / "out"), "--target", "all"]) == 0


@pytest.mark.parametrize(
    "body, shape",
    [
        ("        h = " + " + ".join(["x"] * 330), "H"),
        ("        h = " + "tanh(" * 329 + "x" + ")" * 329, "H"),
        ("        h = " + "-" * 329 + "x", "H"),
        ("        h = tanh(x[0:4])", "+".join(["H"] * 243)),
    ],
    ids=["330-term sum", "329 nested calls", "329 minus signs", "243-term shape"],
)
def test_too_deep_an_expression_is_a_located_syntax_error(body, shape, tmp_path):
    path = tmp_path / "too_deep.cell"
    path.write_text(_cell(body, shape), encoding="utf-8")
    with pytest.raises(CellSyntaxError, match="nested too deeply") as info:
        cortexc.load(path, out_dir=tmp_path / "out")
    loc = info.value.loc
    assert loc is not None and loc.file == str(path) and loc.line in (3, 7)
