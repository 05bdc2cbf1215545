"""The `Program` verifier: a scheduled program is internally consistent before anything renders it.

It checks what the code generators rely on without checking themselves:
one place per body value; every step reads values of its kernel and writes
tile buffers that exist and are wide enough; a GEMM names a packed weight
of the program whose size and params agree with it; accumulated param
gradients have their accumulator; stores write declared states, outputs,
params or inputs with the value's width; a column split covers every step; a
folded GEMM (`passes.fold`) is a forward product of its fold's table rows with its packed weight.
A failure is a compiler bug, raised as `ProgramVerifyError` naming the stage.
"""

from __future__ import annotations

import dataclasses
import math

from cortexc.ir.cell import ParamDecl
from cortexc.ir.ops import Op, param_matrix
from cortexc.ir.program import (
    AccumOuter,
    AccumSum,
    ChildSoftmax,
    Gemm,
    Kernel,
    KernelRole,
    Loop,
    PackedWeight,
    PlaceKind,
    Program,
    Reduce,
    Row,
    SmallMatmul,
    Store,
    StoreTarget,
)
from cortexc.ir.program_printer import VALUE_FIELDS
from cortexc.ir.verify import IRVerifyError


class ProgramVerifyError(IRVerifyError):
    """A scheduled program breaks an invariant (a compiler bug, not a user error)."""


def verify_program(program: Program, stage: str = "") -> Program:
    """`program` itself if it is consistent, else `ProgramVerifyError`."""
    where = f" after {stage}" if stage else ""
    try:
        _verify(program)
    except ProgramVerifyError as err:
        raise ProgramVerifyError(f"program {program.cell.name}{where}: {err}") from None
    return program


def _expect_blocks(weight: PackedWeight, params: dict[str, ParamDecl]) -> None:
    """A packed weight's block rows are params of one row count side by side, [m, k] all together."""
    total = 0
    for row in weight.block_rows():
        matrices = {p: param_matrix(params[p].shape) for p, _ in row}
        shapes = [tuple(reversed(matrices[p])) if flip else matrices[p] for p, flip in row]
        rows = {s[0] if len(s) == 2 else -1 for s in shapes}
        _expect(
            len(rows) == 1 and min(rows) > 0 and sum(s[1] for s in shapes) == weight.k,
            f"packed {weight.name}: a block row of {[p for p, _ in row]} is not [rows, {weight.k}]",
        )
        total += min(rows)
    _expect(total == weight.m, f"packed {weight.name}: its block rows have {total} rows, not {weight.m}")


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise ProgramVerifyError(message)


