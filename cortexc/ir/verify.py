"""The IR verifier: runs after lowering and after every pass.

A failure here is a bug in cortexc, not in the user's program, so it raises
`IRVerifyError` naming the body and value, with the offending dump line.
"""

from __future__ import annotations

from cortexc.errors import CortexcError
from cortexc.ir.cell import Body, BodyKind, Cell, DType, Gradients, GradKind, GradTarget, Value
from cortexc.ir.ops import (
    OPS,
    REDUCE_OPS,
    Domain,
    Op,
    Shape,
    ShapeError,
    concat_shape,
    matmul_shape,
    pad_shape,
    slice_shape,
)
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
        return cell.param(name).shape, per_node
    if kind == GradKind.INPUT:
        return cell.input(name).shape, per_node
    if kind == GradKind.EMBED:
        if target.index is None or not cell.input(target.index).is_index:
            raise KeyError(target.index)
        return (cell.param(name).shape[1],), per_node
    if kind == GradKind.CHILD:
        return cell.state(name).shape, {Domain.CHILD}
    if kind == GradKind.CHILD_AT:
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
    for index, value in enumerate(body.values):
        try:
            _verify_value(cell, body, index, value, role)
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
                value.op not in (Op.CHILD_STATE, Op.CHILD_STATE_AT, Op.STATE, Op.HOISTED),
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


