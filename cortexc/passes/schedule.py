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
  or is itself a reduction, softmax, child softmax, concat or product;
* reductions over children evaluate their argument's expression per child
  edge inside the reduction loop (``sum(f * child.c)`` never stores ``f * child.c``).

Gradient bodies (from `autodiff`) become kernels of the same kinds, run in
reverse level order. Their weight gradients (``outer(g, x)`` summed over
nodes, and over child edges for per-child products) accumulate into
per-thread buffers with a transposed GEMM per tile; ``W^T @ g`` is an
ordinary GEMM with the transposed weight packed once.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import replace

from cortexc.ir.cell import Body, Cell, GradKind, GradTarget, Value
from cortexc.ir.ops import OPS, Op, Placement, StepKind
from cortexc.ir.program import (
    AccumOuter,
    AccumSum,
    Buffer,
    ChildSoftmax,
    Gemm,
    Kernel,
    KernelRole,
    Loop,
    PackedWeight,
    Phase,
    Place,
    PlaceKind,
    Program,
    Reduce,
    Row,
    RowKind,
    Rows,
    SavedValues,
    SmallMatmul,
    Step,
    Store,
    StoreMode,
    StoreTarget,
    Sweep,
    row_kind,
    slice_offset,
    width,
)

#: the deepest expression tree a loop inlines; a deeper one materialises the value that would pass it (a
#: 166-step chain of `t = tanh(t) + b` is then a few loops, not one expression codegen recurses through)
MAX_INLINE_DEPTH = 32


def schedule(cell: Cell) -> Program:
    if cell.leaf is None:
        raise ValueError("schedule needs a specialised cell (run `specialize` first)")
    packed: dict[tuple, PackedWeight] = {}
    kernels = []
    if cell.pre is not None:
        kernels.append(_kernel(KernelRole.PRE, Rows.INTERNAL, cell.pre, cell, packed))
    kernels.append(_kernel(KernelRole.LEAF, Rows.LEVEL, cell.leaf, cell, packed))
    kernels.append(_kernel(KernelRole.NODE, Rows.LEVEL, cell.node, cell, packed))
    for out in cell.outputs:
        rows = Rows.ROOTS if out.at_root else Rows.NODES
        kernels.append(_kernel(KernelRole.OUTPUT, rows, out.body, cell, packed, out.name))
    if cell.grads is not None:
        grads = cell.grads
        for out, body in zip(cell.outputs, grads.outputs):
            rows = Rows.ROOTS if out.at_root else Rows.NODES
            kernels.append(_kernel(KernelRole.GRAD_OUTPUT, rows, body, cell, packed, out.name))
        kernels.append(_kernel(KernelRole.GRAD_NODE, Rows.LEVEL, grads.node, cell, packed))
        kernels.append(_kernel(KernelRole.GRAD_LEAF, Rows.LEVEL, grads.leaf, cell, packed))
        if grads.pre is not None:
            kernels.append(_kernel(KernelRole.GRAD_PRE, Rows.INTERNAL, grads.pre, cell, packed))
    forward, backward = _phases(cell, kernels)
    return Program(cell, tuple(kernels), tuple(packed.values()), accumulator_layout(cell, kernels), forward, backward)


def accumulator_layout(cell: Cell, kernels: list[Kernel]) -> tuple[tuple[str, int, int], ...]:
    """(param, offset, floats) of every param some kernel accumulates a gradient of, by name."""
    accumulated = sorted({s.param for k in kernels for s in k.steps if isinstance(s, AccumOuter | AccumSum)})
    accumulators, offset = [], 0
    for name in accumulated:
        size = math.prod(cell.param(name).shape)
        accumulators.append((name, offset, size))
        offset += size
    return tuple(accumulators)


#: the sweep of each kernel role over its row set
_SWEEPS = {
    KernelRole.PRE: Sweep.ALL,
    KernelRole.LEAF: Sweep.LEAVES,
    KernelRole.NODE: Sweep.UP,
    KernelRole.LEAF_SAVING: Sweep.LEAVES,
    KernelRole.NODE_SAVING: Sweep.UP,
    KernelRole.NODE_DIRECT: Sweep.UP,
    KernelRole.OUTPUT: Sweep.ALL,
    KernelRole.GRAD_OUTPUT: Sweep.ALL,
    KernelRole.GRAD_NODE: Sweep.DOWN,
    KernelRole.GRAD_LEAF: Sweep.LEAVES,
    KernelRole.GRAD_PRE: Sweep.ALL,
}


