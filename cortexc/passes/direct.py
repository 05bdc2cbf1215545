"""The direct node kernel: an inference variant that hoists nothing and fuses the products' K dimension.

Why: hoisting `W_ih @ x` out of the recursion makes it one big GEMM, but each level then reads its hoisted
rows back and runs a GEMM of its own over K = H: two GEMMs of small K and two passes over the gate rows.
On levels of many rows, one product of the column-stacked params by the concatenated vectors,
``[W_ih | W_hh] @ concat(x, child[0].h)`` (K = X + H), keeps the gate rows in registers and has no pre
kernel at all. Measured, 2 cores (Sapphire Rapids), chain LSTM X=32 H=64 forward: 0.86x the time at
100 chains of 100 and 0.75x at 10 chains of 1000, but 1.17x at one chain of 1000 (a level of one row:
there the hoisted GEMM over every row wins). So the C target has both kernels, and the driver picks per
call from the forest's level widths (`cx_direct`), never from the threads: a call's results do not
depend on the team. The two kernels add the same products in another order, so their results agree to
rounding, not bitwise.

Where the params side by side are wide (K above `Target.direct_max_k`), the per-level GEMM of the hoisted
kernel is efficient already, and the big hoisted GEMM over every row is the better half: no direct kernel.

Requires: a scheduled program whose node kernel reads hoisted rows. Guarantees: where the node body, with
its hoisted values computed in place (`inline_hoisted`), has a sum of products ``P_i @ v_i`` (P_i params,
v_i per-node vectors but table rows, each product used by the sum only; a table row's product is a folded
table's row in an inference, cheaper than any GEMM) of which one reads the children and one does
not (what hoisting took out), a `node_direct` kernel over that body with each such sum rewritten as one
product of the stacked params (`stack_products`), and `Program.direct`: the phases of an inference that
runs it (the forward's without the pre kernel, `node_direct` for `node`). Otherwise the program is
unchanged. Training never runs it (the backward reads what the hoisted forward kept).
"""

from __future__ import annotations

from dataclasses import replace

from cortexc.ir.builder import BodyBuilder
from cortexc.ir.cell import Body, BodyKind, Value
from cortexc.ir.ops import Domain, Op
from cortexc.ir.program import KernelRole, Program
from cortexc.passes.hoist import child_readers
from cortexc.passes.schedule import packed_key, schedule_kernel, use_counts


def direct_node(program: Program, max_k: int) -> Program:
    """The program with its direct node kernel and `Program.direct` phases, where it has one (see above):
    where some sum's stacked params have at most `max_k` columns (`Target.direct_max_k`)."""
    cell = program.cell
    if cell.pre is None or program.direct:
        return program
    body = stack_products(inline_hoisted(cell.pre, cell.node), max_k)
    if body is None:
        return program
    packed = {packed_key(w): w for w in program.packed}
    node = program.role(KernelRole.NODE)
    kernel = schedule_kernel(KernelRole.NODE_DIRECT, node.rows, body, cell, packed)
    pre = program.role(KernelRole.PRE).name
    phases = tuple(
        replace(p, kernel=kernel.name) if p.kernel == node.name else p for p in program.forward if p.kernel != pre
    )
    at = program.kernels.index(node) + 1
    return replace(
        program,
        kernels=program.kernels[:at] + (kernel,) + program.kernels[at:],
        packed=tuple(packed.values()),
        direct=phases,
    )


def inline_hoisted(pre: Body, node: Body) -> Body:
    """The node body with each `hoisted` value replaced by the pre body's computation of it."""
    builder = BodyBuilder()
    in_node: dict[int, int] = {}

    def copy_pre(index: int) -> int:
        if index not in in_node:
            value = pre.values[index]
            in_node[index] = _copy(builder, value, tuple(copy_pre(a) for a in value.args))
        return in_node[index]

    renumbered: list[int] = []
    for value in node.values:
        if value.op == Op.HOISTED:
            renumbered.append(copy_pre(pre.result(value.name)))
        else:
            renumbered.append(_copy(builder, value, tuple(renumbered[a] for a in value.args)))
    return builder.finish(BodyKind.NODE, [(name, renumbered[i]) for name, i in node.results])


