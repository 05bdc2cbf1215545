"""Blocks and outputs -> IR bodies, checking every expression on the way.

Each expression is elaborated into an SSA value whose shape and domain are
its type, so a shape mismatch, a per-child value assigned to a state or a
`child[k]` beyond the arity is found exactly where the value would be built,
with the location of the operator or name at fault. Identical values are
shared as they are built (a param read twice is one value), and values that
no result needs are dropped at the end of each body.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from cortexc.errors import SourceLoc
from cortexc.frontend import ast
from cortexc.frontend.check import DeclaredCell, ErrorSink, const_int, const_value, did_you_mean, expr_loc
from cortexc.ir import cell as ir
from cortexc.ir.builder import BodyBuilder
from cortexc.ir.cell import BodyKind, DType, Value
from cortexc.ir.ops import (
    BINARY_SYMBOLS,
    CALLS,
    CHILD_FUNCTIONS,
    OPS,
    REDUCTIONS,
    Domain,
    Op,
    OpDef,
    OpKind,
    Shape,
    ShapeError,
    broadcast_shape,
    concat_shape,
    fmt_shape,
    matmul_shape,
    slice_shape,
)
from cortexc.ir.ops.children import EDGE_VALUES
from cortexc.runtime.signature import GIVEN_INPUTS

FUNCTIONS = sorted([*CALLS, *REDUCTIONS, *CHILD_FUNCTIONS, "concat", "dropout"])


def _dropout_sites(decl: DeclaredCell) -> dict[tuple[int, int], int]:
    """Each `dropout(...)` call of the cell by where it starts -> its site: its position among the cell's
    dropout calls in the order of the text (leaf block, node block and outputs together)."""
    found: list[tuple[int, int]] = []

    def walk(node: Any) -> None:
        if isinstance(node, ast.Call) and node.func == "dropout":
            found.append((node.loc.line, node.loc.col))
        if isinstance(node, tuple):
            for item in node:
                walk(item)
        elif dataclasses.is_dataclass(node) and not isinstance(node, SourceLoc):
            for f in dataclasses.fields(node):
                walk(getattr(node, f.name))

    walk((decl.leaf, decl.node, tuple(out for out, _ in decl.outputs)))
    return {place: site for site, place in enumerate(sorted(found))}


def lower_cell(decl: DeclaredCell, sink: ErrorSink, source_file: str = "") -> ir.Cell | None:
    """Build the IR cell; errors go to `sink` (None is returned if any were found here)."""
    before = len(sink.errors)
    sites = _dropout_sites(decl)
    node = _lower_block(decl, decl.node, sink, sites) if decl.node is not None else None
    leaf = _lower_block(decl, decl.leaf, sink, sites) if decl.leaf is not None else None
    outputs = []
    for out_decl, shape in decl.outputs:
        body = _lower_output(decl, out_decl, shape, sink, sites)
        if body is not None:
            # a graph cell's outputs are per node after the last step: the unrolled steps' roots (`runtime.graph`)
            at_root = out_decl.at_root or decl.steps is not None
            outputs.append(ir.Output(out_decl.name, shape, at_root, body))
    if len(sink.errors) > before or node is None:
        return None
    return ir.Cell(
        name=decl.syntax.name,
        structure=decl.structure,
        arity=decl.arity,
        dims=decl.dims,
        params=decl.params,
        inputs=decl.inputs,
        states=decl.states,
        node=node,
        leaf=leaf,
        outputs=tuple(outputs),
        source=source_file,
        down=decl.down,
        steps=decl.steps,
    )


@dataclass
class _Scope:
    decl: DeclaredCell
    kind: str  # "leaf", "root", "init", "node" or "output"
    builder: BodyBuilder
    sink: ErrorSink
    locals: dict[str, int | None]  # None marks a name whose value had an error
    assigned_states: dict[str, tuple[int | None, SourceLoc]]
    targets: frozenset[str] = frozenset()  # every name the block assigns (to tell "not yet" from "unknown")
    sites: Mapping[tuple[int, int], int] = dataclasses.field(default_factory=dict)  # dropout calls (`_dropout_sites`)


def _lower_block(
    decl: DeclaredCell, block: ast.Block, sink: ErrorSink, sites: Mapping[tuple[int, int], int]
) -> ir.Body:
    targets = frozenset(t.name for stmt in block.stmts for t in stmt.targets)
    scope = _Scope(decl, block.kind, BodyBuilder(), sink, {}, {}, targets, sites)
    states = {s.name: s for s in decl.states}
    read_only = {p.name: "param" for p in decl.params} | {i.name: "input" for i in decl.inputs}
    read_only |= {name: "dim" for name, _ in decl.dims}
    for stmt in block.stmts:
        if len(stmt.targets) != len(stmt.values):
            sink.report(f"{len(stmt.targets)} names on the left but {len(stmt.values)} values on the right", stmt.loc)
            for target in stmt.targets:  # count them as assigned (in error), so no error follows from this one
                if target.name in states:
                    scope.assigned_states.setdefault(target.name, (None, target.loc))
                elif target.name not in read_only:
                    scope.locals[target.name] = None
            continue
        values = [_expr(scope, expr) for expr in stmt.values]  # all right sides first, as in Python
        for target, expr, value in zip(stmt.targets, stmt.values, values):
            _bind(scope, target, expr, value, states, read_only)
    results = []
    for state in decl.states:
        if state.name not in scope.assigned_states:
            sink.report(f"state '{state.name}' is not assigned in the {block.kind} block", block.loc)
            continue
        index, _ = scope.assigned_states[state.name]
        if index is not None:
            results.append((state.name, index))
    # a root block reads no parent, an init block (step 0) no other node
    kind = BodyKind.LEAF if block.kind in ("leaf", "root", "init") else BodyKind.NODE
    return scope.builder.finish(kind, results)


def _bind(
    scope: _Scope,
    target: ast.Target,
    expr: ast.Expr,
    value: int | None,
    states: dict[str, ir.StateDecl],
    read_only: dict[str, str],
) -> None:
    name, sink = target.name, scope.sink
    if name in read_only:
        what = read_only[name]
        sink.report(f"cannot assign to {what} '{name}': {what}s are read-only", target.loc)
        return
    if value is not None:
        scope.builder.label(value, name)
    if name not in states:
        scope.locals[name] = value
        return
    if name in scope.assigned_states:
        first = scope.assigned_states[name][1]
        sink.report(
            f"state '{name}' is assigned twice in the {scope.kind} block (first at line {first.line})", target.loc
        )
        return
    scope.assigned_states[name] = (value, target.loc)
    if value is None:
        return
    v = scope.builder.values[value]
    state = states[name]
    if v.domain == Domain.CHILD:
        sink.report(
            f"state '{name}' is assigned a per-child value: reduce it over the children with "
            "sum(...), mean(...) or max(...)",
            expr_loc(expr),
        )
        scope.assigned_states[name] = (None, target.loc)
    elif v.dtype != DType.F32 or v.shape != state.shape:
        sink.report(
            f"shape mismatch: state {name}{fmt_shape(state.shape)} is assigned a value of shape {_describe(v)}",
            expr_loc(expr),
        )
        scope.assigned_states[name] = (None, target.loc)


def _lower_output(
    decl: DeclaredCell, out: ast.OutputDecl, shape: Shape, sink: ErrorSink, sites: Mapping[tuple[int, int], int]
) -> ir.Body | None:
    scope = _Scope(decl, "output", BodyBuilder(), sink, {}, {}, sites=sites)
    value = _expr(scope, out.expr)
    if value is None:
        return None
    v = scope.builder.values[value]
    if v.dtype != DType.F32 or v.shape != shape:
        sink.report(
            f"shape mismatch: output {out.name}{fmt_shape(shape)} is given a value of shape {_describe(v)}",
            expr_loc(out.expr),
        )
        return None
    return scope.builder.finish(BodyKind.OUTPUT, [(out.name, value)])


def _a_shape(shape: Shape) -> str:
    """A shape as a sentence's complement: "a scalar", or "[3, 4]"."""
    return "a scalar" if not shape else fmt_shape(shape)


