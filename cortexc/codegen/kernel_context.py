"""What the kernel skeleton (`templates/kernels.j2`) reads about one kernel: its symbols, tile buffers and
one context per step (a GEMM, a loop, a reduction, a row op, a store, ...), every expression from `exprs`.
`render` assembles the file around them."""

from __future__ import annotations

import re
from typing import Any

from cortexc.codegen.exprs import (
    KernelExprs,
    gradient_symbol,
    hoisted_symbol,
    input_row,
    input_symbol,
    output_symbol,
    param_symbol,
    prev_row,
    saved_symbol,
    state_symbol,
)
from cortexc.codegen.target import Target
from cortexc.ir.cell import Cell, Value
from cortexc.ir.ops import ELEMENTWISE_OPS, OPS, Op, float_literal
from cortexc.ir.program import (
    AccumOuter,
    AccumSum,
    Adjoints,
    ChildSoftmax,
    Gemm,
    Grouped,
    Kernel,
    Loop,
    PlaceKind,
    Program,
    Reduce,
    Row,
    RowKind,
    Rows,
    SmallMatmul,
    Store,
    StoreMode,
    StoreTarget,
    slice_offset,
    width,
)

_NODE_OF_ROW = {
    Rows.INTERNAL: "call->level_order[pos0 + i]",
    Rows.LEVEL: "call->level_order[pos0 + i]",
    Rows.NODES: "pos0 + i",
    Rows.ROOTS: "call->roots[pos0 + i]",
}
_ROWS_DOC = {
    Rows.INTERNAL: "every internal node (hoisted input projections)",
    Rows.LEVEL: "the nodes of one level",
    Rows.NODES: "every node",
    Rows.ROOTS: "the roots",
}


def abi(cell: Cell, program: Program) -> dict[str, list[str]]:
    """The order of each pointer array of `cx_call` (what the runtime must pass)."""
    return {
        "params": [p.name for p in cell.params],
        "packed": [w.name for w in program.packed],
        "inputs": [i.name for i in cell.inputs],
        "states": [s.name for s in cell.states],
        "hoisted": [name for name, _ in cell.pre.named_results] if cell.pre is not None else [],
        "outputs": [o.name for o in cell.outputs],
        "saved": [values.name for values in program.saved],
    }