def stack_products(body: Body, max_k: int) -> Body | None:
    """`body` with every sum of two or more ``param @ per-node vector`` products, one reading the children
    and one not, whose params have at most `max_k` columns together, written as one product
    ``transpose(concat(transpose(P_1), ...)) @ concat(v_1, ...)`` (the params side by side) plus the sum's
    other terms in their order; None if no sum has such products."""
    values = body.values
    uses = use_counts(body)
    reads_children = child_readers(body)

    def terms(index: int) -> list[int]:
        value = values[index]
        if value.op == Op.ADD and all(values[a].shape == value.shape for a in value.args):
            return [t for a in value.args for t in (terms(a) if uses[a] == 1 else [a])]
        return [index]

    def stackable(index: int) -> bool:
        value = values[index]
        if value.op != Op.MATMUL or uses[index] != 1:
            return False
        left, right = (values[a] for a in value.args)
        # not a table row: its product is a folded table's row in an inference (`passes.fold`), no GEMM at all
        return left.op == Op.PARAM and len(right.shape) == 1 and right.domain == Domain.NODE and right.op != Op.EMBED

    inner = {a for v in values if v.op == Op.ADD for a in v.args if uses[a] == 1 and values[a].op == Op.ADD}
    plans: dict[int, tuple[list[int], list[int]]] = {}
    for index, value in enumerate(values):
        if value.op != Op.ADD or index in inner or value.domain != Domain.NODE or len(value.shape) != 1:
            continue
        parts = terms(index)
        products = [t for t in parts if stackable(t)]
        if len(products) < 2 or len({reads_children[p] for p in products}) < 2:
            continue
        if sum(values[values[p].args[0]].shape[1] for p in products) > max_k:
            continue  # a GEMM of wide K is efficient hoisted too: the direct kernel would only lose the big one
        plans[index] = (products, [t for t in parts if t not in products])
    if not plans:
        return None

    builder = BodyBuilder()
    renumbered: list[int] = []
    for index, value in enumerate(values):
        if index not in plans:
            renumbered.append(_copy(builder, value, tuple(renumbered[a] for a in value.args)))
            continue
        products, rest = plans[index]
        lefts = [values[values[p].args[0]] for p in products]
        rights = [values[p].args[1] for p in products]
        m = value.shape[0]
        columns = [
            builder.add(Op.TRANSPOSE, (renumbered[values[p].args[0]],), (left.shape[1], m), Domain.PARAM)
            for p, left in zip(products, lefts)
        ]
        k = sum(left.shape[1] for left in lefts)
        stacked = builder.add(Op.CONCAT, tuple(columns), (k, m), Domain.PARAM)
        weight = builder.add(Op.TRANSPOSE, (stacked,), (m, k), Domain.PARAM)
        operand = builder.add(Op.CONCAT, tuple(renumbered[r] for r in rights), (k,), Domain.NODE)
        total = builder.add(Op.MATMUL, (weight, operand), (m,), Domain.NODE, loc=value.loc)
        for term in rest:
            term_value = values[term]
            domain = max(Domain.NODE, term_value.domain)
            total = builder.add(Op.ADD, (total, renumbered[term]), (m,), domain, loc=value.loc)
        if value.label:
            builder.label(total, value.label)
        renumbered.append(total)
    return builder.finish(BodyKind.NODE, [(name, renumbered[i]) for name, i in body.results])


def _copy(builder: BodyBuilder, value: Value, args: tuple[int, ...]) -> int:
    new = builder.add(value.op, args, value.shape, value.domain, value.attrs, value.dtype, loc=value.loc)
    if value.label:
        builder.label(new, value.label)
    return new


__all__ = ["direct_node", "inline_hoisted", "stack_products"]
