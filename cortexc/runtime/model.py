"""The classes of a generated package: one per cell, sharing this base.

A model holds its params (float32, read-only arrays: change them with
`load_params`, which also re-packs the GEMM weights) and runs a forest on a
device of `cortexc.runtime.backends` (``"cpu"``: the generated C, built on
first use and cached by source hash; ``"interp"``: the reference
interpreter, the eager baseline; ``"cuda"``, ``"cuda-emu"``).

Everything here reads the package's `cell.json` (the cell's signature and
kernel ABI), never the compiler: only ``device="interp"`` and the `cell`
attribute (the IR) compile the cell's source again, on first use.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from cortexc.errors import CortexcError, InputError, OutputError
from cortexc.runtime.backends import BACKENDS, DEFAULT_DEVICE, ExecutorRequest, backend, compile_ir
from cortexc.runtime.edges import from_kernel_order, to_kernel_order
from cortexc.runtime.executor import Executor
from cortexc.runtime.forest import Forest
from cortexc.runtime.graph import last_step, upstream_to_steps
from cortexc.runtime.package import FORMAT_VERSION, CellSpec, FormatError, PackageSpec
from cortexc.runtime.params import check_params, init_params, take_over, write_params_file
from cortexc.runtime.philox import EVAL, SEED_LIMIT, Dropout, checked_seed
from cortexc.runtime.signature import CellSignature
from cortexc.runtime.topdown import linearize_for
from cortexc.runtime.validate import check_forest, check_inputs, checked_flag

if TYPE_CHECKING:
    from cortexc.ir.cell import Cell


#: every device name (the backend table's); "cuda-emu" runs the CUDA code on the CPU (for tests: slow)
DEVICES = tuple(BACKENDS)


@dataclass(frozen=True)
class SparseRows:
    """A sparse gradient of a table: `values[i]` is the gradient of row `rows[i]` (rows unique, sorted);
    every other row's gradient is zero."""

    rows: np.ndarray  # int64 [R]
    values: np.ndarray  # [R, ...]
    shape: tuple[int, ...]

    def to_dense(self) -> np.ndarray:
        dense = np.zeros(self.shape, self.values.dtype)
        dense[self.rows] = self.values
        return dense


def lookup_nodes(forest: Forest, rows: tuple[str, ...]) -> np.ndarray:
    """The nodes of `EmbeddingSig.rows` ("leaves", "internal", "all", "roots") in a forest."""
    sets = {
        "all": lambda: np.arange(forest.num_nodes),
        "leaves": lambda: np.flatnonzero(forest.num_children == 0),
        "internal": lambda: np.flatnonzero(forest.num_children > 0),
        "roots": lambda: np.asarray(forest.roots),
    }
    return np.unique(np.concatenate([sets[r]() for r in rows])) if rows else np.zeros(0, np.int64)


class Outputs(dict):
    """A model's results by name; with ``grad=True`` it also carries what `backward` needs, and which
    model made it (only that model's `backward` takes it: another's saved layout differs)."""

    saved: tuple | None = None
    made_by: object | None = None
    dropout_seed: int | None = None  # the seed of a training-mode call's dropout masks (None: evaluation mode)


class _CompiledCell:
    """The class attribute `cell`: the cell's IR (with gradient bodies), compiled from the package's
    source on first use, once per class. Only the interpreter and IR-level tools need it."""

    def __get__(self, instance: object, owner: type[CellModel]) -> Cell:
        cached = owner.__dict__.get("_compiled_cell")
        if cached is None:
            description = owner._description
            cached = compile_ir(description.source, description.source_file, description.defines, owner.signature.name)
            type.__setattr__(owner, "_compiled_cell", cached)
        return cached