def _describe(v: Value) -> str:
    return "index (an int)" if v.dtype == DType.I32 else fmt_shape(v.shape)


def _text(expr: ast.Expr) -> str:
    """Short source-like text of an expression, for messages."""
    if isinstance(expr, ast.Number):
        return expr.text
    if isinstance(expr, ast.Name):
        return expr.name
    if isinstance(expr, ast.Binary):
        prec = _PRECEDENCE[expr.op]
        left = _text(expr.left)
        right = _text(expr.right)
        if isinstance(expr.left, ast.Binary) and _PRECEDENCE[expr.left.op] < prec:
            left = f"({left})"
        if isinstance(expr.right, ast.Binary) and _PRECEDENCE[expr.right.op] <= prec:
            right = f"({right})"
        return f"{left} {expr.op} {right}"
    if isinstance(expr, ast.Neg):
        return f"-{_operand_text(expr.operand)}"
    if isinstance(expr, ast.Call):
        return f"{expr.func}({', '.join(_text(a) for a in expr.args)})"
    if isinstance(expr, ast.Slice):
        lo = _text(expr.lo) if expr.lo else ""
        hi = _text(expr.hi) if expr.hi else ""
        return f"{_operand_text(expr.base)}[{lo}:{hi}]"
    if isinstance(expr, ast.Index):
        return f"{_operand_text(expr.base)}[{_text(expr.index)}]"
    if isinstance(expr, ast.ChildAll):
        return f"child.{expr.state}"
    if isinstance(expr, ast.EdgeAll):
        return f"edge.{expr.name}"
    if isinstance(expr, ast.EdgeAt):
        return f"edge[{_text(expr.k)}].{expr.name}"
    if isinstance(expr, ast.ParentAll):
        return f"parent.{expr.state}"
    if isinstance(expr, ast.PrevAll):
        return f"prev.{expr.state}"
    return f"child[{_text(expr.k)}].{expr.state}"


_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2, "@": 2}


def _operand_text(expr: ast.Expr) -> str:
    """`_text` of an operand of unary minus or of a postfix `[...]`, in parentheses if it needs them."""
    return f"({_text(expr)})" if isinstance(expr, ast.Binary | ast.Neg) else _text(expr)


def _named(expr: ast.Expr, v: Value) -> str:
    return f"{_operand_text(expr)}{fmt_shape(v.shape)}" if v.shape else f"{_text(expr)} (a scalar)"


def _expr(scope: _Scope, expr: ast.Expr) -> int | None:
    handler = _HANDLERS[type(expr)]
    return handler(scope, expr)


def _value(scope: _Scope, index: int) -> Value:
    return scope.builder.values[index]


def _float_operand(scope: _Scope, expr: ast.Expr) -> int | None:
    """Elaborate an operand of arithmetic: index inputs are only for look-ups."""
    index = _expr(scope, expr)
    if index is not None and _value(scope, index).dtype == DType.I32:
        scope.sink.report(
            f"'{_text(expr)}' is an index input: it can only select a row of a param, as E[{_text(expr)}]",
            expr_loc(expr),
        )
        return None
    return index


def _number(scope: _Scope, expr: ast.Number) -> int:
    return scope.builder.add(Op.CONST, (), (), Domain.PARAM, (("value", expr.value),), loc=expr.loc)


