"""Node batching and kernel fusion: a specialised, hoisted `Cell` -> `Program`.

Requires: a verified cell with a leaf body (after `specialize`); `hoist` is
optional. Guarantees: one kernel per body, launched over all nodes of a
level at once (every tree of the forest together), and inside a kernel the
fewest passes over memory we know how to make without a cost model:

* matrix products with a param on the left and a per-row vector on the
  right become GEMMs over the tile's rows; products that share the right
  operand (``U_iou @ hc`` and ``U_f @ hc``) are stacked into one GEMM whose
  weights are packed once at load time;
* a GEMM reads its left rows through row pointers, so gathering children's
  states (``child.h``, ``child[1].h``), hoisted rows or embedding rows costs
  nothing: the gather is fused into the GEMM;
* elementwise expressions are inlined into the loops that consume them
  (the gate epilogue is one loop per materialised value); a value is
  materialised only when it is used twice, feeds a GEMM or a small matmul,
  or is itself a reduction, softmax, concat or product;
* reductions over children evaluate their argument's expression per child
  edge inside the reduction loop (``sum(f * child.c)`` never stores ``f * child.c``).
"""

from __future__ import annotations

import math
from collections import defaultdict

from cortexc.ir.cell import Body, Cell, Value
from cortexc.ir.ops import BINARY_OPS, LEAF_OPS, REDUCE_OPS, UNARY_OPS, VECTOR_OPS, Domain, Op
from cortexc.ir.program import (
    Buffer,
    Gemm,
    Kernel,
    Loop,
    PackedWeight,
    Place,
    PlaceKind,
    Program,
    Reduce,
    RowKind,
    Rows,
    SmallMatmul,
    Softmax,
    Step,
    Store,
)

ELEMENTWISE = BINARY_OPS | UNARY_OPS


def width(value: Value) -> int:
    return math.prod(value.shape) if value.shape else 1


def row_kind(value: Value) -> RowKind:
    return RowKind.CHILD if value.domain == Domain.CHILD else RowKind.NODE


def schedule(cell: Cell) -> Program:
    if cell.leaf is None:
        raise ValueError("schedule needs a specialised cell (run `specialize` first)")
    packed: dict[tuple[str, ...], PackedWeight] = {}
    kernels = []
    if cell.pre is not None:
        kernels.append(_kernel("pre", Rows.INTERNAL, cell.pre, cell, packed, "pre"))
    kernels.append(_kernel("leaf", Rows.LEVEL, cell.leaf, cell, packed, "state"))
    kernels.append(_kernel("node", Rows.LEVEL, cell.node, cell, packed, "state"))
    for out in cell.outputs:
        rows = Rows.ROOTS if out.at_root else Rows.NODES
        kernels.append(_kernel(f"out_{out.name}", rows, out.body, cell, packed, "output"))
    return Program(cell, tuple(kernels), tuple(packed.values()))


def _gemm_groups(body: Body) -> dict[int, list[int]]:
    """Matmuls `param matrix @ per-row vector`, grouped by their right operand."""
    groups: dict[int, list[int]] = defaultdict(list)
    for index, value in enumerate(body.values):
        if value.op == Op.MATMUL:
            left, right = (body.values[a] for a in value.args)
            if left.op == Op.PARAM and len(right.shape) == 1:
                groups[value.args[1]].append(index)
    return dict(groups)