def _verify_value(cell: Cell, body: Body, index: int, value: Value, role: BodyKind) -> None:
    for arg in value.args:
        _expect(0 <= arg < index, f"argument %{arg} is not an earlier value")
    args = [body.values[a] for a in value.args]
    for arg_value in args:
        if arg_value.dtype == DType.I32:
            _expect(value.op == Op.EMBED and arg_value is args[1], "an index value is used outside a look-up")
    op = value.op
    shape: Shape
    domain: Domain
    if op == Op.PARAM:
        shape, domain = cell.param(value.name).shape, Domain.PARAM
    elif op == Op.INPUT:
        decl = cell.input(value.name)
        shape, domain = decl.shape, Domain.NODE
        _expect(value.dtype == (DType.I32 if decl.is_index else DType.F32), "input dtype differs from its decl")
    elif op == Op.STATE:
        _expect(role == BodyKind.OUTPUT, "a node's own state is read only by outputs")
        shape, domain = cell.state(value.name).shape, Domain.NODE
    elif op in (Op.CHILD_STATE, Op.CHILD_STATE_AT):
        _expect(role == BodyKind.NODE, "children are read only in node bodies")
        shape = cell.state(value.name).shape
        domain = Domain.CHILD if op == Op.CHILD_STATE else Domain.NODE
        if op == Op.CHILD_STATE_AT:
            _expect(cell.arity is not None and 0 <= value.attr("k") < cell.arity, "child index out of arity")
    elif op == Op.HOISTED:
        _expect(role == BodyKind.NODE, "hoisted values are read by node bodies")
        if cell.pre is None:
            raise IRVerifyError("a hoisted value without a pre body")
        pre_value = cell.pre.values[cell.pre.result(value.name)]
        shape, domain = pre_value.shape, Domain.NODE
    elif op == Op.ADJOINT:
        _expect(body.kind == BodyKind.GRAD, "adjoints are read only by gradient bodies")
        shape, domain = value.shape, Domain.NODE
    elif op == Op.SAVED:
        _expect(body.kind == BodyKind.GRAD, "saved values are read only by gradient bodies")
        _expect(value.attr("column") >= 0, "a saved value's column is negative")
        shape, domain = value.shape, Domain.NODE
    elif op == Op.NUM_CHILDREN:
        _expect(role == BodyKind.NODE, "the number of children is read only in node bodies")
        shape, domain = (), Domain.NODE
    elif op == Op.TRANSPOSE:
        _expect(len(args[0].shape) == 2, "transpose needs a matrix")
        shape, domain = (args[0].shape[1], args[0].shape[0]), args[0].domain
    elif op == Op.OUTER:
        _expect(len(args[0].shape) == 1 and len(args[1].shape) == 1, "outer needs two vectors")
        shape, domain = (args[0].shape[0], args[1].shape[0]), max(args[0].domain, args[1].domain)
    elif op == Op.ROWSUM:
        _expect(value.shape in ((), (1,)), "a row sum is a scalar or [1]")
        shape, domain = value.shape, args[0].domain
    elif op == Op.PAD:
        shape, domain = pad_shape(args[0].shape, value.attr("lo"), value.attr("size")), args[0].domain
    elif op == Op.CONST:
        _expect(isinstance(value.attr("value"), float), "a constant must be a float")
        shape, domain = value.shape, Domain.PARAM  # a scalar, or a filled vector/matrix
    elif op in OPS:  # elementwise and vector ops: the registry's shape rule
        _expect(len(args) == OPS[op].arity, f"{op.value} takes {OPS[op].arity} args")
        shape = OPS[op].shape(*(a.shape for a in args))
        domain = max(OPS[op].min_domain, *(a.domain for a in args))
    elif op == Op.MATMUL:
        shape, domain = matmul_shape(args[0].shape, args[1].shape), max(args[0].domain, args[1].domain)
    elif op == Op.SLICE:
        shape, domain = slice_shape(args[0].shape, value.attr("lo"), value.attr("hi")), args[0].domain
    elif op == Op.CONCAT:
        shape, domain = concat_shape([a.shape for a in args]), max(a.domain for a in args)
    elif op == Op.EMBED:
        _expect(args[0].op == Op.PARAM and len(args[0].shape) == 2, "a look-up reads a param matrix")
        _expect(args[1].dtype == DType.I32, "a look-up needs an index")
        shape, domain = (args[0].shape[1],), max(args[0].domain, args[1].domain)
    elif op == Op.EXPAND:
        _expect(args[0].domain != Domain.CHILD, "expand of a per-child value")
        shape, domain = args[0].shape, Domain.CHILD
    elif op in REDUCE_OPS:
        _expect(args[0].domain == Domain.CHILD, "a reduction needs a per-child argument")
        _expect(role == BodyKind.NODE, "reductions over children happen only in node bodies")
        shape, domain = args[0].shape, Domain.NODE
    elif op == Op.CHILD_SOFTMAX:
        _expect(args[0].domain == Domain.CHILD, "child_softmax needs a per-child argument")
        _expect(role == BodyKind.NODE, "child_softmax happens only in node bodies")
        shape, domain = args[0].shape, Domain.CHILD
    else:  # pragma: no cover - every op is listed above
        raise IRVerifyError(f"unknown op {op}")
    _expect(len(value.args) == _ARG_COUNT.get(op, len(value.args)), f"{op.value} takes {_ARG_COUNT.get(op)} args")
    _expect(value.shape == shape, f"shape {value.shape} but the rule gives {shape}")
    _expect(value.domain == domain, f"domain {value.domain.name} but the rule gives {domain.name}")
    if op != Op.INPUT:
        _expect(value.dtype == DType.F32, "only index inputs are integers")


_ARG_COUNT = {
    Op.PARAM: 0,
    Op.INPUT: 0,
    Op.STATE: 0,
    Op.HOISTED: 0,
    Op.CHILD_STATE: 0,
    Op.CHILD_STATE_AT: 0,
    Op.CONST: 0,
    **{op: d.arity for op, d in OPS.items()},
    Op.MATMUL: 2,
    Op.SLICE: 1,
    Op.EMBED: 2,
    Op.EXPAND: 1,
    **{op: 1 for op in REDUCE_OPS},
    Op.ADJOINT: 0,
    Op.SAVED: 0,
    Op.NUM_CHILDREN: 0,
    Op.TRANSPOSE: 1,
    Op.OUTER: 2,
    Op.ROWSUM: 1,
    Op.CHILD_SOFTMAX: 1,
    Op.PAD: 1,
}