def _symbols(cell: Cell, program: Program, kernel: Kernel, target: Target, acc_offsets: dict[str, int]) -> list[str]:
    """Declarations of the forest-wide arrays this kernel may touch (the caller keeps those it does)."""
    table = abi(cell, program)
    values = kernel.body.values
    stores = [s for s in kernel.steps if isinstance(s, Store)]
    used_params = {v.name for v in values if v.op == Op.PARAM}
    used_inputs = {v.name for v in values if v.op in (Op.INPUT, Op.EDGE_INPUT)}
    used_inputs |= {s.index_input for s in stores if s.target == StoreTarget.D_EMBED}
    used_states = {v.name for v in values if v.op in (Op.STATE, Op.CHILD_STATE, Op.CHILD_STATE_AT, Op.PREV_STATE)}
    used_states |= {s.name for s in stores if s.target == StoreTarget.STATE}
    used_hoisted = {v.name for v in values if v.op == Op.HOISTED}
    used_hoisted |= {s.name for s in stores if s.target == StoreTarget.PRE}
    used_packed = {s.packed for s in kernel.steps if isinstance(s, Gemm)}
    adjoints = {v.name for v in values if v.op == Op.ADJOINT}
    d_states = {s.name for s in stores if s.target in _STATE_GRADIENT_TARGETS}
    d_states |= adjoints if kernel.adjoints == Adjoints.STATE else set()
    d_hoisted = {s.name for s in stores if s.target == StoreTarget.D_HOISTED}
    d_hoisted |= adjoints if kernel.adjoints == Adjoints.PRE else set()
    d_inputs = {s.name for s in stores if s.target in (StoreTarget.D_INPUT, StoreTarget.D_EDGE_INPUT)}
    d_params = {s.name for s in stores if s.target == StoreTarget.D_EMBED}
    upstream = adjoints if kernel.adjoints == Adjoints.OUTPUT else set()
    accumulated = {s.param for s in kernel.steps if isinstance(s, AccumOuter | AccumSum)}
    decls = []

    def declare(names: list[str], used: set[str], text) -> None:
        for index, name in enumerate(names):
            if name in used:
                decls.append(text(index, name))

    declare(table["params"], used_params, lambda i, n: f"const float *{param_symbol(n)} = call->params[{i}];")
    declare(table["packed"], used_packed, lambda i, n: f"const float *{n} = call->packed[{i}];")
    for index, name in enumerate(table["inputs"]):
        if name in used_inputs:
            kind = "int32_t" if cell.input(name).is_index else "float"
            decls.append(f"const {kind} *{input_symbol(name)} = (const {kind} *)call->inputs[{index}];")
    declare(table["states"], used_states, lambda i, n: f"float *{state_symbol(n)} = call->states[{i}];")
    declare(table["hoisted"], used_hoisted, lambda i, n: f"float *{hoisted_symbol(n)} = call->hoisted[{i}];")
    used_saved = {v.name for v in values if v.op == Op.SAVED} | {b.saved for b in kernel.buffers if b.saved}
    used_saved |= {s.name for s in stores if s.target == StoreTarget.SAVED}
    declare(table["saved"], used_saved, lambda i, n: f"float *{saved_symbol(n)} = call->saved[{i}];")
    stored_outputs = {s.name for s in stores if s.target == StoreTarget.OUTPUT}
    declare(table["outputs"], stored_outputs, lambda i, n: f"float *{output_symbol(n)} = call->outputs[{i}];")
    declare(table["states"], d_states, lambda i, n: f"float *{gradient_symbol('state', n)} = grad->d_states[{i}];")
    declare(table["hoisted"], d_hoisted, lambda i, n: f"float *{gradient_symbol('pre', n)} = grad->d_hoisted[{i}];")
    declare(table["inputs"], d_inputs, lambda i, n: f"float *{gradient_symbol('input', n)} = grad->d_inputs[{i}];")
    declare(table["params"], d_params, lambda i, n: f"float *{gradient_symbol('param', n)} = grad->d_params[{i}];")
    declare(
        table["outputs"], upstream, lambda i, n: f"const float *{gradient_symbol('output', n)} = grad->upstream[{i}];"
    )
    param_index = {name: i for i, name in enumerate(table["params"])}
    for name in sorted(accumulated):
        if target.private_accumulators:  # per chunk, summed into the gradients at the end
            if name not in acc_offsets:
                continue  # only deferred terms: nothing is added per tile
            decls.append(f"float *acc_{name} = acc + {acc_offsets[name]};")
        else:  # straight into the gradient, with atomic adds
            decls.append(f"float *acc_{name} = grad->d_params[{param_index[name]}];")
    return decls


