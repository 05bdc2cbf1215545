"""Program -> kernel source, through the Jinja2 skeletons (StrictUndefined).

Everything target-specific comes from the `Target`; every expression from
`exprs`. The ABI the runtime fills (`cx_call`, `cx_grad`, `cx_launch`) is
rendered from `cortexc.runtime.abi`: params, packed weights, inputs, states,
hoisted rows and outputs are arrays of pointers in declaration order, which
`abi` describes for the generated module's JSON. The launch order comes from
the program's phases; each driver renders it with one loop per launch mode.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any

import jinja2

from cortexc.codegen.exprs import (
    c_helpers,
)
from cortexc.codegen.kernel_context import kernel_context
from cortexc.codegen.target import Target
from cortexc.ir.cell import Cell
from cortexc.ir.ops import DType, Op
from cortexc.ir.program import (
    AccumOuter,
    AccumSum,
    Gemm,
    Kernel,
    KernelRole,
    Phase,
    Program,
    RowKind,
    Rows,
    Sweep,
    hoisted_widths,
)
from cortexc.runtime.abi import LAUNCH_MODES, STRUCTS, c_typedef
from cortexc.targets import NAMES


@functools.cache
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        # the shared skeleton's templates, and each target's under its name ("c/dialect.j2")
        loader=jinja2.ChoiceLoader(
            [
                jinja2.PackageLoader("cortexc.codegen", "templates"),
                jinja2.PrefixLoader(
                    {name: jinja2.PackageLoader(f"cortexc.targets.{name}", "templates") for name in NAMES}
                ),
            ]
        ),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["c_comment"] = c_comment_text
    env.filters["py_docstring"] = py_docstring_text
    return env


def c_comment_text(text: str) -> str:
    """User text (a file name) made safe inside a C `/* */` comment: ASCII, escapes shown, no `*/`."""
    return str(text).encode("unicode_escape").decode("ascii").replace("*/", "*\\/")


def py_docstring_text(text: str) -> str:
    """User text made safe inside a Python `\"\"\"` docstring: backslashes, quotes, non-ASCII escaped."""
    return str(text).encode("unicode_escape").decode("ascii").replace('"', '\\"')


@functools.cache
def _cuda_prelude(target: str) -> str:
    """The text of the target's `cuda_prelude.cuh` (`cortexc/targets/<name>/`), which a generated `.cu` carries
    inline; empty for a target without one (C)."""
    prelude = resources.files(f"cortexc.targets.{target}").joinpath("cuda_prelude.cuh")
    return prelude.read_text(encoding="utf-8").rstrip() if prelude.is_file() else ""


def render(program: Program, target: Target, source_file: str) -> str:
    """The kernel source of a program for a target (C or CUDA), from the one skeleton."""
    cell = program.cell
    if target.defer_outer_products and program.deferred is None:
        raise ValueError(f"the {target.name} target defers weight gradients: run passes.deferred first")
    deferred = deferred_outer_products(program) if target.defer_outer_products else []
    accumulators = _accumulators(cell, program, deferred)
    offsets = {a["param"]: a["offset"] for a in accumulators}
    kernels = [kernel_context(cell, program, kernel, target, deferred, offsets) for kernel in program.kernels]
    for context in kernels:
        context["acc_regions"] = [i for i, a in enumerate(accumulators) if context["name"] in a["kernels"]]
    node, leaf = program.role(KernelRole.NODE), program.role(KernelRole.LEAF)
    split = node.split if target.column_split else None
    packed_index = {w.name: i for i, w in enumerate(program.packed)}
    split_weights: dict[int, dict[str, int]] = {}  # by packed weight: each is loaded once
    for kernel in (leaf, node):
        if split is None or kernel.split is None:
            continue
        for step in kernel.steps:
            if isinstance(step, Gemm):
                index = packed_index[step.packed]
                split_weights[index] = {"index": index, "periods": step.m // split.period, "k": step.k}
    staged = {k["name"]: k["staged"] for k in kernels}
    window = hoist_window(program, target)
    template = environment().get_template("kernels.j2")
    return template.render(
        target=target,
        cuda_prelude=_cuda_prelude(target.name),
        c_helpers=c_helpers(program.kernels),
        nr=target.gemm_nr,
        mr=target.gemm_mr,
        source_file=source_file,
        cell_name=cell.name,
        kernels=kernels,
        typedefs={name: c_typedef(name, fields) for name, fields in STRUCTS.items()},
        launch_modes=LAUNCH_MODES,
        forward_phases=[_phase_context(program, phase, target) for phase in program.forward],
        saving_phases=[_phase_context(program, phase, target) for phase in program.saving_forward() if program.saved],
        direct_phases=[_phase_context(program, phase, target) for phase in program.direct],
        direct_min_rows=DIRECT_MIN_ROWS,
        hoist_window=window,
        saving_window=hoist_window(program, target, training=True) if window else None,
        backward_phases=[_phase_context(program, phase, target) for phase in program.backward],
        split_kernel=node.name,
        accumulators=accumulators,
        accumulator_floats=sum(a["size"] for a in accumulators),
        accumulates={k["name"]: k["accumulates"] for k in kernels},
        staged=staged,
        stage_slots=max((len(v) for v in staged.values()), default=0),
        stage_nodes=any(staged[k.name] and k.rows in (Rows.NODES, Rows.ROOTS) for k in program.kernels),
        stage_width=max((s["width"] for v in staged.values() for s in v), default=1),
        has_grads=cell.grads is not None,
        max_child_ks=max((len(k.child_ks) for k in program.kernels), default=0),
        num_packed=max(1, len(program.packed)),
        folds=[
            {
                "name": f.name,
                "param_index": [p.name for p in cell.params].index(f.table),
                "packed_index": packed_index[f.packed],
                "rows": f.rows,
                "m": f.m,
                "k": f.k,
                "doc": f"{f.table} @ {program_packed_params(program, f.packed)}^T",
            }
            for f in program.folds
        ],
        deferred=[{**term, "param_index": [p.name for p in cell.params].index(term["param"])} for term in deferred],
        deferred_params=_deferred_params(cell, deferred),
        defer_tm=C_DEFER_TM,
        defer_tk=C_DEFER_TK,
        narrow_rows=NARROW_ROWS,
        split_period=split.period if split is not None else 0,
        split_weights=list(split_weights.values()),
        split_floats_per_unit=sum(w["periods"] * w["k"] for w in split_weights.values()),
        split_stage_floats=-(-target.tile_rows * (max((w["k"] for w in split_weights.values()), default=0) + 1) // 4)
        * 4,
    )


#: C: a backward's launch of fewer rows than this keeps the narrow weight gradients' factor rows for the
#: deferred phase (`cx_narrow_launch` in the driver; `passes.deferred`), a larger one adds them per tile.
#: Measured (2 cores, Zen 4, chain LSTM X=32 H=64, backward, median of 15 interleaved): 1000 x 1 3.38 ms
#: kept against 4.36 ms per tile, 1000 x 2 3.42 against 4.38; 1000 x 4 and 1000 x 8 the same within noise;
#: 1000 x 10 2-3% slower kept
NARROW_ROWS = 4


#: an inference runs the direct node kernel (`passes.direct`) where the levels above the leaves hold this many
#: rows or more on average (`cx_direct` in the C driver)
DIRECT_MIN_ROWS = 3


def hoist_window(program: Program, target: Target, training: bool = False) -> dict[str, Any] | None:
    """How an inference on this target may compute its hoisted rows a window of levels at a time instead of
    all before the recursion (`Target.hoist_window_bytes`; the C driver): the pre kernel's and the up sweep's
    kernel's names and the window's rows (at least one), or None. Why: the hoisted rows of a long chain are
    megabytes, written to memory by the pre kernel and read back by the levels; a window stays in cache.
    Requires: a pre kernel over every internal node before the up sweep, and no other forward kernel that
    reads hoisted rows (a window holds only the levels being run). `training`: the same for a training
    forward (the saving kernels), which also requires that no gradient kernel reads a hoisted row (what the
    forward saved stands in for them): its backward then gets none (a chain LSTM of 100 x 100: 10 MB less
    written, read back and kept per step)."""
    floats = sum(hoisted_widths(program.cell))
    if not target.hoist_window_bytes or floats == 0:
        return None
    if training and (not program.saved or any(_reads_hoisted(program.kernel(p.kernel)) for p in program.backward)):
        return None
    phases = program.saving_forward() if training else program.forward
    pre = [p for p in phases if program.kernel(p.kernel).role == KernelRole.PRE]
    up = [p for p in phases if p.sweep == Sweep.UP]
    if len(pre) != 1 or len(up) != 1 or pre[0].sweep != Sweep.ALL:
        return None
    if phases.index(pre[0]) > phases.index(up[0]):
        return None
    reads = {p.kernel for p in phases if _reads_hoisted(program.kernel(p.kernel))}
    if not reads <= {up[0].kernel}:
        return None
    return {"pre": pre[0].kernel, "node": up[0].kernel, "rows": max(1, target.hoist_window_bytes // (4 * floats))}


def _reads_hoisted(kernel: Kernel) -> bool:
    return any(v.op == Op.HOISTED for v in kernel.body.values)


def program_packed_params(program: Program, packed: str) -> str:
    """A packed weight's params, as `[A, B]` (comments)."""
    return "[" + ", ".join(next(w for w in program.packed if w.name == packed).params) + "]"