def _name(scope: _Scope, expr: ast.Name) -> int | None:
    name, decl, b = expr.name, scope.decl, scope.builder
    if name in scope.locals:
        return scope.locals[name]
    for state in decl.states:
        if state.name == name:
            if scope.kind == "output":
                return b.add(Op.STATE, (), state.shape, Domain.NODE, (("name", name),), loc=expr.loc)
            if name in scope.assigned_states:
                return scope.assigned_states[name][0]
            hint = f" (the children's {name} is child.{name})" if scope.kind == "node" else ""
            scope.sink.report(
                f"state '{name}' is read before it is assigned in the {scope.kind} block" + hint, expr.loc
            )
            return None
    for inp in decl.inputs:
        if inp.name == name and inp.on_edge:
            scope.sink.report(f"'{name}' is an edge input: read it as edge.{name} (one value per child)", expr.loc)
            return None
        if inp.name == name:
            dtype = DType.I32 if inp.is_index else DType.F32
            return b.add(Op.INPUT, (), inp.shape, Domain.NODE, (("name", name),), dtype, loc=expr.loc)
    for param in decl.params:
        if param.name == name and len(param.shape) == 3:
            r, m, k = param.shape
            scope.sink.report(
                f"'{name}' is a family of {r} matrices [{m}, {k}]: use it as {name}[i] (matrix number i, i an index "
                f"value) or as {name} @ v (the [{r}, {m}] matrix of all {r} products with a [{k}] vector)",
                expr.loc,
            )
            return None
        if param.name == name:
            return b.add(Op.PARAM, (), param.shape, Domain.PARAM, (("name", name),), loc=expr.loc)
    dims = decl.dim_map
    if name in dims:
        return b.add(Op.CONST, (), (), Domain.PARAM, (("value", float(dims[name])),), loc=expr.loc)
    if name in scope.targets:
        scope.sink.report(f"'{name}' is read before it is assigned in the {scope.kind} block", expr.loc)
        return None
    known = [
        *scope.locals,
        *(s.name for s in decl.states),
        *(i.name for i in decl.inputs),
        *(p.name for p in decl.params),
        *dims,
    ]
    hint = did_you_mean(name, known)
    if scope.kind == "output" and not hint:
        hint = " (outputs read the node's states, inputs and params)"
    scope.sink.report(f"unknown name '{name}'" + hint, expr.loc)
    return None


def _family(scope: _Scope, expr: ast.Expr) -> ir.ParamDecl | None:
    """The 3-D param `expr` names, if it is one (read only as `W[i]` and `W @ v`)."""
    if not isinstance(expr, ast.Name) or expr.name in scope.locals:
        return None
    return next((p for p in scope.decl.params if p.name == expr.name and len(p.shape) == 3), None)


def _family_product(scope: _Scope, expr: ast.Binary, family: ir.ParamDecl) -> int | None:
    """`W @ v` of a family `W[R, M, K]` and a `[K]` vector: the `[R, M]` matrix of the `R` products, one GEMM
    over the family's `R*M` rows (`param_views`) whose row is seen as the matrix."""
    right = _float_operand(scope, expr.right)
    if right is None:
        return None
    v = _value(scope, right)
    r, m, k = family.shape
    if v.shape != (k,):
        scope.sink.report(
            f"shape mismatch: {_text(expr)} multiplies {family.name}[{r}, {m}, {k}] by {_named(expr.right, v)}: "
            f"a family of matrices multiplies a [{k}] vector (for one matrix of it write {family.name}[i] @ ...)",
            expr.loc,
        )
        return None
    b = scope.builder
    rows = b.add(Op.PARAM, (), (r * m, k), Domain.PARAM, (("name", family.name),), loc=expr.left.loc)
    product = b.add(Op.MATMUL, (rows, right), (r * m,), v.domain, loc=expr.loc)
    return b.add(Op.RESHAPE, (product,), (r, m), v.domain, loc=expr.loc)


#: the most matrices of a family that `W[edge.rel] @ v` multiplies all of, in one GEMM, before choosing a row
#: per child (more: each child's matrix is looked up and multiplied on its own)
MAX_SELECTED_MATRICES = 16


def _selected_per_child(scope: _Scope, index: ast.Expr, family: ir.ParamDecl) -> bool:
    """Whether `W[index] @ v` runs as all of W's products, then a row per child: `index` is edge.position, or
    an edge index input over a family of at most `MAX_SELECTED_MATRICES`."""
    if not isinstance(index, ast.EdgeAll | ast.EdgeAt):
        return False
    if _is_position(index):
        return True
    on_edge = any(i.name == index.name and i.on_edge and i.is_index for i in scope.decl.inputs)
    return on_edge and family.shape[0] <= MAX_SELECTED_MATRICES


def _is_position(index: ast.Expr) -> bool:
    """Whether an index expression is `edge.position` (a child's place: chooses a row by `select`)."""
    return isinstance(index, ast.EdgeAll) and index.name == "position"


def _positions_fit(scope: _Scope, expr: ast.Expr, name: str, count: int, what: str) -> bool:
    """Whether `name`'s `count` matrices (or rows) cover every child position of an arity cell; else a located
    error. Without an arity the runtime refuses a node with too many children (`check_forest`)."""
    arity = scope.decl.arity
    if arity is None or count >= arity:
        return True
    scope.sink.report(
        f"{_text(expr)}: {name} has {count} {what} but a child's position ranges over [0, {arity}) (arity {arity})",
        expr.loc,
    )
    return False


def _family_select(scope: _Scope, expr: ast.Binary, family: ir.ParamDecl) -> int | None:
    """`W[edge.position] @ v` or `W[edge.rel] @ v`: the products of all of W's matrices with v, one GEMM (grouped,
    not per edge), then each child's row chosen by its position or relation (`select`)."""
    member = expr.left
    assert isinstance(member, ast.Index)  # `_selected_per_child` said so
    r, m, _ = family.shape
    index = _expr(scope, member.index)
    if index is None:
        return None
    i = _value(scope, index)
    by_position = _is_position(member.index)
    if by_position and not _positions_fit(scope, member, family.name, r, "matrices"):
        return None
    if i.op == Op.EDGE_INPUT and not by_position:
        index_range = next(d.index_range for d in scope.decl.inputs if d.name == i.name)
        if index_range is not None and index_range > r:
            scope.sink.report(
                f"{_text(member)}: {family.name} has {r} matrices but {i.name} ranges over [0, {index_range})",
                member.loc,
            )
            return None
    products = _family_product(scope, ast.Binary("@", member.base, expr.right, expr.loc), family)
    if products is None:
        return None
    domain = max(_value(scope, products).domain, i.domain)
    attrs = (("by", "position" if by_position else "index"),)
    chosen = scope.builder.add(Op.SELECT, (products, index), (m,), domain, attrs, loc=expr.loc)
    return _per_node_choice(scope, member.index, chosen)


