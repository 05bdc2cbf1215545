"""The reference interpreter over a forest, and its executor (``device="interp"``): above the compiler, which
it runs to get the IR (`cell_ir`), and the runtime, which reaches it only through `runtime.backends`.

`cortexc.ir.interp` evaluates one body for one node; this module walks a
linearized forest with it, children before parents for the forward and
parents before children for the backward, one node at a time. `run` and
`backward` validate the forest and inputs first (for direct callers);
`InterpExecutor` takes them validated by the model, so they are checked once.
The IR comes from the compiler, so this is the one backend that needs it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from cortexc.ir import interp
from cortexc.ir.cell import Body, Cell, GradKind
from cortexc.runtime.edges import from_kernel_order, to_kernel_order
from cortexc.runtime.forest import Forest
from cortexc.runtime.graph import last_step, upstream_to_steps
from cortexc.runtime.linearize import Linearized
from cortexc.runtime.params import check_params
from cortexc.runtime.philox import EVAL, Dropout
from cortexc.runtime.topdown import linearize_for
from cortexc.runtime.validate import check_forest, check_inputs

if TYPE_CHECKING:
    from cortexc.runtime.executor import DeviceArrayCalls, HostArrayCalls

NO_CHILDREN = np.zeros(0, np.int64)


def _children(lin: Linearized, position: int) -> np.ndarray:
    """The children of the node at a level-order position, in the forest's child order."""
    return lin.edge_child[lin.edge_ptr[position] : lin.edge_ptr[position + 1]]


def _edges(lin: Linearized, position: int) -> np.ndarray:
    """The rows of the edges to those children in the edge inputs' arrays (the kernels' child-edge order)."""
    return np.arange(lin.edge_ptr[position], lin.edge_ptr[position + 1], dtype=np.int64)


def _input_row(lin: Linearized, index: int) -> int:
    """The node inputs' row of the node at `index`: a graph cell's steps read the node's own row each step."""
    return index % lin.step_nodes if lin.step_nodes else index


def _prev(lin: Linearized, position: int, index: int) -> int:
    """A graph cell's node after step 0: its row one step earlier (`runtime.graph`, modulo the states' rows
    of a double-buffered inference); -1 elsewhere."""
    if not lin.step_nodes or position < lin.num_leaves:
        return -1
    return (index - lin.step_nodes) % lin.state_rows


def _hoisted(cell: Cell, node: interp.NodeView) -> dict[str, np.ndarray]:
    if cell.pre is None:
        return {}
    values = interp.eval_body(cell.pre, node)
    return {name: values[result] for name, result in cell.pre.named_results}


#: how many nodes the interpreter walks between two calls of a `progress` callback
PROGRESS_EVERY = 256


