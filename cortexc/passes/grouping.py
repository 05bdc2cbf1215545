"""Grouped GEMMs: a per-target program pass for the products of a family of matrices chosen per row.

Why: `U[edge.rel] @ child.h` (and `W[edge.position] @ v`) is lowered as the product of *all* R matrices
with the row, a view of it as [R, M], and a `select` of the row's own matrix (`frontend.lower`): one GEMM
for the whole level, whatever the relations, but R times the multiply-adds needed. A typed DAG-LSTM at
H=256 with R=4 spent three quarters of its forward on products nobody reads. Here such a GEMM computes,
for each group g, only the columns of matrix g and only for the rows whose index is g: the rows of a group
are gathered and multiplied by the panels of their matrix, into scratch, and copied into their rows, so
every `select` reads what it read before. Each element is the same sum over k in the same order as the
whole GEMM's (the micro-kernel's rule), so results are bitwise unchanged.

Covered: a forward-direction `Gemm` (not split by columns, not folded) whose stacked products are each
either read by `select`s alone, through their [R, M] view, all by one index of the GEMM's rows (a child's
product by its edge's relation, a node's by a value of the node) that is a source or computed by an
earlier step, or by anything (their columns are then computed for every row as before).

The gradient's side: the product of the transposed family with a chosen product's gradient put back among
zeros (`reshape(unselect(g, index))`: a row's k are zero but those of its group) reads, per group, only
that group's k of the packed weight, from its rows gathered (`Gemm.grouped_k`). Each element is the whole
sum without its zero terms: the same value (NaN where the whole sum met an inf weight times a zero).

A weight gradient of such a product (`outer(reshape(unselect(g, index)), v)` summed) adds, per group, only
its rows to that group's matrix (`AccumOuter.grouped`): the per-tile sums by the C kernels, and the
deferred phase's (rows chosen by an edge index input, read again there). Each element is the same sum of
the same nonzero terms in the same order: bitwise the whole one's.

Requires: a scheduled program. Guarantees: such a `Gemm` lists its grouped column ranges (`Gemm.grouped`,
in column order, disjoint) or its grouped k (`Gemm.grouped_k`) and names a scratch buffer of its kernel
wide enough for the largest group's panels (`grouped_scratch_width`) or its whole rows; such an `AccumOuter`
names its groups (`AccumOuter.grouped`); nothing else changes.
"""

from __future__ import annotations

from dataclasses import replace

from cortexc.ir.ops import Op
from cortexc.ir.program import AccumOuter, Buffer, Gemm, Grouped, Kernel, PlaceKind, Program, width

#: the widest GEMM panel of any target build (floats): a group's columns are covered by whole panels, at
#: most its width plus one partial panel at each end
MAX_PANEL = 32


def grouped_scratch_width(group_width: int) -> int:
    """Floats per row of a grouped GEMM's scratch: the panels that cover a group's columns, and two ints (the
    row's group and its place in the gathered order)."""
    return group_width + 2 * MAX_PANEL + 2


def group_products(program: Program) -> Program:
    """The program with each GEMM that computes a family's products for a per-row choice grouped (see the
    module docstring)."""
    kernels = tuple(_grouped_kernel(k) for k in program.kernels)
    return replace(program, kernels=kernels)


def _grouped_kernel(kernel: Kernel) -> Kernel:
    steps, buffers = list(kernel.steps), list(kernel.buffers)
    users: dict[int, list[int]] = {}
    for index, value in enumerate(kernel.body.values):
        for arg in value.args:
            users.setdefault(arg, []).append(index)
    # the values a step or a result reads directly (not through the body's expressions)
    read_by_steps = {
        getattr(s, field) for s in kernel.steps for field in ("value", "operand", "a", "b") if hasattr(s, field)
    }
    read_by_steps |= {index for _, index in kernel.body.results}
    split = kernel.split.split_steps if kernel.split is not None else ()
    for number, step in enumerate(steps):
        if isinstance(step, AccumOuter):
            steps[number] = replace(step, grouped=_unselected(kernel, step.a, len(steps)))
            continue
        if not isinstance(step, Gemm) or step.fold or (number < len(split) and split[number]):
            continue
        grouped = _grouped_columns(kernel, number, step, users, read_by_steps)
        by_k = _unselected(kernel, step.operand, number)  # the gradient's side: the operand's k by group
        if not grouped and by_k is None:
            continue
        name = f"{step.out}_groups"
        widths = [grouped_scratch_width(g.width) for g in grouped] + ([step.m + 2] if by_k is not None else [])
        buffers.append(Buffer(name, step.rows, max(widths)))
        steps[number] = replace(step, grouped=tuple(grouped), grouped_k=by_k, scratch=name)
    return replace(kernel, steps=tuple(steps), buffers=tuple(buffers))


def _grouped_columns(
    kernel: Kernel, number: int, step: Gemm, users: dict[int, list[int]], read_by_steps: set[int]
) -> list[Grouped]:
    """The column ranges of `step` that only a per-row choice of one of their matrices reads (`users`: each
    value's readers in the body; `read_by_steps`: the values steps or results read, which must stay whole)."""
    values, places = kernel.body.values, kernel.places
    grouped = []
    for index, value in enumerate(values):
        place = places[index]
        if value.op != Op.MATMUL or place.kind != PlaceKind.BUFFER or place.buffer != step.out:
            continue
        views = users.get(index, [])
        if index in read_by_steps or not views or any(values[v].op != Op.RESHAPE for v in views):
            continue
        shapes = {values[v].shape for v in views}
        choices = [c for v in views for c in users.get(v, [])]
        if len(shapes) != 1 or any(v in read_by_steps for v in views) or not choices:
            continue
        if any(values[c].op != Op.SELECT or values[values[c].args[0]].op != Op.RESHAPE for c in choices):
            continue
        indices = {values[c].args[1] for c in choices}
        [(groups, group_width)] = list(shapes)
        if len(indices) != 1 or groups * group_width != width(value):
            continue
        (chooser,) = indices
        # one choice per row of the GEMM (a node's product read by each of its children's choices is not)
        if values[chooser].domain == value.domain and _ready_before(kernel, chooser, number):
            grouped.append(Grouped(place.column, group_width, groups, chooser))
    return sorted(grouped, key=lambda g: g.lo)


def _unselected(kernel: Kernel, index: int, number: int) -> Grouped | None:
    """How value `index` is zero but in each row's group's columns, where it is `reshape(unselect(g, chooser))`
    (a chosen product's gradient put back among the family's zeros) and the chooser, of the same rows, can
    be read before step `number`; else None."""
    values = kernel.body.values
    value = values[index]
    if value.op != Op.RESHAPE or values[value.args[0]].op != Op.UNSELECT:
        return None
    unselect = values[value.args[0]]
    groups, group_width = unselect.shape
    chooser = unselect.args[1]
    if values[chooser].domain != value.domain or not _ready_before(kernel, chooser, number):
        return None
    return Grouped(0, group_width, groups, chooser)


def _ready_before(kernel: Kernel, index: int, number: int) -> bool:
    """Whether value `index` can be read for every row before step `number`: a source, or in a buffer an
    earlier step wrote."""
    place = kernel.places[index]
    if place.kind == PlaceKind.SOURCE:
        return True
    if place.kind != PlaceKind.BUFFER:
        return False
    return any(getattr(s, "out", None) == place.buffer for s in kernel.steps[:number])