class CellModel:
    """A compiled cell. Subclasses are made by `load_package`; do not instantiate this directly."""

    _package: ClassVar[Path]
    _kernel_sources: ClassVar[dict[str, str]]  # by target, read at import and checked against their hashes
    _description: ClassVar[PackageSpec]
    _spec: ClassVar[CellSpec]
    signature: ClassVar[CellSignature]  # what forests, inputs and params are validated against
    cell: ClassVar[Cell] = _CompiledCell()  # type: ignore[assignment]  # the IR, compiled on first use

    def __init__(self, device: str = DEFAULT_DEVICE, seed: int | None = 0, fold: bool = True):
        target = backend(device).target
        if target is not None and target not in type(self)._kernel_sources:
            first = next(d for d, b in BACKENDS.items() if b.target == target)  # its target's first device
            raise CortexcError(
                f"device={device!r} needs the {target} kernels, which this package was compiled "
                f"without (cortexc compile --target {first} or all)"
            )
        self.device = device
        self._params = _frozen(init_params(self.signature, seed))
        self._executor: Executor | None = None
        self._fold = checked_flag(fold, "fold")
        # the dropout seeds of training-mode calls without one: the model's own stream (apart from the params')
        self._dropout_rng = np.random.default_rng(None if seed is None else (int(seed), 0x64726F70))

    # --- params ---------------------------------------------------------------
    @property
    def params(self) -> Mapping[str, np.ndarray]:
        """Name -> float32 array (read-only, arrays and mapping; use `load_params` to change them)."""
        return MappingProxyType(self._params)

    def load_params(self, params: Mapping[str, np.ndarray] | str | os.PathLike) -> None:
        """Replace some or all params (a dict, an `.npz` or a `.safetensors` path); every shape is checked."""
        checked = check_params(self.signature, params, partial=True)
        self._params = {**self._params, **_frozen(checked)}  # one store: a running call keeps the old dict
        if self._executor is not None:
            self._executor.set_params(self._params)

    def save_params(self, path: str | os.PathLike[str]) -> None:
        """Write every param to an `.npz` file, or a `.safetensors` one (what `cortexc export` reads)."""
        write_params_file(path, self._params)

    @property
    def fold(self) -> bool:
        """Whether an inference (a call without ``grad``) may read folded look-up projections instead of
        their GEMMs (`cortexc.passes.fold`; device "cpu"): tables of ``E @ W^T``, bitwise the GEMMs' results,
        built once the inferences since the params changed have run as many rows as the tables have
        (``CORTEXC_FOLD=eager``: on the first). Off: ``fold=False`` here or ``CORTEXC_FOLD=0``;
        their memory is capped by ``CORTEXC_FOLD_MAX_MB`` (default 256)."""
        return self._fold

    @fold.setter
    def fold(self, value: bool) -> None:
        self._fold = checked_flag(value, "fold")
        if self._executor is not None and hasattr(self._executor, "folding"):
            setattr(self._executor, "folding", self._fold)  # noqa: B010 - not in the Executor protocol

    # --- running ----------------------------------------------------------------
    def __call__(
        self,
        forest: Forest,
        grad: bool = False,
        host: bool = True,
        train: bool = False,
        dropout_seed: int | None = None,
        **inputs: Any,
    ) -> Outputs:
        """States `[N, ...]` in the forest's node order and every output, for the whole forest.

        ``train=True`` turns the cell's `dropout` calls on: their masks come from ``dropout_seed`` (an int in
        [0, 2^64)) or, without one, from a seed drawn from the model's own generator (seeded by its `seed`);
        the result records it as ``out.dropout_seed`` and `backward` replays the same masks. In evaluation
        mode (the default) `dropout(e, p)` is `e` and ``dropout_seed`` is ignored.

        With ``grad=True`` the result also keeps what `backward` needs (the
        forest, the inputs and every state; the rest is recomputed). With
        ``host=False`` on ``device="cuda"`` the arrays stay on the GPU (PyCUDA
        ``GPUArray``s, no copy back) for callers that go on there; every other
        device computes in host memory and returns NumPy arrays either way.
        """
        grad, host = checked_flag(grad, "grad"), checked_flag(host, "host")
        dropout = self._dropout_mode(train, dropout_seed)
        check_forest(self.signature, forest)
        checked = to_kernel_order(self.signature, forest, check_inputs(self.signature, forest, inputs))
        executor = self._executor_for_device()
        # a graph cell's inference double-buffers its steps' states (not in training mode: the dropout masks of
        # its init and outputs are by the node rows of every step kept, as when a backward follows)
        lin = linearize_for(self.signature, forest, every_step=grad or dropout.train)
        out, kept = executor.forward(lin, checked, keep=grad, host=host, dropout=dropout)
        if self.signature.structure.steps:  # a graph cell: the states after the last step
            out = last_step(self.signature, dict(out), lin)
        result = Outputs(out)
        result.dropout_seed = dropout.seed if dropout.train else None
        if grad:
            result.saved = (forest, checked, {s.name: out[s.name] for s in self.signature.states}, kept)
            result.made_by = self
        return result

    def _dropout_mode(self, train: object, seed: object) -> Dropout:
        """The call's dropout mode: an explicit seed is checked (and does not advance the generator)."""
        if not checked_flag(train, "train"):
            return EVAL
        if seed is None:
            return Dropout(True, int(self._dropout_rng.integers(0, SEED_LIMIT, dtype=np.uint64)))
        return Dropout(True, checked_seed(seed))

    def backward(
        self, out: Outputs, upstream: Mapping[str, np.ndarray], sparse: bool = False
    ) -> dict[str, np.ndarray | SparseRows]:
        """Gradients of every param and every float input, given upstream gradients of outputs/states.

        The result must come from this model's `__call__` with ``grad=True``; editing its arrays (or the
        inputs given to the call) afterwards does not change the gradients: the executors keep copies.
        With ``sparse=True`` the gradient of a param used only as an embedding table is a `SparseRows`
        of the looked-up rows (the `cortexc.train` optimizers then update only those rows)."""
        sparse = checked_flag(sparse, "sparse")
        saved = getattr(out, "saved", None)
        if saved is None:
            raise CortexcError("backward needs the result of model(forest, grad=True, ...)")
        if out.made_by is not self:
            raise InputError(
                f"backward was given the result of another model ({out.made_by!r}); only the model that "
                "made a result can take its gradient"
            )
        forest, inputs, states, kept = saved
        if not isinstance(upstream, Mapping):
            raise InputError(f"upstream must map output or state names to gradients, got {type(upstream).__name__}")
        checked = {}
        for name, grad in upstream.items():
            if name not in out:
                known = ", ".join(out)
                raise InputError(f"no output or state named {name!r} to take a gradient of (there are: {known})")
            array = np.asarray(grad)
            if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
                raise InputError(f"the gradient of {name} must be a float array, got dtype {array.dtype}")
            if array.shape != out[name].shape:
                raise InputError(f"the gradient of {name} must have shape {out[name].shape}, got {array.shape}")
            checked[name] = np.ascontiguousarray(array, dtype=np.float32)
        shapes = {p.name: p.shape for p in self.signature.params}
        executor = self._executor_for_device()
        steps = self.signature.structure.steps
        if steps:  # a graph cell: its states' upstream is of the last step's rows (of every step's, kept)
            checked = upstream_to_steps(self.signature, checked, linearize_for(self.signature, forest))
        looked_up = {}
        if sparse:
            for embedding in self.signature.embeddings:
                nodes = lookup_nodes(forest, ("all",) if steps else embedding.rows)  # a graph: any node, any step
                rows = np.unique(inputs[embedding.index][nodes])
                looked_up[embedding.param] = rows.astype(np.int64)
        if looked_up and getattr(executor, "sparse_backward", False):  # only the rows computed (cpu)
            values = executor.backward(kept, checked, shapes, sparse_rows=looked_up)  # type: ignore[call-arg]
            grads: dict[str, np.ndarray | SparseRows] = from_kernel_order(self.signature, forest, dict(values))
            for name, rows in looked_up.items():
                grads[name] = SparseRows(rows, values[name], tuple(shapes[name]))
            return grads
        grads = from_kernel_order(self.signature, forest, dict(executor.backward(kept, checked, shapes)))
        for name, rows in looked_up.items():
            dense = grads[name]
            if not isinstance(dense, np.ndarray):  # pragma: no cover - every executor returns arrays
                raise CortexcError(f"the gradient of {name} is not an array")
            grads[name] = SparseRows(rows, dense[rows], dense.shape)
        return grads

    def _executor_for_device(self) -> Executor:
        """The executor of this model's device, built (or loaded from the cache) on first use."""
        if self._executor is None:
            executor = type(self).make_executor(self.device)
            executor.set_params(self._params)
            if hasattr(executor, "folding"):  # the executors that fold (cpu)
                setattr(executor, "folding", self._fold)  # noqa: B010
            self._executor = executor
        return self._executor

    @classmethod
    def make_executor(cls, device: str, arch: tuple[int, int] | None = None) -> Executor:
        """A new executor of this cell on `device` (its library built or loaded from the cache), with no
        params yet: `set_params` comes next. `cortexc.torch` drives one per module (`arch`: the GPU's
        compute capability for ``device="cuda"``, from torch: see `ExecutorRequest`)."""
        chosen = backend(device)
        target = chosen.target
        request = ExecutorRequest(
            spec=cls._spec,
            source=cls._kernel_sources[target] if target is not None else "",
            source_path=cls._package / cls._spec.target(target).kernel_file if target is not None else cls._package,
            name=f"{cls._description.package}_{cls.signature.name}",
            compile_ir=lambda: cls.cell,
            arch=arch,
        )
        return chosen.make_executor(request)

    # --- pickling ---------------------------------------------------------------
    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled as (package directory, cell name, device, params): the class is made again by
        importing the package from its directory (it is registered under a digest name, not its own)."""
        return (restore_model, (str(self._package), self.signature.name, self.device, dict(self._params)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device!r})"


def cell_class(package_dir: str | os.PathLike[str], name: str) -> type[CellModel]:
    """The class of cell `name` of the package at `package_dir` (imported once per process)."""
    from cortexc.runtime.loader import import_package

    module = import_package(Path(package_dir))
    cls = getattr(module, name, None)
    if not (isinstance(cls, type) and issubclass(cls, CellModel)):
        raise CortexcError(f"the package at {package_dir} has no cell {name!r}")
    return cls


def restore_model(package_dir: str, name: str, device: str, params: Mapping[str, np.ndarray]) -> CellModel:
    """A model unpickled: its class from the package directory, its params as they were."""
    model = cell_class(package_dir, name)(device=device, seed=None)
    model.load_params(params)
    return model


def _frozen(params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Read-only float32 copies the caller cannot change; an optimizer's handed-over result
    (`params.hand_over`: fresh, read-only, held by nothing else) is kept without a copy."""
    frozen = {}
    for name, value in params.items():
        if isinstance(value, np.ndarray) and take_over(value):
            frozen[name] = value
            continue
        array = np.array(value, dtype=np.float32, copy=True)
        array.flags.writeable = False
        frozen[name] = array
    return frozen


