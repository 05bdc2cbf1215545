"""Declaration checks: names, dims (with `-D` overrides), shapes, inits, block order.

The result is a `DeclaredCell`: every declaration resolved to integers, the
blocks and outputs still as syntax. `lower` then checks and translates the
bodies (the type of an expression is exactly the shape and domain of the IR
value it becomes, so those checks live where the values are built).

The checker keeps going after an error, so one run reports every mistake it
can; the first error is raised with the rest in ``.others``.
"""

from __future__ import annotations

import difflib
import keyword
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cortexc.errors import CellError, CellTypeError, DimError, SourceLoc
from cortexc.frontend import ast
from cortexc.ir import cell as ir
from cortexc.ir.ops import Shape
from cortexc.options import MAX_DIM, define_problem
from cortexc.runtime.signature import GIVEN_INPUTS

INIT_ARITY = {"zeros": 0, "ones": 0, "xavier": 0, "uniform": 2, "normal": 2}


class ErrorSink:
    """Collects located errors; `raise_if_any` raises the first with the others attached."""

    def __init__(self) -> None:
        self.errors: list[CellError] = []

    def report(self, message: str, loc: SourceLoc | None, cls: type[CellError] = CellTypeError) -> None:
        self.errors.append(cls(message, loc))

    def raise_if_any(self) -> None:
        if self.errors:
            # in source order (blocks are checked node first), command-line (-D) errors before the file's
            ordered = sorted(self.errors, key=lambda e: (e.loc.line, e.loc.col) if e.loc else (0, 0))
            first = ordered[0]
            first.others = ordered[1:]
            raise first


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


@dataclass(frozen=True)
class DeclaredCell:
    """A cell whose declarations are resolved; blocks and outputs are still syntax."""

    syntax: ast.CellDef
    structure: ir.Structure
    arity: int | None
    dims: tuple[tuple[str, int], ...]
    params: tuple[ir.ParamDecl, ...]
    inputs: tuple[ir.InputDecl, ...]
    states: tuple[ir.StateDecl, ...]
    leaf: ast.Block | None  # the leaf block, or a down cell's root block (nodes with nothing to read)
    node: ast.Block | None
    outputs: tuple[tuple[ast.OutputDecl, Shape], ...]
    down: bool = False  # a `down` cell: roots first, reading `parent`
    steps: int | None = None  # a graph cell's T; its `leaf` is the init block

    @property
    def dim_map(self) -> dict[str, int]:
        return dict(self.dims)


def check_module(module: ast.Module, defines: Mapping[str, int] | None = None) -> list[DeclaredCell]:
    """Check every cell of a file; `defines` are the `-D NAME=VALUE` overrides."""
    defines = dict(defines or {})
    sink = ErrorSink()
    for name, value in list(defines.items()):
        problem = define_problem(name, value)
        if problem is not None:
            sink.report(problem, None, DimError)
            del defines[name]  # checked with its default instead, so no error follows from it
    seen_cells: dict[str, ast.CellDef] = {}
    declared: list[DeclaredCell] = []
    for cell_def in module.cells:
        if cell_def.name in seen_cells:
            first = seen_cells[cell_def.name].loc
            sink.report(f"duplicate cell '{cell_def.name}' (first defined at line {first.line})", cell_def.loc)
            continue
        seen_cells[cell_def.name] = cell_def
        _check_cell_name(cell_def, sink)
        result = _check_cell(cell_def, defines, sink)
        if result is not None:
            declared.append(result)
    if not module.cells:
        first_line = next(iter(module.source.splitlines()), "")
        sink.report(
            "the file defines no cell (write one as `cell NAME on tree { ... }`)",
            SourceLoc(module.file, 1, 1, first_line),
        )
    every_dim = {item.name for c in module.cells for item in c.items if isinstance(item, ast.DimDecl)}
    for name in defines:
        if name not in every_dim:
            sink.report(
                f"dim override {name}={defines[name]}: no cell in {module.file} declares a dim '{name}'"
                + did_you_mean(name, every_dim),
                None,
                DimError,
            )
    sink.raise_if_any()
    return declared


#: the largest dim (a `-D` value too), and the most elements of one param, input, state or output: the kernels
#: index rows with 32-bit integers, and params are initialised in float64 first
MAX_ELEMENTS = (1 << 31) - 1

#: the largest magnitude of an init's numbers: values drawn from it stay finite in float32
MAX_INIT = 1e30

#: the longest cell name: it names the cell's kernel files and libraries (a file name has 255 bytes at most)
MAX_CELL_NAME = 100