def _kernel(name: str, rows: Rows, body: Body, cell: Cell, packed: dict, target: str) -> Kernel:
    values = body.values
    uses = [0] * len(values)
    for value in values:
        for arg in value.args:
            uses[arg] += 1
    for _, index in body.results:
        uses[index] += 1
    groups = _gemm_groups(body)
    in_gemm = {member: operand for operand, members in groups.items() for member in members}

    # which values must have an address (a row pointer): GEMM and small-matmul operands
    needs_address = [False] * len(values)
    for operand in groups:
        needs_address[operand] = True
    for index, value in enumerate(values):
        if value.op == Op.MATMUL and index not in in_gemm:
            for arg in value.args:
                needs_address[arg] = True
    for index in reversed(range(len(values))):  # through views to what they view
        if needs_address[index] and values[index].op in (Op.SLICE, Op.EXPAND):
            needs_address[values[index].args[0]] = True

    places: list[Place] = []
    buffers: list[Buffer] = []
    steps: list[Step] = []
    group_buffer: dict[int, str] = {}

    def new_buffer(value: Value, buffer_width: int | None = None, prefix: str = "b") -> str:
        buffer_name = f"{prefix}{len(buffers)}"
        buffers.append(Buffer(buffer_name, row_kind(value), buffer_width or width(value)))
        return buffer_name

    for index, value in enumerate(values):
        op = value.op
        if op == Op.CONST and needs_address[index]:
            places.append(Place(PlaceKind.BUFFER, new_buffer(value)))
            steps.append(Loop(index, places[-1].buffer, 0, row_kind(value), width(value)))
        elif op in LEAF_OPS or op == Op.EMBED:
            places.append(Place(PlaceKind.SOURCE))
        elif op == Op.SLICE:
            base = places[value.args[0]]
            column = base.column + value.attr("lo")
            places.append(Place(base.kind, base.buffer, column if base.kind == PlaceKind.BUFFER else 0))
        elif op == Op.EXPAND:
            places.append(Place(PlaceKind.INLINE))
        elif index in in_gemm:
            operand = in_gemm[index]
            members = groups[operand]
            if operand not in group_buffer:
                total = sum(values[m].shape[0] for m in members)
                group_buffer[operand] = new_buffer(value, total, "g")
                weights = tuple(values[values[m].args[0]].name for m in members)
                k = values[operand].shape[0]
                if weights not in packed:
                    packed[weights] = PackedWeight(f"w{len(packed)}", weights, total, k)
                steps.append(Gemm(group_buffer[operand], operand, packed[weights].name, weights,
                                  row_kind(value), k, total))
            column = sum(values[m].shape[0] for m in members[: members.index(index)])
            places.append(Place(PlaceKind.BUFFER, group_buffer[operand], column))
        elif op == Op.MATMUL:
            a, b = (values[x] for x in value.args)
            m, k = a.shape
            n = b.shape[1] if len(b.shape) == 2 else 1
            places.append(Place(PlaceKind.BUFFER, new_buffer(value)))
            steps.append(SmallMatmul(index, places[-1].buffer, row_kind(value), m, k, n))
        elif op in REDUCE_OPS:
            places.append(Place(PlaceKind.BUFFER, new_buffer(value)))
            steps.append(Reduce(index, places[-1].buffer, width(value)))
        elif op in VECTOR_OPS:
            places.append(Place(PlaceKind.BUFFER, new_buffer(value)))
            steps.append(Softmax(index, places[-1].buffer, row_kind(value), width(value), op == Op.LOG_SOFTMAX))
        elif op == Op.CONCAT:
            buffer_name = new_buffer(value)
            places.append(Place(PlaceKind.BUFFER, buffer_name))
            column = 0
            for arg in value.args:
                steps.append(Loop(arg, buffer_name, column, row_kind(value), width(values[arg]), compute=False))
                column += width(values[arg])
        elif op in ELEMENTWISE:
            if needs_address[index] or (uses[index] >= 2 and op != Op.NEG):
                places.append(Place(PlaceKind.BUFFER, new_buffer(value)))
                steps.append(Loop(index, places[-1].buffer, 0, row_kind(value), width(value)))
            else:
                places.append(Place(PlaceKind.INLINE))
        else:  # pragma: no cover - every op is placed above
            raise NotImplementedError(f"schedule has no rule for {op}")

    for result_name, index in body.results:
        steps.append(Store(index, target, result_name, width(values[index])))
    child_ks = tuple(sorted({v.attr("k") for v in values if v.op == Op.CHILD_STATE_AT}))
    return Kernel(name, rows, body, tuple(places), tuple(buffers), tuple(steps), child_ks)
