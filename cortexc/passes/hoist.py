"""Hoisting (recursive refactoring): input projections leave the recursion.

Requires: a verified cell. Guarantees: every per-node value of the node body
that reads no child, directly or not, and contains a matrix product or a
look-up (``W_iou @ x``, ``W_f @ x``, ``W @ E[word]``) is computed in the new
``pre`` body; the node body reads it back as a `hoisted` value. What is
hoisted is the largest such subexpression that a children-dependent value
(or a state) uses, so the recursion keeps only what needs the children. The
runtime evaluates ``pre`` for all internal nodes at once, as big GEMMs over
every node of the forest, instead of one small product per level. The leaf
body is left alone: leaves are all on level 0, already one batch.
"""

from __future__ import annotations

from dataclasses import replace

from cortexc.ir.builder import BodyBuilder
from cortexc.ir.cell import Body, BodyKind, Cell
from cortexc.ir.ops import CHILD_READ_OPS, Domain, Op


def child_readers(body: Body) -> list[bool]:
    """Per value of `body`: whether it reads a child, directly or through its operands (or is per child)."""
    reads: list[bool] = []
    for value in body.values:
        reads.append(value.op in CHILD_READ_OPS or value.domain == Domain.CHILD or any(reads[a] for a in value.args))
    return reads


def hoist(cell: Cell) -> Cell:
    if cell.pre is not None:
        return cell
    node = cell.node
    reads_children = child_readers(node)
    heavy = [False] * len(node.values)
    for index, value in enumerate(node.values):
        heavy[index] = value.op in (Op.MATMUL, Op.EMBED) or any(heavy[a] for a in value.args)

    def hoistable(index: int) -> bool:
        value = node.values[index]
        return value.domain == Domain.NODE and not reads_children[index] and heavy[index]

    frontier: set[int] = {index for _, index in node.results if hoistable(index)}
    for index, value in enumerate(node.values):
        if reads_children[index]:
            frontier.update(a for a in value.args if hoistable(a))
    if not frontier:
        return cell

    pre_builder, node_builder = BodyBuilder(), BodyBuilder()
    in_pre: dict[int, int] = {}

    def copy_into_pre(index: int) -> int:
        if index not in in_pre:
            value = node.values[index]
            args = tuple(copy_into_pre(a) for a in value.args)
            in_pre[index] = pre_builder.add(
                value.op, args, value.shape, value.domain, value.attrs, value.dtype, loc=value.loc
            )
            if value.label:
                pre_builder.label(in_pre[index], value.label)
        return in_pre[index]

    names: dict[int, str] = {}
    for index in sorted(frontier):
        copy_into_pre(index)
        names[index] = f"pre{len(names)}"

    renumbered: list[int] = []
    for index, value in enumerate(node.values):
        if index in names:
            attrs = (("name", names[index]),)
            new = node_builder.add(Op.HOISTED, (), value.shape, Domain.NODE, attrs, loc=value.loc)
        else:
            args = tuple(renumbered[a] for a in value.args)
            new = node_builder.add(value.op, args, value.shape, value.domain, value.attrs, value.dtype, loc=value.loc)
        if value.label:
            node_builder.label(new, value.label)
        renumbered.append(new)

    pre = pre_builder.finish(BodyKind.PRE, [(names[i], in_pre[i]) for i in sorted(frontier)])
    new_node = node_builder.finish(BodyKind.NODE, [(name, renumbered[i]) for name, i in node.results])
    return replace(cell, pre=pre, node=new_node)


__all__ = ["hoist", "Body"]