def _phases(cell: Cell, kernels: list[Kernel]) -> tuple[tuple[Phase, ...], tuple[Phase, ...]]:
    """The launch order. Forward: the hoisted projections (every internal node at once: they read no
    state), the leaves, each level bottom up, the outputs. Backward: the output gradients (each only
    when its output has an upstream gradient), each level top down, the leaves, the hoisted rows."""
    outputs = [o.name for o in cell.outputs]
    forward: list[Phase] = []
    backward: list[Phase] = []
    for kernel in kernels:
        phase = Phase(kernel.name, _SWEEPS[kernel.role])
        if kernel.role == KernelRole.GRAD_OUTPUT:
            phase = replace(phase, upstream=outputs.index(kernel.output))
        (backward if kernel.role.is_gradient else forward).append(phase)
    return tuple(forward), tuple(backward)


def schedule_kernel(
    role: KernelRole, rows: Rows, body: Body, cell: Cell, packed: dict, saved: SavedValues | None = None
) -> Kernel:
    """`_kernel` for a program pass that schedules a body of its own (`packed`: the program's packed
    weights by their params, which the pass extends and keeps)."""
    return _kernel(role, rows, body, cell, packed, saved=saved)


def _gemm_left(body: Body, value: Value) -> tuple[str, bool] | None:
    """The param of a `param @ vector` product (transposed for `transpose(param) @ vector`), else None."""
    left, right = (body.values[a] for a in value.args)
    if len(right.shape) != 1:
        return None
    if left.op == Op.PARAM:
        return left.name, False
    if left.op == Op.TRANSPOSE and body.values[left.args[0]].op == Op.PARAM:
        return body.values[left.args[0]].name, True
    return None


def use_counts(body: Body) -> list[int]:
    """How many times each value is read: as an operand of a later value, and as a result of the body."""
    uses = [0] * len(body.values)
    for value in body.values:
        for arg in value.args:
            uses[arg] += 1
    for _, index in body.results:
        uses[index] += 1
    return uses


def stacked_left(body: Body, value: Value) -> tuple[str, ...] | None:
    """The params of a product whose left is params side by side, ``transpose(concat(transpose(P_1), ...))``
    (`passes.direct` writes ``P_1 @ a + P_2 @ b`` so), else None."""
    left, right = (body.values[a] for a in value.args)
    if len(right.shape) != 1 or left.op != Op.TRANSPOSE:
        return None
    stacked = body.values[left.args[0]]
    if stacked.op != Op.CONCAT:
        return None
    names = []
    for arg in stacked.args:
        column = body.values[arg]
        if column.op != Op.TRANSPOSE or body.values[column.args[0]].op != Op.PARAM:
            return None
        names.append(body.values[column.args[0]].name)
    return tuple(names)


def packed_key(weight: PackedWeight) -> tuple:
    """What identifies a packed weight among a program's: its params, laid out how (and which transposed)."""
    return (tuple(zip(weight.params, weight.transposed)), weight.blocks)


def _block_row(body: Body, value: Value) -> list[tuple[str, bool]]:
    """The block row a grouped product adds to its GEMM's packed weight: (param, transposed) side by side,
    one pair for ``P @ v`` or ``P^T @ v``, several for params side by side (`stacked_left`)."""
    stacked = stacked_left(body, value)
    if stacked is not None:
        return [(name, False) for name in stacked]
    left = _gemm_left(body, value)
    if left is None:  # pragma: no cover - only grouped matmuls are asked
        raise ValueError("not a param @ vector product")
    return [left]


def _gemm_groups(body: Body) -> dict[int, list[int]]:
    """Matmuls `param matrix @ per-row vector` (or params side by side @ it), grouped by their right
    operand: one GEMM each, whatever mix of block rows its products are (equal operands are one value:
    `BodyBuilder` shares them)."""
    groups: dict[int, list[int]] = defaultdict(list)
    for index, value in enumerate(body.values):
        if value.op == Op.MATMUL and (stacked_left(body, value) is not None or _gemm_left(body, value) is not None):
            groups[value.args[1]].append(index)
    return dict(groups)


