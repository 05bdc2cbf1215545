"""The IR verifier: runs after lowering and after every pass.

A failure here is a bug in cortexc, not in the user's program, so it raises
`IRVerifyError` naming the body and value, with the offending dump line.
"""

from __future__ import annotations

import math

from cortexc.errors import CortexcError
from cortexc.ir.cell import Body, BodyKind, Cell, DType, Gradients, GradKind, GradTarget, Value
from cortexc.ir.ops import OPS, Domain, Op, Shape, ShapeError, param_matrix
from cortexc.ir.printer import format_value


class IRVerifyError(CortexcError):
    """The IR broke an invariant (an internal compiler error)."""


def verify_cell(cell: Cell, stage: str = "") -> Cell:
    """Check every invariant of the IR; returns the cell so it can sit in a pipeline."""
    where = f" after {stage}" if stage else ""
    if cell.pre is not None:
        _verify_body(cell, cell.pre, BodyKind.PRE, f"{cell.name}.pre{where}")
    if cell.leaf is not None:
        _verify_body(cell, cell.leaf, BodyKind.LEAF, f"{cell.name}.leaf{where}")
    _verify_body(cell, cell.node, BodyKind.NODE, f"{cell.name}.node{where}")
    if cell.grads is not None:
        _verify_grads(cell, cell.grads, where)
    for out in cell.outputs:
        _verify_body(cell, out.body, BodyKind.OUTPUT, f"{cell.name}.output {out.name}{where}")
        if out.body.results != ((out.name, out.body.result(out.name)),):
            raise IRVerifyError(f"{cell.name}.output {out.name}{where}: must produce exactly '{out.name}'")
        result = out.body.values[out.body.result(out.name)]
        if result.shape != out.shape:
            raise IRVerifyError(
                f"{cell.name}.output {out.name}{where}: result shape {result.shape} != declared {out.shape}"
            )
    return cell


def _verify_grads(cell: Cell, grads: Gradients, where: str) -> None:
    if cell.leaf is None:
        raise IRVerifyError(f"{cell.name}{where}: gradient bodies without a leaf body")
    pairs = [(grads.leaf, cell.leaf, BodyKind.LEAF, "leaf"), (grads.node, cell.node, BodyKind.NODE, "node")]
    if (grads.pre is None) != (cell.pre is None):
        raise IRVerifyError(f"{cell.name}{where}: a gradient pre body exactly when there is a pre body")
    if grads.pre is not None and cell.pre is not None:
        pairs.append((grads.pre, cell.pre, BodyKind.PRE, "pre"))
    pairs += [(g, o.body, BodyKind.OUTPUT, f"output {o.name}") for g, o in zip(grads.outputs, cell.outputs)]
    for grad, forward, role, name in pairs:
        label = f"{cell.name}.grad {name}{where}"
        _verify_body(cell, grad, BodyKind.GRAD, label, role)
        for value in grad.values:
            if value.op == Op.ADJOINT and value.name not in dict(forward.results):
                raise IRVerifyError(f"{label}: adjoint of {value.name}, which the forward body does not produce")
        for target, index in grad.grad_results:
            _verify_grad_result(cell, target, grad.values[index], label)


def _grad_result_shape(cell: Cell, target: GradTarget) -> tuple[tuple[int, ...], set[Domain]]:
    per_node = {Domain.NODE, Domain.PARAM}
    kind, name = target.kind, target.name
    if kind == GradKind.PARAM:
        return param_matrix(cell.param(name).shape), per_node
    if kind == GradKind.INPUT:
        return cell.input(name).shape, per_node
    if kind == GradKind.EDGE_INPUT:
        return cell.input(name).shape, {Domain.CHILD}
    if kind == GradKind.EMBED:
        if target.index is None or not cell.input(target.index).is_index:
            raise KeyError(target.index)
        by_edge = {Domain.CHILD} if cell.input(target.index).on_edge else per_node  # W[edge.rel]: per child
        return (math.prod(cell.param(name).shape[1:]),), by_edge
    if kind == GradKind.CHILD:
        return cell.state(name).shape, {Domain.CHILD}
    if kind in (GradKind.CHILD_AT, GradKind.PREV):
        return cell.state(name).shape, per_node
    if kind == GradKind.STATE:
        return cell.state(name).shape, per_node
    if kind == GradKind.HOISTED and cell.pre is not None:
        return cell.pre.values[cell.pre.result(name)].shape, per_node
    raise KeyError(str(target))


