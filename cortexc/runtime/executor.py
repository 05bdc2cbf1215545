"""The `Executor` protocol: what a backend's runner offers the model classes.

An executor runs one compiled cell of a package. It owns no model knowledge:
everything it needs (the ABI, the packed weights' layout, result shapes) is
the cell's entry of the package's `cell.json`.

Besides the NumPy API's calls (`set_params`, `forward`, `backward`: the executor
allocates the results), an executor may offer calls on arrays its caller
allocated, with the params passed per call (`array_calls`): what `cortexc.torch`
drives, zero copy, on torch's tensors. They come in two kinds, told apart by
`on_device`: `HostArrayCalls` on host NumPy arrays (the CPU executor), and
`DeviceArrayCalls` on device addresses (the CUDA host path, on a GPU or emulated).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from cortexc.runtime.package import CellSpec
from cortexc.runtime.philox import EVAL, Dropout

if TYPE_CHECKING:
    from cortexc.runtime.linearize import Linearized
    from cortexc.runtime.package import TargetSpec
    from cortexc.targets.cuda.host import DeviceParams


class Executor(Protocol):
    def set_params(self, params: Mapping[str, np.ndarray]) -> None:
        """Take (a full set of) params; weights are packed here, once, not per call."""
        ...

    def forward(
        self,
        lin: Any,
        inputs: Mapping[str, np.ndarray],
        keep: bool = False,
        host: bool = True,
        dropout: Dropout = EVAL,
    ) -> tuple[dict[str, Any], Any]:
        """States and outputs of a linearized forest for validated inputs, in `dropout`'s mode; with ``keep``,
        also what `backward` needs (else None; it replays the forward's dropout masks)."""
        ...

    def backward(
        self, saved: Any, upstream: Mapping[str, np.ndarray], param_shapes: Mapping[str, tuple[int, ...]]
    ) -> dict[str, np.ndarray]:
        """Gradients of every param and float input, from what `forward` kept and upstream gradients."""
        ...

    def array_calls(self) -> HostArrayCalls | DeviceArrayCalls | None:
        """This executor's calls on caller-allocated arrays (itself, typed as one of the two kinds; its
        `on_device` says which), or None where it has none (the interpreter)."""
        ...


class HostArrayCalls(Protocol):
    """Calls on host arrays the caller allocated, in the ABI's orders and shapes (the CPU executor's):
    the params are passed per call, the packed GEMM weights kept by the executor (`repack`)."""

    #: the arrays are host NumPy arrays (the discriminator against `DeviceArrayCalls`)
    on_device: Literal[False]
    #: the executor's target's section of the cell's `cell.json` entry (packed weights, folds, saved arrays)
    section: TargetSpec

    @property
    def weights(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The params and packed weights of the last `set_params`/`repack`, as one value."""
        ...

    def repack(self, params: Mapping[str, np.ndarray]) -> None:
        """Pack the GEMM weights again from these params (those the calls then run with by default)."""
        ...

    def folded_tables(
        self, weights: tuple[list[np.ndarray], list[np.ndarray]], rows: int = 0
    ) -> list[np.ndarray | None] | None:
        """The folded look-up projections of these weights for an inference of `rows` nodes, once built; or None."""
        ...

    def forget_folded(self) -> None:
        """Drop the folded tables; the next inferences count rows again before a build."""
        ...

    def run_forward(
        self,
        lin: Linearized,
        params: Sequence[np.ndarray],
        inputs: Sequence[np.ndarray],
        states: Sequence[np.ndarray],
        hoisted: Sequence[np.ndarray],
        outputs: Sequence[np.ndarray],
        packed: Sequence[np.ndarray] | None = None,
        dropout: Dropout = EVAL,
        folded: Sequence[np.ndarray | None] | None = None,
        activations: Sequence[np.ndarray] | None = None,
    ) -> None:
        """The forward into the caller's arrays (states with N + 1 rows, the last zero)."""
        ...

    def run_backward(
        self,
        lin: Linearized,
        params: Sequence[np.ndarray],
        inputs: Sequence[np.ndarray],
        states: Sequence[np.ndarray],
        hoisted: Sequence[np.ndarray],
        grads: Sequence[Sequence[np.ndarray | None]],
        packed: Sequence[np.ndarray] | None = None,
        dropout: Dropout = EVAL,
        activations: Sequence[np.ndarray] | None = None,
    ) -> None:
        """The backward into the caller's zeroed gradient arrays (d_params, d_inputs, d_states, d_hoisted,
        upstream outputs)."""
        ...


class DeviceArrayCalls(Protocol):
    """Calls on device arrays the caller allocated, given by address in the ABI's orders (the CUDA host
    path's): the params are passed per call, their packed GEMM weights uploaded by the caller's request
    (`upload_packed`); every call runs on the caller's CUDA stream and is done when it returns."""

    #: the arrays are device addresses (the discriminator against `HostArrayCalls`)
    on_device: Literal[True]
    #: the executor's target's section of the cell's `cell.json` entry (packed weights, deferred terms)
    section: TargetSpec

    def upload_packed(self, params: Mapping[str, np.ndarray], stream: int = 0) -> DeviceParams:
        """The packed GEMM weights of these host params on the device, uploaded on `stream`."""
        ...

    def deferred_shapes(self, lin: Linearized) -> list[tuple[int, int]]:
        """The shapes of the deferred weight gradients' factor rows a backward needs (the caller zeroes them)."""
        ...

    def run_forward_at(
        self,
        lin: Linearized,
        packed: DeviceParams,
        arrays: Mapping[str, list[int]],
        dropout: Dropout = EVAL,
        stream: int = 0,
    ) -> None:
        """The forward into device arrays: "params", "inputs", "states", "hoisted", "outputs" -> addresses."""
        ...

    def run_backward_at(
        self,
        lin: Linearized,
        packed: DeviceParams,
        arrays: Mapping[str, list[int]],
        grads: Mapping[str, list[int]],
        dropout: Dropout = EVAL,
        stream: int = 0,
    ) -> None:
        """The backward into device arrays (`arrays` as for `run_forward_at`, `grads` the gradient tables)."""
        ...


@dataclass(frozen=True)
class ExecutorRequest:
    """What a factory gets: the cell's `cell.json` entry, its kernel source for the backend's target
    (already checked against its hash; empty for the interpreter), where that source lives, a name for
    build caches, and a way to get the cell's IR (it compiles the source: only the interpreter asks).
    `arch`: the GPU's compute capability, where the caller knows it and keeps the arrays itself
    (`cortexc.torch`: torch's CUDA device); the cuda backend then builds for it and needs no PyCUDA."""

    spec: CellSpec
    source: str
    source_path: Path
    name: str
    compile_ir: Callable[[], Any]
    arch: tuple[int, int] | None = None


@dataclass(frozen=True)
class Backend:
    """One device: the kernel target it runs and how to make its executor (`cortexc.runtime.backends`)."""

    device: str  # what users pass as `device=`
    target: str | None  # the kernel source it runs (a `cortexc.targets.NAMES` name); None: the IR
    make_executor: Callable[[ExecutorRequest], Executor]
    summary: str
    #: the torch device type whose tensors `cortexc.torch` runs through this backend (its array calls):
    #: ``"cpu"`` or ``"cuda"``; None where it has no array calls (the interpreter). For a device type, the
    #: first such backend of the table is the default; the others are `CellModule.use_backend`'s choices
    tensors: str | None = None
