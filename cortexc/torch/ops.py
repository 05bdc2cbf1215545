"""The two `torch.library` custom ops a `CellModule` runs, ``cortexc::cell_forward`` and
``cortexc::cell_backward``, tied by `register_autograd`, with their fake implementations.

The ops take lists of tensors (params, inputs, the linearised forest) and a string key naming the compiled
cell and its backend (`keys.cell_key`: the package's digest, the same in every process; no handle, address
or counter reaches a graph). The key and the params find the runner (`runner.runner_for`): the module's
that owns the params, else the process's shared one, loaded by key from the build cache when need be; so
an exported program (`torch.export`) runs in a fresh process after ``import cortexc.torch``, and a graph
still runs after its module is gone. What the backward needs (params, inputs, forest, every state and
hoisted row) travels as tensors saved by autograd. Each op has a fake implementation (shapes only, from the
key's cell), so `torch.compile` and `torch.export` trace them without a graph break and
`torch.library.opcheck` passes.

Zero copy: contiguous float32 CPU tensors go into the `cx_call` pointer tables as they are (NumPy views
of the detached tensors share their memory: `HostArrayCalls.run_forward`), torch allocates every result,
and the states come back as views of the kernels' arrays. A CPU forward after which no backward can follow
(`CellModule.forward` says so with the op's ``fold`` flag) may read folded look-up projections
(`cortexc.passes.fold`), built from the current params by the library's `cx_fold` (`_Runner.folded`).

On a GPU (``module.to("cuda")``) the same ops run the CUDA target on torch's CUDA tensors: torch
allocates every result, the params and inputs are read where they are, and only the forest and the
pointer tables go up per call (`DeviceArrayCalls.run_forward_at`); the packed GEMM weights are packed on
the host and uploaded when a param changed. Every copy and launch of a call goes on torch's current
stream of the device (`torch.cuda.current_stream().cuda_stream`, carried in `cx_launch.stream`), after
the work torch queued there (the zeroed results), and the call returns when that stream has run it; all
in the device's primary context (which torch uses). PyCUDA is not needed there: the arch comes from
torch. `CellModule.use_backend("cuda-emu")` runs a module's CPU tensors through the same host path and
the emulated CUDA library (how the tests check it without a GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
from torch import Tensor

from cortexc.errors import ForestError, InputError
from cortexc.runtime.linearize import Linearized
from cortexc.runtime.philox import EVAL, SEED_LIMIT, Dropout
from cortexc.torch.runner import _Runner, _view, device_index, runner_for

if TYPE_CHECKING:
    from cortexc.runtime.executor import DeviceArrayCalls


# ------------------------------------------------------------------------------------------------ tensors
def _linearized(
    runner: _Runner, level_order: Tensor, level_ptr: Tensor, edge_ptr: Tensor, edge_child: Tensor, roots: Tensor
):
    """The executor's `Linearized` over NumPy views of the forest tensors (no copy for int64 CPU ones); a graph
    cell's unrolled steps (`ForestBatch.from_forest(forest, steps=T)`) have the nodes of one step at level 0."""
    arrays = [np.ascontiguousarray(_host(t), dtype=np.int64) for t in (level_order, level_ptr, edge_ptr)]
    order, ptr, eptr = arrays
    child = np.ascontiguousarray(_host(edge_child), dtype=np.int64)
    root = np.ascontiguousarray(_host(roots), dtype=np.int64)
    max_children = int(np.diff(eptr).max()) if len(order) else 0
    step_nodes = int(ptr[1]) if runner.signature.structure.steps and len(ptr) > 1 else 0
    return Linearized(len(order), max(len(ptr) - 1, 1), max_children, order, ptr, eptr, child, root, step_nodes)