def _binary(scope: _Scope, expr: ast.Binary) -> int | None:
    family = _family(scope, expr.left) if expr.op == "@" else None
    if family is not None:
        return _family_product(scope, expr, family)
    member_of = _family(scope, expr.left.base) if expr.op == "@" and isinstance(expr.left, ast.Index) else None
    if member_of is not None and _selected_per_child(scope, expr.left.index, member_of):  # type: ignore[union-attr]
        return _family_select(scope, expr, member_of)
    left = _float_operand(scope, expr.left)
    right = _float_operand(scope, expr.right)
    if left is None or right is None:
        return None
    a, b = _value(scope, left), _value(scope, right)
    try:
        if expr.op == "@":
            op, shape = Op.MATMUL, matmul_shape(a.shape, b.shape)
        else:
            op, shape = BINARY_SYMBOLS[expr.op], broadcast_shape(a.shape, b.shape)
    except ShapeError as err:
        verb = {"@": "multiplies", "+": "adds", "-": "subtracts", "*": "multiplies", "/": "divides"}[expr.op]
        scope.sink.report(
            f"shape mismatch: {_text(expr)} {verb} {_named(expr.left, a)} "
            f"{'by' if expr.op in '@*/' else 'and'} {_named(expr.right, b)}: {err}",
            expr.loc,
        )
        return None
    domain = max(a.domain, b.domain)
    return scope.builder.add(op, (left, right), shape, domain, loc=expr.loc)


def _neg(scope: _Scope, expr: ast.Neg) -> int | None:
    operand = _float_operand(scope, expr.operand)
    if operand is None:
        return None
    v = _value(scope, operand)
    return scope.builder.add(Op.NEG, (operand,), v.shape, v.domain, loc=expr.loc)


def _call(scope: _Scope, expr: ast.Call) -> int | None:
    func, sink, b = expr.func, scope.sink, scope.builder
    if func == "concat":
        maybe_args = [_float_operand(scope, a) for a in expr.args]
        args = [a for a in maybe_args if a is not None]
        if len(args) != len(maybe_args):
            return None
        values = [_value(scope, a) for a in args]
        try:
            shape = concat_shape([v.shape for v in values])
        except ShapeError as err:
            sink.report(f"shape mismatch in concat: {err}", expr.loc)
            return None
        domain = max(v.domain for v in values)
        return b.add(Op.CONCAT, tuple(args), shape, domain, loc=expr.loc)
    if func in CHILD_FUNCTIONS and scope.decl.down:
        sink.report(f"{func} in a down cell: it normalises across children, which a down cell does not read", expr.loc)
        return None
    if func in CHILD_FUNCTIONS:
        return _child_function(scope, expr)
    if func == "dropout":
        return _dropout(scope, expr)
    if func in ("min", "max") and len(expr.args) == 2:
        elementwise = "minimum" if func == "min" else "maximum"
        sink.report(
            f"{func}(a, b) with two values: for the elementwise {elementwise} write {elementwise}(a, b)"
            + ("; max(e) is the maximum over the children" if func == "max" else ""),
            expr.loc,
        )
        return None
    if func in CALLS:  # the operands here, not in _function: a frame less per level of nesting (MAX_NESTING)
        definition = OPS[CALLS[func]]
        arity = definition.arity or 1
        if len(expr.args) != arity:
            sink.report(f"{func} takes {_COUNTS.get(arity, f'{arity} arguments')}, got {len(expr.args)}", expr.loc)
            return None
        operands = []
        for operand in expr.args:
            operands.append(_float_operand(scope, operand))
        return _function(scope, expr, definition, operands)
    if func not in REDUCTIONS:
        hint = _MISSING_FUNCTIONS.get(func) or did_you_mean(func, FUNCTIONS)
        sink.report(f"unknown function '{func}'" + hint, expr.loc)
        return None
    if len(expr.args) != 1:
        sink.report(f"{func} takes one argument, got {len(expr.args)}", expr.loc)
        return None
    arg = _float_operand(scope, expr.args[0])
    if arg is None:
        return None
    v = _value(scope, arg)
    # a reduction over the children (over the parents in a down cell on a DAG)
    if not _reduction_visible(scope, f"{func}(...)", expr.loc):
        return None
    if v.domain != Domain.CHILD and not _is_number(b.values, arg):
        over, each = ("parents", "parent") if scope.decl.down else ("children", "child")
        sink.report(
            f"{func} reduces over the {over}, but {_text(expr.args[0])} is the same for every {each} (it reads "
            f"no per-{each} value); over a vector's components, write dot(v, w) for a weighted sum or layernorm(v)",
            expr.loc,
        )
        return None
    if v.domain != Domain.CHILD:  # a number taken once per child: sum(1) counts the children
        arg = b.add(Op.EXPAND, (arg,), v.shape, Domain.CHILD, loc=expr.loc)
    return b.add(REDUCTIONS[func], (arg,), v.shape, Domain.NODE, loc=expr.loc)


_COUNTS = {1: "one argument", 2: "two arguments"}

#: functions users reach for that the language has not, and what to write instead
_MISSING_FUNCTIONS = {
    "transpose": ": params are used as declared; declare the param transposed (param U[K, M]) and write U @ v",
    "reshape": ": shapes are as declared; slices (v[a:b]) cut vectors and concat(a, b) joins them",
    "view": ": shapes are as declared; slices (v[a:b]) cut vectors and concat(a, b) joins them",
    "outer": ": an outer product is only used through @, and outer(a, b) @ c is a * dot(b, c)",
    "pow": ": there is no power function; write x * x for a square (exp(p * log(x)) for x > 0 otherwise)",
}


def _is_number(values: list[Value], index: int) -> bool:
    """A value computed from constants alone (numbers and dims): the same for every child by nature."""
    if values[index].domain != Domain.PARAM:
        return False
    stack = [index]
    while stack:
        value = values[stack.pop()]
        if value.op == Op.CONST:
            continue
        if not value.args:
            return False
        stack.extend(value.args)
    return True


