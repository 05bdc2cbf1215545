"""The runners: a cell's executor on one backend, and how an op finds the runner of its key.

A runner (`_Runner`) holds what the ops read of its cell's `cell.json` entry (orders and shapes) and what
it derived from the params: the GEMM weights, packed again only when a packed param's version counter or
storage changed (an optimizer step), once per step, and (on the CPU) the folded look-up projections
(`cortexc.passes.fold`) of the current params. It drives its executor only through the `Executor`
protocol's calls on caller-allocated arrays (`Executor.array_calls`): `HostArrayCalls` on NumPy views of
torch's CPU tensors, or `DeviceArrayCalls` on the addresses of its CUDA tensors (or, for ``cuda-emu``,
of its CPU tensors). The CUDA executor comes from the backend table, built for torch's device's arch.

An op names its cell by key (`keys`) and finds its runner by that key and the params it is given
(`runner_for`): the runner of the module that owns those params (`own`: a `CellModule` keeps one runner per
key and device, with its packed weights and folded tables), else the process's shared runner of the key,
made on first use from the cell class the key names (loaded from the build cache if need be): for a
program loaded by `torch.export.load` or `aoti_load_package`, opcheck's copies, any params no module owns.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeAlias

import numpy as np
import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from cortexc.errors import CortexcError
from cortexc.runtime.backends import BACKENDS, backends_for
from cortexc.torch.keys import class_of, parse_key

if TYPE_CHECKING:
    from cortexc.runtime.executor import DeviceArrayCalls, HostArrayCalls
    from cortexc.runtime.model import CellModel
    from cortexc.targets.cuda.host import DeviceParams


class _Runner:
    """A cell's executor on one backend (``cpu``, ``cuda``, ``cuda-emu``), a module's own or a key's shared
    one, and what the ops read from its `cell.json` entry (orders and shapes)."""

    def __init__(self, cls: type[CellModel], backend: str | None = None, device_index: int | None = None):
        self.backend = backend = backend or backends_for("cpu")[0]
        self.device_index = device_index
        #: its executor runs on torch's CUDA tensors (a GPU), not on CPU ones (`Backend.tensors`)
        self.on_gpu = BACKENDS[backend].tensors == "cuda"
        arch = None
        if self.on_gpu:  # torch's arch and context: no PyCUDA
            major, minor = torch.cuda.get_device_capability(device_index)
            arch = (major, minor)
        # the executor's calls on the arrays torch allocates: on host arrays (cpu) or device addresses (cuda*)
        executor = cls.make_executor(backend, arch=arch).array_calls()
        if executor is None:  # pragma: no cover - the backend table
            raise CortexcError(f"cortexc.torch cannot drive the {backend} executor")
        self.executor: HostArrayCalls | DeviceArrayCalls = executor
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
        folds = () if executor.on_device else section.folds
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
        self.saved_rows = [] if executor.on_device else [(v.width, v.internal) for v in section.saved]
        self.repacks = 0  # how often the weights were packed (tests: only when a param changed)

    def prepare(self, params: Sequence[Tensor], stream: int = 0) -> None:
        """Pack the GEMM weights again if a packed param changed since the last call: its version
        counter (bumped by every in-place update, `torch.optim` steps included) or its storage. A device
        runner uploads them on `stream`, the call's."""
        executor = self.executor
        key = tuple((params[i]._version, params[i].data_ptr()) for i in self.packed_positions)
        if key != self._packed_key or (self.packed is None and executor.on_device):
            arrays = {self.params[i]: _view(params[i].detach().cpu()) for i in self.packed_positions}
            if executor.on_device:  # packed on the host, uploaded (a copy down first)
                self.packed = executor.upload_packed(arrays, stream)
            else:
                executor.repack(arrays)
            self._packed_key = key
            self.repacks += 1

    def folded(
        self, params: Sequence[Tensor], rows: int
    ) -> tuple[tuple[list[np.ndarray], list[np.ndarray]], list[np.ndarray | None] | None]:
        """The weights an inference of `rows` nodes runs with (views of `params`, the packed weights of the
        last `prepare`) and the folded tables built from them (`HostArrayCalls.folded_tables`: once the
        inferences since a change have run as many nodes as the tables have rows), or None. A change of
        any param a fold reads (its version counter or its storage, as for the packed weights) or a repack
        makes a new weights value, so the executor drops the old tables and counts again."""
        executor = self.executor
        assert not executor.on_device  # the ops fold on a host runner only
        packed = executor.weights[1]
        key = tuple((params[i]._version, params[i].data_ptr()) for i in self.fold_positions)
        weights = self._fold_weights
        if weights is None or key != self._fold_key or weights[1] is not packed:
            weights = ([_view(p) for p in params], packed)
            self._fold_weights, self._fold_key = weights, key
        return weights, executor.folded_tables(weights, rows)

    def forget_params(self) -> None:
        """Drop what was derived from the params (packed weights' key, folded tables): the next call
        packs and counts again (`CellModule.params_changed`, `.to()`)."""
        self._packed_key = None
        self._fold_key = self._fold_weights = None
        executor = self.executor
        if not executor.on_device:
            executor.forget_folded()

    def stream(self) -> int:
        """The cudaStream_t a call goes on: torch's current stream on the runner's GPU (so the kernels run
        after the work torch queued there, its zeroed results included, as any torch op would); 0, the
        default stream, for the emulator's CPU tensors."""
        if not self.on_gpu:
            return 0
        return int(torch.cuda.current_stream(self.device_index).cuda_stream)


#: (key, device index) -> runner: the runners of one module (`CellModule._runners`), or the shared ones
Runners: TypeAlias = dict[tuple[str, int | None], _Runner]

#: param tensor -> its module's runners, by identity, weakly (an entry goes with its param, not its module)
_OWNED: WeakIdKeyDictionary = WeakIdKeyDictionary()
#: the process's own runner per (key, device index), for params no module owns
_SHARED: Runners = {}
_SHARED_LOCK = threading.Lock()


def own(params: Sequence[Tensor], runners: Runners) -> None:
    """Say that ops given these params run on `runners` (a module's, keyed by (key, device index)), so that a
    module's calls keep their packed weights and folded tables however the op is reached (eagerly, from a
    compiled or exported graph holding the module's params, from autograd's saved tensors)."""
    for param in params:
        if _OWNED.get(param) is not runners:
            _OWNED[param] = runners


def runner_for(key: str, params: Sequence[Tensor], index: int | None) -> _Runner:
    """The runner an op of `key` on GPU `index` (None off a GPU) runs `params` on: their module's, else the
    process's shared one (made now from the key's cell class: an `OutputError` if it is nowhere)."""
    for param in params:
        runners = _OWNED.get(param)
        if runners is not None:
            runner = runners.get((key, index))
            if runner is not None:
                return runner
    runner = _SHARED.get((key, index))
    if runner is None:
        backend = parse_key(key).backend
        cls = class_of(key)
        with _SHARED_LOCK:
            runner = _SHARED.get((key, index))
            if runner is None:
                runner = _SHARED[(key, index)] = _Runner(cls, backend, index)
    return runner


def device_index(tensor: Tensor) -> int | None:
    """The GPU a tensor is on (None for any other device): with the key, which runner an op takes."""
    return tensor.device.index if tensor.device.type == "cuda" else None


def _view(tensor: Tensor) -> np.ndarray:
    """A float32 C-contiguous NumPy view of a CPU tensor (a copy only if it is not one already)."""
    return np.ascontiguousarray(tensor.detach().numpy(), dtype=np.float32)
