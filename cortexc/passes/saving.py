"""Saved activations: a training forward keeps what the gradient kernels would otherwise compute again.

Why: `autodiff`'s GRAD bodies recompute their forward body per node from the children's saved states. For
a chain LSTM that is the recurrent GEMM (a fifth of a training step's multiply-adds) and five
transcendentals per element run twice. A training forward that stores the gates costs 5 H floats per node
written once and read once; PyTorch's LSTM keeps the same.

Requires: a scheduled program (`schedule`), before the other program passes. Guarantees, for the leaf and
the node kernel whose gradient kernel reads per-node vector values of the forward (not the sources:
params, inputs, states, hoisted rows, look-ups, constants; not dropouts, whose masks the gradient
recomputes): a `SavedValues` listing them; a variant of the forward kernel (`leaf_saving`,
`node_saving`) that also stores them in the node's row of the saved array; the gradient kernel rebuilt
from the GRAD body that reads them as `saved` values (so what only they needed is no longer computed).
`Program.saving_forward()` then gives the forward's phases with the saving variants in place of the leaf
and node kernels. The cell's own GRAD bodies (what the reference interpreter runs) are unchanged. A
backward of this program needs a forward that ran those phases (the runtime keeps its saved arrays).
"""

from __future__ import annotations

from dataclasses import replace

from cortexc.ir.cell import Body, DType
from cortexc.ir.ops import LEAF_OPS, Domain, Op
from cortexc.ir.program import KernelRole, Program, Rows, SavedValues, width
from cortexc.passes.autodiff import grad_body, recomputed_reads
from cortexc.passes.schedule import accumulator_layout, packed_key, schedule_kernel

#: forward ops never worth saving: what a kernel reads where it lives, views and dropouts (see above)
_NOT_SAVED = LEAF_OPS | {Op.EMBED, Op.EXPAND, Op.TRANSPOSE, Op.DROPOUT}

#: (forward role, its saving variant, its gradient kernel's role)
_PAIRS = (
    (KernelRole.LEAF, KernelRole.LEAF_SAVING, KernelRole.GRAD_LEAF),
    (KernelRole.NODE, KernelRole.NODE_SAVING, KernelRole.GRAD_NODE),
)


def saved_values(forward: Body) -> list[int]:
    """The values of `forward` a training forward keeps: those its GRAD body's adjoints read that are
    computed per node (for a slice, its base; a concatenation of sources is only copies of them)."""
    values = forward.values

    def sources_only(index: int) -> bool:
        value = values[index]
        if value.op in (Op.SLICE, Op.RESHAPE, Op.CONCAT):
            return all(sources_only(arg) for arg in value.args)
        return value.op in _NOT_SAVED

    chosen: set[int] = set()
    for index in recomputed_reads(forward):
        while values[index].op in (Op.SLICE, Op.RESHAPE):
            index = values[index].args[0]
        value = values[index]
        if sources_only(index) or value.domain != Domain.NODE or value.dtype != DType.F32:
            continue
        if len(value.shape) > 1:
            continue  # per-node matrices: too wide to keep
        chosen.add(index)
    return sorted(chosen)


def save_activations(program: Program) -> Program:
    cell = program.cell
    if cell.grads is None or program.saved:
        return program
    packed = {packed_key(w): w for w in program.packed}
    kernels = list(program.kernels)
    saved: list[SavedValues] = []
    for role, saving_role, grad_role in _PAIRS:
        forward = program.role(role)
        grad = program.role(grad_role)
        chosen = saved_values(forward.body)
        if not chosen:
            continue
        columns, total = [], 0
        for index in chosen:
            columns.append(total)
            total += width(forward.body.values[index])
        internal = role == KernelRole.NODE
        values = SavedValues(forward.name, saving_role.value, grad.name, tuple(chosen), tuple(columns), total, internal)
        where = {index: (values.name, column) for index, column in zip(chosen, columns)}
        body = grad_body(forward.body, where)
        new_grad = schedule_kernel(grad_role, grad.rows, body, cell, packed)
        saving = schedule_kernel(saving_role, Rows.LEVEL, forward.body, cell, packed, saved=values)
        kernels[kernels.index(grad)] = new_grad
        kernels.insert(kernels.index(forward) + 1, saving)
        saved.append(values)
    if not saved or len(packed) != len(program.packed):  # every target packs the same weights (one list)
        return program
    return replace(
        program,
        kernels=tuple(kernels),
        packed=tuple(packed.values()),
        accumulators=accumulator_layout(cell, kernels),
        saved=tuple(saved),
    )
