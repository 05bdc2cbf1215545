"""Reverse-mode autodiff: a reverse body for every forward body of the cell.

Requires: a verified, specialised cell (hoisting optional). Guarantees:
``cell.grads`` holds, for the leaf, node, pre and every output body, a GRAD
body that first recomputes the forward body and then the adjoints of every
value, in reverse order, from the `adjoint` of each result (the incoming
gradient of that state / output / hoisted row for this node).

What the forward saves and what is recomputed: the forward with
``grad=True`` keeps every state of every node (they are the recursion's
carried values, needed anyway); everything else a node computed (gates,
products) is recomputed in the backward sweep from its children's saved
states, which costs one more forward but no memory per intermediate.

Every op's rule is its registry entry's (`cortexc.ir.ops.OPS`, ``derivative``), structural ops' too;
here, the glue: a per-node operand of a per-child op gets the sum over the children of its adjoint, and a
scalar (or `[1]`) operand of a wider op gets the sum of the elements.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from cortexc.ir.builder import BodyBuilder
from cortexc.ir.cell import Body, BodyKind, Cell, DType, Gradients, GradKind, GradTarget, ResultKey, Value
from cortexc.ir.ops import OPS, Domain, Op, broadcast_shape


def autodiff(cell: Cell) -> Cell:
    if cell.leaf is None:
        raise ValueError("autodiff needs a specialised cell (run `specialize` first)")
    grads = Gradients(
        leaf=grad_body(cell.leaf),
        node=grad_body(cell.node),
        pre=grad_body(cell.pre) if cell.pre is not None else None,
        outputs=tuple(grad_body(out.body) for out in cell.outputs),
    )
    return replace(cell, grads=grads)


class _Reverse:
    """Builds one GRAD body: the forward values, then adjoints accumulated per value."""

    def __init__(self, forward: Body, saved: Mapping[int, tuple[str, int]] | None = None):
        self.forward = forward
        self.saved = saved or {}  # forward value index -> (saved array, column): read, not recomputed
        self.b = BodyBuilder()
        self.copy: list[int] = []  # forward value index -> index in the new body
        self.adjoint: dict[int, int] = {}  # forward value index -> adjoint value in the new body
        self.results: dict[GradTarget, int] = {}
        self.masks: dict[int, int] = {}  # a recomputed dropout value -> its mask (`_dropout`)

    # --- building blocks -----------------------------------------------------
    def v(self, index: int) -> Value:
        return self.b.values[index]

    def op(self, op: Op, *args: int, shape=None, domain=None, attrs=()) -> int:
        values = [self.v(a) for a in args]
        if shape is None:
            shape = values[0].shape
            for other in values[1:]:
                shape = broadcast_shape(shape, other.shape)
        if domain is None:
            domain = max((v.domain for v in values), default=Domain.PARAM)
        return self.b.add(op, args, shape, domain, attrs)

    def const(self, number: float) -> int:
        return self.b.add(Op.CONST, (), (), Domain.PARAM, (("value", number),))

    def rowsum(self, x: int) -> int:
        return self.op(Op.ROWSUM, x, shape=())

    def mask(self, y: int) -> int:
        return self.masks[y]

    def value(self, x: int) -> Value:
        return self.v(x)

    def gradient(self, kind: str, g: int, name: str, k: int | None = None, index: str | None = None) -> None:
        self.add_result(GradTarget(GradKind(kind), name, k=k, index=index), g)

    def _dropout(self, value: Value, x: int) -> int:
        """A forward `dropout(x)` recomputed as ``x * M``, M the mask (dropout of ones at the same site and
        elements: the scale where kept, else 0), which the gradient shares: one Philox block per element."""
        ones = self.b.add(Op.CONST, (), value.shape, Domain.PARAM, (("value", 1.0),))
        if value.domain == Domain.CHILD:
            ones = self.b.add(Op.EXPAND, (ones,), value.shape, Domain.CHILD)
        mask = self.b.add(value.op, (ones,), value.shape, value.domain, value.attrs, loc=value.loc)
        y = self.b.add(Op.MUL, (x, mask), value.shape, value.domain, loc=value.loc)
        self.masks[y] = mask
        return y

    def add_result(self, target: GradTarget, g: int) -> None:
        if target in self.results:
            self.results[target] = self.op(Op.ADD, self.results[target], g)
        else:
            self.results[target] = g

    def contribute(self, forward_arg: int, g: int) -> None:
        """Add `g` to the adjoint of a forward value, reducing broadcast axes first."""
        target = self.forward.values[forward_arg]
        if target.dtype != DType.F32 or target.op == Op.CONST:
            return
        if self.v(g).domain == Domain.CHILD and target.domain != Domain.CHILD:
            g = self.op(Op.SUM, g, domain=Domain.NODE)
        if not target.shape and self.v(g).shape:
            g = self.op(Op.ROWSUM, g, shape=())
        elif target.shape == (1,) and self.v(g).shape != (1,):  # a broadcast [1] operand, as a scalar
            g = self.op(Op.ROWSUM, g, shape=(1,))
        if forward_arg in self.adjoint:
            self.adjoint[forward_arg] = self.op(Op.ADD, self.adjoint[forward_arg], g)
        else:
            self.adjoint[forward_arg] = g

    # --- the pass ---------------------------------------------------------------
    def run(self) -> Body:
        for index, value in enumerate(self.forward.values):
            args = tuple(self.copy[a] for a in value.args)
            if index in self.saved:
                array, column = self.saved[index]
                attrs = (("name", array), ("column", column))
                self.copy.append(self.b.add(Op.SAVED, (), value.shape, Domain.NODE, attrs, loc=value.loc))
                continue
            if value.op == Op.DROPOUT:
                self.copy.append(self._dropout(value, args[0]))
                continue
            self.copy.append(
                self.b.add(value.op, args, value.shape, value.domain, value.attrs, value.dtype, loc=value.loc)
            )
        for name, index in self.forward.results:
            value = self.forward.values[index]
            seed = self.b.add(Op.ADJOINT, (), value.shape, Domain.NODE, (("name", name),))
            self.contribute(index, seed)
        for index in reversed(range(len(self.forward.values))):
            if index in self.adjoint:
                self._rule(index, self.adjoint[index])
        # by their spelling, as the dumps show them
        ordered: list[tuple[ResultKey, int]] = sorted(self.results.items(), key=lambda item: str(item[0]))
        return self.b.finish(BodyKind.GRAD, ordered)

    def _rule(self, index: int, g: int) -> None:
        """The op's registry derivative: contributions to its arguments, results for leaves."""
        value = self.forward.values[index]
        self.const(1.0)  # before the rule's own values (many use it): the order the golden dumps show
        copies = [self.copy[x] for x in value.args]
        rule = OPS[value.op].derivative(self, g, self.copy[index], copies, value)
        for position, contribution in enumerate(rule):
            if contribution is not None:
                self.contribute(value.args[position], contribution)