def _host(tensor: Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor (a copy to the host for a device one: the forest, which is small)."""
    return tensor.detach().cpu().numpy()


def _dropout(train: bool, seed: Tensor) -> Dropout:
    """The ops' dropout args as the executor's mode: the seed travels as an int64 tensor (its two's complement)."""
    return Dropout(True, int(seed.item()) % SEED_LIMIT) if train else EVAL


def _kernel_inputs(runner: _Runner, inputs: Sequence[Tensor], check: bool) -> list[Tensor]:
    """The inputs as the kernels read them (index inputs as int32, each detached and contiguous). With
    `check`, every index is first checked against its range on the integers given: a compiled graph skips
    `CellModule._check`, and the kernels must never read outside a table (a typed error instead)."""
    kernel_inputs = []
    for position, value in enumerate(inputs):
        bound = runner.index_ranges.get(position)
        if bound is not None:
            if check:
                bad = torch.nonzero((value < 0) | (value >= bound)).flatten()
                if bad.numel():
                    name, node = runner.inputs[position], int(bad[0])
                    raise InputError(
                        f"input {name}: node {node} has index {int(value[node])}, outside "
                        f"[0, {bound}) ({bad.numel()} nodes out of range)"
                    )
            value = value.to(torch.int32)
        kernel_inputs.append(value.detach().contiguous())
    return kernel_inputs


def _check_linearized(runner: _Runner, lin: Linearized) -> None:
    """The forest's structure against the cell, from the linearised arrays (what a compiled graph still
    checks): no node with more children than a fixed arity or an `edge.position`-indexed family holds, no
    shared child for a tree cell (for a `down` cell, of the forest its batch reversed)."""
    sig = runner.signature
    counts = np.diff(lin.edge_ptr)
    steps = sig.structure.steps
    if steps:  # a graph cell: its T + 1 steps, each of the same nodes (`runtime.graph.linearize_steps`)
        ptr = lin.level_ptr
        if len(ptr) != steps + 2 or np.any(ptr != np.arange(steps + 2) * lin.step_nodes) or np.any(counts[: ptr[1]]):
            raise ForestError(
                f"cell {sig.name} is a graph cell of {steps} steps: its batch must be its unrolled steps, "
                f"ForestBatch.from_forest(forest, steps={steps}) (or pass the Forest)"
            )
        return
    # the forest's children and parents counts by node: a down cell's batch is the reversed forest
    children = np.zeros(lin.num_nodes, dtype=np.int64)
    children[lin.level_order] = counts
    parents = np.bincount(lin.edge_child, minlength=lin.num_nodes)
    if sig.structure.down:
        children, parents = parents, children
    limits = [(sig.arity, f"cell {sig.name}'s arity is {sig.arity}")] if sig.arity is not None else []
    limits += [
        (count, f"{family}[edge.position] of cell {sig.name} chooses among {count}") for family, count in sig.positions
    ]
    for limit, why in limits:
        if len(children) and children.max() > limit:
            node = int(np.flatnonzero(children > limit)[0])
            raise ForestError(f"node {node} has {int(children[node])} children but {why}")
    if not sig.structure.shares_children and len(parents) and parents.max() > 1:
        raise ForestError(
            f"node {int(np.argmax(parents))} has {int(parents.max())} parents; cell {sig.name} is on a tree, not a dag"
        )


# ------------------------------------------------------------------------------------------------ the ops
def _runner(key: str, params: Sequence[Tensor], level_order: Tensor) -> _Runner:
    """The runner of an op's call: by its key and params, on the GPU of its tensors (`runner_for`)."""
    return runner_for(key, params, device_index(params[0] if params else level_order))


@torch.library.custom_op("cortexc::cell_forward", mutates_args=())
def cell_forward(
    key: str,
    params: list[Tensor],
    inputs: list[Tensor],
    level_order: Tensor,
    level_ptr: Tensor,
    edge_ptr: Tensor,
    edge_child: Tensor,
    roots: Tensor,
    internal: Tensor,
    train: bool,
    dropout_seed: Tensor,
    fold: bool = False,
    keep: bool = True,
) -> list[Tensor]:
    """Every state ([N + 1] rows, the last zero), every hoisted row set, every saved activation array
    (`passes.saving`, a CPU runner's: rows x width, flat, with ``keep``, else empty), then every output (ABI
    order); with ``train``, the dropout masks of the int64 ``dropout_seed`` (mod 2^64). ``fold``: the caller
    knows no backward follows (`CellModule.forward`), so a CPU runner may build and read folded look-up
    projections (bitwise the same results; the flag only keeps training forwards from paying for tables).
    ``keep``: a backward may follow, so the kernels keep what it reads (else nothing is saved)."""
    runner = _runner(key, params, level_order)
    stream = runner.stream()
    runner.prepare(params, stream)
    results = _forward_shapes(runner, params, level_order, roots, internal, fake=False, keep=keep)
    states, hoisted, activations, outputs = _split(runner, results)
    lin = _linearized(runner, level_order, level_ptr, edge_ptr, edge_child, roots)
    _check_linearized(runner, lin)
    inputs = _kernel_inputs(runner, inputs, check=True)
    executor = runner.executor
    if executor.on_device:
        params = [p.detach().contiguous() for p in params]  # kept alive (and contiguous) through the call
        arrays = {
            "params": _addresses(params),
            "inputs": _addresses(inputs),
            "states": _addresses(states),
            "hoisted": _addresses(hoisted),
            "outputs": _addresses(outputs),
        }
        assert runner.packed is not None  # prepare uploaded them
        executor.run_forward_at(lin, runner.packed, arrays, _dropout(train, dropout_seed), stream)
        return results
    param_views, packed, folded = [_view(p) for p in params], None, None
    if fold and runner.fold_positions:  # tables of these params, and the packed weights they were made with
        (_, packed), folded = runner.folded(params, lin.num_nodes)
    executor.run_forward(
        lin,
        param_views,
        [i.numpy() for i in inputs],
        [s.numpy() for s in states],
        [h.numpy() for h in hoisted],
        [o.numpy() for o in outputs],
        packed=packed,
        dropout=_dropout(train, dropout_seed),
        folded=folded,
        activations=_activation_arrays(runner, [a.numpy() for a in activations]) if keep else None,
    )
    return results


def _addresses(tensors: Sequence[Tensor | None]) -> list[int]:
    """Device addresses of tensors (0 for None)."""
    return [0 if t is None else int(t.data_ptr()) for t in tensors]


def _forward_shapes(
    runner: _Runner,
    params: Sequence[Tensor],
    level_order: Tensor,
    roots: Tensor,
    internal: Tensor,
    fake: bool,
    keep: bool = True,
) -> list[Tensor]:
    """The forward's results, allocated by torch on the params' device: states zeroed (row N is the
    kernels' zero row)."""
    n, r, i = level_order.shape[0], roots.shape[0], internal.shape[0]
    device = params[0].device if params else level_order.device

    def empty(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        return level_order.new_empty(shape, dtype=dtype, device=device)

    def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    states = [(empty if fake else zeros)((n + 1, *s), dtype=torch.float32) for s in runner.state_shapes]
    hoisted = [empty((i, width), dtype=torch.float32) for width in runner.spec.hoisted_widths]
    saved = [  # every row written by the kernels (one per internal node or leaf), or none without `keep`
        empty((((i if internal_rows else n - i) if keep else 0) * width,), dtype=torch.float32)
        for width, internal_rows in runner.saved_rows
    ]
    outputs = [empty(((r if o.at_root else n), *o.shape), dtype=torch.float32) for o in runner.signature.outputs]
    return states + hoisted + saved + outputs


def _activation_arrays(runner: _Runner, flat: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The saved activations as the kernels' [rows, width] arrays. They travel flat: a size of N - I (the
    leaves) in a two-dimensional shape would make `torch.export` guard that a forest has not one leaf."""
    return [array.reshape(array.size // width, width) for array, (width, _) in zip(flat, runner.saved_rows)]


_Item = TypeVar("_Item")


def _split(runner: _Runner, results: Sequence[_Item]) -> tuple[list[_Item], list[_Item], list[_Item], list[_Item]]:
    """The forward's results (or anything in their order: their upstream gradients, what autograd saved of
    them) as states, hoisted rows, saved activations and outputs."""
    ns, nh, nv = len(runner.states), len(runner.spec.hoisted_widths), len(runner.saved_rows)
    kept = ns + nh + nv
    return list(results[:ns]), list(results[ns : ns + nh]), list(results[ns + nh : kept]), list(results[kept:])


@cell_forward.register_fake
def _cell_forward_fake(
    key,
    params,
    inputs,
    level_order,
    level_ptr,
    edge_ptr,
    edge_child,
    roots,
    internal,
    train,
    dropout_seed,
    fold=False,
    keep=True,
):
    return _forward_shapes(
        _runner(key, params, level_order), params, level_order, roots, internal, fake=True, keep=keep
    )


@torch.library.custom_op("cortexc::cell_backward", mutates_args=())
def cell_backward(
    key: str,
    params: list[Tensor],
    inputs: list[Tensor],
    level_order: Tensor,
    level_ptr: Tensor,
    edge_ptr: Tensor,
    edge_child: Tensor,
    roots: Tensor,
    internal: Tensor,
    states: list[Tensor],
    hoisted: list[Tensor],
    activations: list[Tensor],
    d_states: list[Tensor | None],
    d_outputs: list[Tensor | None],
    train: bool,
    dropout_seed: Tensor,
) -> list[Tensor]:
    """The gradient of every param, then of every float input (ABI order), from upstream gradients of
    the states ([N + 1] rows) and outputs; None: no upstream (an output's phases then do nothing).
    `activations`: what the forward saved for it (a CPU runner's, `passes.saving`)."""
    runner = _runner(key, params, level_order)
    stream = runner.stream()
    runner.prepare(params, stream)
    d_params = [torch.zeros_like(p, memory_format=torch.contiguous_format) for p in params]
    d_inputs: list[Tensor | None] = [None] * len(inputs)
    for position in runner.float_inputs:
        d_inputs[position] = torch.zeros(inputs[position].shape, dtype=torch.float32, device=inputs[position].device)
    executor = runner.executor
    if executor.on_device:
        return _device_backward(
            executor,
            runner,
            params,
            inputs,
            level_order,
            level_ptr,
            edge_ptr,
            edge_child,
            roots,
            states,
            hoisted,
            d_states,
            d_outputs,
            d_params,
            d_inputs,
            _dropout(train, dropout_seed),
            stream,
        )
    d_state_arrays = []
    for state, upstream in zip(states, d_states):
        d_state = torch.zeros_like(state) if upstream is None else upstream.to(torch.float32, copy=True).contiguous()
        d_state_arrays.append(d_state.numpy())  # the kernels add the children's adjoints into it
    lin = _linearized(runner, level_order, level_ptr, edge_ptr, edge_child, roots)
    grads = (
        [d.numpy() for d in d_params],
        [None if d is None else d.numpy() for d in d_inputs],
        d_state_arrays,
        [np.zeros(h.shape, np.float32) for h in hoisted],
        [None if d is None else _view(d) for d in d_outputs],
    )
    executor.run_backward(
        lin,
        [_view(p) for p in params],
        [i.numpy() for i in _kernel_inputs(runner, inputs, check=False)],
        [_view(s) for s in states],
        [_view(h) for h in hoisted],
        grads,
        dropout=_dropout(train, dropout_seed),  # the forward's masks, recomputed
        activations=_activation_arrays(runner, [_view(a) for a in activations]),
    )
    return d_params + [d for d in d_inputs if d is not None]


def _device_backward(
    executor: DeviceArrayCalls,
    runner: _Runner,
    params: list[Tensor],
    inputs: list[Tensor],
    level_order: Tensor,
    level_ptr: Tensor,
    edge_ptr: Tensor,
    edge_child: Tensor,
    roots: Tensor,
    states: list[Tensor],
    hoisted: list[Tensor],
    d_states: list[Tensor | None],
    d_outputs: list[Tensor | None],
    d_params: list[Tensor],
    d_inputs: list[Tensor | None],
    dropout: Dropout,
    stream: int,
) -> list[Tensor]:
    """`cell_backward` on a device runner (`executor`, its calls): every gradient array allocated by torch
    where the params are (`dropout`: the forward's mode, whose masks the kernels recompute), run on `stream`."""
    assert runner.packed is not None  # prepare uploaded them
    lin = _linearized(runner, level_order, level_ptr, edge_ptr, edge_child, roots)
    kept = [
        [p.detach().contiguous() for p in params],
        _kernel_inputs(runner, inputs, check=False),
        [s.detach().contiguous() for s in states],
        [h.detach().contiguous() for h in hoisted],
    ]
    d_state_tensors = [
        torch.zeros_like(state) if upstream is None else upstream.to(torch.float32, copy=True).contiguous()
        for state, upstream in zip(kept[2], d_states)
    ]
    d_hoisted = [torch.zeros_like(h) for h in kept[3]]
    upstream = [None if d is None else d.to(torch.float32).contiguous() for d in d_outputs]
    device = d_state_tensors[0].device if d_state_tensors else level_order.device
    deferred = [torch.zeros(shape, dtype=torch.float32, device=device) for shape in executor.deferred_shapes(lin)]
    arrays = {
        "params": _addresses(kept[0]),
        "inputs": _addresses(kept[1]),
        "states": _addresses(kept[2]),
        "hoisted": _addresses(kept[3]),
        "outputs": [0] * len(runner.spec.abi.outputs),
    }
    grads = {
        "d_params": _addresses(d_params),
        "d_inputs": _addresses(d_inputs),
        "d_states": _addresses(d_state_tensors),
        "d_hoisted": _addresses(d_hoisted),
        "upstream": _addresses(upstream),
        "deferred": _addresses(deferred),
    }
    executor.run_backward_at(lin, runner.packed, arrays, grads, dropout, stream)
    return d_params + [d for d in d_inputs if d is not None]


@cell_backward.register_fake
def _cell_backward_fake(key, params, inputs, level_order, *rest):
    runner = _runner(key, params, level_order)
    d_params = [p.new_empty(p.shape) for p in params]
    return d_params + [inputs[i].new_empty(inputs[i].shape, dtype=torch.float32) for i in runner.float_inputs]


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    key, params, cell_inputs, *rest = inputs
    forest, (train, dropout_seed) = rest[:6], rest[6:8]  # then `fold` and `keep` (no gradient, nothing to keep)
    runner = _runner(key, params, forest[0])
    ctx.train = train
    ctx.set_materialize_grads(False)  # a result the loss does not use has no upstream (and costs nothing)
    ctx.key = key
    ctx.counts = (len(params), len(cell_inputs))
    states, hoisted, activations, _ = _split(runner, output)
    saved = [*states, *hoisted, *activations]
    ctx.save_for_backward(*params, *cell_inputs, *forest, dropout_seed, *saved)


def _backward(ctx: Any, grads: Sequence[Tensor | None]) -> tuple[Any, ...]:
    num_params, num_inputs = ctx.counts
    saved = list(ctx.saved_tensors)
    params, saved = saved[:num_params], saved[num_params:]
    cell_inputs, saved = saved[:num_inputs], saved[num_inputs:]
    forest, dropout_seed, saved = saved[:6], saved[6], saved[7:]
    runner = _runner(ctx.key, params, forest[0])
    states, hoisted, activations, _ = _split(runner, saved)
    # None for the forest, train, dropout_seed and fold when given (the dispatcher drops an argument equal to
    # its default, so the op was applied to 11 or 12 arguments: as many flags as autograd says)
    rest = (None,) * (len(ctx.needs_input_grad) - 3)
    grads = list(grads)
    d_states, _, _, d_outputs = _split(runner, grads)
    if all(g is None for g in grads):
        return (None, [None] * num_params, [None] * num_inputs) + rest
    result = cell_backward(
        ctx.key,
        params,
        cell_inputs,
        *forest,
        states,
        hoisted,
        activations,
        d_states,
        d_outputs,
        ctx.train,
        dropout_seed,
    )
    d_inputs: list[Tensor | None] = [None] * num_inputs
    for position, d in zip(runner.float_inputs, result[num_params:]):
        d_inputs[position] = d
    return (None, list(result[:num_params]), d_inputs) + rest


torch.library.register_autograd("cortexc::cell_forward", _backward, setup_context=_setup_context)