def run_linearized(
    cell: Cell,
    lin: Linearized,
    params: Mapping[str, np.ndarray],
    inputs: Mapping[str, np.ndarray],
    dtype: type,
    dropout: Dropout = EVAL,
    *,
    progress: Callable[[int], None] | None = None,
) -> dict[str, np.ndarray]:
    """States and outputs for validated inputs and params (arrays of `dtype`), in `dropout`'s mode.
    `progress(k)`, when given, is told every `PROGRESS_EVERY` nodes (and at the end) that k more nodes
    are done: the interpreter is slow (minutes on SST train), and the CLI shows how far it is."""
    n = lin.num_nodes
    states: dict[str, np.ndarray] = {s.name: np.zeros((lin.state_rows, *s.shape), dtype) for s in cell.states}
    for position in range(n):
        if progress is not None and position and position % PROGRESS_EVERY == 0:
            progress(PROGRESS_EVERY)
        index = int(lin.level_order[position])
        children = _children(lin, position)
        body = cell.leaf if cell.leaf is not None and position < lin.num_leaves else cell.node
        edges, prev, row = _edges(lin, position), _prev(lin, position, index), _input_row(lin, index)
        node = interp.NodeView(index, children, states, inputs, params, dtype, dropout, edges, prev, row)
        if body is cell.node:
            node.hoisted = _hoisted(cell, node)
        values = interp.eval_body(body, node)
        for name, result in body.named_results:
            states[name][index] = values[result]
    if progress is not None and n:
        progress(n - (n - 1) // PROGRESS_EVERY * PROGRESS_EVERY)
    out: dict[str, np.ndarray] = dict(states)
    for output in cell.outputs:
        rows = lin.roots if output.at_root else np.arange(n, dtype=np.int64)
        out[output.name] = _readout(output.body, lin, rows, states, inputs, params, dtype, dropout)
    return out


def _readout(
    body: Body,
    lin: Linearized,
    rows: np.ndarray,
    states: Any,
    inputs: Any,
    params: Any,
    dtype: type,
    dropout: Dropout,
) -> np.ndarray:
    """A read-out for the given nodes, one node at a time like the recursion."""
    shape = body.values[body.results[0][1]].shape
    result: np.ndarray = np.zeros((len(rows), *shape), dtype)
    for i, index in enumerate(rows):
        row = _input_row(lin, int(index))
        node = interp.NodeView(int(index), NO_CHILDREN, states, inputs, params, dtype, dropout, input_row=row)
        result[i] = interp.eval_body(body, node)[body.results[0][1]]
    return result


def backward_linearized(
    cell: Cell,
    lin: Linearized,
    params: Mapping[str, np.ndarray],
    inputs: Mapping[str, np.ndarray],
    states: Mapping[str, np.ndarray],
    upstream: Mapping[str, np.ndarray],
    dtype: type,
    dropout: Dropout = EVAL,
) -> dict[str, np.ndarray]:
    """Gradients of every param and float input for validated inputs (see `backward`), with the forward's
    `dropout` mode (its masks are recomputed)."""
    grad_bodies, leaf_body = cell.grads, cell.leaf
    if grad_bodies is None or leaf_body is None:
        raise ValueError("backward needs a cell with gradient bodies (the specialize and autodiff passes)")
    n = lin.num_nodes
    d_states: dict[str, np.ndarray] = {s.name: np.zeros((n, *s.shape), dtype) for s in cell.states}
    for name, grad in upstream.items():
        if name in d_states:
            d_states[name] += grad
    grads: dict[str, np.ndarray] = {p.name: np.zeros(p.shape, dtype) for p in cell.params}
    for i in cell.inputs:
        if not i.is_index:
            count = len(lin.edge_child) if i.on_edge else len(inputs[i.name])  # a graph cell's: the graph's nodes
            grads[i.name] = np.zeros((count, *i.shape), dtype)

    def accumulate(node: interp.NodeView, values: list[np.ndarray], body: Body) -> dict[str, np.ndarray]:
        """Send a gradient body's per-node results where they belong; returns the hoisted ones."""
        hoisted = {}
        for target, index in body.grad_results:
            value = values[index]
            if target.kind == GradKind.PARAM:  # a 3-D family's comes as its [R*M, K] rows: one row-major array
                grads[target.name] += value.reshape(grads[target.name].shape)
            elif target.kind == GradKind.INPUT:
                grads[target.name][node.input_row] += value
            elif target.kind == GradKind.EDGE_INPUT:
                grads[target.name][node.edges] += value
            elif target.kind == GradKind.EMBED and target.index is not None:
                table = grads[target.name]
                if cell.input(target.index).on_edge:  # a row per child edge, rows of one table may repeat
                    rows = node.inputs[target.index][node.edges]
                    np.add.at(table, rows, value.reshape(len(rows), *table.shape[1:]))
                else:
                    table[node.inputs[target.index][node.input_row]] += value.reshape(table.shape[1:])
            elif target.kind == GradKind.STATE:
                d_states[target.name][node.index] += value
            elif target.kind == GradKind.CHILD:
                np.add.at(d_states[target.name], node.children, value)
            elif target.kind == GradKind.PREV:
                d_states[target.name][node.prev] += value
            elif target.kind == GradKind.CHILD_AT and target.k is not None:
                if target.k < len(node.children):
                    d_states[target.name][node.children[target.k]] += value
            elif target.kind == GradKind.HOISTED:
                hoisted[target.name] = value
        return hoisted

    for output, grad_body in zip(cell.outputs, grad_bodies.outputs):
        if output.name not in upstream:
            continue
        rows = lin.roots if output.at_root else np.arange(n, dtype=np.int64)
        for position, index in enumerate(rows):
            at = _input_row(lin, int(index))
            node = interp.NodeView(int(index), NO_CHILDREN, states, inputs, params, dtype, dropout, input_row=at)
            node.adjoints = {output.name: np.asarray(upstream[output.name][position], dtype)}
            accumulate(node, interp.eval_body(grad_body, node), grad_body)

    for position in reversed(range(n)):
        index = int(lin.level_order[position])
        children = _children(lin, position)
        leaf = position < lin.num_leaves  # level 0 (a graph cell's step 0 too, whatever its edges)
        body, grad_body = (leaf_body, grad_bodies.leaf) if leaf else (cell.node, grad_bodies.node)
        edges, prev, row = _edges(lin, position), _prev(lin, position, index), _input_row(lin, index)
        node = interp.NodeView(index, children, states, inputs, params, dtype, dropout, edges, prev, row)
        if not leaf:
            node.hoisted = _hoisted(cell, node)
        node.adjoints = {name: d_states[name][index] for name, _ in body.named_results}
        hoisted = accumulate(node, interp.eval_body(grad_body, node), grad_body)
        if hoisted and grad_bodies.pre is not None:
            node.adjoints = hoisted
            accumulate(node, interp.eval_body(grad_bodies.pre, node), grad_bodies.pre)
    return grads


def run(
    cell: Cell,
    forest: Forest,
    params: Mapping[str, np.ndarray],
    inputs: Mapping[str, object],
    dtype: type = np.float32,
    dropout: Dropout = EVAL,
    *,
    progress: Callable[[int], None] | None = None,
) -> dict[str, np.ndarray]:
    """Every state (`[N, ...]` in the forest's node order) and every output of the cell.

    ``dtype`` is float32 like the compiled code, or float64 for gradient checks;
    ``progress`` as in `run_linearized`. Raises `ForestError`/`InputError` before computing anything if the forest or
    the inputs do not fit the cell.
    """
    check_forest(cell, forest)
    checked = to_kernel_order(cell.signature(), forest, check_inputs(cell, forest, inputs, dtype))
    checked_params = check_params(cell, params, dtype=dtype)
    lin = linearize_for(cell.signature(), forest)
    out = run_linearized(cell, lin, checked_params, checked, dtype, progress=progress, dropout=dropout)
    return last_step(cell.signature(), out, lin) if cell.steps is not None else out


def backward(
    cell: Cell,
    forest: Forest,
    params: Mapping[str, np.ndarray],
    inputs: Mapping[str, object],
    states: Mapping[str, np.ndarray],
    upstream: Mapping[str, np.ndarray],
    dtype: type = np.float32,
    dropout: Dropout = EVAL,
) -> dict[str, np.ndarray]:
    """Gradients of every param and float input, one node at a time, parents before children.

    `cell` must carry `grads` (the `autodiff` pass); `states` are the forward's
    states (what the forward with ``grad=True`` keeps); `upstream` maps states
    and outputs to their incoming gradients (`[N, ...]`, or `[num_roots, ...]`
    for outputs at the roots). Index inputs get none; an embedding table gets
    the sum of the gradients of the rows that were looked up. A graph cell's
    `states` are those after its last step: the steps before are computed again.
    """
    check_forest(cell, forest)
    checked = to_kernel_order(cell.signature(), forest, check_inputs(cell, forest, inputs, dtype))
    lin = linearize_for(cell.signature(), forest)
    params = check_params(cell, params, dtype=dtype)
    if cell.steps is not None:
        states = {
            s.name: run_linearized(cell, lin, params, checked, dtype, dropout=dropout)[s.name] for s in cell.states
        }
        upstream = upstream_to_steps(cell.signature(), upstream, lin)
    grads = backward_linearized(cell, lin, params, checked, states, upstream, dtype, dropout)
    return from_kernel_order(cell.signature(), forest, grads)


@dataclass
class _Saved:
    lin: Linearized
    inputs: Mapping[str, np.ndarray]
    states: dict[str, np.ndarray]
    dropout: Dropout


class InterpExecutor:
    """``device="interp"``: the reference interpreter behind the `Executor` protocol. The IR is
    compiled from the package's source on first use (``cell_of``), the one thing that needs the compiler."""

    def __init__(self, cell_of: Callable[[], Cell]):
        self._cell_of = cell_of
        self._params: Mapping[str, np.ndarray] = {}

    def set_params(self, params: Mapping[str, np.ndarray]) -> None:
        self._params = params

    def forward(
        self,
        lin: Linearized,
        inputs: Mapping[str, np.ndarray],
        keep: bool = False,
        host: bool = True,
        dropout: Dropout = EVAL,
    ) -> tuple[dict[str, Any], Any]:
        cell = self._cell_of()
        out = run_linearized(cell, lin, self._params, inputs, np.float32, dropout=dropout)
        saved = None
        if keep:  # copies: the caller may edit the inputs it passed or the states it got back
            kept_inputs = {name: array.copy() for name, array in inputs.items()}
            saved = _Saved(lin, kept_inputs, {s.name: out[s.name].copy() for s in cell.states}, dropout)
        return out, saved

    def backward(
        self, saved: Any, upstream: Mapping[str, np.ndarray], param_shapes: Mapping[str, tuple[int, ...]]
    ) -> dict[str, np.ndarray]:
        cell = self._cell_of()
        return backward_linearized(
            cell, saved.lin, self._params, saved.inputs, saved.states, upstream, np.float32, saved.dropout
        )

    def array_calls(self) -> HostArrayCalls | DeviceArrayCalls | None:
        """None: the interpreter runs only on arrays it allocates (no calls on caller-allocated ones)."""
        return None


def cell_ir(source: str, source_file: str, defines: Mapping[str, int], name: str) -> Cell:
    """The IR of cell `name` of a `.cell` source, with its gradient bodies: what `device="interp"` runs
    (a package carries its source and defines; `cortexc.runtime.backends.compile_ir` asks here)."""
    from cortexc.pipeline import compile_source

    cells = compile_source(source, source_file, dict(defines))
    return next(c for c in cells if c.name == name)