def load_package(directory: str | os.PathLike[str]) -> dict[str, type[CellModel]]:
    """The model classes of a generated package, by cell name (reads `cell.json` and the kernels only)."""
    directory = Path(directory)
    try:
        description = PackageSpec.from_json(json.loads((directory / "cell.json").read_text(encoding="utf-8")))
        return _classes(directory, description)
    except FormatError as err:
        raise CortexcError(
            f"{directory / 'cell.json'} is format {err.found!r}, this runtime reads format "
            f"{FORMAT_VERSION}: compile the package again"
        ) from None
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as err:
        if isinstance(err, CortexcError):
            raise
        raise OutputError(
            f"the package {directory} is damaged ({type(err).__name__}: {err}): compile it again"
        ) from None


def _classes(directory: Path, description: PackageSpec) -> dict[str, type[CellModel]]:
    classes: dict[str, type[CellModel]] = {}
    for spec in description.cells:
        sources = {}
        for target, section in spec.targets.items():
            kernel_path = directory / section.kernel_file
            sources[target] = kernel_path.read_text(encoding="utf-8")
            if hashlib.sha256(sources[target].encode()).hexdigest() != section.kernel_sha256:
                raise CortexcError(
                    f"{kernel_path} does not match {directory / 'cell.json'} (the package was "
                    "changed after it was generated): compile it again"
                )
        signature = spec.signature
        attributes = {
            "_kernel_sources": sources,
            "_package": directory,
            "_description": description,
            "_spec": spec,
            "signature": signature,
            "__doc__": f"The cell {signature.name} of {description.source_file} (compiled by cortexc).",
            "__module__": description.package,
        }
        classes[signature.name] = type(signature.name, (CellModel,), attributes)
    return classes
