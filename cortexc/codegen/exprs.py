"""Expressions: every op's C text (from the op registry, `ir.ops.OPS`), and where each value is read from.

`KernelExprs.ref(value, rows, row, col)` is the C expression of element
`col` of a value for row `row` of a loop over `rows` (node rows ``r`` or
child-edge rows ``e``); it follows the value's `Place`: a param, input,
state, hoisted row or embedding row is read where it lives, a materialised
value from its tile buffer, and an inline value is expanded from its
operands. The same text serves C and CUDA.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from cortexc.ir.cell import Cell, Value
from cortexc.ir.ops import OPS, OpDef
from cortexc.ir.program import Adjoints, Kernel, PlaceKind, RowKind, row_kind, width


def _form(definition: OpDef, inline: bool) -> tuple[str, str, tuple[str, ...]]:
    """An op's C text, its helper and the helper's own helpers: the libm-free ones (`OpDef.c_inline`) in a
    kernel with `Kernel.inline_gates` where the op has them."""
    if inline and definition.c_inline:
        return definition.c_inline, definition.c_inline_helper, definition.c_inline_needs
    return definition.c, definition.c_helper, definition.c_helper_needs


def c_helpers(kernels: Iterable[Kernel]) -> list[str]:
    """The C helper functions the texts of the kernels' ops call, in registry order (without qualifiers);
    a helper's own helpers come just before it."""
    used = {(v.op, k.inline_gates) for k in kernels for v in k.body.values}
    helpers: list[str] = []
    for op, definition in OPS.items():
        for inline in (False, True):
            _, helper, needs = _form(definition, inline)
            if (op, inline) in used and helper:
                helpers.extend(h for h in (*needs, helper) if h not in helpers)
    return helpers


def input_row(cell: Cell, node: str) -> str:
    """The row of the node inputs that node `node` (C text) reads: its own, or a graph cell's node at any of
    its unrolled steps (`runtime.graph`), the graph node's."""
    return f"({node} % call->step_nodes)" if cell.steps is not None else node


def prev_row(node: str) -> str:
    """The state row of node `node` (C text) one step earlier: the unrolled steps' row N before, modulo the
    rows the states have (every step's, or a graph inference's two, used in turn: `runtime.graph`)."""
    return f"(({node} + call->state_rows - call->step_nodes) % call->state_rows)"


def param_symbol(name: str) -> str:
    return f"P_{name}"


def input_symbol(name: str) -> str:
    return f"I_{name}"


def state_symbol(name: str) -> str:
    return f"S_{name}"


def hoisted_symbol(name: str) -> str:
    return f"H_{name}"


def saved_symbol(name: str) -> str:
    return f"SV_{name}"


def output_symbol(name: str) -> str:
    return f"O_{name}"


def gradient_symbol(kind: str, name: str) -> str:
    """Forest-wide gradient arrays: d of a state, a hoisted row, an input, a param; upstream of an output."""
    return {"state": "dS", "pre": "dH", "input": "dI", "param": "dP", "output": "G"}[kind] + f"_{name}"


class KernelExprs:
    """Renders reads and computations of the values of one kernel's body."""

    def __init__(
        self, cell: Cell, kernel: Kernel, train: bool = True, saved: Mapping[str, tuple[int, str]] | None = None
    ):
        self.train = train  # False: the evaluation-mode text, where dropout(e, p) is e (no mask work at all)
        self.cell = cell
        self.kernel = kernel
        # each saved array's floats per row and its first row's position (`passes.saving`)
        self.saved = saved or {}
        self.values = kernel.body.values
        self.buffer_width = {b.name: b.width for b in kernel.buffers}
        self.grid = 0  # while a Loop step is rendered as rows p x columns q of this width: its `col_split`

    def adjoint(self, name: str, row: str, row_width: int, col: str) -> str:
        """The incoming gradient of result `name` for this kernel's row."""
        source = self.kernel.adjoints
        if source == Adjoints.STATE:
            return f"{gradient_symbol('state', name)}[nd[{row}] * {row_width} + {col}]"
        if source == Adjoints.PRE:
            return f"{gradient_symbol('pre', name)}[(pre_base + {row}) * {row_width} + {col}]"
        return f"{gradient_symbol('output', name)}[(pos0 + {row}) * {row_width} + {col}]"

    def saved_row(self, name: str, row: str) -> str:
        """The first element of row `row`'s row of saved array `name` (rows by level-order position)."""
        saved_width, first = self.saved[name]
        return f"({saved_symbol(name)} + (pos0 - {first} + {row}) * {saved_width})"

    def ref(self, index: int, rows: RowKind, row: str, col: str) -> str:
        """Element `col` of value `index` for row `row` of a loop over `rows`."""
        value = self.values[index]
        if row_kind(value) == RowKind.NODE and rows == RowKind.CHILD:
            rows, row = RowKind.NODE, f"er[{row}]"  # a node value seen from one of its child edges
        if width(value) == 1:  # a scalar or a [1] vector: broadcast to every column of its user
            col = "0"
        place = self.kernel.places[index]
        if place.kind == PlaceKind.BUFFER:
            offset = f"{place.column} + {col}" if place.column else col
            return f"{place.buffer}[({row}) * {self.buffer_width[place.buffer]} + {offset}]"
        return OPS[value.op].c_rule(_Element(self, value, rows, row, col), value)

    def address(self, index: int, rows: RowKind, row: str) -> str:
        """A pointer to the row's first element (GEMM and small-matmul operands)."""
        return f"&{self.ref(index, rows, row, '0')}"

    def compute(self, index: int, rows: RowKind, row: str, col: str) -> str:
        """The value's own expression (how a materialising loop computes it): its op's C rule."""
        value = self.values[index]
        if row_kind(value) == RowKind.NODE and rows == RowKind.CHILD:
            rows, row = RowKind.NODE, f"er[{row}]"
        if width(value) == 1:  # a scalar or a [1] vector: broadcast to every column of its user
            col = "0"
        return OPS[value.op].c_rule(_Element(self, value, rows, row, col), value)