def grad_body(forward: Body, saved: Mapping[int, tuple[str, int]] | None = None) -> Body:
    """The GRAD body of `forward`; `saved` maps forward values (per node, not a dropout) to where a
    training forward kept them (a saved array's name and column): the body reads those as `saved` values
    and recomputes only what else it needs (`passes.saving`)."""
    return _Reverse(forward, saved).run()


def recomputed_reads(forward: Body) -> set[int]:
    """The forward values the adjoints in `forward`'s GRAD body read (after dead values are dropped):
    what a training forward could keep instead of the gradient recomputing it."""
    reverse = _Reverse(forward)
    reverse.run()
    prefix = len(forward.values)  # the copies come first; dropout adds values among them, so find the end
    for number, value in enumerate(reverse.b.values):
        if value.op == Op.ADJOINT:
            prefix = number
            break
    live = _live(reverse.b.values, list(reverse.results.values()))
    copies: dict[int, list[int]] = {}
    for forward_index, copy in enumerate(reverse.copy):
        copies.setdefault(copy, []).append(forward_index)
    reads: set[int] = set()
    for number in sorted(live):
        if number < prefix:
            continue
        for arg in reverse.b.values[number].args:
            if arg < prefix:
                reads.update(copies.get(arg, ()))
    for index in reverse.results.values():
        if index < prefix:
            reads.update(copies.get(index, ()))
    return reads


def _live(values: list[Value], roots: list[int]) -> set[int]:
    live: set[int] = set()
    stack = list(roots)
    while stack:
        index = stack.pop()
        if index not in live:
            live.add(index)
            stack.extend(values[index].args)
    return live