def _accumulation_terms(
    body: Body, index: int, uses: list[int], rows: RowKind = RowKind.NODE
) -> list[tuple[int, RowKind]]:
    """A per-node param gradient as a sum of terms over rows: through `add`s and sums over children
    that nothing else uses (a value used elsewhere too is a term of its own)."""
    value = body.values[index]
    if uses[index] == 1:
        same_shapes = all(body.values[a].shape == value.shape for a in value.args)
        if value.op == Op.ADD and same_shapes:
            return _accumulation_terms(body, value.args[0], uses, rows) + _accumulation_terms(
                body, value.args[1], uses, rows
            )
        if value.op == Op.SUM and rows == RowKind.NODE:
            return _accumulation_terms(body, value.args[0], uses, RowKind.CHILD)
    return [(index, row_kind(value) if rows == RowKind.NODE else rows)]


def _element_uses(body: Body, uses: list[int]) -> list[int]:
    """How many times an element of each value is read, at most: a slice reads only its own elements, so
    a value read by slices that do not overlap, each used once, has each element read once (an LSTM's
    gate pre-activations ``g``, sliced into four gates: inlined into the gate loops, never stored), and one
    whose slice is used twice is read twice (materialised: not computed twice inline)."""
    values = body.values
    counts = list(uses)
    slices: dict[int, list[int]] = defaultdict(list)
    for index, value in enumerate(values):
        if value.op == Op.SLICE:
            slices[value.args[0]].append(index)
    for base in sorted(slices, reverse=True):  # a slice of a slice comes after it: counted first
        views = slices[base]
        per_element = [0] * width(values[base])
        for view in views:
            lo = slice_offset(values[base], values[view].attr("lo"))
            for column in range(lo, lo + width(values[view])):
                per_element[column] += counts[view]
        counts[base] = uses[base] - len(views) + max(per_element, default=0)
    return counts


#: where a gradient result goes, and how it is written there (param gradients are accumulated instead)
_GRADIENT_STORES = {
    GradKind.STATE: (StoreTarget.D_STATE, StoreMode.ADD, RowKind.NODE),
    GradKind.CHILD: (StoreTarget.D_CHILD, StoreMode.ADD, RowKind.CHILD),
    GradKind.CHILD_AT: (StoreTarget.D_CHILD_AT, StoreMode.ADD, RowKind.NODE),
    # a node one step earlier is also read by its out-neighbours (their child gradients, added atomically)
    GradKind.PREV: (StoreTarget.D_PREV, StoreMode.ATOMIC_ADD, RowKind.NODE),
    GradKind.HOISTED: (StoreTarget.D_HOISTED, StoreMode.SET, RowKind.NODE),
    GradKind.INPUT: (StoreTarget.D_INPUT, StoreMode.ADD, RowKind.NODE),
    GradKind.EDGE_INPUT: (StoreTarget.D_EDGE_INPUT, StoreMode.ADD, RowKind.CHILD),  # each edge one row
    GradKind.EMBED: (StoreTarget.D_EMBED, StoreMode.ATOMIC_ADD, RowKind.NODE),
}


