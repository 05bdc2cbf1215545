"""A compiled cell as a `torch.nn.Module` (the contract: ../shared/spec/torch.md).

`CellModule(cls)` wraps a cell class of a generated package: its params are
`nn.Parameter`s named as in the `.cell` file, and calling it runs the generated
C through two `torch.library` custom ops, ``cortexc::cell_forward`` and
``cortexc::cell_backward``, tied by `register_autograd`. The ops take lists of
tensors (params, inputs, the linearised forest) and an integer handle naming
the module's executor; what the backward needs (params, inputs, forest, every
state and hoisted row) travels as tensors saved by autograd. Each op has a
fake implementation (shapes only), so `torch.compile` traces them without a
graph break and `torch.library.opcheck` passes.

Zero copy: contiguous float32 CPU tensors go into the `cx_call` pointer tables
as they are (NumPy views of the detached tensors share their memory), torch
allocates every result, and the states come back as views of the kernels'
arrays. The GEMM weights are packed again only when a packed param's version
counter or storage changed (an optimizer step), once per step. A CPU forward
after which no backward can follow (`CellModule.forward` says so with the op's
``fold`` flag) may read folded look-up projections (`cortexc.passes.fold`),
built from the current params by the library's `cx_fold` (`_Runner.folded`).

On a GPU (``module.to("cuda")``) the same ops run the CUDA target on torch's CUDA tensors: torch
allocates every result, the params and inputs are read where they are, and only the forest and the
pointer tables go up per call (`DeviceExecutor.run_forward_at`); the packed GEMM weights are packed on
the host and uploaded when a param changed. Every copy and launch of a call goes on torch's current
stream of the device (`torch.cuda.current_stream().cuda_stream`, carried in `cx_launch.stream`), after
the work torch queued there (the zeroed results), and the call returns when that stream has run it; all
in the device's primary context (which torch uses). PyCUDA is not needed there: the arch comes from
torch. `use_backend("cuda-emu")` runs a module's CPU tensors through the same host path and the
emulated CUDA library (how the tests check it without a GPU).

Importing this module imports torch; `import cortexc` never does.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor, nn

from cortexc.errors import CortexcError, ForestError, InputError
from cortexc.runtime.cpu import CpuExecutor
from cortexc.runtime.device import DeviceExecutor, DeviceParams
from cortexc.runtime.forest import Forest
from cortexc.runtime.linearize import Linearized, linearize
from cortexc.runtime.model import CellModel, cell_class
from cortexc.runtime.philox import EVAL, SEED_LIMIT, Dropout
from cortexc.runtime.signature import CellSignature, EmbeddingSig
from cortexc.runtime.validate import check_forest, checked_flag

__all__ = ["CellModule", "ForestBatch", "ignore_sparse_tables_for_ddp"]


# ------------------------------------------------------------------------------------------------ forest
@dataclass(frozen=True, eq=False)
class ForestBatch:
    """A linearised forest as int64 tensors (`runtime/linearize.py`): what the kernels walk.

    `internal` is the level-order tail of the nodes with children (its length sizes the hoisted rows,
    so that shapes follow from tensor sizes alone, as `torch.compile` needs); `roots` the roots in the
    forest's order. `forest` is kept to check the structure against a cell (in eager mode).
    """

    level_order: Tensor
    level_ptr: Tensor
    edge_ptr: Tensor
    edge_child: Tensor
    roots: Tensor
    internal: Tensor
    forest: Forest | None = field(default=None, repr=False)

    @classmethod
    def from_forest(cls, forest: Forest) -> ForestBatch:
        if not isinstance(forest, Forest):
            raise InputError(f"ForestBatch.from_forest expects a cortexc.Forest, got {type(forest).__name__}")
        lin = linearize(forest)
        order = torch.tensor(lin.level_order)  # copies: the forest's arrays are read-only
        batch = cls(
            level_order=order,
            level_ptr=torch.tensor(lin.level_ptr),
            edge_ptr=torch.tensor(lin.edge_ptr),
            edge_child=torch.tensor(lin.edge_child),
            roots=torch.tensor(lin.roots),
            internal=order[lin.num_leaves :].clone(),  # its own tensor: a view would tie its size to a storage offset
            forest=forest,
        )
        return batch.mark_dynamic()

    @property
    def num_nodes(self) -> int:
        return int(self.level_order.shape[0])

    def tensors(self) -> tuple[Tensor, ...]:
        """The tensors in the order the ops take them."""
        return (self.level_order, self.level_ptr, self.edge_ptr, self.edge_child, self.roots, self.internal)

    def mark_dynamic(self) -> ForestBatch:
        """Mark every size dynamic for `torch.compile` (`from_forest` does): forests of any size then share
        one graph, except where two sizes of the first forest were equal (dynamo gives them one symbol)."""
        for tensor in self.tensors():
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
        return self


def _linearized(level_order: Tensor, level_ptr: Tensor, edge_ptr: Tensor, edge_child: Tensor, roots: Tensor):
    """The executor's `Linearized` over NumPy views of the forest tensors (no copy for int64 CPU ones)."""
    arrays = [np.ascontiguousarray(_host(t), dtype=np.int64) for t in (level_order, level_ptr, edge_ptr)]
    order, ptr, eptr = arrays
    child = np.ascontiguousarray(_host(edge_child), dtype=np.int64)
    root = np.ascontiguousarray(_host(roots), dtype=np.int64)
    max_children = int(np.diff(eptr).max()) if len(order) else 0
    return Linearized(len(order), max(len(ptr) - 1, 1), max_children, order, ptr, eptr, child, root)