def _function(scope: _Scope, expr: ast.Call, definition: OpDef, operands: list[int | None]) -> int | None:
    """A call of a function the op registry defines (elementwise and row ops), of its elaborated operands
    (None: one had an error, reported), checked by its entry's shape rule."""
    func, sink = expr.func, scope.sink
    arity = definition.arity or 1
    args = [a for a in operands if a is not None]
    if len(args) != len(operands):
        return None
    values = [_value(scope, a) for a in args]
    if definition.kind == OpKind.VECTOR:
        for arg_expr, v in zip(expr.args, values):
            if len(v.shape) != 1:
                what = "a vector" if arity == 1 else "vectors"
                sink.report(f"{func} takes {what}, but {_text(arg_expr)} is {_a_shape(v.shape)}", expr.loc)
                return None
        if definition.row is not None and definition.row.element and values[0].shape == (1,):
            # normalised over its one element: a constant, never what was meant
            assert definition.numpy is not None  # a row op's entry has its NumPy rule
            always = f"{float(definition.numpy(np.ones(1))[0]):g}"
            across = " across the children" if values[0].domain == Domain.CHILD else ""
            text = _text(expr.args[0])
            sink.report(
                f"{func} of {text}, a [1] value, is always {always} (a {func} over one element)"
                + (definition.hint_on_one.format(arg=text, across=across) if definition.hint_on_one else ""),
                expr.loc,
            )
            return None
    assert definition.shape is not None  # every callable entry has its shape rule
    try:
        shape = definition.shape(*(v.shape for v in values))
    except ShapeError as err:
        sink.report(f"shape mismatch in {func}: {err}", expr.loc)
        return None
    domain = max(definition.min_domain, *(v.domain for v in values))
    return scope.builder.add(definition.op, tuple(args), shape, domain, loc=expr.loc)


def _child_function(scope: _Scope, expr: ast.Call) -> int | None:
    """`child_softmax(e)`: a per-child value normalised across the node's children (component-wise)."""
    func, sink = expr.func, scope.sink
    if len(expr.args) != 1:
        sink.report(f"{func} takes one argument (a per-child value), got {len(expr.args)}", expr.loc)
        return None
    if not _children_visible(scope, f"{func}(...)", expr.loc):
        return None
    arg = _float_operand(scope, expr.args[0])
    if arg is None:
        return None
    v = _value(scope, arg)
    if v.domain != Domain.CHILD:
        sink.report(
            f"{func} takes a per-child value (one per child, e.g. w_a @ child.h), but {_text(expr.args[0])} "
            f"is the same for every child: it would be 1 / (number of children)",
            expr.loc,
        )
        return None
    return scope.builder.add(CHILD_FUNCTIONS[func], (arg,), v.shape, Domain.CHILD, loc=expr.loc)


def _dropout(scope: _Scope, expr: ast.Call) -> int | None:
    """`dropout(e, p)`: p a constant of numbers and dims in [0, 1) (a float64); the result varies per node at
    least (its mask does), per child where e does."""
    sink = scope.sink
    if len(expr.args) != 2:
        sink.report(f"dropout takes two arguments, dropout(e, p), got {len(expr.args)}", expr.loc)
        return None
    arg = _float_operand(scope, expr.args[0])
    p = const_value(expr.args[1], scope.decl.dim_map, sink, "the dropout probability p", _other_names(scope))
    if arg is None or p is None:
        return None
    if not 0.0 <= p < 1.0:
        sink.report(
            f"the dropout probability p must be in [0, 1), but {_text(expr.args[1])} is {p:g}", expr_loc(expr.args[1])
        )
        return None
    if scope.decl.steps is not None and scope.kind == "node":
        sink.report(
            "dropout in a graph cell's node block: its mask would repeat at every step; use it in the init block "
            "or in an output",
            expr.loc,
        )
        return None
    v = _value(scope, arg)
    site = scope.sites[(expr.loc.line, expr.loc.col)]
    domain = max(v.domain, Domain.NODE)
    return scope.builder.add(Op.DROPOUT, (arg,), v.shape, domain, (("site", site), ("p", float(p))), loc=expr.loc)


def _reduction_visible(scope: _Scope, what: str, loc: SourceLoc) -> bool:
    """Whether a reduction may be written here: over children in a node block, over parents in a down cell
    on a DAG (not in its root block or outputs); a node of a tree has one parent, read as parent.NAME."""
    if not scope.decl.down:
        return _children_visible(scope, what, loc)
    if not scope.decl.structure.shares_children:
        scope.sink.report(
            f"{what} in a down cell on a tree: a node has one parent, read as parent.NAME (per node, 0 at a root); "
            "reductions over parents are for down cells on a dag",
            loc,
        )
        return False
    if scope.kind != "node":
        where = "the root block: roots have no parent" if scope.kind == "root" else "an output"
        scope.sink.report(f"{what} in {where}", loc)
        return False
    return True


def _children_visible(scope: _Scope, what: str, loc: SourceLoc) -> bool:
    if scope.decl.down:
        if what.startswith("edge"):  # edge[k]: a down cell reads the edge to its parent, as edge.NAME
            scope.sink.report(
                f"{what} in a down cell: a node's edge to its parent is read as edge.NAME (edge[k] reads the edge "
                "to child k, which a down cell does not read)",
                loc,
            )
        else:
            scope.sink.report(
                f"{what} in a down cell: a down cell computes a node after its parent and reads it as parent.NAME; "
                "children are read by bottom-up cells",
                loc,
            )
        return False
    if scope.kind == "leaf":
        scope.sink.report(f"{what} in a leaf block: leaves have no children", loc)
        return False
    if scope.kind == "init":
        scope.sink.report(
            f"{what} in the init block: step 0 reads no other node (the node block reads the in-neighbours)", loc
        )
        return False
    if scope.kind == "output":
        scope.sink.report(f"{what} in an output: outputs are computed from the node alone, without children", loc)
        return False
    return True


def _slice(scope: _Scope, expr: ast.Slice) -> int | None:
    base = _float_operand(scope, expr.base)
    if base is None:
        return None
    v = _value(scope, base)
    if len(v.shape) != 1:
        scope.sink.report(f"only vectors can be sliced, but {_text(expr.base)} is {_a_shape(v.shape)}", expr.loc)
        return None
    dims = scope.decl.dim_map
    others = _other_names(scope)
    lo = 0 if expr.lo is None else const_int(expr.lo, dims, scope.sink, "a slice bound", others)
    hi = v.shape[0] if expr.hi is None else const_int(expr.hi, dims, scope.sink, "a slice bound", others)
    if lo is None or hi is None:
        return None
    try:
        shape = slice_shape(v.shape, lo, hi)
    except ShapeError as err:
        at_fault = expr.hi if expr.hi is not None and (hi > v.shape[0] or expr.lo is None) else expr.lo
        scope.sink.report(f"{_text(expr)}: {err}", expr_loc(at_fault or expr.base))
        return None
    return scope.builder.add(Op.SLICE, (base,), shape, v.domain, (("lo", lo), ("hi", hi)), loc=expr.loc)


