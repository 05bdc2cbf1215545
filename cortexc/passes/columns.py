"""Column split: which steps of a scheduled kernel may run over a subset of the columns.

Why: a level near the top of a forest has a handful of nodes, far fewer than a GPU has thread blocks.
Cortex's answer ("model persistence") is to cut the *columns* of the recursion among the blocks instead
of the rows: each block owns a few hidden units, keeps the weights of those units in shared memory for
the whole recursion, and computes every node of the level for them. That is only correct when a unit's
columns never need another block's columns within the same node, which this module decides.

Requires: a `Kernel` from `schedule` (its places and steps). Guarantees, when it returns a `ColumnSplit`
with period P: every value the kernel computes is either

* *full* -- needed whole (a GEMM's operand, a softmax or a small matmul and their inputs, a scalar, ...)
  and computed from sources only, so every block can compute it redundantly; or
* *split* -- its width is a multiple of P and its column j reads only column j of split values, column
  j + (a multiple of P) of slices and concatenations, or anything of sources and full values; a GEMM
  output is split column by column.

So a block that owns the residues ``[u0, u0 + nu)`` of P can run every split step over the columns
``q * P + u0 + u`` alone, every full step whole, and write only its columns of split results. It returns
None (with the reason in `why_not`) when some GEMM output is needed whole (a second GEMM on the first's
result would need every block's columns, i.e. a grid barrier inside a node) or the period would be 1.
"""

from __future__ import annotations

import math
from dataclasses import replace

from cortexc.ir.ops import BINARY_OPS, REDUCE_OPS, UNARY_OPS, Op
from cortexc.ir.program import (
    AccumOuter,
    AccumSum,
    ColumnSplit,
    Gemm,
    Kernel,
    KernelRole,
    Loop,
    PlaceKind,
    Program,
    Reduce,
    Store,
    StoreMode,
    slice_offset,
    width,
)

#: ops whose column j reads column j of their operands (scalars broadcast)
_COLUMNWISE = BINARY_OPS | UNARY_OPS | REDUCE_OPS | {Op.EXPAND}


def split_columns(program: Program, granule: int = 1) -> Program:
    """The per-target program pass: the node kernel's column split, and the leaf kernel's and the direct node
    kernel's (`passes.direct`) when their period is the node kernel's (one ownership of columns serves the
    whole launch); other kernels run whole. The
    saving variants (`passes.saving`) run by rows: split, their loops into the saved rows gave other last
    bits than whole (measured: a binary Tree-LSTM at H=144, 1 vs 2 threads), and results may not depend on
    the threads.
    `granule`: the target shares columns in whole runs of that many (the C target: GEMM panels), so a
    period it does not divide is no split there.

    Requires: a scheduled program. Guarantees: ``split`` set on the leaf/node kernels that may be shared
    among blocks by columns (see the module docstring), with a period that `granule` divides; None elsewhere.
    """
    node = program.role(KernelRole.NODE)
    node_split = column_split(node)
    if node_split is not None and node_split.period % granule:
        node_split = None
    leaf_split = column_split(program.role(KernelRole.LEAF))
    if node_split is None or leaf_split is None or leaf_split.period != node_split.period:
        leaf_split = None
    direct = [k for k in program.kernels if k.role == KernelRole.NODE_DIRECT]
    direct_split = column_split(direct[0]) if direct and node_split is not None else None
    if direct_split is None or node_split is None or direct_split.period != node_split.period:
        direct_split = None  # one ownership of columns per program (the driver's CX_SPLIT_PERIOD)
    splits = {KernelRole.NODE: node_split, KernelRole.LEAF: leaf_split, KernelRole.NODE_DIRECT: direct_split}
    return replace(program, kernels=tuple(replace(k, split=splits.get(k.role)) for k in program.kernels))


def column_split(kernel: Kernel) -> ColumnSplit | None:
    split, _ = _analyse(kernel)
    return split


def why_not(kernel: Kernel) -> str:
    """Why a kernel cannot be split by columns ("" when it can)."""
    return _analyse(kernel)[1]


def _analyse(kernel: Kernel) -> tuple[ColumnSplit | None, str]:
    values, places = kernel.body.values, kernel.places
    accumulates = any(isinstance(s, AccumOuter | AccumSum) for s in kernel.steps)
    if accumulates or any(isinstance(s, Store) and s.mode != StoreMode.SET for s in kernel.steps):
        return None, "a gradient kernel (accumulations, added stores)"
    computed = [places[i].kind != PlaceKind.SOURCE for i in range(len(values))]
    gemms = [s for s in kernel.steps if isinstance(s, Gemm)]
    members = {
        i
        for i, v in enumerate(values)
        if v.op == Op.MATMUL and places[i].kind == PlaceKind.BUFFER and any(places[i].buffer == g.out for g in gemms)
    }

    full: set[int] = {g.operand for g in gemms}
    for index, value in enumerate(values):
        if not computed[index]:
            continue
        columnwise = value.op in _COLUMNWISE or value.op in (Op.SLICE, Op.CONCAT) or index in members
        if not columnwise or len(value.shape) > 1 or width(value) == 1:
            full.add(index)
    stack = list(full)
    while stack:
        index = stack.pop()
        if index in members:
            return None, f"the GEMM result %{index} is needed whole"
        for arg in values[index].args:
            if computed[arg] and arg not in full:
                full.add(arg)
                stack.append(arg)
    split = {i for i in range(len(values)) if computed[i] and i not in full}

    # every distance between split columns must be a multiple of the period
    distances: list[int] = []
    for index in split:
        value = values[index]
        distances.append(width(value))
        if value.op == Op.SLICE and value.args[0] in split:
            base = values[value.args[0]]
            distances.append(slice_offset(base, value.attr("lo")))
        elif value.op == Op.CONCAT:
            distances += [width(values[a]) for a in value.args]
        elif index in members:
            distances.append(places[index].column)
        elif value.op in _COLUMNWISE:
            for arg in value.args:
                if width(values[arg]) not in (1, width(value)):
                    return None, f"%{index} broadcasts %{arg} of another width"
    for gemm in gemms:
        distances.append(gemm.m)
    period = math.gcd(*distances) if distances else 0
    if period < 2:
        return None, "no column period above 1"

    concat_of = {places[i].buffer: i for i in split if values[i].op == Op.CONCAT}
    flags = []
    for step in kernel.steps:
        if isinstance(step, Gemm):
            flags.append(True)
        elif isinstance(step, Loop):
            flags.append(step.value in split if step.compute else step.out in concat_of)
        elif isinstance(step, Reduce | Store):
            flags.append(step.value in split)
        else:  # softmaxes, per-row sums and small matmuls: their values are full
            flags.append(False)
    return ColumnSplit(period, tuple(flags)), ""