def _host(tensor: Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor (a copy to the host for a device one: the forest, which is small)."""
    return tensor.detach().cpu().numpy()


# ------------------------------------------------------------------------------------------------ runners
class _Runner:
    """One module's executor on one backend (``cpu``, ``cuda``, ``cuda-emu``) and what the ops read from
    its `cell.json` entry (orders and shapes)."""

    def __init__(self, cls: type[CellModel], backend: str = "cpu", device_index: int | None = None):
        self.backend = backend
        self.device_index = device_index
        self.executor: CpuExecutor | DeviceExecutor
        if backend == "cuda":  # torch's arch and context: no PyCUDA
            from cortexc.runtime.cuda import CudaExecutor

            major, minor = torch.cuda.get_device_capability(device_index)
            name = f"{cls._description.package}_{cls.signature.name}"
            self.executor = CudaExecutor(cls._spec, cls._kernel_sources["cuda"], name, arch=(major, minor))
        else:
            executor = cls.make_executor(backend)
            if not isinstance(executor, CpuExecutor | DeviceExecutor):  # pragma: no cover - the backend table
                raise CortexcError(f"cortexc.torch cannot drive the {backend} executor")
            self.executor = executor
        self.packed: DeviceParams | None = None  # a device runner's packed weights
        self.spec = cls._spec
        self.signature = cls.signature
        abi = self.spec.abi
        self.params: list[str] = list(abi.params)
        self.inputs: list[str] = list(abi.inputs)
        self.states: list[str] = list(abi.states)
        ranges = {i.name: i.index_range for i in self.signature.inputs if i.index_range is not None}
        self.float_inputs = [position for position, name in enumerate(self.inputs) if name not in ranges]
        self.index_ranges = {position: ranges[name] for position, name in enumerate(self.inputs) if name in ranges}
        section = self.executor.section  # the packed weights, folds and saved arrays of the executor's target
        self.packed_positions = sorted({self.params.index(p) for w in section.packed for p in w.params})
        self._packed_key: tuple[tuple[int, int], ...] | None = None
        # folded look-up projections (`cortexc.passes.fold`, the C target's): the params each fold reads (its
        # table and its packed weight's params), and the weights value the executor's tables are paired with
        folds = section.folds if isinstance(self.executor, CpuExecutor) else ()
        packed_params = {weight.name: weight.params for weight in section.packed}
        self.fold_positions = sorted(
            {self.params.index(f.table) for f in folds}
            | {self.params.index(p) for f in folds for p in packed_params[f.packed]}
        )
        self._fold_key: tuple[tuple[int, int], ...] | None = None
        self._fold_weights: tuple[list[np.ndarray], list[np.ndarray]] | None = None
        self.state_shapes = [state.shape for state in self.signature.states]
        self.dropout_sites = self.spec.dropout_sites  # 0: training mode changes nothing
        # what a training forward keeps for its backward (`passes.saving`: the C program's; device runners
        # run their own target's kernels, which save nothing)
        cpu = isinstance(self.executor, CpuExecutor)
        self.saved_rows = [(v.width, v.internal) for v in section.saved] if cpu else []
        self.repacks = 0  # how often the weights were packed (tests: only when a param changed)

    def prepare(self, params: Sequence[Tensor], stream: int = 0) -> None:
        """Pack the GEMM weights again if a packed param changed since the last call: its version
        counter (bumped by every in-place update, `torch.optim` steps included) or its storage. A device
        runner uploads them on `stream`, the call's."""
        key = tuple((params[i]._version, params[i].data_ptr()) for i in self.packed_positions)
        if key != self._packed_key or (self.packed is None and isinstance(self.executor, DeviceExecutor)):
            arrays = {self.params[i]: _view(params[i].detach().cpu()) for i in self.packed_positions}
            if isinstance(self.executor, DeviceExecutor):  # packed on the host, uploaded (a copy down first)
                self.packed = self.executor.upload_packed(arrays, stream)
            else:
                self.executor.repack(arrays)
            self._packed_key = key
            self.repacks += 1

    def folded(
        self, params: Sequence[Tensor], rows: int
    ) -> tuple[tuple[list[np.ndarray], list[np.ndarray]], list[np.ndarray | None] | None]:
        """The weights an inference of `rows` nodes runs with (views of `params`, the packed weights of the
        last `prepare`) and the folded tables built from them (`CpuExecutor.folded_tables`: once the
        inferences since a change have run as many nodes as the tables have rows), or None. A change of
        any param a fold reads (its version counter or its storage, as for the packed weights) or a repack
        makes a new weights value, so the executor drops the old tables and counts again."""
        assert isinstance(self.executor, CpuExecutor)
        packed = self.executor.weights[1]
        key = tuple((params[i]._version, params[i].data_ptr()) for i in self.fold_positions)
        weights = self._fold_weights
        if weights is None or key != self._fold_key or weights[1] is not packed:
            weights = ([_view(p) for p in params], packed)
            self._fold_weights, self._fold_key = weights, key
        return weights, self.executor.folded_tables(weights, rows)

    def forget_params(self) -> None:
        """Drop what was derived from the params (packed weights' key, folded tables): the next call
        packs and counts again (`CellModule.params_changed`, `.to()`)."""
        self._packed_key = None
        self._fold_key = self._fold_weights = None
        if isinstance(self.executor, CpuExecutor):
            self.executor.forget_folded()

    def stream(self) -> int:
        """The cudaStream_t a call goes on: torch's current stream on the runner's GPU (so the kernels run
        after the work torch queued there, its zeroed results included, as any torch op would); 0, the
        default stream, for the emulator's CPU tensors."""
        if self.backend != "cuda":
            return 0
        return int(torch.cuda.current_stream(self.device_index).cuda_stream)


_RUNNERS: dict[int, _Runner] = {}
_HANDLES = itertools.count(1)


def _runner(handle: int) -> _Runner:
    runner = _RUNNERS.get(handle)
    if runner is None:
        raise CortexcError(f"no cortexc CellModule with handle {handle} in this process")
    return runner


def _dropout(train: bool, seed: Tensor) -> Dropout:
    """The ops' dropout args as the executor's mode: the seed travels as an int64 tensor (its two's complement)."""
    return Dropout(True, int(seed.item()) % SEED_LIMIT) if train else EVAL


def _view(tensor: Tensor) -> np.ndarray:
    """A float32 C-contiguous NumPy view of a CPU tensor (a copy only if it is not one already)."""
    return np.ascontiguousarray(tensor.detach().numpy(), dtype=np.float32)


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
    checks): no node with more children than a fixed arity, no shared child for a tree cell."""
    sig = runner.signature
    counts = np.diff(lin.edge_ptr)
    if sig.arity is not None and lin.max_children > sig.arity:
        position = int(np.flatnonzero(counts > sig.arity)[0])
        raise ForestError(
            f"node {int(lin.level_order[position])} has {int(counts[position])} children but cell {sig.name}'s "
            f"arity is {sig.arity}"
        )
    if not sig.structure.shares_children and len(lin.edge_child):
        readers = np.bincount(lin.edge_child, minlength=lin.num_nodes)
        if readers.max() > 1:
            raise ForestError(
                f"node {int(np.argmax(readers))} has {int(readers.max())} parents; cell {sig.name} is on a tree, "
                "not a dag"
            )


# ------------------------------------------------------------------------------------------------ the ops
@torch.library.custom_op("cortexc::cell_forward", mutates_args=())
def cell_forward(
    handle: int,
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
    (`passes.saving`, a CPU runner's: [N, width] with ``keep``, else no rows), then every output (ABI
    order); with ``train``, the dropout masks of the int64 ``dropout_seed`` (mod 2^64). ``fold``: the caller
    knows no backward follows (`CellModule.forward`), so a CPU runner may build and read folded look-up
    projections (bitwise the same results; the flag only keeps training forwards from paying for tables).
    ``keep``: a backward may follow, so the kernels keep what it reads (else nothing is saved)."""
    runner = _runner(handle)
    stream = runner.stream()
    runner.prepare(params, stream)
    results = _forward_shapes(runner, params, level_order, roots, internal, fake=False, keep=keep)
    states, hoisted, activations, outputs = _split(runner, results)
    lin = _linearized(level_order, level_ptr, edge_ptr, edge_child, roots)
    _check_linearized(runner, lin)
    inputs = _kernel_inputs(runner, inputs, check=True)
    if isinstance(runner.executor, DeviceExecutor):
        params = [p.detach().contiguous() for p in params]  # kept alive (and contiguous) through the call
        arrays = {
            "params": _addresses(params),
            "inputs": _addresses(inputs),
            "states": _addresses(states),
            "hoisted": _addresses(hoisted),
            "outputs": _addresses(outputs),
        }
        assert runner.packed is not None  # prepare uploaded them
        runner.executor.run_forward_at(lin, runner.packed, arrays, _dropout(train, dropout_seed), stream)
        return results
    param_views, packed, folded = [_view(p) for p in params], None, None
    if fold and runner.fold_positions:  # tables of these params, and the packed weights they were made with
        (_, packed), folded = runner.folded(params, lin.num_nodes)
    runner.executor.run_forward(
        lin,
        param_views,
        [i.numpy() for i in inputs],
        [s.numpy() for s in states],
        [h.numpy() for h in hoisted],
        [o.numpy() for o in outputs],
        packed=packed,
        dropout=_dropout(train, dropout_seed),
        folded=folded,
        activations=[a.numpy() for a in activations] if keep else None,
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
        empty(((i if internal_rows else n - i) if keep else 0, width), dtype=torch.float32)
        for width, internal_rows in runner.saved_rows
    ]
    outputs = [empty(((r if o.at_root else n), *o.shape), dtype=torch.float32) for o in runner.signature.outputs]
    return states + hoisted + saved + outputs