def _family_member(scope: _Scope, expr: ast.Index, family: ir.ParamDecl) -> int | None:
    """`W[i]` of a family `W[R, M, K]`: the `[M, K]` matrix number `i`, a look-up of the family read as `R`
    rows of `M*K` (`param_views`), per node or per child as `i` is."""
    r, m, k = family.shape
    row = _expr(scope, expr.index)
    if row is None:
        return None
    i = _value(scope, row)
    b = scope.builder
    if _is_position(expr.index):
        # each child's matrix by its place: a row of the family read as R rows of M*K (the products' view
        # [R*M, K] reshaped, so that its gradient is that view's, as every other use of the family)
        if not _positions_fit(scope, expr, family.name, r, "matrices"):
            return None
        view = b.add(Op.PARAM, (), (r * m, k), Domain.PARAM, (("name", family.name),), loc=expr.base.loc)
        table = b.add(Op.RESHAPE, (view,), (r, m * k), Domain.PARAM, loc=expr.base.loc)
        chosen = b.add(Op.SELECT, (table, row), (m * k,), i.domain, (("by", "position"),), loc=expr.loc)
        return b.add(Op.RESHAPE, (chosen,), (m, k), i.domain, loc=expr.loc)
    if i.dtype != DType.I32:
        scope.sink.report(
            f"{_text(expr)}: a matrix of the family {family.name} is chosen by an index value "
            "(an input declared 'input w : index[V]'), not a float",
            expr_loc(expr.index),
        )
        return None
    index_range = next(d.index_range for d in scope.decl.inputs if d.name == i.name)
    if index_range is not None and index_range > r:
        scope.sink.report(
            f"{_text(expr)}: {family.name} has {r} matrices but {i.name} ranges over [0, {index_range})", expr.loc
        )
        return None
    table = b.add(Op.PARAM, (), (r, m * k), Domain.PARAM, (("name", family.name),), loc=expr.base.loc)
    looked_up = b.add(Op.EMBED, (table, row), (m * k,), i.domain, loc=expr.loc)
    return _per_node_choice(scope, expr.index, b.add(Op.RESHAPE, (looked_up,), (m, k), i.domain, loc=expr.loc))


def _index(scope: _Scope, expr: ast.Index) -> int | None:
    sink = scope.sink
    family = _family(scope, expr.base)
    if family is not None:
        return _family_member(scope, expr, family)
    table = _expr(scope, expr.base)
    of_edge = isinstance(expr.index, ast.EdgeAll | ast.EdgeAt)
    looks_up = isinstance(expr.index, ast.Name) or of_edge
    looks_up = looks_up and any(
        i.name == _index_name(expr.index) and i.is_index and i.on_edge == of_edge  # type: ignore[arg-type]
        for i in scope.decl.inputs
    )
    if table is not None and len(_value(scope, table).shape) == 1 and not looks_up:
        return _subscript(scope, expr, table)
    if table is not None and not looks_up and not _is_param_matrix(_value(scope, table)):
        # a constant (or other non-index) subscript of a scalar, a computed matrix or an index input:
        # say what v[k] needs rather than what a look-up needs
        return _subscript(scope, expr, table)
    row = _expr(scope, expr.index)
    if table is None or row is None:
        return None
    t, r = _value(scope, table), _value(scope, row)
    if _is_position(expr.index) and t.op == Op.PARAM:
        # a row per child by its place (`select`, as W[edge.position] @ v chooses its product)
        if not _positions_fit(scope, expr, t.name, t.shape[0], "rows"):
            return None
        attrs = (("by", "position"),)
        return scope.builder.add(Op.SELECT, (table, row), (t.shape[1],), r.domain, attrs, loc=expr.loc)
    if t.op != Op.PARAM or len(t.shape) != 2:
        sink.report(
            f"{_text(expr)}: only a param matrix can be indexed by an index input (E[word]); "
            "use a slice v[a:b] for part of a vector",
            expr_loc(expr.base),
        )
        return None
    if r.dtype != DType.I32:
        sink.report(
            f"{_text(expr)}: the row must be an index input (declared 'input w : index[V]')", expr_loc(expr.index)
        )
        return None
    rows = t.shape[0]
    index_range = next(i.index_range for i in scope.decl.inputs if i.name == r.attr("name"))
    if index_range is not None and index_range > rows:
        sink.report(f"{_text(expr)}: {t.name} has {rows} rows but {r.name} ranges over [0, {index_range})", expr.loc)
        return None
    looked_up = scope.builder.add(Op.EMBED, (table, row), (t.shape[1],), max(t.domain, r.domain), loc=expr.loc)
    return _per_node_choice(scope, expr.index, looked_up)


def _index_name(expr: ast.Name | ast.EdgeAll | ast.EdgeAt) -> str:
    """The input an index expression names: `w` (a node's) or `edge.rel` (an edge's)."""
    return expr.name


def _subscript(scope: _Scope, expr: ast.Index, base: int) -> int | None:
    """`v[k]` of a vector, `k` a constant integer expression: the `[1]` vector `v[k:k+1]`."""
    v = _value(scope, base)
    if v.dtype == DType.I32:
        scope.sink.report(
            f"'{_text(expr.base)}' is an index input: it can only select a row of a param, as E[{_text(expr.base)}]",
            expr_loc(expr.base),
        )
        return None
    if len(v.shape) != 1:
        what = "a scalar" if not v.shape else f"a {fmt_shape(v.shape)} matrix"
        scope.sink.report(
            f"{_text(expr)}: a subscript v[k] takes one element of a vector, but {_operand_text(expr.base)} is "
            f"{what} (only a param matrix has rows to look up, with an index input: E[word])",
            expr_loc(expr.base),
        )
        return None
    k = const_int(expr.index, scope.decl.dim_map, scope.sink, "a subscript", _other_names(scope))
    if k is None:
        return None
    if not 0 <= k < v.shape[0]:
        scope.sink.report(
            f"{_text(expr)}: subscript {k} is out of range for {_named(expr.base, v)} "
            f"(its elements are numbered 0 to {v.shape[0] - 1})",
            expr_loc(expr.index),
        )
        return None
    attrs = (("lo", k), ("hi", k + 1))
    return scope.builder.add(Op.SLICE, (base,), (1,), v.domain, attrs, loc=expr.loc)


