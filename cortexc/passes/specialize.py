"""Leaf specialisation: give every cell a leaf body that reads no children.

Requires: a verified cell. Guarantees: ``cell.leaf`` is set and reads no
child; the node body is unchanged. A cell with a `leaf` block keeps it. For a
cell without one, leaves run `node` with zero children, so the pass evaluates
`node` symbolically with no children: every per-child value is empty, every
reduction over the children is a known zero, `child[k].s` is a known zero,
and the zeros are folded away (``x + 0 -> x``, ``x * 0 -> 0``, ``W @ 0 -> 0``)
so that the terms they fed disappear from the leaf program. An op that cannot
fold a zero gets it as an explicit constant, so folding is only ever an
optimisation, never a change of meaning.
"""

from __future__ import annotations

from dataclasses import replace

from cortexc.ir.builder import BodyBuilder
from cortexc.ir.cell import Body, BodyKind, Cell, ResultKey, Value
from cortexc.ir.ops import OPS, Domain, Op


class _Zero:
    """A value known to be all zeros (of its own shape)."""


class _Empty:
    """A per-child value of a node with no children: it has no rows at all."""


ZERO, EMPTY = _Zero(), _Empty()
Lowered = int | _Zero | _Empty


def specialize(cell: Cell) -> Cell:
    if cell.leaf is not None:
        return cell
    return replace(cell, leaf=leaf_body(cell.node))


def leaf_body(node: Body) -> Body:
    """The node body evaluated with no children, zeros folded."""
    builder = BodyBuilder()
    lowered: list[Lowered] = []

    def materialize(item: Lowered, value: Value) -> int:
        if isinstance(item, int):
            return item
        return builder.add(Op.CONST, (), value.shape, Domain.PARAM, (("value", 0.0),))

    def const(value: Value, number: float) -> int:
        return builder.add(Op.CONST, (), value.shape, Domain.PARAM, (("value", number),))

    for value in node.values:
        args = [lowered[a] for a in value.args]
        arg_values = [node.values[a] for a in value.args]
        lowered.append(_fold(value, args, arg_values, builder, materialize, const))
        if isinstance(lowered[-1], int) and value.label:
            builder.label(lowered[-1], value.label)

    results: list[tuple[ResultKey, int]] = []
    for name, index in node.named_results:
        item = lowered[index]
        results.append((name, materialize(item, node.values[index])))
    body = builder.finish(BodyKind.LEAF, results)
    return body


def _fold(
    value: Value, args: list[Lowered], arg_values: list[Value], builder: BodyBuilder, materialize, const
) -> Lowered:
    definition = OPS[value.op]
    if value.domain == Domain.CHILD:
        return EMPTY  # includes child.s, expand, and anything computed per child
    if definition.childless_zero:
        return ZERO  # child[k].s of a missing child; a reduction over no children
    zeros = [isinstance(a, _Zero) for a in args]
    if any(zeros):
        folded = _fold_zero(value, args, arg_values, zeros, const)
        if folded is not None:
            return folded
    new_args = tuple(materialize(a, v) for a, v in zip(args, arg_values))
    # folding can turn a per-node operand into a constant: the result varies only as its operands do
    domain = max((builder.values[a].domain for a in new_args), default=value.domain)
    domain = max(domain, definition.min_domain)  # dropout's mask varies per node whatever its operand
    return builder.add(value.op, new_args, value.shape, domain, value.attrs, value.dtype, loc=value.loc)


def _fold_zero(value: Value, args, arg_values, zeros, const) -> Lowered | None:
    """The result of an op with a known-zero argument (by its registry entry's zero rules), or None if it
    must be computed."""
    definition = OPS[value.op]
    if all(zeros) and definition.at_zero is not None:  # the registry's f(0)
        return ZERO if definition.at_zero == 0.0 else const(value, definition.at_zero)
    if any(zeros[position] for position in definition.zero_absorbs):
        return ZERO
    zero = [position for position, is_zero in enumerate(zeros) if is_zero]
    if len(args) == 2 and len(zero) == 1 and zero[0] in definition.zero_identity:  # x + 0 -> x
        other = 1 - zero[0]
        if arg_values[other].shape != value.shape:
            return None  # the zero sets the shape: compute with it
        return args[other]
    return None