#: the rows of one run of a phase, as C expressions over `call` and `lp` (the level offsets; the driver
#: declares it), by sweep, and for a sweep over the whole row set by the kernel's rows
_PHASE_ROWS = {
    Sweep.LEAVES: ("0", "lp[1]"),
    Sweep.UP: ("lp[level]", "lp[level + 1] - lp[level]"),
    Sweep.DOWN: ("lp[level]", "lp[level + 1] - lp[level]"),
}
_ALL_ROWS = {
    Rows.INTERNAL: ("lp[1]", "call->num_nodes - lp[1]"),
    Rows.NODES: ("0", "call->num_nodes"),
    Rows.ROOTS: ("0", "call->num_roots"),
}


def _phase_context(program: Program, phase: Phase, target: Target) -> dict[str, Any]:
    """A phase for the drivers: its kernel, sweep, rows of one run (`first`, `count`), the output whose
    upstream gradient it needs (or None), and whether a small level may go by columns on this target."""
    kernel = program.kernel(phase.kernel)
    first, count = _ALL_ROWS[kernel.rows] if phase.sweep == Sweep.ALL else _PHASE_ROWS[phase.sweep]
    return {
        "kernel": kernel.name,
        "sweep": phase.sweep.value,
        "first": first,
        "count": count,
        "upstream": phase.upstream,
        "columns": target.column_split and kernel.split is not None,
    }


