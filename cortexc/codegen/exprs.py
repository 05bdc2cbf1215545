"""Expressions: every op's C text (from the op registry, `ir.ops.OPS`), and where each value is read from.

`KernelExprs.ref(value, rows, row, col)` is the C expression of element
`col` of a value for row `row` of a loop over `rows` (node rows ``r`` or
child-edge rows ``e``); it follows the value's `Place`: a param, input,
state, hoisted row or embedding row is read where it lives, a materialised
value from its tile buffer, and an inline value is expanded from its
operands. The same text serves C and CUDA.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from cortexc.ir.cell import Cell, Value
from cortexc.ir.ops import OPS, Op, OpDef
from cortexc.ir.program import Adjoints, Kernel, PlaceKind, RowKind, row_kind, slice_offset, width


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


def c_text(op: Op, inline: bool) -> str:
    """The C text of an elementwise op in a kernel with (or without) `Kernel.inline_gates`."""
    return _form(OPS[op], inline)[0]


def float_literal(value: float) -> str:
    if math.isnan(value):
        return "NAN"
    if math.isinf(value):
        return "INFINITY" if value > 0 else "(-INFINITY)"
    return f"{float(value)!r}f"


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
        if place.kind == PlaceKind.SOURCE:
            return self._source(value, rows, row, col)
        return self.compute(index, rows, row, col)

    def address(self, index: int, rows: RowKind, row: str) -> str:
        """A pointer to the row's first element (GEMM and small-matmul operands)."""
        return f"&{self.ref(index, rows, row, '0')}"

    def compute(self, index: int, rows: RowKind, row: str, col: str) -> str:
        """The value's own expression (how a materialising loop computes it)."""
        value = self.values[index]
        if row_kind(value) == RowKind.NODE and rows == RowKind.CHILD:
            rows, row = RowKind.NODE, f"er[{row}]"
        if width(value) == 1:  # a scalar or a [1] vector: broadcast to every column of its user
            col = "0"
        op = value.op
        if op == Op.CONST:
            return float_literal(value.attr("value"))
        if op == Op.SLICE:
            return self.ref(value.args[0], rows, row, f"{col} + {self._slice_offset(value)}")
        if op == Op.EXPAND:
            return self.ref(value.args[0], rows, row, col)
        if op == Op.TRANSPOSE:  # element (i, j) of the [K, M] transpose is (j, i) of the [M, K] matrix
            m, k = self.values[value.args[0]].shape
            return self.ref(value.args[0], rows, row, f"(({col}) % {m}) * {k} + ({col}) / {m}")
        if op == Op.OUTER:
            k = value.shape[1]
            a, b = value.args
            return f"({self.ref(a, rows, row, f'({col}) / {k}')} * {self.ref(b, rows, row, f'({col}) % {k}')})"
        if op == Op.PAD:
            arg = self.values[value.args[0]]
            lo, size = slice_offset(arg, value.attr("lo")), width(arg)
            inner = self.ref(value.args[0], rows, row, f"({col}) - {lo}")
            return f"(({col}) >= {lo} && ({col}) < {lo + size} ? {inner} : 0.0f)"
        operands = [self.ref(arg, rows, row, col) for arg in value.args]
        definition = OPS[op]
        if definition.c_identity is not None and not self.train:
            return operands[0]
        if definition.c_identity is not None:  # the element's identity: its index, node id and child slot
            node_row = f"er[{row}]" if rows == RowKind.CHILD else row
            slot = f"1 + ({row}) - eb[er[{row}]]" if rows == RowKind.CHILD else "0"
            where = {"elem": col, "node": f"nd[{node_row}]", "slot": slot}
            return definition.c.format(*operands, **where, **definition.c_identity(dict(value.attrs)))
        return c_text(op, self.kernel.inline_gates).format(*operands)

    def _slice_offset(self, value: Value) -> int:
        """Where a slice starts in its base's flattened row (rows of a matrix count whole rows)."""
        return slice_offset(self.values[value.args[0]], value.attr("lo"))

    def _source(self, value: Value, rows: RowKind, row: str, col: str) -> str:
        op = value.op
        if op == Op.CONST:
            return float_literal(value.attr("value"))
        if op == Op.PARAM:
            return f"{param_symbol(value.name)}[{col}]"
        if op == Op.SLICE:
            return self.ref(value.args[0], rows, row, f"{col} + {self._slice_offset(value)}")
        if op == Op.NUM_CHILDREN:
            return f"(float)(eb[{row} + 1] - eb[{row}])"
        if op == Op.EMBED:
            table, index = (self.values[a] for a in value.args)
            position = f"(int64_t){input_symbol(index.name)}[nd[{row}]]"
            return f"{param_symbol(table.name)}[{position} * {table.shape[1]} + {col}]"
        row_width = width(value)
        if op == Op.INPUT:
            return f"{input_symbol(value.name)}[nd[{row}] * {row_width} + {col}]"
        if op == Op.STATE:
            return f"{state_symbol(value.name)}[nd[{row}] * {row_width} + {col}]"
        if op == Op.CHILD_STATE:
            return f"{state_symbol(value.name)}[ch[{row}] * {row_width} + {col}]"
        if op == Op.CHILD_STATE_AT:
            return f"{state_symbol(value.name)}[kid{value.attr('k')}[{row}] * {row_width} + {col}]"
        if op == Op.HOISTED:
            return f"{hoisted_symbol(value.name)}[(pre_base + {row}) * {row_width} + {col}]"
        if op == Op.ADJOINT:
            return self.adjoint(value.name, row, row_width, col)
        if op == Op.SAVED:
            return f"{self.saved_row(value.name, row)}[{value.attr('column')} + {col}]"
        raise NotImplementedError(f"no source read for {op}")  # pragma: no cover