def _verify_grad_result(cell: Cell, target: GradTarget, value: Value, where: str) -> None:
    try:
        shape, domains = _grad_result_shape(cell, target)
    except (KeyError, IndexError):
        raise IRVerifyError(f"{where}: unknown gradient result {target}") from None
    if value.shape != shape or value.domain not in domains:
        raise IRVerifyError(f"{where}: gradient {target} has shape {value.shape} {value.domain.name}, expected {shape}")


def _verify_body(cell: Cell, body: Body, kind: BodyKind, where: str, role: BodyKind | None = None) -> None:
    """`role` is the forward body a GRAD body reverses: it decides what the body may read."""
    if body.kind != kind:
        raise IRVerifyError(f"{where}: body kind {body.kind} where {kind} was expected")
    role = role or kind
    context = _Context(cell, body, role)
    for index, value in enumerate(body.values):
        try:
            _verify_value(context, body, index, value)
        except (ShapeError, KeyError, IRVerifyError) as err:
            raise IRVerifyError(f"{where}: {err}\n    {format_value(index, value)}") from None
    for name, index in body.results:
        if isinstance(name, GradTarget) != (kind == BodyKind.GRAD):
            raise IRVerifyError(f"{where}: result {name}: gradient targets are the results of gradient bodies only")
        if not 0 <= index < len(body.values):
            raise IRVerifyError(f"{where}: result {name} refers to missing value %{index}")
        if body.values[index].domain == Domain.CHILD and kind != BodyKind.GRAD:
            raise IRVerifyError(f"{where}: result {name} is per-child")
    if kind == BodyKind.GRAD:
        return
    if kind == BodyKind.PRE:
        for name, index in body.results:
            _expect(body.values[index].domain == Domain.NODE, f"pre result {name} is not per-node")
        for value in body.values:
            _expect(
                value.op not in (Op.CHILD_STATE, Op.CHILD_STATE_AT, Op.PREV_STATE, Op.STATE, Op.HOISTED),
                f"the pre body reads {value.op.value}",
            )
    if kind in (BodyKind.LEAF, BodyKind.NODE):
        names = tuple(name for name, _ in body.results)
        expected = tuple(s.name for s in cell.states)
        if names != expected:
            raise IRVerifyError(f"{where}: results {names} are not the states {expected}")
        for state in cell.states:
            value = body.values[body.result(state.name)]
            if value.shape != state.shape or value.dtype != DType.F32:
                raise IRVerifyError(f"{where}: state {state.name} gets shape {value.shape}")


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise IRVerifyError(message)


class _Context:
    """What the type rules may ask (`cortexc.ir.ops.TypeContext`) of the cell and the body being verified."""

    def __init__(self, cell: Cell, body: Body, role: BodyKind):
        self.cell = cell
        self.node_body = role == BodyKind.NODE
        self.output_body = role == BodyKind.OUTPUT
        self.gradient = body.kind == BodyKind.GRAD
        self.arity = cell.read_arity
        self.steps = cell.steps is not None

    def param_shape(self, name: str) -> Shape:
        return self.cell.param(name).shape

    def input_decl(self, name: str) -> tuple[Shape, DType, bool]:
        decl = self.cell.input(name)
        return decl.shape, DType.I32 if decl.is_index else DType.F32, decl.on_edge

    def state_shape(self, name: str) -> Shape:
        return self.cell.state(name).shape

    def hoisted_shape(self, name: str) -> Shape:
        if self.cell.pre is None:
            raise ShapeError("a hoisted value without a pre body")
        return self.cell.pre.values[self.cell.pre.result(name)].shape


def _verify_value(context: _Context, body: Body, index: int, value: Value) -> None:
    for arg in value.args:
        _expect(0 <= arg < index, f"argument %{arg} is not an earlier value")
    args = [body.values[a] for a in value.args]
    definition = OPS[value.op]
    for position, arg_value in enumerate(args):
        if arg_value.dtype == DType.I32:
            _expect(position in definition.index_args, "an index value is used outside a look-up")
    if definition.arity is not None:
        _expect(len(args) == definition.arity, f"{value.op.value} takes {definition.arity} args")
    shape, domain = definition.type_rule(context, value, args)
    _expect(value.shape == shape, f"shape {value.shape} but the rule gives {shape}")
    _expect(value.domain == domain, f"domain {value.domain.name} but the rule gives {domain.name}")
    if value.op not in (Op.INPUT, Op.EDGE_INPUT):
        _expect(value.dtype == DType.F32, "only index inputs are integers")