#: the rows a gradient kernel covers, as positions (C expressions over `call`), by its row set and name
_KERNEL_POSITIONS = {
    Rows.INTERNAL: ("call->level_ptr[1]", "call->num_nodes"),
    Rows.NODES: ("0", "call->num_nodes"),
    Rows.ROOTS: ("0", "call->num_roots"),
}


def deferred_outer_products(program: Program) -> list[dict[str, Any]]:
    """The program's deferred weight-gradient terms (`passes.deferred`) as template values: each with the
    first and last row of the forest its factors cover (C expressions over `call`), `when` its rows were
    written (a C condition over `grad`, None: always), and for a narrow term the launches that kept them:
    `levels` (the first and the end level of a level kernel's launches, C expressions) or, for a kernel of
    one launch, `positions` (its first and end row; None for a level kernel)."""
    terms = []
    for term in program.deferred or ():
        kernel = program.kernel(term.kernel)
        step = kernel.steps[term.step]
        assert isinstance(step, AccumOuter)  # passes.deferred lists AccumOuter steps only
        levels = None
        if kernel.rows == Rows.LEVEL:
            grad_node = kernel.role == KernelRole.GRAD_NODE
            first, last = ("call->level_ptr[1]", "call->num_nodes") if grad_node else ("0", "call->level_ptr[1]")
            levels = ("1", "call->num_levels") if grad_node else ("0", "1")
        else:
            first, last = _KERNEL_POSITIONS[kernel.rows]
        positions = (first, last) if levels is None else None
        if term.rows == RowKind.CHILD:
            first, last = f"call->edge_ptr[{first}]", f"call->edge_ptr[{last}]"
        # the rows exist only where the kernel ran: a phase that needs an output's upstream gradient is
        # skipped without it (its rows are then never written)
        upstreams = [p.upstream for p in program.backward if p.kernel == term.kernel]
        when = (
            None
            if not upstreams or None in upstreams
            else " || ".join(f"grad->upstream[{u}]" for u in sorted(set(u for u in upstreams if u is not None)))
        )
        terms.append(
            {
                "kernel": term.kernel,
                "step": term.step,
                "param": term.param,
                "m": term.m,
                "k": term.k,
                "rows": term.rows.value,
                "first": first,
                "last": last,
                "when": when,
                "narrow": term.narrow,
                "levels": levels,
                "positions": positions,
                "group": _deferred_group(program, kernel, step),
            }
        )
    return terms


