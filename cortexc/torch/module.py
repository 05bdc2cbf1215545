"""`CellModule`, a compiled cell as a `torch.nn.Module` (the forest it runs on: `batch.ForestBatch`).

The module owns the params (`nn.Parameter`s) and checks what it is given (eagerly); it runs the cell
through the custom ops (`ops.cell_forward`, whose autograd formula is `ops.cell_backward`), named by the
key of its cell and backend (`keys.cell_key`), on its own runner of its params' device (`runner._Runner`,
which the ops find through the params it owns: `runner.own`). With ``sparse=True`` an embedding table is
looked up here first (`_compact_lookup`: only the rows the forest reads, so its gradient is sparse), and
synchronised over the ranks by `ddp`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from cortexc.errors import CortexcError, ForestError, InputError
from cortexc.runtime.backends import BACKENDS, backends_for
from cortexc.runtime.forest import Forest
from cortexc.runtime.model import CellModel, cell_class
from cortexc.runtime.signature import CellSignature, EmbeddingSig
from cortexc.runtime.validate import check_forest, checked_flag, edge_text
from cortexc.torch import ddp
from cortexc.torch.batch import ForestBatch
from cortexc.torch.keys import cell_key
from cortexc.torch.ops import _split, cell_forward
from cortexc.torch.runner import Runners, _Runner, own


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
    DDP's ``no_sync()`` accumulated in the table's ``.grad``) averaged over the ranks (`ddp._SparseAllReduce`);
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
            names = [alias for name in self.sparse_tables for alias in ddp._ddp_names("", name)]
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
        self._cpu_key = cell_key(cls, backends_for("cpu")[0])
        # (key, device index) -> this module's runner: the cpu one now, others on first use (`_runner_for`)
        self._runners: Runners = {(self._cpu_key, None): _Runner(cls)}
        own(list(self.parameters()), self._runners)

    def use_backend(self, backend: str) -> CellModule:
        """Run this module's CPU tensors on another backend that takes them (`Backend.tensors`): ``"cuda-emu"``
        drives the CUDA host path (what a module on a GPU runs) through the emulated CUDA library, on the
        CPU; the default is the table's first (``"cpu"``, the compiled C). Returns the module."""
        choices = backends_for("cpu")
        if backend not in choices:
            raise CortexcError(
                f"use_backend takes {' or '.join(map(repr, choices))}, got {backend!r} (for a GPU: .to('cuda'))"
            )
        self._cpu_backend = backend
        return self

    def _runner_for(self, device: torch.device) -> tuple[str, _Runner]:
        """The op key and this module's runner for tensors on `device` (the runner made on first use)."""
        choices = backends_for(device.type)
        if not choices:
            kinds = dict.fromkeys(b.tensors for b in BACKENDS.values() if b.tensors is not None)
            raise CortexcError(f"CellModule runs on {' or '.join(map(str, kinds))} tensors, not on {device}")
        backend = getattr(self, "_cpu_backend", choices[0]) if device.type == "cpu" else choices[0]
        key = cell_key(self._cell_class, backend)
        index = device.index if device.type != "cpu" else None
        runner = self._runners.get((key, index))
        if runner is None:
            runner = self._runners[(key, index)] = _Runner(self._cell_class, backend, index)
        return key, runner

    @property
    def runner(self) -> _Runner:
        """The cpu runner (the orders and shapes every runner of the cell shares)."""
        return self._runners[(self._cpu_key, None)]

    # --- pickling: the cell class and the executor are made again from the package directory -------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in ("_cpu_key", "_runners", "signature", "_cell_class", "_sparse_group"):
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
        return list(getattr(self, "_runners", {}).values())

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """`nn.Module._apply` (`.to()`, `.float()`, ...), then drop the state derived from the old params:
        the new ones have new storage, which the keys see anyway; this frees the old tables at once."""
        result = super()._apply(fn, recurse)
        for runner in self._all_runners():
            runner.forget_params()
        return result

    # --- running -----------------------------------------------------------------------------------
    def forward(self, batch: ForestBatch | Forest, **inputs: Tensor) -> dict[str, Tensor]:
        steps, down = self.signature.structure.steps, self.signature.structure.down
        if isinstance(batch, Forest):
            batch = ForestBatch.from_forest(batch, steps=steps, down=down)
        if not isinstance(batch, ForestBatch):
            raise InputError(f"expected a cortexc.torch.ForestBatch or a cortexc.Forest, got {type(batch).__name__}")
        runner = self.runner
        params = [getattr(self, name) for name in runner.params]
        device = params[0].device if params else torch.device("cpu")
        key, device_runner = self._runner_for(device)
        eager = not torch.compiler.is_compiling()
        if eager:
            self._check(batch, inputs, device)
            own(params, self._runners)  # again: a param may be new (a compiled graph finds what eager calls owned)
        converted = {}
        for decl in self.signature.inputs:
            if decl.given_by:  # the runtime's own (`_kernel_rows`)
                continue
            value = inputs[decl.name]
            # index inputs as given (the op checks their range, then makes them int32); float ones as float32
            converted[decl.name] = value.contiguous() if decl.is_index else value.to(torch.float32).contiguous()
        converted = _kernel_rows(self.signature, batch, converted)
        if self.sparse and not eager and torch.is_grad_enabled() and ddp._distributed():
            raise CortexcError(
                "CellModule(sparse=True) in a compiled graph would give its tables dense gradients, which DDP "
                "ignores and nothing averages over the ranks: with more than one rank, use sparse=False under "
                "torch.compile(fullgraph=True) (without fullgraph, this forward runs eagerly)"
            )
        float_inputs = [converted[d.name] for d in self.signature.inputs if not d.is_index and not d.given_by]
        # no backward can follow this call (autograd records the op only with grad enabled and some tensor
        # argument requiring grad): then it may read folded look-up projections, and needs no sparse tables
        inference = not (torch.is_grad_enabled() and any(t.requires_grad for t in [*params, *float_inputs]))
        if self.sparse and eager and not inference:
            group = self._sparse_sync_group()
            for embedding in self.signature.embeddings:
                position = runner.params.index(embedding.param)
                table = params[position] if group is None else ddp._SparseAllReduce.apply(params[position], group)
                params[position], converted[embedding.index] = _compact_lookup(
                    table, converted[embedding.index], embedding, batch, steps
                )
        train = self.training and runner.dropout_sites > 0
        if train:  # torch's default generator: torch.manual_seed(k) makes a run reproducible
            dropout_seed = torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64)
        else:
            dropout_seed = torch.zeros((), dtype=torch.int64)
        cell_inputs = [converted[name] for name in runner.inputs]
        fold = self.fold and inference and device.type == "cpu"
        keep = not inference
        results = cell_forward(key, params, cell_inputs, *batch.tensors(), train, dropout_seed, fold, keep)
        n = batch.level_order.shape[0]
        first = n - n // (steps + 1)  # a graph cell's states after its last step (`runtime.graph`)
        out = {name: state[first:n] for name, state in zip(runner.states, results)}
        outputs = _split(device_runner, results)[3]  # the device's runner: its backend decides what is saved
        out.update(zip(runner.spec.abi.outputs, outputs))
        return out

    def _sparse_sync_group(self) -> Any:
        """The process group that synchronises the sparse tables, or None (`ddp._sparse_sync_group`)."""
        return ddp._sparse_sync_group(self)

    def _check(self, batch: ForestBatch, inputs: Mapping[str, Tensor], device: torch.device) -> None:
        """The NumPy API's checks, on tensors: the forest's structure, the inputs' names, shapes, dtypes
        and index ranges (eager mode; a compiled graph trusts what it was traced with)."""
        sig = self.signature
        if batch.forest is not None:
            check_forest(sig, batch.forest)
        steps = sig.structure.steps
        if batch.down is not None and batch.down != sig.structure.down:
            kind, wanted = ("a down", "down=True") if sig.structure.down else ("a bottom-up", "")
            raise ForestError(
                f"cell {sig.name} is {kind} cell, but this batch is of the "
                f"{'forest' if sig.structure.down else 'reversed forest (a down cell)'}: pass "
                f"ForestBatch.from_forest(forest{', ' + wanted if wanted else ''}) (or the Forest itself)"
            )
        ptr = batch.level_ptr
        if steps and (len(ptr) != steps + 2 or not torch.equal(ptr, torch.arange(steps + 2) * ptr[1])):
            raise ForestError(
                f"cell {sig.name} is a graph cell of {steps} steps: its batch must be its unrolled steps, "
                f"ForestBatch.from_forest(forest, steps={steps}) (or pass the Forest)"
            )
        declared = {decl.name: decl for decl in sig.inputs if not decl.given_by}  # the runtime gives the others
        unknown = sorted(set(inputs) - set(declared))
        if unknown:
            raise InputError(
                f"cell {sig.name} has no input {', '.join(map(repr, unknown))} "
                f"(its inputs: {', '.join(declared) or 'none'})"
            )
        missing = [name for name in declared if name not in inputs]
        if missing:
            raise InputError(f"missing input {', '.join(map(repr, missing))} for cell {sig.name}")
        n = batch.num_nodes // (steps + 1)  # a graph cell's batch: its unrolled steps
        edges = int(batch.edge_child.shape[0]) // max(steps, 1)
        for name, decl in declared.items():
            value = inputs[name]
            if not isinstance(value, Tensor):
                raise InputError(f"input {name} must be a torch.Tensor, got {type(value).__name__}")
            if value.device != device:
                raise InputError(f"input {name} is on {value.device}; this CellModule's params are on {device}")
            rows, each = (edges, "edge") if decl.on_edge else (n, "node")
            if decl.is_index:
                if tuple(value.shape) != (rows,):
                    raise InputError(
                        f"input {name} must have shape ({rows},) (one index per {each}), got {tuple(value.shape)}"
                    )
                if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
                    raise InputError(f"input {name} is an index input and must be integers, got dtype {value.dtype}")
                assert decl.index_range is not None
                bad = torch.nonzero((value < 0) | (value >= decl.index_range)).flatten()
                if bad.numel():
                    row = int(bad[0])
                    where = f"node {row}"
                    if decl.on_edge:  # the edge by its number and nodes where the forest is at hand
                        where = f"edge {row}" if batch.forest is None else edge_text(batch.forest, row)
                    raise InputError(
                        f"input {name}: {where} has index {int(value[row])}, outside "
                        f"[0, {decl.index_range}) ({bad.numel()} {each}s out of range)"
                    )
            else:
                expected = (rows, *decl.shape)
                if tuple(value.shape) != expected:
                    raise InputError(
                        f"input {name} must have shape {expected} (one row per {each}), got {tuple(value.shape)}"
                    )
                if not value.is_floating_point():
                    raise InputError(f"input {name} must be float32, got dtype {value.dtype}")

    def extra_repr(self) -> str:
        return f"{self.signature.name}, sparse={self.sparse}, fold={self.fold}"