def _verify(program: Program) -> None:
    cell = program.cell
    params = {p.name: p for p in cell.params}
    names = [k.name for k in program.kernels]
    _expect(len(set(names)) == len(names), f"kernel names repeat: {names}")
    packed = {w.name: w for w in program.packed}
    _expect(len(packed) == len(program.packed), "packed weight names repeat")
    for weight in program.packed:
        _expect(all(p in params for p in weight.params), f"packed {weight.name} names an unknown param")
        _expect(weight.m > 0 and weight.k > 0, f"packed {weight.name} is empty")
        _expect(
            len(weight.transposed) == len(weight.params) == sum(weight.blocks) and min(weight.blocks, default=0) > 0,
            f"packed {weight.name}: its blocks {weight.blocks} do not lay out its {len(weight.params)} params",
        )
        if all(p in params for p in weight.params) and len(weight.transposed) == sum(weight.blocks):
            _expect_blocks(weight, params)
    accumulated = {name: floats for name, _, floats in program.accumulators}
    offset = 0
    for name, start, floats in program.accumulators:
        _expect(name in params, f"accumulator of unknown param {name}")
        _expect(start == offset, f"accumulator {name} starts at {start}, expected {offset}")
        _expect(floats == math.prod(params[name].shape), f"accumulator {name} has {floats} floats")
        offset += floats
    for term in program.deferred or ():
        steps = {k.name: k.steps for k in program.kernels}
        _expect(term.kernel in steps and 0 <= term.step < len(steps[term.kernel]), f"deferred {term} has no step")
        step = steps[term.kernel][term.step]
        _expect(
            isinstance(step, AccumOuter)
            and (step.param, step.m, step.k, step.rows) == (term.param, term.m, term.k, term.rows),
            f"deferred term {term.kernel}[{term.step}] is not its AccumOuter",
        )
    folds = {f.name: f for f in program.folds}
    _expect(len(folds) == len(program.folds), "fold names repeat")
    for fold in program.folds:
        _expect(fold.packed in packed, f"fold {fold.name} uses unknown packed weight {fold.packed!r}")
        _expect(fold.table in params, f"fold {fold.name} folds unknown table {fold.table!r}")
        if fold.packed in packed and fold.table in params:
            weight = packed[fold.packed]
            _expect(
                (weight.m, weight.k) == (fold.m, fold.k) and params[fold.table].shape == (fold.rows, fold.k),
                f"fold {fold.name} disagrees with {weight.name} or {fold.table}",
            )
    for kernel in program.kernels:
        for step in kernel.steps:
            if isinstance(step, Gemm) and step.fold:
                named = folds.get(step.fold)
                _expect(named is not None, f"kernel {kernel.name}: a GEMM names unknown fold {step.fold!r}")
                _expect(not kernel.role.is_gradient, f"kernel {kernel.name}: a gradient kernel reads fold {step.fold}")
                operand = kernel.body.values[step.operand]
                _expect(
                    named is not None
                    and named.packed == step.packed
                    and operand.op == Op.EMBED
                    and kernel.body.values[operand.args[0]].name == named.table,
                    f"kernel {kernel.name}: GEMM of fold {step.fold} is not a product of its table's rows",
                )
    _verify_saved(program)
    _verify_direct(program)
    for kernel in program.kernels:
        try:
            _verify_kernel(program, kernel, packed, accumulated)
        except ProgramVerifyError as err:
            raise ProgramVerifyError(f"kernel {kernel.name}: {err}") from None


def _verify_saved(program: Program) -> None:
    """Saved activations (`passes.saving`): each set's saving kernel stores exactly its values, in place,
    and every `saved` read of a kernel lies inside a set that a gradient kernel may read."""
    names = {k.name for k in program.kernels}
    sets = {values.name: values for values in program.saved}
    _expect(len(sets) == len(program.saved), "saved value sets repeat")
    for values in program.saved:
        _expect({values.name, values.saving, values.grad} <= names, f"saved {values.name} names a missing kernel")
        if not {values.name, values.saving} <= names:
            continue
        forward, saving = program.kernel(values.name), program.kernel(values.saving)
        _expect(forward.body == saving.body, f"saving kernel {saving.name} runs another body than {forward.name}")
        stores = {(s.value, s.column) for s in saving.steps if isinstance(s, Store) and s.target == StoreTarget.SAVED}
        rows = {b.name for b in saving.buffers if b.saved == values.name}
        for kept, column in zip(values.values, values.columns):
            place = saving.places[kept]
            computed_there = place.kind == PlaceKind.BUFFER and place.buffer in rows and place.column == column
            _expect(computed_there or (kept, column) in stores, f"{saving.name} does not keep %{kept} at {column}")
        ends = [c + _width(forward.body.values[v].shape) for v, c in zip(values.values, values.columns)]
        _expect(max(ends, default=0) <= values.width, f"saved {values.name} overflows its width {values.width}")
    for kernel in program.kernels:
        for value in kernel.body.values:
            if value.op == Op.SAVED:
                named = sets.get(value.name)
                _expect(
                    named is not None and named.grad == kernel.name,
                    f"kernel {kernel.name} reads saved {value.name}, which it is not the gradient kernel of",
                )
                end = value.attr("column") + _width(value.shape)
                _expect(named is None or end <= named.width, f"kernel {kernel.name}: a saved read past the row")
    if program.saved:
        _expect(all(p.kernel in names for p in program.saving_forward()), "saving forward names a missing kernel")


