"""Program -> kernel source, through the Jinja2 skeletons (StrictUndefined).

Everything target-specific comes from the `Target`; every expression from
`exprs`. The ABI the runtime fills (`cx_call`) is fixed: params, packed
weights, inputs, states, hoisted rows and outputs are arrays of pointers in
declaration order, which `abi` describes for the generated module's JSON.
"""

from __future__ import annotations

import functools
from typing import Any

import jinja2

from cortexc.codegen.exprs import (
    KernelExprs,
    hoisted_symbol,
    input_symbol,
    output_symbol,
    param_symbol,
    state_symbol,
)
from cortexc.codegen.target import Target
from cortexc.ir.cell import Cell
from cortexc.ir.ops import Op
from cortexc.ir.program import (
    Gemm,
    Kernel,
    Loop,
    Program,
    Reduce,
    RowKind,
    Rows,
    SmallMatmul,
    Softmax,
    Store,
)
from cortexc.passes.schedule import width


@functools.cache
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("cortexc.codegen", "templates"),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def abi(cell: Cell, program: Program) -> dict[str, list[str]]:
    """The order of each pointer array of `cx_call` (what the runtime must pass)."""
    return {
        "params": [p.name for p in cell.params],
        "packed": [w.name for w in program.packed],
        "inputs": [i.name for i in cell.inputs],
        "states": [s.name for s in cell.states],
        "hoisted": [name for name, _ in cell.pre.results] if cell.pre is not None else [],
        "outputs": [o.name for o in cell.outputs],
    }


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


def render_c(program: Program, target: Target, source_file: str) -> str:
    cell = program.cell
    kernels = [_kernel_context(cell, program, kernel, target) for kernel in program.kernels]
    outputs = [
        {"kernel": k.name, "count": "call->num_roots" if k.rows == Rows.ROOTS else "call->num_nodes"}
        for k in program.kernels
        if k.rows in (Rows.NODES, Rows.ROOTS)
    ]
    template = environment().get_template("kernels.c.j2")
    return template.render(
        target=target,
        nr=target.gemm_nr,
        mr=target.gemm_mr,
        source_file=source_file,
        cell_name=cell.name,
        kernels=kernels,
        outputs=outputs,
        has_pre=cell.pre is not None,
        max_child_ks=max((len(k.child_ks) for k in program.kernels), default=0),
    )


def _symbols(cell: Cell, program: Program, kernel: Kernel) -> list[dict[str, str]]:
    """Declarations of the forest-wide arrays this kernel touches."""
    table = abi(cell, program)
    used_params = _params_read_by_expressions(kernel)
    used_inputs = {v.name for v in kernel.body.values if v.op == Op.INPUT}
    used_states = {v.name for v in kernel.body.values if v.op in (Op.STATE, Op.CHILD_STATE, Op.CHILD_STATE_AT)}
    used_hoisted = {v.name for v in kernel.body.values if v.op == Op.HOISTED}
    used_packed = {s.packed for s in kernel.steps if isinstance(s, Gemm)}
    for step in kernel.steps:
        if isinstance(step, Store) and step.target == "state":
            used_states.add(step.name)
    decls = []
    for index, name in enumerate(table["params"]):
        if name in used_params:
            decls.append(f"const float *{param_symbol(name)} = call->params[{index}];")
    for index, name in enumerate(table["packed"]):
        if name in used_packed:
            decls.append(f"const float *{name} = call->packed[{index}];")
    for index, name in enumerate(table["inputs"]):
        if name in used_inputs:
            kind = "int32_t" if cell.input(name).is_index else "float"
            decls.append(f"const {kind} *{input_symbol(name)} = (const {kind} *)call->inputs[{index}];")
    for index, name in enumerate(table["states"]):
        if name in used_states:
            decls.append(f"float *{state_symbol(name)} = call->states[{index}];")
    stores_pre = any(isinstance(s, Store) and s.target == "pre" for s in kernel.steps)
    for index, name in enumerate(table["hoisted"]):
        if name in used_hoisted or stores_pre:
            decls.append(f"float *{hoisted_symbol(name)} = call->hoisted[{index}];")
    for index, name in enumerate(table["outputs"]):
        if any(isinstance(s, Store) and s.target == "output" and s.name == name for s in kernel.steps):
            decls.append(f"float *{output_symbol(name)} = call->outputs[{index}];")
    return [{"decl": d} for d in decls]