def kernel_context(
    cell: Cell,
    program: Program,
    kernel: Kernel,
    target: Target,
    deferred: list[dict[str, Any]],
    acc_offsets: dict[str, int],
) -> dict[str, Any]:
    saved = {v.name: (v.width, "call->level_ptr[1]" if v.internal else "0") for v in program.saved}
    exprs = KernelExprs(cell, kernel, saved=saved)
    offsets = []
    node_floats = child_floats = 0
    for buffer in kernel.buffers:
        if buffer.saved:  # the tile's rows of a saved array (rows by level-order position), not scratch
            origin = exprs.saved_row(buffer.saved, "0")
            offsets.append({"name": buffer.name, "offset": "", "origin": origin})
            continue
        offsets.append({"name": buffer.name, "offset": _offset(node_floats, child_floats), "origin": ""})
        if buffer.rows == RowKind.NODE:
            node_floats += buffer.width
        else:
            child_floats += buffer.width
    offset_terms = _offset(node_floats, child_floats)
    split = kernel.split if target.column_split else None
    whole = [split is None or not split.split_steps[n] for n in range(len(kernel.steps))]  # columns not split
    steps = [_step_context(exprs, kernel, step, grid_ok) for step, grid_ok in zip(kernel.steps, whole)]
    # a loop or store whose text has dropout is versioned on the call's train flag: the evaluation-mode
    # copy computes exactly e (a branch inside the loop would be if-converted, the masks computed anyway)
    plain = KernelExprs(cell, kernel, train=False, saved=saved)
    for step, context, grid_ok in zip(kernel.steps, steps, whole):
        if context["kind"] in ("loop", "store"):
            text = _step_context(plain, kernel, step, grid_ok)["expr"]
            versioned = text != context["expr"] and context.get("mode") != StoreMode.ATOMIC_ADD.value
            context["expr_eval"] = text if versioned else ""
    packed_index = {w.name: i for i, w in enumerate(program.packed)}
    for number, (step, context) in enumerate(zip(kernel.steps, steps)):
        context["split"] = split is not None and split.split_steps[number]
        context["owner_only"] = split is not None and isinstance(step, Store) and not context["split"]
        if isinstance(step, Gemm):
            context["packed_index"] = packed_index[step.packed]
            context.update(_fold_context(program, kernel, step))
        if isinstance(step, AccumOuter):
            where = [i for i, t in enumerate(deferred) if t["kernel"] == kernel.name and t["step"] == number]
            context["deferred"] = where[0] if where else None
            context["narrow"] = bool(where) and deferred[where[0]]["narrow"]
            if where and not context["narrow"]:
                del context["acc"]  # nothing is added here: the deferred phase adds to the gradient
            context["first_row"] = "e0" if step.rows == RowKind.CHILD else "pos0"
            context["rows"] = step.rows.value
    # the stores several rows of one launch add to (C stages them, CUDA adds atomically)
    staged: list[dict[str, Any]] = []
    for step, context in zip(kernel.steps, steps):
        if isinstance(step, Store) and step.mode == StoreMode.ATOMIC_ADD:
            context["slot"] = len(staged)
            context["rows"] = step.rows.value
            staged.append({"slot": len(staged), "width": step.width, "child": step.rows == RowKind.CHILD})
    reads_children = bool(kernel.child_ks) or any(
        OPS[v.op].reads_children or v.domain.name == "CHILD" for v in kernel.body.values
    )
    uses_pre_base = (
        any(v.op == Op.HOISTED for v in kernel.body.values)
        or any(isinstance(s, Store) and s.target in (StoreTarget.PRE, StoreTarget.D_HOISTED) for s in kernel.steps)
        or kernel.adjoints == Adjoints.PRE
    )
    row_macs = sum(s.m * s.k for s in kernel.steps if isinstance(s, Gemm))  # the GEMMs' multiply-adds per row
    return {
        "name": kernel.name,
        "rows_doc": _ROWS_DOC[kernel.rows],
        "node_of_row": _NODE_OF_ROW[kernel.rows],
        "symbols": _used(_symbols(cell, program, kernel, target, acc_offsets), [*steps, *offsets]),
        "reads_children": reads_children,
        # each child edge's row (`er`): only steps over child edges read it, and its fill loop (a branch per
        # row) was ~3% of a chain LSTM's forward that reads none
        "edge_rows": bool(_used(["er"], [*steps, *offsets])),
        "child_ks": kernel.child_ks,
        "uses_pre_base": uses_pre_base,
        "buffers": offsets,
        "steps": steps,
        "scratch_floats": offset_terms,
        "split": split.period if split is not None else 0,
        "split_macs": row_macs if split is not None else 0,
        "row_macs": row_macs,
        "staged": staged,
        "accumulates": any(c["kind"] in ("accum_outer", "accum_sum") and "acc" in c for c in steps),
    }