# ------------------------------------------------------------------------------------------------ kernel rows
def _kernel_rows(sig: CellSignature, batch: ForestBatch, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
    """The inputs as the kernels read them, in autograd's graph (what `runtime.edges.to_kernel_order` does
    with arrays): edge inputs in the kernels' child-edge order (`ForestBatch.edge_order`: a graph cell's once
    per step), their gradients flowing back scattered by autograd; node inputs as they are (a graph cell's
    steps read the node's row); and a `down` cell's `edge.position` and `edge.siblings` (`_given_rows`)."""
    if not any(decl.on_edge for decl in sig.inputs):
        return inputs
    rows = dict(inputs)
    given = _given_rows(batch) if any(decl.given_by for decl in sig.inputs) else {}
    for decl in sig.inputs:
        if decl.given_by:
            rows[decl.name] = given[decl.given_by]
        elif decl.on_edge:
            rows[decl.name] = inputs[decl.name][batch.edge_order]
    return rows


def _given_rows(batch: ForestBatch) -> dict[str, Tensor]:
    """A `down` cell's runtime-given edge inputs (`runtime.edges.given_by_runtime`) by what they hold, in its
    kernels' edge order, `[E, 1]` float32, from the batch's tensors: the reversed forest's child of edge e is
    the forest's parent, whose children count and first edge (by parent id) follow from how often it is a
    child there."""
    parent = batch.edge_child
    counts = torch.zeros(batch.level_order.shape[0], dtype=torch.int64, device=parent.device)
    counts = counts.index_add(0, parent, torch.ones_like(parent))  # each node's children in the forest
    first = torch.cumsum(counts, 0) - counts  # each node's first edge (by parent id)
    values = {"siblings": counts[parent], "position": batch.edge_order - first[parent]}
    return {name: v.to(torch.float32).reshape(-1, 1) for name, v in values.items()}


# ------------------------------------------------------------------------------------------------ sparse tables
def _lookup_nodes(embedding: EmbeddingSig, batch: ForestBatch, steps: int = 0) -> Tensor:
    """The nodes that read the table (`EmbeddingSig.rows`); a graph cell's: every node (its input rows)."""
    n = batch.level_order.shape[0]
    if steps:
        return torch.arange(n // (steps + 1), device=batch.level_order.device)
    internal = batch.internal.shape[0]
    sets = {
        "all": lambda: batch.level_order,
        "leaves": lambda: batch.level_order[: n - internal],
        "internal": lambda: batch.internal,
        "roots": lambda: batch.roots,
    }
    parts = [sets[rows]() for rows in embedding.rows]
    return parts[0] if len(parts) == 1 else torch.unique(torch.cat(parts))


def _compact_lookup(
    table: Tensor, index: Tensor, embedding: EmbeddingSig, batch: ForestBatch, steps: int = 0
) -> tuple[Tensor, Tensor]:
    """The looked-up rows of `table` (through `F.embedding(sparse=True)`, so its gradient is a sparse
    COO tensor of those rows) and the index input renumbered into them: the kernels then read and
    write only those rows."""
    nodes = _lookup_nodes(embedding, batch, steps)
    rows, inverse = torch.unique(index[nodes].long(), return_inverse=True)
    compact = nn.functional.embedding(rows, table, sparse=True)
    renumbered = torch.zeros_like(index)
    renumbered[nodes] = inverse.to(index.dtype)
    return compact, renumbered
