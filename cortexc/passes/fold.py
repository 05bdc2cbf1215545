"""Folding: a param projection of a table look-up becomes a read of a projected table (inference).

Why: the leaves of the SST Tree-LSTM compute ``W_iou @ E[word]``, ~37% of a forward's FLOPs, and the
product depends on the word only. With the params fixed, ``P = E @ W_iou^T`` (a [V, 3H] table) turns
each leaf's GEMM into a row copy. The runtime builds P lazily, with the package's own `cx_fold`, once the
inferences since the params changed have run as many rows as P has (at once with `CORTEXC_FOLD=eager`), and
never uses it in a forward kept for a backward.

The unit folded is a scheduled `Gemm` step: the products sharing one look-up are already stacked into
one GEMM with one packed weight (``W_iou @ E[w]`` and ``W_f @ E[w]`` together), and `cx_fold` runs that
same GEMM code over that same packed weight for every row of E. Every element of a GEMM is one sum over
k in order whatever the row tiling, so a folded row is bitwise what the kernel computes for that word.
That is why this pass runs on programs (after `schedule`) rather than on cells: the stacking and packing
it must reproduce exist only there.

Covered: a GEMM of a forward kernel (pre, leaf, node, output) whose operand is ``E[idx]`` itself, E a
param and idx an index input; any number of products stacked on it. Not covered: a look-up under another
op first (``W @ dropout(E[w])``: the identity in evaluation mode only), a look-up concatenated with other
rows (``W @ concat(E[w], h)``), gradient kernels (training never folds).

Requires: a scheduled program. Guarantees: every such GEMM names its `Fold` (`Gemm.fold`), one per
(packed weight, table) in `Program.folds`; nothing else changes (the GEMM stays: a call without tables
runs it).
"""

from __future__ import annotations

from dataclasses import replace

from cortexc.ir.ops import Op
from cortexc.ir.program import Fold, Gemm, Kernel, Program


def fold_lookups(program: Program) -> Program:
    """The program with its foldable GEMMs marked and their `Fold`s listed (see the module docstring)."""
    folds: dict[tuple[str, str], Fold] = {}
    kernels = []
    for kernel in program.kernels:
        if kernel.role.is_gradient:
            kernels.append(kernel)
            continue
        steps = []
        for step in kernel.steps:
            table = _folded_table(kernel, step)
            if table is not None and isinstance(step, Gemm):
                key = (step.packed, table)
                if key not in folds:
                    rows = program.cell.param(table).shape[0]
                    folds[key] = Fold(f"f{len(folds)}", step.packed, table, rows, step.m, step.k)
                step = replace(step, fold=folds[key].name)
            steps.append(step)
        kernels.append(replace(kernel, steps=tuple(steps)))
    if not folds:
        return program
    return replace(program, kernels=tuple(kernels), folds=tuple(folds.values()))


def _folded_table(kernel: Kernel, step: object) -> str | None:
    """The table a GEMM's operand is a plain look-up of (`E[idx]`, E a param, idx an index input), or None."""
    if not isinstance(step, Gemm):
        return None
    values = kernel.body.values
    operand = values[step.operand]
    if operand.op != Op.EMBED:
        return None
    table, index = (values[a] for a in operand.args)
    if table.op != Op.PARAM or index.op != Op.INPUT:
        return None
    return table.name