_Item = TypeVar("_Item")


def _split(runner: _Runner, results: Sequence[_Item]) -> tuple[list[_Item], list[_Item], list[_Item], list[_Item]]:
    """The forward's results (or anything in their order: their upstream gradients, what autograd saved of
    them) as states, hoisted rows, saved activations and outputs."""
    ns, nh, nv = len(runner.states), len(runner.spec.hoisted_widths), len(runner.saved_rows)
    kept = ns + nh + nv
    return list(results[:ns]), list(results[ns : ns + nh]), list(results[ns + nh : kept]), list(results[kept:])


@cell_forward.register_fake
def _cell_forward_fake(
    handle,
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
    return _forward_shapes(_runner(handle), params, level_order, roots, internal, fake=True, keep=keep)


@torch.library.custom_op("cortexc::cell_backward", mutates_args=())
def cell_backward(
    handle: int,
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
    runner = _runner(handle)
    stream = runner.stream()
    runner.prepare(params, stream)
    d_params = [torch.zeros_like(p, memory_format=torch.contiguous_format) for p in params]
    d_inputs: list[Tensor | None] = [None] * len(inputs)
    for position in runner.float_inputs:
        d_inputs[position] = torch.zeros(inputs[position].shape, dtype=torch.float32, device=inputs[position].device)
    if isinstance(runner.executor, DeviceExecutor):
        return _device_backward(
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
    lin = _linearized(level_order, level_ptr, edge_ptr, edge_child, roots)
    grads = (
        [d.numpy() for d in d_params],
        [None if d is None else d.numpy() for d in d_inputs],
        d_state_arrays,
        [np.zeros(h.shape, np.float32) for h in hoisted],
        [None if d is None else _view(d) for d in d_outputs],
    )
    runner.executor.run_backward(
        lin,
        [_view(p) for p in params],
        [i.numpy() for i in _kernel_inputs(runner, inputs, check=False)],
        [_view(s) for s in states],
        [_view(h) for h in hoisted],
        grads,
        dropout=_dropout(train, dropout_seed),  # the forward's masks, recomputed
        activations=[_view(a) for a in activations],
    )
    return d_params + [d for d in d_inputs if d is not None]


def _device_backward(
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
    """`cell_backward` on a device runner: every gradient array allocated by torch where the params are
    (`dropout`: the forward's mode, whose masks the kernels recompute), run on `stream`."""
    assert isinstance(runner.executor, DeviceExecutor) and runner.packed is not None
    lin = _linearized(level_order, level_ptr, edge_ptr, edge_child, roots)
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
    deferred = [
        torch.zeros(shape, dtype=torch.float32, device=device) for shape in runner.executor.deferred_shapes(lin)
    ]
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
    runner.executor.run_backward_at(lin, runner.packed, arrays, grads, dropout, stream)
    return d_params + [d for d in d_inputs if d is not None]


@cell_backward.register_fake
def _cell_backward_fake(handle, params, inputs, level_order, *rest):
    runner = _runner(handle)
    d_params = [p.new_empty(p.shape) for p in params]
    return d_params + [inputs[i].new_empty(inputs[i].shape, dtype=torch.float32) for i in runner.float_inputs]


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    handle, params, cell_inputs, *rest = inputs
    forest, (train, dropout_seed) = rest[:6], rest[6:8]  # then `fold` and `keep` (no gradient, nothing to keep)
    runner = _runner(handle)
    ctx.train = train
    ctx.set_materialize_grads(False)  # a result the loss does not use has no upstream (and costs nothing)
    ctx.handle = handle
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
    runner = _runner(ctx.handle)
    states, hoisted, activations, _ = _split(runner, saved)
    # None for the forest, train, dropout_seed and fold when given (the dispatcher drops an argument equal to
    # its default, so the op was applied to 11 or 12 arguments: as many flags as autograd says)
    rest = (None,) * (len(ctx.needs_input_grad) - 3)
    grads = list(grads)
    d_states, _, _, d_outputs = _split(runner, grads)
    if all(g is None for g in grads):
        return (None, [None] * num_params, [None] * num_inputs) + rest
    result = cell_backward(
        ctx.handle,
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


# ------------------------------------------------------------------------------------------------ module
class CellModule(nn.Module):
    """A compiled cell as an `nn.Module`: ``CellModule(mod.BinaryTreeLSTM, seed=0)``.

    Params are float32 `nn.Parameter`s named and ordered as the `.cell` file declares them (so
    `state_dict` keys are the `.npz` keys of the NumPy API), initialised as the NumPy model with the
    same seed. ``module(batch, **inputs)`` takes a `ForestBatch` (or a `Forest`) and one tensor per
    input and returns every state (`[N, ...]`, node order) and output by name, in autograd's graph.
    With ``sparse=True`` the gradient of a param used only as an embedding table is a sparse COO
    tensor of the looked-up rows (as `nn.Embedding(sparse=True)`); eager mode only. Such tables are
    DDP-ignored (DDP's reducer takes sparse gradients only from `nn.Embedding`) and synchronised by the
    module itself in a process group of more than one rank: rank 0's values broadcast before the first
    forward with grad enabled, each synced backward's sparse gradient (with what earlier backwards under
    DDP's ``no_sync()`` accumulated in the table's ``.grad``) averaged over the ranks (`_SparseAllReduce`);
    under ``no_sync()`` nothing is averaged and no collective runs, as for DDP's own params.
    `train()` / `eval()` switch the cell's `dropout` calls on and off (a module starts in training mode):
    in training mode each call draws its dropout seed from torch's default generator (so
    `torch.manual_seed` reproduces a run) and the backward replays the same masks.
    With ``fold=True`` (the default; the ``fold`` attribute too) a CPU inference — grad disabled, or no
    param or float input requiring grad — reads folded look-up projections (bitwise the same results),
    built again after any param change torch's version counters record; `params_changed` for others.
    """

    def __init__(self, cls: type[CellModel], seed: int | None = 0, sparse: bool = False, fold: bool = True):
        super().__init__()
        if not (isinstance(cls, type) and issubclass(cls, CellModel)):
            raise CortexcError(f"CellModule wraps a cell class of a generated package, got {cls!r}")
        self._cell_ref = (str(cls._package), cls.signature.name)
        self.sparse = checked_flag(sparse, "sparse")
        self.fold = checked_flag(fold, "fold")
        from cortexc.runtime.params import init_params

        values = init_params(cls.signature, seed)
        for decl in cls.signature.params:
            if hasattr(self, decl.name):
                raise CortexcError(f"param {decl.name} of cell {cls.signature.name} clashes with an nn.Module name")
            self.register_parameter(decl.name, nn.Parameter(torch.from_numpy(values[decl.name])))
        self._attach(cls)
        if self.sparse:  # DDP(cell) leaves them to the module (nested in a bigger model: ignore_sparse_tables_for_ddp)
            names = [alias for name in self.sparse_tables for alias in _ddp_names("", name)]
            nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(self, names)

    @property
    def sparse_tables(self) -> list[str]:
        """The params whose gradient is sparse (``sparse=True``): the embedding tables, in ABI order."""
        if not self.sparse:
            return []
        tables = {embedding.param for embedding in self.signature.embeddings}
        return [name for name in self.runner.params if name in tables]

    def _attach(self, cls: type[CellModel]) -> None:
        self.signature: CellSignature = cls.signature
        self._cell_class = cls
        self._handle = next(_HANDLES)
        _RUNNERS[self._handle] = _Runner(cls)
        self._device_handles: dict[tuple[str, int | None], int] = {}  # (backend, device index) -> handle

    def use_backend(self, backend: str) -> CellModule:
        """Run this module's CPU tensors on another executor: ``"cuda-emu"`` drives the CUDA host path
        (what a module on a GPU runs) through the emulated CUDA library, on the CPU; ``"cpu"`` (the
        default) the compiled C. Returns the module."""
        if backend not in ("cpu", "cuda-emu"):
            raise CortexcError(f"use_backend takes 'cpu' or 'cuda-emu', got {backend!r} (for a GPU: .to('cuda'))")
        self._cpu_backend = backend
        return self

    def _handle_for(self, device: torch.device) -> int:
        """The op handle of the runner for tensors on `device` (made on first use)."""
        backend = "cuda" if device.type == "cuda" else getattr(self, "_cpu_backend", "cpu")
        if device.type not in ("cpu", "cuda"):
            raise CortexcError(f"CellModule runs on the cpu or cuda, not on {device}")
        if backend == "cpu":
            return self._handle
        key = (backend, device.index)
        if key not in self._device_handles:
            handle = next(_HANDLES)
            _RUNNERS[handle] = _Runner(self._cell_class, backend, device.index)
            self._device_handles[key] = handle
        return self._device_handles[key]

    @property
    def runner(self) -> _Runner:
        return _RUNNERS[self._handle]

    def __del__(self) -> None:
        _RUNNERS.pop(getattr(self, "_handle", 0), None)
        for handle in getattr(self, "_device_handles", {}).values():
            _RUNNERS.pop(handle, None)

    # --- pickling: the cell class and the executor are made again from the package directory -------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in ("_handle", "signature", "_cell_class", "_device_handles", "_sparse_group"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("fold", True)  # a module pickled before the switch existed
        super().__setstate__(state)
        self._attach(cell_class(*self._cell_ref))

    def params_changed(self) -> None:
        """Say that the params changed in a way torch's version counters do not record (a write through
        ``p.data``, or through memory shared outside torch): the packed weights and folded tables are made
        again from them on the next call. Every other change (optimizer steps, ``load_state_dict``,
        ``with torch.no_grad(): p.copy_(...)``, ``.to()``, replacing a param) is seen without it."""
        for runner in self._all_runners():
            runner.forget_params()

    def _all_runners(self) -> list[_Runner]:
        handles = [self._handle, *self._device_handles.values()]
        return [_RUNNERS[h] for h in handles if h in _RUNNERS]

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """`nn.Module._apply` (`.to()`, `.float()`, ...), then drop the state derived from the old params:
        the new ones have new storage, which the keys see anyway; this frees the old tables at once."""
        result = super()._apply(fn, recurse)
        if hasattr(self, "_handle"):
            for runner in self._all_runners():
                runner.forget_params()
        return result

    # --- running -----------------------------------------------------------------------------------
    def forward(self, batch: ForestBatch | Forest, **inputs: Tensor) -> dict[str, Tensor]:
        if isinstance(batch, Forest):
            batch = ForestBatch.from_forest(batch)
        if not isinstance(batch, ForestBatch):
            raise InputError(f"expected a cortexc.torch.ForestBatch or a cortexc.Forest, got {type(batch).__name__}")
        runner = self.runner
        params = [getattr(self, name) for name in runner.params]
        device = params[0].device if params else torch.device("cpu")
        handle = self._handle_for(device)
        eager = not torch.compiler.is_compiling()
        if eager:
            self._check(batch, inputs, device)
        converted = {}
        for decl in self.signature.inputs:
            value = inputs[decl.name]
            # index inputs as given (the op checks their range, then makes them int32); float ones as float32
            converted[decl.name] = value.contiguous() if decl.is_index else value.to(torch.float32).contiguous()
        if self.sparse and not eager and torch.is_grad_enabled() and _distributed():
            raise CortexcError(
                "CellModule(sparse=True) in a compiled graph would give its tables dense gradients, which DDP "
                "ignores and nothing averages over the ranks: with more than one rank, use sparse=False under "
                "torch.compile(fullgraph=True) (without fullgraph, this forward runs eagerly)"
            )
        float_inputs = [converted[d.name] for d in self.signature.inputs if not d.is_index]
        # no backward can follow this call (autograd records the op only with grad enabled and some tensor
        # argument requiring grad): then it may read folded look-up projections, and needs no sparse tables
        inference = not (torch.is_grad_enabled() and any(t.requires_grad for t in [*params, *float_inputs]))
        if self.sparse and eager and not inference:
            group = self._sparse_sync_group()
            for embedding in self.signature.embeddings:
                position = runner.params.index(embedding.param)
                table = params[position] if group is None else _SparseAllReduce.apply(params[position], group)
                params[position], converted[embedding.index] = _compact_lookup(
                    table, converted[embedding.index], embedding, batch
                )
        train = self.training and runner.dropout_sites > 0
        if train:  # torch's default generator: torch.manual_seed(k) makes a run reproducible
            dropout_seed = torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64)
        else:
            dropout_seed = torch.zeros((), dtype=torch.int64)
        cell_inputs = [converted[name] for name in runner.inputs]
        fold = self.fold and inference and device.type == "cpu"
        keep = not inference
        results = cell_forward(handle, params, cell_inputs, *batch.tensors(), train, dropout_seed, fold, keep)
        n = batch.level_order.shape[0]
        out = {name: state[:n] for name, state in zip(runner.states, results)}
        outputs = _split(_runner(handle), results)[3]  # the handle's runner: its backend decides what is saved
        out.update(zip(runner.spec.abi.outputs, outputs))
        return out

    def _sparse_sync_group(self) -> Any:
        """The process group that synchronises the sparse tables, or None: only with grad enabled, in an
        initialised group of more than one rank (the tables are DDP-ignored from construction on; the
        params' own `_ddp_ignored` mark is not relied on, `copy.deepcopy` drops it), and not inside the
        forward of a DDP module that does not sync this backward (`ddp.no_sync()`: DDP's
        `require_backward_grad_sync`, read from the DDP module whose forward runs this one). Made (a group
        of its own, so that its collectives never interleave with DDP's buckets) and rank 0's tables
        broadcast on the first forward with grad enabled, synced or not, which every rank runs (as DDP's
        own forward requires)."""
        if not torch.is_grad_enabled() or not _distributed():
            return None
        import torch.distributed as dist

        tables = [getattr(self, name) for name in self.sparse_tables]
        if not any(t.requires_grad for t in tables):
            return None
        group = getattr(self, "_sparse_group", None)
        if group is None:
            group = dist.new_group()
            with torch.no_grad():
                for table in tables:
                    dist.broadcast(table, src=dist.get_global_rank(group, 0), group=group)
            self.params_changed()  # the broadcast writes in place without moving the version counters
            self._sparse_group = group
        return group if _ddp_syncs_this_backward() else None

    def _check(self, batch: ForestBatch, inputs: Mapping[str, Tensor], device: torch.device) -> None:
        """The NumPy API's checks, on tensors: the forest's structure, the inputs' names, shapes, dtypes
        and index ranges (eager mode; a compiled graph trusts what it was traced with)."""
        sig = self.signature
        if batch.forest is not None:
            check_forest(sig, batch.forest)
        declared = {decl.name: decl for decl in sig.inputs}
        unknown = sorted(set(inputs) - set(declared))
        if unknown:
            raise InputError(
                f"cell {sig.name} has no input {', '.join(map(repr, unknown))} "
                f"(its inputs: {', '.join(declared) or 'none'})"
            )
        missing = [name for name in declared if name not in inputs]
        if missing:
            raise InputError(f"missing input {', '.join(map(repr, missing))} for cell {sig.name}")
        n = batch.num_nodes
        for name, decl in declared.items():
            value = inputs[name]
            if not isinstance(value, Tensor):
                raise InputError(f"input {name} must be a torch.Tensor, got {type(value).__name__}")
            if value.device != device:
                raise InputError(f"input {name} is on {value.device}; this CellModule's params are on {device}")
            if decl.is_index:
                if tuple(value.shape) != (n,):
                    raise InputError(
                        f"input {name} must have shape ({n},) (one index per node), got {tuple(value.shape)}"
                    )
                if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
                    raise InputError(f"input {name} is an index input and must be integers, got dtype {value.dtype}")
                assert decl.index_range is not None
                bad = torch.nonzero((value < 0) | (value >= decl.index_range)).flatten()
                if bad.numel():
                    node = int(bad[0])
                    raise InputError(
                        f"input {name}: node {node} has index {int(value[node])}, outside "
                        f"[0, {decl.index_range}) ({bad.numel()} nodes out of range)"
                    )
            else:
                expected = (n, *decl.shape)
                if tuple(value.shape) != expected:
                    raise InputError(
                        f"input {name} must have shape {expected} (one row per node), got {tuple(value.shape)}"
                    )
                if not value.is_floating_point():
                    raise InputError(f"input {name} must be float32, got dtype {value.dtype}")

    def extra_repr(self) -> str:
        return f"{self.signature.name}, sparse={self.sparse}, fold={self.fold}"


def _ddp_syncs_this_backward() -> bool:
    """False inside the forward of a `DistributedDataParallel` under ``no_sync()`` (DDP then leaves the
    gradients to accumulate locally until the next synced backward); True otherwise, outside DDP too."""
    active = nn.parallel.DistributedDataParallel._get_active_ddp_module()
    return active is None or bool(active.require_backward_grad_sync)


class _SparseAllReduce(torch.autograd.Function):
    """Identity forward; the backward averages the table's sparse gradient over the group's ranks, as
    DDP averages a dense one: the ranks' rows and values gathered (padded to the largest count), put
    together in rank order and coalesced, so every rank gets bitwise the same sum, divided by the
    world size.

    What the table's ``.grad`` holds already (backwards under DDP's ``no_sync()``, which averaged
    nothing) is taken into the sum and the ``.grad`` cleared, so the table ends with the average of
    every rank's accumulated gradient, as DDP's buckets (which all-reduce the accumulated ``.grad``) give
    the dense params, bitwise the same on every rank (adding a rank's own part after averaging would not be)."""

    @staticmethod
    def forward(ctx: Any, table: Tensor, group: Any) -> Tensor:
        ctx.group = group
        ctx.table = table  # the leaf param: its accumulated .grad joins the average
        return table.view_as(table)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        import torch.distributed as dist

        world = dist.get_world_size(ctx.group)
        grad = grad if grad.is_sparse else grad.to_sparse(1)
        accumulated = ctx.table.grad
        if accumulated is not None:  # runs before the table's AccumulateGrad: it then takes the average
            grad = grad + (accumulated if accumulated.is_sparse else accumulated.to_sparse(1))
            ctx.table.grad = None
        grad = grad.coalesce()
        rows, values = grad.indices()[0], grad.values()
        count = torch.tensor([rows.numel()], dtype=torch.int64, device=rows.device)
        counts = [torch.empty_like(count) for _ in range(world)]
        dist.all_gather(counts, count, group=ctx.group)
        sizes = [int(c) for c in counts]
        most = max(sizes)
        padded_rows = rows.new_zeros(most)
        padded_rows[: rows.numel()] = rows
        padded_values = values.new_zeros((most, *values.shape[1:]))
        padded_values[: rows.numel()] = values
        all_rows = [torch.empty_like(padded_rows) for _ in range(world)]
        all_values = [torch.empty_like(padded_values) for _ in range(world)]
        dist.all_gather(all_rows, padded_rows, group=ctx.group)
        dist.all_gather(all_values, padded_values, group=ctx.group)
        indices = torch.cat([r[:n] for r, n in zip(all_rows, sizes)]).unsqueeze(0)
        values = torch.cat([v[:n] for v, n in zip(all_values, sizes)])
        summed = torch.sparse_coo_tensor(indices, values, grad.shape, check_invariants=False).coalesce()
        return summed / world, None


def ignore_sparse_tables_for_ddp(model: nn.Module) -> nn.Module:
    """Tell DDP to leave the sparse tables of every ``CellModule(sparse=True)`` inside `model` to
    their module (call it before ``DistributedDataParallel(model)``; `DDP(cell)` of a bare module needs
    nothing): DDP reads the names to ignore from the module it wraps, by their full names. Returns `model`."""
    names = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    for prefix, module in model.named_modules():
        if isinstance(module, CellModule):
            names += [alias for name in module.sparse_tables for alias in _ddp_names(prefix, name)]
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sorted(set(names)))
    return model


def _distributed() -> bool:
    """Whether this process is one of several ranks of an initialised default process group."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _ddp_names(prefix: str, name: str) -> list[str]:
    """The names DDP must find a param under to ignore it: its full name, and for a param of the
    wrapped module itself also ``.name`` too (DDP's reducer joins an empty module name with a dot)."""
    return [f"{prefix}.{name}"] if prefix else [name, f".{name}"]


def _lookup_nodes(embedding: EmbeddingSig, batch: ForestBatch) -> Tensor:
    """The nodes that read the table (`EmbeddingSig.rows`)."""
    n = batch.level_order.shape[0]
    internal = batch.internal.shape[0]
    sets = {
        "all": lambda: batch.level_order,
        "leaves": lambda: batch.level_order[: n - internal],
        "internal": lambda: batch.internal,
        "roots": lambda: batch.roots,
    }
    parts = [sets[rows]() for rows in embedding.rows]
    return parts[0] if len(parts) == 1 else torch.unique(torch.cat(parts))


def _compact_lookup(table: Tensor, index: Tensor, embedding: EmbeddingSig, batch: ForestBatch) -> tuple[Tensor, Tensor]:
    """The looked-up rows of `table` (through `F.embedding(sparse=True)`, so its gradient is a sparse
    COO tensor of those rows) and the index input renumbered into them: the kernels then read and
    write only those rows."""
    nodes = _lookup_nodes(embedding, batch)
    rows, inverse = torch.unique(index[nodes].long(), return_inverse=True)
    compact = nn.functional.embedding(rows, table, sparse=True)
    renumbered = torch.zeros_like(index)
    renumbered[nodes] = inverse.to(index.dtype)
    return compact, renumbered