def _fold_context(program: Program, kernel: Kernel, step: Gemm) -> dict[str, Any]:
    """A folded GEMM (`passes.fold`): its slot in `cx_call.folded` and the table row of tile row `i` (the
    look-up's index), or `fold` None."""
    if not step.fold:
        return {"fold": None}
    slot = [f.name for f in program.folds].index(step.fold)
    index = kernel.body.values[kernel.body.values[step.operand].args[1]]
    return {"fold": slot, "fold_row": f"(int64_t){input_symbol(index.name)}[{input_row(program.cell, 'nd[i]')}]"}


#: the stores that write a state's gradient (the kernel declares those arrays)
_STATE_GRADIENT_TARGETS = (StoreTarget.D_STATE, StoreTarget.D_CHILD, StoreTarget.D_CHILD_AT, StoreTarget.D_PREV)


def _store_destination(exprs: KernelExprs, step: Store) -> str:
    """The first element of the row a store writes, for row `i` of the tile."""
    w = step.width
    if step.target == StoreTarget.SAVED:  # a column range of the node's row (rows by level-order position)
        return f"{exprs.saved_row(step.name, 'i')} + {step.column}"
    # a table row chosen by the node's index
    index, looked_up = input_symbol(step.index_input), input_row(exprs.cell, "nd[i]")
    # (or by the child edge's: W[edge.rel])
    if step.target == StoreTarget.D_EMBED and exprs.cell.input(step.index_input).on_edge:
        looked_up = "e0 + i"
    rows = {
        StoreTarget.STATE: (state_symbol(step.name), "nd[i]"),
        StoreTarget.PRE: (hoisted_symbol(step.name), "(pre_base + i)"),
        StoreTarget.OUTPUT: (output_symbol(step.name), "(pos0 + i)"),
        StoreTarget.D_STATE: (gradient_symbol("state", step.name), "nd[i]"),
        StoreTarget.D_CHILD: (gradient_symbol("state", step.name), "ch[i]"),
        StoreTarget.D_CHILD_AT: (gradient_symbol("state", step.name), f"kid{step.k}[i]"),
        StoreTarget.D_PREV: (gradient_symbol("state", step.name), prev_row("nd[i]")),
        StoreTarget.D_HOISTED: (gradient_symbol("pre", step.name), "(pre_base + i)"),
        StoreTarget.D_INPUT: (gradient_symbol("input", step.name), input_row(exprs.cell, "nd[i]")),
        StoreTarget.D_EDGE_INPUT: (gradient_symbol("input", step.name), "(e0 + i)"),
        StoreTarget.D_EMBED: (gradient_symbol("param", step.name), f"(int64_t){index}[{looked_up}]"),
    }
    array, row = rows[step.target]
    return f"{array} + {row} * {w}"


