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

The rules of the elementwise and vector ops are their registry entries'
(`cortexc.ir.ops.OPS`, ``derivative``); the structural ops' rules are here
(``g`` is the adjoint of ``y = op(args)``):

* ``W @ x``: outer(g, x) to W, transpose(W) @ g to x; ``A @ B``: g @ transpose(B), transpose(A) @ g
* slices: pad(g) back in place; ``concat``: the slices of g; ``E[w]``: g to row w of E
* ``expand``: sum over the children; ``sum``: expand(g); ``mean``: expand(g / num_children);
  ``max``: expand(g / ties) where the child equals the max (tied children share it, like torch.amax)
* ``child_softmax``: y_j (g_j - sum_k y_k g_k) per node (the softmax Jacobian across the children, built
  of `sum`, `expand`, `sub` and `mul`, so the gradient kernels need no step of its own);
* a per-node operand of a per-child op gets the sum over the children of its adjoint;
  a scalar (or `[1]`) operand of a wider op gets the sum of the elements.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from cortexc.ir.builder import BodyBuilder
from cortexc.ir.cell import Body, BodyKind, Cell, DType, Gradients, GradKind, GradTarget, ResultKey, Value
from cortexc.ir.ops import (
    OPS,
    Domain,
    Op,
    broadcast_shape,
    matmul_shape,
    pad_shape,
    slice_shape,
)


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
        value = self.forward.values[index]
        op, args = value.op, value.args
        y = self.copy[index]
        self.const(1.0)  # before the rule's own values (many use it): the order the golden dumps show
        definition = OPS.get(op)
        if definition is not None:  # elementwise and vector ops: the registry's derivative
            for arg, contribution in zip(args, definition.derivative(self, g, y, [self.copy[x] for x in args])):
                if contribution is not None:
                    self.contribute(arg, contribution)
        elif op == Op.PARAM:
            self.add_result(GradTarget(GradKind.PARAM, value.name), g)
        elif op == Op.INPUT:
            self.add_result(GradTarget(GradKind.INPUT, value.name), g)
        elif op == Op.STATE:
            self.add_result(GradTarget(GradKind.STATE, value.name), g)
        elif op == Op.CHILD_STATE:
            self.add_result(GradTarget(GradKind.CHILD, value.name), g)
        elif op == Op.CHILD_STATE_AT:
            self.add_result(GradTarget(GradKind.CHILD_AT, value.name, k=value.attr("k")), g)
        elif op == Op.HOISTED:
            self.add_result(GradTarget(GradKind.HOISTED, value.name), g)
        elif op == Op.MATMUL:
            self._matmul(args, g)
        elif op == Op.SLICE:
            size = self.forward.values[args[0]].shape[0]
            lo = value.attr("lo")
            shape = pad_shape(self.v(g).shape, lo, size)
            self.contribute(args[0], self.op(Op.PAD, g, shape=shape, attrs=(("lo", lo), ("size", size))))
        elif op == Op.CONCAT:
            start = 0
            for arg in args:
                part = self.forward.values[arg]
                stop = start + part.shape[0]
                shape = slice_shape(self.v(g).shape, start, stop)
                piece = self.op(Op.SLICE, g, shape=shape, attrs=(("lo", start), ("hi", stop)))
                self.contribute(arg, piece)
                start = stop
        elif op == Op.EMBED:
            table, row = (self.forward.values[x] for x in args)
            self.add_result(GradTarget(GradKind.EMBED, table.name, index=row.name), g)
        elif op == Op.EXPAND:
            self.contribute(args[0], self.op(Op.SUM, g, domain=Domain.NODE))
        elif op == Op.SUM:
            self.contribute(args[0], self.op(Op.EXPAND, g, domain=Domain.CHILD))
        elif op == Op.MEAN:
            count = self.b.add(Op.NUM_CHILDREN, (), (), Domain.NODE)
            self.contribute(args[0], self.op(Op.EXPAND, self.op(Op.DIV, g, count), domain=Domain.CHILD))
        elif op == Op.MAX:  # tied children share the gradient (as torch.amax does)
            holds_max = self.op(Op.EQ, self.copy[args[0]], self.op(Op.EXPAND, y, domain=Domain.CHILD))
            ties = self.op(Op.SUM, holds_max, domain=Domain.NODE)
            share = self.op(Op.EXPAND, self.op(Op.DIV, g, ties), domain=Domain.CHILD)
            self.contribute(args[0], self.op(Op.MUL, holds_max, share))
        elif op == Op.CHILD_SOFTMAX:  # d e_j = y_j * (g_j - sum_k y_k g_k), over the node's children
            dot = self.op(Op.SUM, self.op(Op.MUL, y, g), domain=Domain.NODE)
            centred = self.op(Op.SUB, g, self.op(Op.EXPAND, dot, domain=Domain.CHILD))
            self.contribute(args[0], self.op(Op.MUL, y, centred))
        elif op == Op.CONST:
            pass
        else:  # pragma: no cover - every forward op has a rule above
            raise NotImplementedError(f"autodiff has no rule for {op}")

    def _matmul(self, args: tuple[int, ...], g: int) -> None:
        a, b = self.copy[args[0]], self.copy[args[1]]
        left, right = self.v(a), self.v(b)
        left_t = self.op(Op.TRANSPOSE, a, shape=(left.shape[1], left.shape[0]))
        if len(right.shape) == 1:
            outer_shape = (self.v(g).shape[0], right.shape[0])
            self.contribute(args[0], self.op(Op.OUTER, g, b, shape=outer_shape))
        else:
            right_t = self.op(Op.TRANSPOSE, b, shape=(right.shape[1], right.shape[0]))
            shape = matmul_shape(self.v(g).shape, self.v(right_t).shape)
            self.contribute(args[0], self.op(Op.MATMUL, g, right_t, shape=shape))
        shape = matmul_shape(self.v(left_t).shape, self.v(g).shape)
        self.contribute(args[1], self.op(Op.MATMUL, left_t, g, shape=shape))


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