def _params_read_by_expressions(kernel: Kernel) -> set[str]:
    """Params some expression reads (those only multiplied by a GEMM are read packed instead)."""
    values = kernel.body.values
    gemm_outs = {s.out for s in kernel.steps if isinstance(s, Gemm)}
    read = {values[index].name for _, index in kernel.body.results if values[index].op == Op.PARAM}
    for index, value in enumerate(values):
        packed_product = value.op == Op.MATMUL and kernel.places[index].buffer in gemm_outs
        for position, arg in enumerate(value.args):
            if values[arg].op == Op.PARAM and not (packed_product and position == 0):
                read.add(values[arg].name)
    return read


def _kernel_context(cell: Cell, program: Program, kernel: Kernel, target: Target) -> dict[str, Any]:
    exprs = KernelExprs(cell, kernel)
    offsets, offset_terms = [], []
    node_floats = child_floats = 0
    for buffer in kernel.buffers:
        offsets.append({"name": buffer.name, "offset": _offset(node_floats, child_floats)})
        if buffer.rows == RowKind.NODE:
            node_floats += buffer.width
        else:
            child_floats += buffer.width
    offset_terms = _offset(node_floats, child_floats)
    steps = [_step_context(exprs, kernel, step) for step in kernel.steps]
    reads_children = bool(kernel.child_ks) or any(
        v.op in (Op.CHILD_STATE, Op.CHILD_STATE_AT) or v.domain.name == "CHILD" for v in kernel.body.values
    )
    uses_pre_base = any(v.op == Op.HOISTED for v in kernel.body.values) or any(
        isinstance(s, Store) and s.target == "pre" for s in kernel.steps
    )
    return {
        "name": kernel.name,
        "rows_doc": _ROWS_DOC[kernel.rows],
        "node_of_row": _NODE_OF_ROW[kernel.rows],
        "symbols": _symbols(cell, program, kernel),
        "reads_children": reads_children,
        "child_ks": kernel.child_ks,
        "uses_pre_base": uses_pre_base,
        "buffers": offsets,
        "steps": steps,
        "scratch_floats": offset_terms,
    }


def _offset(node_floats: int, child_floats: int) -> str:
    return f"(int64_t)CX_TILE * {node_floats} + (int64_t)CX_TILE * maxc * {child_floats}"


def _count(rows: RowKind) -> str:
    return "n" if rows == RowKind.NODE else "ne"


def _step_context(exprs: KernelExprs, kernel: Kernel, step) -> dict[str, Any]:
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
        }
    if isinstance(step, Loop):
        render = exprs.compute if step.compute else exprs.ref
        out_width = next(b.width for b in kernel.buffers if b.name == step.out)
        return {
            "kind": "loop",
            "doc": f"{step.out}[:, {step.column}:{step.column + step.width}] = %{step.value}",
            "count": _count(step.rows),
            "out": step.out,
            "out_width": out_width,
            "column": step.column,
            "width": step.width,
            "expr": render(step.value, step.rows, "i", "j"),
        }
    if isinstance(step, Reduce):
        value = values[step.value]
        arg = exprs.ref(value.args[0], RowKind.CHILD, "e", "j")
        op = value.op
        combine = f"fmaxf(out_row[j], {arg})" if op == Op.MAX else f"out_row[j] + {arg}"
        return {
            "kind": "reduce",
            "doc": f"{step.out} = {op.value} over children of %{value.args[0]}",
            "out": step.out,
            "width": step.width,
            "init": "-INFINITY" if op == Op.MAX else "0.0f",
            "combine": combine,
            "mean": op == Op.MEAN,
        }
    if isinstance(step, Softmax):
        value = values[step.value]
        return {
            "kind": "softmax",
            "doc": f"{step.out} = {value.op.value}(%{value.args[0]})",
            "count": _count(step.rows),
            "out": step.out,
            "width": step.width,
            "x": exprs.ref(value.args[0], step.rows, "i", "j"),
            "log": step.log,
        }
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
    if isinstance(step, Store):
        if step.target == "state":
            dst = f"{state_symbol(step.name)} + nd[i] * {step.width}"
        elif step.target == "pre":
            dst = f"{hoisted_symbol(step.name)} + (pre_base + i) * {step.width}"
        else:
            dst = f"{output_symbol(step.name)} + (pos0 + i) * {step.width}"
        return {
            "kind": "store",
            "doc": f"{step.target} {step.name} = %{step.value}",
            "dst": dst,
            "width": step.width,
            "expr": exprs.ref(step.value, RowKind.NODE, "i", "j"),
        }
    raise NotImplementedError(type(step))  # pragma: no cover


__all__ = ["render_c", "abi", "environment", "width"]