#: the symbol of each forest array an op's C rule reads (`Emitter.read`)
_ARRAYS = {"input": input_symbol, "state": state_symbol, "pre": hoisted_symbol}


class _Element:
    """One element of one value in one row of a kernel's loop, as an op's C rule sees it (`ir.ops.Emitter`)."""

    def __init__(self, exprs: KernelExprs, value: Value, rows: RowKind, row: str, col: str):
        self.exprs, self.value, self.rows, self.row, self.col = exprs, value, rows, row, col
        self.train = exprs.train
        self.inline_gates = exprs.kernel.inline_gates

    def arg(self, position: int, col: str | None = None) -> str:
        return self.exprs.ref(self.value.args[position], self.rows, self.row, self.col if col is None else col)

    def arg_value(self, position: int) -> Value:
        return self.exprs.values[self.value.args[position]]

    def read(self, array: str, name: str, row: str, width: int) -> str:
        if row == "node" and array == "input":
            at = input_row(self.exprs.cell, f"nd[{self.row}]")
        elif row == "node":
            at = f"nd[{self.row}]"
        elif row == "child":
            at = f"ch[{self.row}]"
        elif row == "pre":
            at = f"(pre_base + {self.row})"
        elif row == "edge":  # rows of an edge input are in the kernels' child-edge order (`edge_order`)
            at = f"(e0 + {self.row})"
        elif row == "prev":  # a graph cell's unrolled steps: the node one step earlier (`runtime.graph`)
            at = prev_row(f"nd[{self.row}]")
        else:  # kid<k>: child k of this node
            at = f"{row}[{self.row}]"
        return f"{_ARRAYS[array](name)}[{at} * {width} + {self.col}]"

    def param(self, name: str, offset: str) -> str:
        return f"{param_symbol(name)}[{offset}]"

    def index(self, name: str) -> str:
        return f"(int64_t){input_symbol(name)}[{input_row(self.exprs.cell, f'nd[{self.row}]')}]"

    def edge_index(self, name: str) -> str:
        return f"(int64_t){input_symbol(name)}[e0 + {self.row}]"

    def adjoint(self, name: str, width: int) -> str:
        return self.exprs.adjoint(name, self.row, width, self.col)

    def saved(self, name: str, column: int) -> str:
        return f"{self.exprs.saved_row(name, self.row)}[{column} + {self.col}]"

    def num_children(self) -> str:
        return f"(float)(eb[{self.row} + 1] - eb[{self.row}])"

    def has_child(self, k: int) -> str:
        return f"(eb[{self.row} + 1] - eb[{self.row}] > {k})"

    def col_split(self, k: int) -> tuple[str, str]:
        if self.col == "j" and self.exprs.grid == k:  # the loop walks rows p and columns q (`dialect.for_rows_grid`)
            return "p", "q"
        if self.col == f"p * {k} + r":  # a small matmul's operand, element (p, r) (`small_matmul` in kernels.j2)
            return "p", "r"
        return f"({self.col}) / {k}", f"({self.col}) % {k}"

    def edge_position(self) -> str:
        return f"(float)(({self.row}) - eb[er[{self.row}]])"

    def edge_siblings(self) -> str:
        return f"(float)(eb[er[{self.row}] + 1] - eb[er[{self.row}]])"

    def node(self) -> str:
        return f"nd[er[{self.row}]]" if self.rows == RowKind.CHILD else f"nd[{self.row}]"

    def slot(self) -> str:
        return f"1 + ({self.row}) - eb[er[{self.row}]]" if self.rows == RowKind.CHILD else "0"