def _state_named(scope: _Scope, name: str, loc: SourceLoc) -> ir.StateDecl | None:
    for state in scope.decl.states:
        if state.name == name:
            return state
    names = [s.name for s in scope.decl.states]
    whose = "parents" if scope.decl.down else "children"
    scope.sink.report(f"the {whose} have no state '{name}'" + did_you_mean(name, names), loc)
    return None


def _other_names(scope: _Scope) -> dict[str, str]:
    """What each visible non-dim name is, for messages about constants."""
    names = {name: "a local" for name in scope.locals}
    names.update({s.name: "a state" for s in scope.decl.states})
    names.update({i.name: "an input" for i in scope.decl.inputs})
    names.update({p.name: "a param" for p in scope.decl.params})
    return names


def _child_all(scope: _Scope, expr: ast.ChildAll) -> int | None:
    if not _children_visible(scope, f"child.{expr.state}", expr.loc):
        return None
    state = _state_named(scope, expr.state, expr.loc)
    if state is None:
        return None
    return scope.builder.add(Op.CHILD_STATE, (), state.shape, Domain.CHILD, (("name", state.name),), loc=expr.loc)


def _parent_all(scope: _Scope, expr: ast.ParentAll) -> int | None:
    """`parent.s` in a down cell: the parent's state (0 at a root) on a tree, one per parent on a DAG (a
    per-parent value, reduced like a per-child one): the reversed forest's child reads (`runtime.topdown`)."""
    text = f"parent.{expr.state}"
    if not scope.decl.down:
        scope.sink.report(
            f"{text} in a bottom-up cell: it reads its children (child.{expr.state}, child[k].{expr.state}) and runs "
            f"a parent after its children; a cell that reads its parent is written 'cell {scope.decl.syntax.name} on "
            f"{scope.decl.syntax.structure} down'",
            expr.loc,
        )
        return None
    if scope.kind == "root":
        scope.sink.report(f"{text} in the root block: roots have no parent", expr.loc)
        return None
    if scope.kind == "output":
        scope.sink.report(f"{text} in an output: outputs are computed from the node alone", expr.loc)
        return None
    state = _state_named(scope, expr.state, expr.loc)
    if state is None:
        return None
    if scope.decl.structure.shares_children:
        return scope.builder.add(Op.CHILD_STATE, (), state.shape, Domain.CHILD, (("name", state.name),), loc=expr.loc)
    attrs = (("name", state.name), ("k", 0))
    return scope.builder.add(Op.CHILD_STATE_AT, (), state.shape, Domain.NODE, attrs, loc=expr.loc)


def _prev_all(scope: _Scope, expr: ast.PrevAll) -> int | None:
    """`prev.s` in a graph cell's node block: the node's own state one step earlier (the unrolled steps keep
    every step's states: node n of step t reads row n - step_nodes, `runtime.graph`)."""
    text = f"prev.{expr.state}"
    if scope.decl.steps is None:
        scope.sink.report(
            f"{text} outside a graph cell: only a graph cell ('cell {scope.decl.syntax.name} on graph(steps = T)') "
            "runs in steps; a tree or dag cell reads its children (child.NAME)",
            expr.loc,
        )
        return None
    if scope.kind != "node":
        where = "the init block: step 0 has no step before it" if scope.kind == "init" else "an output"
        scope.sink.report(f"{text} in {where}; prev is read in the node block", expr.loc)
        return None
    state = None
    for s in scope.decl.states:
        if s.name == expr.state:
            state = s
    if state is None:
        names = [s.name for s in scope.decl.states]
        scope.sink.report(f"there is no state '{expr.state}'" + did_you_mean(expr.state, names), expr.loc)
        return None
    return scope.builder.add(Op.PREV_STATE, (), state.shape, Domain.NODE, (("name", state.name),), loc=expr.loc)


def _position_k(scope: _Scope, k_expr: ast.Expr, text: str, every: str, what: str, loc: SourceLoc) -> int | None:
    """The constant k of `child[k].s` / `edge[k].NAME`, within the cell's arity (else a located error; `every`
    is the form for every child, `what` names k in messages)."""
    if not _children_visible(scope, text, loc):
        return None
    arity = scope.decl.arity
    if arity is None:
        scope.sink.report(
            f"{text} needs a cell with an arity, e.g. 'on tree(arity = 2)'; use {every} for every child", loc
        )
        return None
    k = const_int(k_expr, scope.decl.dim_map, scope.sink, what, _other_names(scope))
    if k is None:
        return None
    if not 0 <= k < arity:
        scope.sink.report(
            f"{text} is out of the declared arity {arity} (children are numbered 0 to {arity - 1})", k_expr.loc
        )
        return None
    return k


def _child_at(scope: _Scope, expr: ast.ChildAt) -> int | None:
    k = _position_k(scope, expr.k, _text(expr), f"child.{expr.state}", "a child number", expr.loc)
    if k is None:
        return None
    state = _state_named(scope, expr.state, expr.loc)
    if state is None:
        return None
    attrs = (("name", state.name), ("k", k))
    return scope.builder.add(Op.CHILD_STATE_AT, (), state.shape, Domain.NODE, attrs, loc=expr.loc)


def _edge_value(scope: _Scope, name: str, text: str, loc: SourceLoc, inputs: bool = True) -> bool:
    """Whether `name` is a value edges have: position, siblings, or (with `inputs`) an edge input; else a
    located error listing them (a node input read so is told to be read by its bare name)."""
    edge_inputs = [i.name for i in scope.decl.inputs if i.on_edge and not i.given_by] if inputs else []
    if name in EDGE_VALUES or name in edge_inputs:
        return True
    known = [*EDGE_VALUES, *edge_inputs]
    if any(i.name == name and not i.on_edge for i in scope.decl.inputs):
        message = f"{text}: '{name}' is a node input, read as {name}; edge.NAME reads {', '.join(known)}"
    else:
        message = f"unknown edge value '{name}' in {text}: an edge has {', '.join(known)}" + did_you_mean(name, known)
    scope.sink.report(message, loc)
    return False