#: the keywords of `model(forest, grad=False, host=True, train=False, dropout_seed=None, **inputs)` (and its
#: `self`): no input can be passed so
RESERVED_INPUTS = frozenset({"forest", "grad", "host", "train", "dropout_seed", "self"})


def _check_cell_name(cell_def: ast.CellDef, sink: ErrorSink) -> None:
    """A cell is a class of its generated Python package, named as the cell: the name must be able to be one."""
    name = cell_def.name
    if keyword.iskeyword(name):
        sink.report(f"cell name '{name}' is a Python keyword: the cell is a Python class of that name", cell_def.loc)
    elif name.startswith("_"):
        sink.report(f"cell name '{name}' starts with '_': such names are kept for the generated package", cell_def.loc)
    elif len(name) > MAX_CELL_NAME:
        sink.report(
            f"cell name '{name[:20]}...' has {len(name)} characters, at most {MAX_CELL_NAME} (it names files)",
            cell_def.loc,
        )


def _check_cell(cell_def: ast.CellDef, defines: Mapping[str, int], sink: ErrorSink) -> DeclaredCell | None:
    arity = None
    if cell_def.arity is not None:
        if not cell_def.arity.is_int or int(cell_def.arity.text) < 1:
            sink.report(f"arity must be a positive integer, not {cell_def.arity.text}", cell_def.arity.loc)
        else:
            arity = int(cell_def.arity.text)

    names: dict[str, tuple[str, SourceLoc]] = {}  # every declared name -> (what, where)

    def declare(name: str, what: str, loc: SourceLoc) -> bool:
        if name in names:
            other_what, other_loc = names[name]
            sink.report(
                f"duplicate declaration of '{name}' (already declared as {other_what} at line {other_loc.line})",
                loc,
            )
            return False
        names[name] = (what, loc)
        return True

    # order rules: declarations, then blocks, then outputs
    phase = 0  # 0 declarations, 1 blocks, 2 outputs
    blocks: dict[str, ast.Block] = {}
    for item in cell_def.items:
        if isinstance(item, ast.Block):
            if phase == 2:
                sink.report(f"the {item.kind} block must come before the outputs", item.loc)
            phase = max(phase, 1)
            if item.kind in blocks:
                sink.report(f"duplicate {item.kind} block (first at line {blocks[item.kind].loc.line})", item.loc)
            elif item.kind == "root" and not cell_def.down:
                sink.report(
                    f"a root block in a bottom-up cell: only a down cell ('cell {cell_def.name} on "
                    f"{cell_def.structure} down') has one; a bottom-up cell's nodes without children use leaf",
                    item.loc,
                )
            elif item.kind == "leaf" and cell_def.down:
                sink.report(
                    "a leaf block in a down cell: a down cell computes roots first; nodes without a parent use root",
                    item.loc,
                )
            elif item.kind == "init" and cell_def.structure != "graph":
                sink.report(
                    f"an init block in a {cell_def.structure} cell: only a graph cell ('cell {cell_def.name} on "
                    "graph(steps = T)') has one, for step 0; "
                    + ("roots use root" if cell_def.down else "nodes without children use leaf"),
                    item.loc,
                )
            elif item.kind in ("leaf", "root") and cell_def.structure == "graph":
                sink.report(
                    f"a {item.kind} block in a graph cell: every node runs the init block at step 0, then the node "
                    "block at steps 1..T; write init { ... }",
                    item.loc,
                )
            else:
                blocks[item.kind] = item
        elif isinstance(item, ast.OutputDecl):
            phase = 2
        elif phase > 0:
            sink.report(f"declaration of '{item.name}' after a block: declarations come before the blocks", item.loc)
    if "node" not in blocks:
        sink.report(f"cell '{cell_def.name}' has no node block (it is required)", cell_def.loc)
    graph = cell_def.structure == "graph"
    if graph and "init" not in blocks:
        sink.report(
            f"graph cell '{cell_def.name}' has no init block (it is required: init {{ ... }} gives every state its "
            "step-0 value)",
            cell_def.loc,
        )
    if graph and cell_def.down:
        sink.report(
            "a graph cell cannot be down: its node block reads its in-neighbours (child) each step", cell_def.loc
        )

    # dims first: shapes anywhere may use any dim
    dims: dict[str, int] = {}
    for item in cell_def.items:
        if isinstance(item, ast.DimDecl) and declare(item.name, "a dim", item.loc):
            if not item.value.is_int or int(item.value.text) < 1:
                sink.report(f"dim {item.name} must be a positive integer, not {item.value.text}", item.value.loc)
            elif int(item.value.text) > MAX_DIM:
                sink.report(f"dim {item.name} = {item.value.text} is too large (at most {MAX_DIM})", item.value.loc)
            if not item.value.is_int or not 1 <= int(item.value.text) <= MAX_DIM:
                dims[item.name] = 1
            else:
                dims[item.name] = int(defines.get(item.name, int(item.value.text)))

    def shape_of(exprs: tuple[ast.Expr, ...], what: str, loc: SourceLoc, max_sizes: int = 2) -> Shape | None:
        if not 1 <= len(exprs) <= max_sizes:
            if max_sizes == 3:
                sink.report(f"{what} must have 1, 2 or 3 sizes (a family of matrices), not {len(exprs)}", loc)
            else:
                family = "; only a param may have 3 (a family of matrices)" if len(exprs) == 3 else ""
                sink.report(f"{what} must be a vector or a matrix (1 or 2 sizes), not {len(exprs)} sizes{family}", loc)
            return None
        sizes = []
        for expr in exprs:
            size = const_int(expr, dims, sink, "a size")
            if size is None:
                return None
            if size < 1:
                sink.report(f"sizes must be positive, but this one is {size}", expr_loc(expr))
                return None
            sizes.append(size)
        if math.prod(sizes) > MAX_ELEMENTS:
            sink.report(f"{what} would have {math.prod(sizes):,} elements, at most {MAX_ELEMENTS:,}", loc)
            return None
        return tuple(sizes)

    params: list[ir.ParamDecl] = []
    inputs: list[ir.InputDecl] = []
    states: list[ir.StateDecl] = []
    outputs: list[tuple[ast.OutputDecl, Shape]] = []
    for item in cell_def.items:
        if isinstance(item, ast.InputDecl):
            if not declare(item.name, "an input", item.loc):
                continue
            if item.name in GIVEN_INPUTS.values():
                sink.report(
                    f"an input cannot be named '{item.name}': the runtime gives down cells an edge input so named",
                    item.loc,
                )
                continue
            if item.name in RESERVED_INPUTS:
                sink.report(
                    f"an input cannot be named '{item.name}': inputs are passed as keywords of "
                    "model(forest, grad=False, host=True, train=False, dropout_seed=None, **inputs), which has its own",
                    item.loc,
                )
                continue
            if item.index_range is not None:
                size = const_int(item.index_range, dims, sink, "an index range")
                if size is not None and size < 1:
                    sink.report(f"an index range must be positive, not {size}", expr_loc(item.index_range))
                elif size is not None:
                    inputs.append(ir.InputDecl(item.name, (), size, item.on_edge))
            else:
                shape = shape_of(item.shape, f"input {item.name}", item.loc)
                if shape is not None and len(shape) != 1:
                    sink.report(f"input {item.name} must be a vector, not a matrix", item.loc)
                elif shape is not None:
                    inputs.append(ir.InputDecl(item.name, shape, None, item.on_edge))
        elif isinstance(item, ast.ParamDecl):
            if not declare(item.name, "a param", item.loc):
                continue
            shape = shape_of(item.shape, f"param {item.name}", item.loc, max_sizes=3)
            init = _check_init(item, shape, sink)
            if shape is not None and init is not None:
                params.append(ir.ParamDecl(item.name, shape, init))
        elif isinstance(item, ast.StateDecl):
            if not declare(item.name, "a state", item.loc):
                continue
            shape = shape_of(item.shape, f"state {item.name}", item.loc)
            if shape is not None:
                states.append(ir.StateDecl(item.name, shape))
        elif isinstance(item, ast.OutputDecl):
            if not declare(item.name, "an output", item.loc):
                continue
            shape = shape_of(item.shape, f"output {item.name}", item.loc)
            if shape is not None:
                outputs.append((item, shape))
    steps = None
    if cell_def.steps is not None:
        others = {i.name: "an input" for i in inputs} | {p.name: "a param" for p in params}
        others |= {s.name: "a state" for s in states}
        steps = const_int(cell_def.steps, dims, sink, "the number of steps", others)
        if steps is not None and steps < 1:
            sink.report(f"a graph cell runs at least 1 step, not {steps}", expr_loc(cell_def.steps))
            steps = None
        for item, _ in outputs:
            if item.at_root:
                sink.report(
                    f"output {item.name} is 'at root' in a graph cell: a graph has no roots; its outputs are per "
                    "node, from the states after the last step (drop 'at root')",
                    item.loc,
                )
    if cell_def.down:  # what a node's edge to its parent holds: given by the runtime (`runtime.edges`)
        inputs += [ir.InputDecl(name, (1,), None, True, given_by) for given_by, name in GIVEN_INPUTS.items()]
    if not any(isinstance(item, ast.StateDecl) for item in cell_def.items):
        sink.report(f"cell '{cell_def.name}' declares no state: it would compute nothing", cell_def.loc)

    return DeclaredCell(
        syntax=cell_def,
        structure=ir.Structure(cell_def.structure),
        arity=arity,
        dims=tuple(dims.items()),
        params=tuple(params),
        inputs=tuple(inputs),
        states=tuple(states),
        leaf=blocks.get("root" if cell_def.down else "init" if graph else "leaf"),
        node=blocks.get("node"),
        outputs=tuple(outputs),
        down=cell_def.down,
        steps=steps,
    )