def _kernel(
    role: KernelRole,
    rows: Rows,
    body: Body,
    cell: Cell,
    packed: dict,
    output: str = "",
    saved: SavedValues | None = None,
) -> Kernel:
    """One body's kernel; with `saved` (a training forward's variant, `passes.saving`) it also stores
    those values of the body in the node's row of the saved array."""
    values = body.values
    uses = use_counts(body)
    for index in saved.values if saved is not None else ():
        uses[index] += 1
    element_uses = _element_uses(body, uses)
    groups = _gemm_groups(body)
    in_gemm = {member: operand for operand, members in groups.items() for member in members}
    # the params side by side of a stacked product (`stacked_left`): its packed weight, never a row of values
    side_by_side = {
        values[values[member].args[0]].args[0]  # the concat under the left's transpose
        for member in in_gemm
        if stacked_left(body, values[member]) is not None
    }

    # param gradients: sums of terms over the rows, accumulated per thread (not stored per node)
    accumulate: list[Step] = []
    glue: set[int] = set()  # adds and sums that only assemble those terms
    for result_name, index in body.results:
        if isinstance(result_name, GradTarget) and result_name.kind == GradKind.PARAM:
            param = result_name.name
            terms = _accumulation_terms(body, index, uses)
            term_ids = {t for t, _ in terms}
            stack = [index]
            while stack:
                current = stack.pop()
                if current not in term_ids:
                    glue.add(current)
                    stack.extend(values[current].args)
            for term, term_rows in terms:
                value = values[term]
                if value.op == Op.OUTER:
                    a, b = value.args
                    accumulate.append(AccumOuter(param, a, b, term_rows, value.shape[0], value.shape[1]))
                else:
                    accumulate.append(AccumSum(param, term, term_rows, width(value)))

    # which values must have an address (a row pointer): GEMM, small-matmul and outer-product operands
    needs_address = [False] * len(values)
    for operand in groups:
        needs_address[operand] = True
    for index, value in enumerate(values):
        if value.op == Op.MATMUL and index not in in_gemm:
            for arg in value.args:
                needs_address[arg] = True
    for step in accumulate:
        if isinstance(step, AccumOuter):
            needs_address[step.a] = needs_address[step.b] = True
    for index in reversed(range(len(values))):  # through views to what they view
        if needs_address[index] and (
            OPS[values[index].op].placement == Placement.VIEW or values[index].op == Op.EXPAND
        ):
            needs_address[values[index].args[0]] = True

    places: list[Place] = []
    buffers: list[Buffer] = []
    steps: list[Step] = []
    group_buffer: dict[int, str] = {}

    saved_at = dict(zip(saved.values, saved.columns)) if saved is not None else {}
    saved_buffer = ""
    if saved is not None:
        saved_buffer = f"sv_{saved.name}"
        buffers.append(Buffer(saved_buffer, RowKind.NODE, saved.width, saved=saved.name))

    def new_buffer(value: Value, buffer_width: int | None = None, prefix: str = "b") -> str:
        buffer_name = f"{prefix}{len(buffers)}"
        buffers.append(Buffer(buffer_name, row_kind(value), buffer_width or width(value)))
        return buffer_name

    def materialize(index: int, value: Value) -> None:
        places.append(Place(PlaceKind.BUFFER, new_buffer(value)))
        steps.append(Loop(index, places[-1].buffer, 0, row_kind(value), width(value)))

    def inline_depth(index: int) -> int:
        """How deep the expression tree of value `index` would be if inlined (its inlined args nest in it)."""
        nested = [depth[a] for a in values[index].args if places[a].kind == PlaceKind.INLINE]
        return 1 + max(nested, default=0)

    def in_a_step(index: int, value: Value) -> None:
        """A value its op's entry computes in a step of its own (`ir.ops.StepKind`), into a new buffer."""
        definition = OPS[value.op]
        buffer_name = new_buffer(value)
        places.append(Place(PlaceKind.BUFFER, buffer_name))
        kind, rows = definition.step, row_kind(value)
        if kind == StepKind.SMALL_MATMUL:
            left, right = (values[x] for x in value.args)
            n = right.shape[1] if len(right.shape) == 2 else 1
            steps.append(SmallMatmul(index, buffer_name, rows, left.shape[0], left.shape[1], n))
        elif kind == StepKind.REDUCE:
            steps.append(Reduce(index, buffer_name, width(value)))
        elif kind == StepKind.CHILD_SOFTMAX:
            steps.append(ChildSoftmax(index, buffer_name, width(value)))
        elif kind == StepKind.ROW:
            steps.append(Row(index, buffer_name, rows, width(values[value.args[0]])))
        else:  # CONCAT: each operand copied into its columns
            column = 0
            for arg in value.args:
                steps.append(Loop(arg, buffer_name, column, rows, width(values[arg]), compute=False))
                column += width(values[arg])

    depth: list[int] = []  # of each value placed INLINE (0 otherwise)
    for index, value in enumerate(values):
        definition = OPS[value.op]
        placement = definition.placement
        if index in glue:
            places.append(Place(PlaceKind.INLINE))  # never read: the accumulation steps take its terms
        elif placement == Placement.SOURCE and not (needs_address[index] and not definition.addressable):
            places.append(Place(PlaceKind.SOURCE))
        elif placement == Placement.SOURCE:  # a constant that must have an address (a GEMM operand)
            materialize(index, value)
        elif placement == Placement.VIEW and needs_address[index] and places[value.args[0]].kind == PlaceKind.INLINE:
            materialize(index, value)  # a view of an expression (a reshaped outer product) has no address of its own
        elif placement == Placement.VIEW:
            base = places[value.args[0]]
            assert definition.view_column is not None  # every VIEW entry says where its window starts
            column = base.column + definition.view_column(values[value.args[0]], value)
            places.append(Place(base.kind, base.buffer, column if base.kind == PlaceKind.BUFFER else 0))
        elif placement == Placement.EXPRESSION or index in side_by_side:
            places.append(Place(PlaceKind.INLINE))
        elif index in in_gemm:
            operand = in_gemm[index]
            members = groups[operand]
            if operand not in group_buffer:
                total = sum(values[m].shape[0] for m in members)
                group_buffer[operand] = new_buffer(value, total, "g")
                k = values[operand].shape[0]
                block_rows = [_block_row(body, values[m]) for m in members]
                pairs = [pair for row in block_rows for pair in row]
                candidate = PackedWeight(
                    f"w{len(packed)}",
                    tuple(p for p, _ in pairs),
                    total,
                    k,
                    tuple(t for _, t in pairs),
                    tuple(len(row) for row in block_rows),
                )
                weight = packed.setdefault(packed_key(candidate), candidate)
                steps.append(
                    Gemm(group_buffer[operand], operand, weight.name, weight.params, row_kind(value), k, total)
                )
            column = sum(values[m].shape[0] for m in members[: members.index(index)])
            places.append(Place(PlaceKind.BUFFER, group_buffer[operand], column))
        elif placement == Placement.STEP:
            in_a_step(index, value)
        else:  # ELEMENTWISE: inline unless read twice, by address, too deep, masked or saved
            too_deep = inline_depth(index) > MAX_INLINE_DEPTH  # long chains: C text and codegen stay shallow
            # dropout in its own loop: one that gcc vectorises (not scalar Philox inside a padded gradient or a
            # staged add) and that codegen versions on the train flag (evaluation mode: a copy, no mask work)
            masked = definition.identity is not None
            if index in saved_at:  # computed straight into the node's row of the saved array
                places.append(Place(PlaceKind.BUFFER, saved_buffer, saved_at[index]))
                steps.append(Loop(index, saved_buffer, saved_at[index], row_kind(value), width(value)))
            elif needs_address[index] or (element_uses[index] >= 2 and value.op != Op.NEG) or too_deep or masked:
                materialize(index, value)
            else:
                places.append(Place(PlaceKind.INLINE))
        depth.append(inline_depth(index) if places[index].kind == PlaceKind.INLINE else 0)

    steps += accumulate
    for index, column in saved_at.items():  # the others: stored from where they are
        if places[index].buffer != saved_buffer:
            steps.append(
                Store(index, StoreTarget.SAVED, saved.name if saved else "", width(values[index]), column=column)
            )
    for result_name, index in body.results:
        value_width = width(values[index])
        if not isinstance(result_name, GradTarget):  # a forward kernel: states, hoisted rows, outputs
            target = {KernelRole.PRE: StoreTarget.PRE, KernelRole.OUTPUT: StoreTarget.OUTPUT}.get(
                role, StoreTarget.STATE
            )
            steps.append(Store(index, target, result_name, value_width))
            continue
        if result_name.kind == GradKind.PARAM:
            continue
        store_target, mode, store_rows = _GRADIENT_STORES[result_name.kind]
        if result_name.kind == GradKind.EMBED:  # a table looked up per child edge (W[edge.rel]) too
            store_rows = row_kind(values[index])
        if cell.shares_read_nodes and result_name.kind in (GradKind.CHILD, GradKind.CHILD_AT):
            mode = StoreMode.ATOMIC_ADD  # a shared child's parents may be in the same level
        if cell.steps is not None and result_name.kind == GradKind.INPUT and role == KernelRole.GRAD_PRE:
            mode = StoreMode.ATOMIC_ADD  # every step of a graph node reads its input row: this launch has them all
        steps.append(
            Store(
                index,
                store_target,
                result_name.name,
                value_width,
                store_rows,
                mode,
                k=result_name.k or 0,
                index_input=result_name.index or "",
            )
        )
    child_ks = tuple(
        sorted(
            {v.attr("k") for v in values if v.op == Op.CHILD_STATE_AT}
            | {s.k for s in steps if isinstance(s, Store) and s.target == StoreTarget.D_CHILD_AT}
        )
    )
    return Kernel(role, rows, body, tuple(places), tuple(buffers), tuple(steps), child_ks, output)