def _down_edge(scope: _Scope, expr: ast.EdgeAll) -> int | None:
    """`edge.NAME` in a down cell: of the edge to each parent (a per-parent value) on a DAG, of the edge to the
    parent (per node, 0 at a root: the sum over its at most one parent) on a tree. Position and siblings are
    edge inputs the runtime gives (`runtime.edges`), read like the caller's."""
    text = _text(expr)
    if scope.kind != "node":
        where = "the root block: roots have no parent" if scope.kind == "root" else "an output"
        scope.sink.report(f"{text} in {where}", expr.loc)
        return None
    if not _edge_value(scope, expr.name, text, expr.loc):
        return None
    name = GIVEN_INPUTS.get(expr.name, expr.name)
    decl = next(i for i in scope.decl.inputs if i.name == name and i.on_edge)
    tree = not scope.decl.structure.shares_children
    dtype = DType.I32 if decl.is_index else DType.F32
    b = scope.builder
    per_parent = b.add(Op.EDGE_INPUT, (), decl.shape, Domain.CHILD, (("name", name),), dtype, loc=expr.loc)
    if not tree or decl.is_index:  # a tree's index: what it chooses is summed where it is used (`_per_node_choice`)
        return per_parent
    return b.add(Op.SUM, (per_parent,), decl.shape, Domain.NODE, loc=expr.loc)  # the one parent's, 0 at a root


def _edge_all(scope: _Scope, expr: ast.EdgeAll) -> int | None:
    """`edge.position`, `edge.siblings`, `edge.w` (an edge input): a value per child (the edge to it)."""
    if scope.decl.down:
        return _down_edge(scope, expr)
    text = _text(expr)
    if not _children_visible(scope, text, expr.loc) or not _edge_value(scope, expr.name, text, expr.loc):
        return None
    decl = next((i for i in scope.decl.inputs if i.name == expr.name and i.on_edge), None)
    if decl is not None:
        dtype = DType.I32 if decl.is_index else DType.F32
        attrs = (("name", decl.name),)
        return scope.builder.add(Op.EDGE_INPUT, (), decl.shape, Domain.CHILD, attrs, dtype, loc=expr.loc)
    return scope.builder.add(Op.EDGE, (), (1,), Domain.CHILD, (("name", expr.name),), loc=expr.loc)


def _per_node_choice(scope: _Scope, index: ast.Expr, value: int) -> int:
    """`value`, computed per child from an edge input, as the per-node value `index` means: for `edge[k].NAME`
    (arity cells) child k's row and for `edge.NAME` in a down cell on a tree the one parent's, 0 where there is
    none (the per-child rows masked to child k and summed). An index edge input stays per child until what it
    chooses (`E[edge[k].rel]`, `W[edge[k].rel] @ v`) is known, which is summed so: a row it would choose where
    the node has no child k (or at a root) reads 0. Any other `value` as it is."""
    down_tree = scope.decl.down and not scope.decl.structure.shares_children
    if not (isinstance(index, ast.EdgeAt) or (down_tree and isinstance(index, ast.EdgeAll))):
        return value
    if not any(i.name == index.name and i.on_edge and not i.given_by for i in scope.decl.inputs):
        return value  # edge.position / edge.siblings: per node already
    b, v = scope.builder, _value(scope, value)
    if v.domain != Domain.CHILD:
        return value
    if isinstance(index, ast.EdgeAt):
        k = _position_k(scope, index.k, _text(index), f"edge.{index.name}", "an edge number", index.loc)
        position = b.add(Op.EDGE, (), (1,), Domain.CHILD, (("name", "position"),), loc=index.loc)
        at = b.add(Op.CONST, (), (), Domain.PARAM, (("value", float(k or 0)),), loc=index.loc)
        mask = b.add(Op.EQ, (position, at), (1,), Domain.CHILD, loc=index.loc)
        value = b.add(Op.MUL, (value, mask), v.shape, Domain.CHILD, loc=index.loc)
    return b.add(Op.SUM, (value,), v.shape, Domain.NODE, loc=index.loc)


def _edge_at(scope: _Scope, expr: ast.EdgeAt) -> int | None:
    """`edge[k].position`, `edge[k].siblings`, `edge[k].w` (an edge input): the edge to child k, 0 where there is
    none (arity cells)."""
    text = _text(expr)
    k = _position_k(scope, expr.k, text, f"edge.{expr.name}", "an edge number", expr.loc)
    if k is None:
        return None
    decl = next((i for i in scope.decl.inputs if i.name == expr.name and i.on_edge), None)
    if decl is not None:  # an edge input of the edge to child k: per child, masked to child k
        dtype = DType.I32 if decl.is_index else DType.F32
        b = scope.builder
        per_child = b.add(Op.EDGE_INPUT, (), decl.shape, Domain.CHILD, (("name", decl.name),), dtype, loc=expr.loc)
        if decl.is_index:  # what it chooses is summed where it is used (`_per_node_choice`)
            return per_child
        return _per_node_choice(scope, expr, per_child)
    if not _edge_value(scope, expr.name, text, expr.loc, inputs=False):
        return None
    attrs = (("name", expr.name), ("k", k))
    return scope.builder.add(Op.EDGE_AT, (), (1,), Domain.NODE, attrs, loc=expr.loc)


# Each handler takes its own ast class, so the value type is as wide as Any.
_HANDLERS: dict[type[ast.Expr], Callable[[_Scope, Any], int | None]] = {
    ast.Number: _number,
    ast.Name: _name,
    ast.Binary: _binary,
    ast.Neg: _neg,
    ast.Call: _call,
    ast.Slice: _slice,
    ast.Index: _index,
    ast.ChildAll: _child_all,
    ast.ChildAt: _child_at,
    ast.EdgeAll: _edge_all,
    ast.EdgeAt: _edge_at,
    ast.ParentAll: _parent_all,
    ast.PrevAll: _prev_all,
}


def _is_param_matrix(v: Value) -> bool:
    """What `E[word]` can look a row up in."""
    return v.op == Op.PARAM and len(v.shape) == 2