def _check_init(item: ast.ParamDecl, shape: Shape | None, sink: ErrorSink) -> ir.Init | None:
    if item.init is None:
        matrix = shape is not None and len(shape) >= 2  # matrices and families of them
        return ir.Init(ir.InitKind.XAVIER if matrix else ir.InitKind.ZEROS)
    spec = item.init
    if spec.name not in INIT_ARITY:
        sink.report(
            f"unknown init '{spec.name}' (expected zeros, ones, xavier, uniform(a, b) or normal(mean, std))"
            + did_you_mean(spec.name, INIT_ARITY),
            spec.loc,
        )
        return None
    expected = INIT_ARITY[spec.name]
    if len(spec.args) != expected:
        sink.report(f"init {spec.name} takes {expected} numbers, got {len(spec.args)}", spec.loc)
        return None
    if any(not abs(a) <= MAX_INIT for a in spec.args):
        sink.report(f"init {spec.name}: its numbers must be at most {MAX_INIT:g} in magnitude", spec.loc)
        return None
    if spec.name == "uniform" and not spec.args[0] < spec.args[1]:
        sink.report(f"uniform(a, b) needs a < b, got uniform({spec.args[0]:g}, {spec.args[1]:g})", spec.loc)
        return None
    if spec.name == "normal" and spec.args[1] < 0:
        sink.report(f"normal(mean, std) needs std >= 0, got {spec.args[1]:g}", spec.loc)
        return None
    return ir.Init(ir.InitKind(spec.name), tuple(spec.args))