def _used(declarations: list[str], steps: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The declarations whose variable some step's text mentions (nvcc warns about the others)."""
    text = " ".join(str(value) for step in steps for value in step.values())
    kept = []
    for declaration in declarations:
        name = declaration.split("=")[0].split("*")[-1].strip()
        if re.search(rf"\b{re.escape(name)}\b", text):
            kept.append({"decl": declaration})
    return kept


def _offset(node_floats: int, child_floats: int) -> str:
    return f"(int64_t)CX_TILE * {node_floats} + (int64_t)CX_TILE * maxc * {child_floats}"


def _count(rows: RowKind) -> str:
    return "n" if rows == RowKind.NODE else "ne"


def _pad_spans(kernel: Kernel, index: int, loop_width: int) -> list[tuple[int, int]]:
    """The column ranges of a loop over value `index` between which no padded term (a slice's gradient put
    back in place: `pad`) starts or ends, when the value's inlined expression adds such terms (an LSTM's
    gate gradients make one [4H] row of four [H] ones). A loop per range lets the compiler drop every term
    that is 0 there (its condition on j is decided by the loop's bounds) instead of computing each
    element's four terms and selecting one; one range otherwise."""
    values, places = kernel.body.values, kernel.places
    cuts = {0, loop_width}
    stack, seen = [index], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        value = values[current]
        if value.op == Op.PAD:
            lo = slice_offset(values[value.args[0]], value.attr("lo"))
            cuts.update({lo, lo + width(values[value.args[0]])})
        elif value.op not in ELEMENTWISE_OPS:
            continue  # a slice, a transpose, an outer product: its columns are not the loop's
        stack.extend(a for a in value.args if places[a].kind == PlaceKind.INLINE and width(values[a]) == loop_width)
    ends = sorted(c for c in cuts if 0 <= c <= loop_width)
    return list(zip(ends, ends[1:]))


def _row_context(exprs: KernelExprs, value: Value, step: Row) -> dict[str, Any]:
    """A row op's passes (`ir.ops.RowOp`) as C: its operands' element j in each text."""
    row = OPS[value.op].row
    assert row is not None  # a Row step is made for row ops only
    operands = [exprs.ref(arg, step.rows, "i", "j") for arg in value.args]
    n = float_literal(float(step.width))
    passes = []
    for p in row.passes:
        update = p.update.format(*operands, n=n)
        loop = f"{{ out_row[j] = {p.store.format(*operands, n=n)}; {update}; }}" if p.store else f"{update};"
        passes.append({"before": p.before.format(n=n), "loop": loop})
    return {
        "kind": "row",
        "doc": f"{step.out} = {value.op.value}({', '.join(f'%{a}' for a in value.args)}) per row",
        "count": _count(step.rows),
        "out": step.out,
        "width": step.width,
        "accumulators": ", ".join(f"{name} = {init}" for name, init in row.accumulators),
        "passes": passes,
        "setup": row.setup.format(n=n),
        "element": row.element.format(*operands, n=n),
        "scalar": row.scalar,
    }


def _loop_grid(kernel: Kernel, step: Loop) -> int:
    """The width k of the matrix a Loop step writes whole, as rows x k columns, where the value is an outer
    product (its C then reads the loop's own row and column, `col_split`): else 0, a flat loop over j."""
    value = kernel.body.values[step.value]
    while value.op == Op.RESHAPE:  # a view: the same elements, the same col
        value = kernel.body.values[value.args[0]]
    if value.op != Op.OUTER or not step.compute or step.width != width(value):
        return 0
    return value.shape[1] if len(_pad_spans(kernel, step.value, step.width)) == 1 else 0


def _group_context(exprs: KernelExprs, group: Grouped | None, rows: RowKind) -> dict[str, Any] | None:
    """A grouped range (`passes.grouping`) as C: its columns, its count, and row `i`'s group (an int)."""
    if group is None:
        return None
    index = exprs.ref(group.index, rows, "i", "0")
    return {"lo": group.lo, "width": group.width, "groups": group.groups, "index": index}


def _plain_columns(step: Gemm) -> list[tuple[int, int]]:
    """The column ranges of a grouped GEMM that every row computes: those of no `Grouped` range."""
    ranges, start = [], 0
    for g in step.grouped:
        if g.lo > start:
            ranges.append((start, g.lo))
        start = g.lo + g.groups * g.width
    return ranges + ([(start, step.m)] if step.grouped and start < step.m else [])


def _step_context(exprs: KernelExprs, kernel: Kernel, step, grid_ok: bool = False) -> dict[str, Any]:
    """A step's template context; `grid_ok`: its columns are not split over blocks (a Loop may then walk a
    matrix by row and column, `_loop_grid`)."""
    values = kernel.body.values
    if isinstance(step, Gemm):
        return {
            "kind": "gemm",
            "doc": f"GEMM {step.out} = %{step.operand} @ [{', '.join(step.weights)}]^T",
            "count": _count(step.rows),
            "address": exprs.address(step.operand, step.rows, "i"),
            "k": step.k,
            "m": step.m,
            "packed": step.packed,
            "out": step.out,
            "scratch": step.scratch,
            "grouped": [_group_context(exprs, g, step.rows) for g in step.grouped],
            "plain": _plain_columns(step),
            "grouped_k": _group_context(exprs, step.grouped_k, step.rows),
        }
    if isinstance(step, Loop):
        render = exprs.compute if step.compute else exprs.ref
        out_width = next(b.width for b in kernel.buffers if b.name == step.out)
        exprs.grid = _loop_grid(kernel, step) if grid_ok else 0
        expr = render(step.value, step.rows, "i", "j")
        grid, exprs.grid = exprs.grid, 0
        return {
            "kind": "loop",
            "doc": f"{step.out}[:, {step.column}:{step.column + step.width}] = %{step.value}",
            "count": _count(step.rows),
            "out": step.out,
            "out_width": out_width,
            "column": step.column,
            "width": step.width,
            "expr": expr,
            "spans": _pad_spans(kernel, step.value, step.width) if step.compute else [(0, step.width)],
            "grid": [step.width // grid, grid] if grid else [],
        }
    if isinstance(step, Reduce):
        value = values[step.value]
        reduce = OPS[value.op].reduce
        assert reduce is not None  # a Reduce step is made for reductions only
        return {
            "kind": "reduce",
            "doc": f"{step.out} = {value.op.value} over children of %{value.args[0]}",
            "out": step.out,
            "width": step.width,
            "init": reduce.init,
            "op": reduce.combine,
            "arg": exprs.ref(value.args[0], RowKind.CHILD, "e", "j"),
            "mean": reduce.mean,
        }
    if isinstance(step, ChildSoftmax):
        value = values[step.value]
        return {
            "kind": "child_softmax",
            "doc": f"{step.out} = child_softmax(%{value.args[0]}) across each node's child edges",
            "out": step.out,
            "width": step.width,
            "arg": exprs.ref(value.args[0], RowKind.CHILD, "e", "j"),
        }
    if isinstance(step, Row):
        return _row_context(exprs, values[step.value], step)
    if isinstance(step, SmallMatmul):
        value = values[step.value]
        a, b = value.args
        return {
            "kind": "small_matmul",
            "doc": f"{step.out} = %{a} @ %{b} per row",
            "count": _count(step.rows),
            "out": step.out,
            "m": step.m,
            "k": step.k,
            "n": step.n,
            "a": exprs.ref(a, step.rows, "i", f"p * {step.k} + r"),
            "b": exprs.ref(b, step.rows, "i", f"r * {step.n} + q" if step.n > 1 else "r"),
        }

    if isinstance(step, AccumOuter):
        return {
            "kind": "accum_outer",
            "doc": f"d {step.param} += sum over rows of outer(%{step.a}, %{step.b})",
            "count": _count(step.rows),
            "a": exprs.address(step.a, step.rows, "i"),
            "b": exprs.address(step.b, step.rows, "i"),
            "m": step.m,
            "k": step.k,
            "acc": f"acc_{step.param}",
            "grouped": _group_context(exprs, step.grouped, step.rows),
        }
    if isinstance(step, AccumSum):
        return {
            "kind": "accum_sum",
            "doc": f"d {step.param} += sum over rows of %{step.value}",
            "count": _count(step.rows),
            "width": step.width,
            "acc": f"acc_{step.param}",
            "expr": exprs.ref(step.value, step.rows, "i", "j"),
        }
    if isinstance(step, Store):
        return {
            "kind": "store",
            "doc": f"{step.target.value} {step.name} {'=' if step.mode == StoreMode.SET else '+='} %{step.value}",
            "count": _count(step.rows),
            "dst": _store_destination(exprs, step),
            "width": step.width,
            "mode": step.mode.value,
            "expr": exprs.ref(step.value, step.rows, "i", "j"),
        }
    raise NotImplementedError(type(step))  # pragma: no cover
