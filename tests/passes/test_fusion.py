"""What the scheduler keeps out of tile scratch, and how padded gradient rows are looped.

- A value read only through slices that do not overlap, each used once (an LSTM's gate pre-activations
  ``g``, four gates), is inlined into the gate loops: each element is still computed once, and never
  stored and read back. Overlapping or repeated slices keep it materialised (no element computed twice).
- A loop whose value adds padded terms (the gradient of those gates: four [H] rows put back in one [4H]
  row) runs one loop per range of columns, so the compiler drops the terms that are 0 there.
Numerics of both: every example against the interpreter (tests/test_compiled*.py), bitwise the same as
before (benchmarks/bench_ab.py reports same bits).
"""

from __future__ import annotations

import re

import pytest

from cortexc.codegen.kernel_context import _pad_spans
from cortexc.ir.ops import Op
from cortexc.ir.program import KernelRole, PlaceKind
from cortexc.options import CompileOptions
from cortexc.pipeline import Source, run_stages
from tests.helpers import EXAMPLES


def _program(text: str, name: str = "t.cell"):
    (program,) = run_stages(Source(text, name), CompileOptions.make(), until="schedule")
    return program


def _sliced_value_place(text: str):
    """The place of the node kernel's value that the slices read (g reads a child: not hoisted)."""
    kernel = _program(text).kernel("node")
    values = kernel.body.values
    bases = {v.args[0] for v in values if v.op == Op.SLICE}
    (base,) = bases
    return kernel.places[base].kind


def test_an_lstm_s_gates_are_inlined_not_stored():
    program = _program((EXAMPLES / "lstm.cell").read_text(encoding="utf-8"), "lstm.cell")
    node = program.kernel("node")
    values = node.body.values
    (gates,) = {v.args[0] for v in values if v.op == Op.SLICE}
    assert values[gates].shape == (256,) and node.places[gates].kind == PlaceKind.INLINE
    assert all(b.width <= 64 for b in node.buffers if b.name.startswith("b")), node.buffers


@pytest.mark.parametrize(
    "expr, kind",
    [
        ("sigmoid(g[0:H]) * tanh(g[H:2*H])", PlaceKind.INLINE),  # disjoint, once each
        ("sigmoid(g[0:H]) * tanh(g[4:H+4])", PlaceKind.BUFFER),  # overlapping: elements 4..15 twice
        ("g[0:H] * g[0:H]", PlaceKind.BUFFER),  # the same slice twice
    ],
)
def test_only_disjoint_single_use_slices_inline_their_base(expr, kind):
    text = f"""cell C on tree(arity = 1) {{
    dim X = 8, H = 16
    input x[X]
    param W[2*H, X], U[2*H, H]
    state h[H]
    node {{
        g = tanh(W @ x + U @ child[0].h)
        h = {expr}
    }}
}}"""
    assert _sliced_value_place(text) == kind


def test_a_slice_used_twice_keeps_its_base_stored():
    text = """cell C on tree(arity = 1) {
    dim X = 8, H = 16
    input x[X]
    param W[2*H, X], U[2*H, H]
    state h[H], c[H]
    node {
        g = tanh(W @ x + U @ child[0].h)
        a = g[0:H]
        h = a * sigmoid(g[H:2*H])
        c = a
    }
}"""
    assert _sliced_value_place(text) == PlaceKind.BUFFER


def test_the_lstm_gate_gradient_row_is_looped_per_gate():
    program = _program((EXAMPLES / "lstm.cell").read_text(encoding="utf-8"), "lstm.cell")
    kernel = next(k for k in program.kernels if k.role == KernelRole.GRAD_NODE)
    padded = [s for s in kernel.steps if getattr(s, "width", 0) == 256 and getattr(s, "compute", False)]
    assert padded, kernel.steps
    assert _pad_spans(kernel, padded[0].value, 256) == [(0, 64), (64, 128), (128, 192), (192, 256)]
    # a row without padded terms is one range
    assert _pad_spans(program.kernel("node"), len(program.kernel("node").body.values) - 1, 64) == [(0, 64)]


def test_the_rendered_gradient_loops_cover_each_gate_once():
    (rendered,) = run_stages(
        Source((EXAMPLES / "lstm.cell").read_text(encoding="utf-8"), "lstm.cell"), CompileOptions.make(),
        until="render",
    )  # fmt: skip
    for target, text in rendered.sources:
        grad = text[text.index("cx_kernel_grad_node") :]
        grad = grad[: grad.index("\n}\n")]
        if target == "c":
            spans = re.findall(r"for \(int64_t j = (\d+); j < (\d+); \+\+j\)", grad)
        else:
            spans = [(lo, str(int(lo) + int(w))) for w, lo in re.findall(r"\* (\d+); t_ \+= blockDim\.x\) \{\s*"
                     r"const int64_t i = t_ / \1, j = (\d+) \+", grad)]  # fmt: skip
        gates = [(0, 64), (64, 128), (128, 192), (192, 256)]
        spans = [(int(a), int(b)) for a, b in spans]
        assert any(spans[i : i + 4] == gates for i in range(len(spans))), (target, spans)