def _deferred_group(program: Program, kernel: Kernel, step: AccumOuter) -> dict[str, Any] | None:
    """For a term of a chosen product's gradient (`AccumOuter.grouped`) over child edges whose choice is an
    edge index input: that input's slot in `cx_call.inputs` and the group's width, so the deferred phase
    reads each row's group and skips the rows of groups outside a block (their factors are zero there)."""
    grouped = step.grouped
    if grouped is None or step.rows != RowKind.CHILD:
        return None
    chooser = kernel.body.values[grouped.index]
    if chooser.op != Op.EDGE_INPUT or chooser.dtype != DType.I32:
        return None
    inputs = [i.name for i in program.cell.inputs]
    return {"input": inputs.index(chooser.attr("name")), "width": grouped.width}


def _accumulators(cell: Cell, program: Program, deferred: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The weight gradients the kernels still add per tile (all but the deferred terms: the bias sums, on a
    target that defers, and the narrow terms, which wide launches add per tile), each with its offset in a
    chunk's accumulator (C), its param's index and the kernels that add to it."""
    added = {kernel.name: _added_per_tile(kernel, deferred) for kernel in program.kernels}
    kept = set().union(*added.values())
    names = [p.name for p in cell.params]
    accumulators, offset = [], 0
    for name, _, size in program.accumulators:
        if name in kept:
            kernels = [k for k, params in added.items() if name in params]
            accumulators.append(
                {"param": name, "index": names.index(name), "offset": offset, "size": size, "kernels": kernels}
            )
            offset += size
    return accumulators


def _added_per_tile(kernel: Kernel, deferred: list[dict[str, Any]]) -> set[str]:
    """The params `kernel`'s tiles may add to (AccumSum, and AccumOuter but for the wide deferred terms)."""
    skipped = {t["step"] for t in deferred if not t["narrow"] and t["kernel"] == kernel.name}
    return {
        step.param
        for number, step in enumerate(kernel.steps)
        if isinstance(step, AccumSum) or (isinstance(step, AccumOuter) and number not in skipped)
    }


#: output rows x columns of one work item of the C deferred phase (its threads share the items)
C_DEFER_TM, C_DEFER_TK = 128, 64


def _deferred_params(cell: Cell, deferred: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The deferred terms grouped by param, in param order, for the C deferred phase: a work item is one
    output block of one param and adds that param's terms in term order, so every element of a gradient
    is summed by one thread in one order. `start`/`end`: the param's range of work items."""
    groups, start = [], 0
    for index, param in enumerate(cell.params):
        terms = [i for i, t in enumerate(deferred) if t["param"] == param.name]
        if not terms:
            continue
        m, k = deferred[terms[0]]["m"], deferred[terms[0]]["k"]
        if any((deferred[i]["m"], deferred[i]["k"]) != (m, k) for i in terms):  # pragma: no cover
            raise ValueError(f"the deferred terms of {param.name} differ in shape")
        tiles_m, tiles_k = -(-m // C_DEFER_TM), -(-k // C_DEFER_TK)
        items = tiles_m * tiles_k
        groups.append(
            {"param": param.name, "index": index, "m": m, "k": k, "terms": terms, "tiles_k": tiles_k}
            | {"start": start, "end": start + items}
        )
        start += items
    return groups


__all__ = ["render", "environment", "hoist_window"]