def expr_loc(expr: ast.Expr) -> SourceLoc:
    """Where an expression starts (a binary expression's own loc is its operator)."""
    while isinstance(expr, ast.Binary | ast.Slice | ast.Index):
        expr = expr.left if isinstance(expr, ast.Binary) else expr.base
    return expr.loc


def const_int(
    expr: ast.Expr, dims: Mapping[str, int], sink: ErrorSink, what: str, others: Mapping[str, str] | None = None
) -> int | None:
    """Evaluate an integer expression of literals and dims (+ - * /), reporting what is wrong.

    `others` names what the other visible names are ("an input", ...) so that using one where a
    constant is needed is reported as such rather than as an unknown dim.
    """
    value = const_value(expr, dims, sink, what, others)
    if value is None:
        return None
    if not math.isfinite(value) or value != int(value):
        sink.report(f"{what} must be an integer, but this is {value:g}", expr_loc(expr))
        return None
    return int(value)


def const_value(
    expr: ast.Expr, dims: Mapping[str, int], sink: ErrorSink, what: str, others: Mapping[str, str] | None = None
) -> float | None:
    if isinstance(expr, ast.Number):
        return expr.value
    if isinstance(expr, ast.Name):
        if expr.name in dims:
            return float(dims[expr.name])
        if others and expr.name in others:
            sink.report(
                f"{what} must be a constant made of numbers and dims, but '{expr.name}' is {others[expr.name]}",
                expr.loc,
            )
            return None
        sink.report(f"unknown dim '{expr.name}' in {what}" + did_you_mean(expr.name, dims), expr.loc)
        return None
    if isinstance(expr, ast.Neg):
        inner = const_value(expr.operand, dims, sink, what, others)
        return None if inner is None else -inner
    if isinstance(expr, ast.Binary) and expr.op in "+-*/":
        left = const_value(expr.left, dims, sink, what, others)
        right = const_value(expr.right, dims, sink, what, others)
        if left is None or right is None:
            return None
        if expr.op == "/" and right == 0:
            sink.report("division by zero", expr.loc)
            return None
        return {"+": left + right, "-": left - right, "*": left * right, "/": left / (right or 1)}[expr.op]
    sink.report(f"{what} must be a constant made of numbers and dims", expr.loc)
    return None