def _verify_direct(program: Program) -> None:
    """The direct phases (`passes.direct`): the forward's, without the pre kernel, the direct node kernel (which
    reads no hoisted row) in place of the node kernel; and a direct node kernel only with them."""
    direct = [k for k in program.kernels if k.role == KernelRole.NODE_DIRECT]
    _expect(len(direct) == (1 if program.direct else 0), "a direct node kernel without direct phases, or the reverse")
    if not program.direct:
        return
    kernel = direct[0]
    _expect(all(v.op != Op.HOISTED for v in kernel.body.values), f"{kernel.name} reads hoisted rows")
    node, pre = program.role(KernelRole.NODE).name, program.role(KernelRole.PRE).name
    expected = tuple(
        dataclasses.replace(p, kernel=kernel.name) if p.kernel == node else p
        for p in program.forward
        if p.kernel != pre
    )
    _expect(program.direct == expected, "the direct phases are not the forward's without pre, node_direct for node")


def _verify_kernel(program: Program, kernel: Kernel, packed: dict, accumulated: dict) -> None:
    values = kernel.body.values
    _expect(len(kernel.places) == len(values), f"{len(kernel.places)} places for {len(values)} values")
    widths = {b.name: b.width for b in kernel.buffers}
    _expect(len(widths) == len(kernel.buffers), "buffer names repeat")
    for index, place in enumerate(kernel.places):
        if place.kind == PlaceKind.BUFFER:
            _expect(place.buffer in widths, f"%{index} lives in unknown buffer {place.buffer!r}")
            _expect(
                place.column + _width(values[index].shape) <= widths[place.buffer],
                f"%{index} does not fit in buffer {place.buffer} at column {place.column}",
            )
    for number, step in enumerate(kernel.steps):
        what = f"step {number} ({type(step).__name__.lower()})"
        for field in dataclasses.fields(step):
            if field.name in VALUE_FIELDS:
                index = getattr(step, field.name)
                _expect(0 <= index < len(values), f"{what} reads %{index}, which the body does not have")
        out = getattr(step, "out", None)
        if isinstance(step, Gemm):
            _expect(step.packed in packed, f"{what} uses unknown packed weight {step.packed!r}")
            weight = packed[step.packed]
            _expect(
                (weight.m, weight.k, weight.params) == (step.m, step.k, step.weights),
                f"{what} disagrees with {weight.name}",
            )
            _expect(_width(values[step.operand].shape) == step.k, f"{what}: operand width is not k = {step.k}")
            _expect(
                out in widths and widths[out] >= step.m, f"{what} writes {out!r}, missing or narrower than {step.m}"
            )
        elif isinstance(step, Loop):
            _expect(out in widths and step.column + step.width <= widths[out], f"{what} overflows buffer {out!r}")
        elif isinstance(step, Reduce | ChildSoftmax | Row | SmallMatmul):
            _expect(out in widths, f"{what} writes unknown buffer {out!r}")
            _expect(kernel.places[step.value].buffer == out, f"{what}: %{step.value} does not live in {out}")
        elif isinstance(step, AccumOuter | AccumSum):
            _expect(step.param in accumulated, f"{what} accumulates {step.param}, which has no accumulator")
        elif isinstance(step, Store):
            _expect(step.width == _width(values[step.value].shape), f"{what}: width {step.width} is not the value's")
    if kernel.split is not None:
        _expect(kernel.split.period > 0, "column split with a period of 0")
        _expect(len(kernel.split.split_steps) == len(kernel.steps), "column split does not cover every step")


def _width(shape: tuple[int, ...]) -> int:
    return math.prod(shape) if shape else 1
