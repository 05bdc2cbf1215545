"""The host side of the CUDA target, shared by the GPU (``device="cuda"``) and its CPU emulation
(``device="cuda-emu"``).

Why one class: CI has no GPU, so whatever differs between the two paths goes untested. Here every
transfer goes through the generated library's own ``cx_mem_*`` functions (the CUDA runtime inside the
`.cu`), which the emulator implements too; the executors differ only in how the library is built and,
on a GPU, in PyCUDA making the context and wrapping results as GPUArrays.

Per call, everything the kernels read or write lives in one block of device memory (an *arena*, reused
from call to call): the forest's index arrays, the inputs and the pointer tables are written into one
host staging buffer and go up in one copy; the states, hoisted rows and outputs are zeroed with one
memset; the results come back in one copy. Params and packed weights go up once, in `set_params`.

How the driver launches (`LaunchOptions`) reaches the generated code as a `cx_launch` struct; the C side
never reads the environment. So does the call's CUDA stream (`cx_launch.stream`): the NumPy API uses the
default stream, `cortexc.torch` torch's current one (`run_forward_at`/`run_backward_at`, `upload_packed`).
Every copy, memset and launch of a call is queued on that stream, and the entry points return once it has
run them (`cudaStreamSynchronize`), so the arena goes back to the pool, and the host staging buffer is let
go, only after the stream is done with them (on a failure, after `cx_mem_sync`).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import threading
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from cortexc.errors import CortexcError
from cortexc.runtime.abi import DEVICE_MEMORY_EXPORTS, CxCall, CxGrad, CxLaunch, LaunchOptions, packed_weights
from cortexc.runtime.build import load_library
from cortexc.runtime.linearize import Linearized
from cortexc.runtime.package import CellSpec
from cortexc.runtime.philox import EVAL, Dropout

if TYPE_CHECKING:
    from cortexc.runtime.executor import DeviceArrayCalls, HostArrayCalls

ALIGN = 256  # bytes: every array of an arena starts on a boundary this wide
MIN_BLOCK = 1 << 20  # the smallest block the pool allocates, so small forests share one
CALL_TABLES = ("inputs", "states", "hoisted", "outputs")  # the call's pointer tables besides the params'


def cuda_include_flags() -> tuple[str, ...]:
    """What a build of a generated `.cu` adds to its flags: the folder of the headers it includes
    (`cuda_prelude.cuh`, and `cuda_emu.h` for the emulator), and their hash, so that the build cache
    (keyed by source and flags) never reuses a library built against other headers."""
    folder = Path(__file__).resolve().parent  # this target's folder, wherever it was copied to
    digest = hashlib.sha256()
    for header in ("cuda_prelude.cuh", "cuda_emu.h"):
        digest.update((folder / header).read_bytes())
    return (f"-I{folder}", f"-DCX_HEADERS_SHA256={digest.hexdigest()[:16]}")


def _aligned(nbytes: int) -> int:
    return (max(nbytes, 1) + ALIGN - 1) // ALIGN * ALIGN


def _bytes(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


class Layout:
    """Where the arrays of one call go in its arena, in the order they are placed."""

    def __init__(self) -> None:
        self.offsets: dict[str, int] = {}
        self.nbytes: dict[str, int] = {}
        self.size = 0

    def place(self, key: str, nbytes: int) -> int:
        self.offsets[key] = self.size
        self.nbytes[key] = nbytes
        self.size += _aligned(nbytes)
        return self.offsets[key]

    def span(self, first: str, last: str) -> tuple[int, int]:
        """Offset and length of the bytes from array `first` to the end of array `last`."""
        start = self.offsets[first]
        return start, self.offsets[last] + self.nbytes[last] - start


class DeviceMemory:
    """The library's `cx_mem_*` entry points; a failed call is a `CortexcError` naming the CUDA error."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        missing = [name for name in DEVICE_MEMORY_EXPORTS if not hasattr(lib, name)]
        if missing:
            raise CortexcError(
                f"the CUDA library {getattr(lib, '_name', lib)} lacks {', '.join(missing)}: it was built from a "
                "package of an older cortexc (before calls took a CUDA stream); compile the package again"
            )
        lib.cx_mem_alloc.argtypes = [ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p)]
        lib.cx_mem_free.argtypes = [ctypes.c_void_p]
        stream = ctypes.c_void_p  # a cudaStream_t; None: the default stream
        lib.cx_mem_upload.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, stream]
        lib.cx_mem_zero.argtypes = [ctypes.c_void_p, ctypes.c_int64, stream]
        lib.cx_mem_download.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, stream]
        lib.cx_mem_sync.argtypes = [stream]
        for name in DEVICE_MEMORY_EXPORTS:
            getattr(lib, name).restype = ctypes.c_int

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise CortexcError(f"CUDA {what} failed with cudaError {status}")

    def alloc(self, nbytes: int) -> int:
        pointer = ctypes.c_void_p()
        self._check(self.lib.cx_mem_alloc(nbytes, ctypes.byref(pointer)), f"allocation of {nbytes} bytes")
        return int(pointer.value or 0)

    def free(self, address: int) -> None:
        self._check(self.lib.cx_mem_free(address), "free")

    def upload(self, address: int, host: np.ndarray, stream: int = 0) -> None:
        """Queue a copy up on `stream`: `host` must stay alive and unchanged until the stream is synchronised."""
        if host.nbytes:
            self._check(
                self.lib.cx_mem_upload(address, host.ctypes.data, host.nbytes, stream or None), "copy to the device"
            )

    def zero(self, address: int, nbytes: int, stream: int = 0) -> None:
        if nbytes:
            self._check(self.lib.cx_mem_zero(address, nbytes, stream or None), "memset")

    def download(self, host: np.ndarray, address: int, stream: int = 0) -> None:
        """Copy to the host after what `stream` has queued; returns when the bytes are there."""
        if host.nbytes:
            self._check(
                self.lib.cx_mem_download(host.ctypes.data, address, host.nbytes, stream or None), "copy to the host"
            )

    def sync(self, stream: int = 0) -> None:
        """Wait until `stream` has run everything queued on it."""
        self._check(self.lib.cx_mem_sync(stream or None), "stream synchronisation")


class ArenaPool:
    """Device blocks reused from call to call (cudaMalloc per call would cost more than a small forest's
    whole forward). A block kept by a forward for its backward comes back when that result is dropped.
    Calls from several threads share it (the kernels run without the GIL): a lock guards its lists."""

    def __init__(self, memory: DeviceMemory):
        self.memory = memory
        self.idle: list[tuple[int, int]] = []  # (nbytes, address)
        self.owned: list[int] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> tuple[int, int]:
        with self._lock:
            fitting = [block for block in self.idle if block[0] >= nbytes]
            if fitting:
                block = min(fitting)
                self.idle.remove(block)
                return block
        size = max(_aligned(nbytes), MIN_BLOCK)
        return size, self.allocate(size)

    def allocate(self, nbytes: int) -> int:
        """A block of its own (freed by `release`, or with the pool)."""
        address = self.memory.alloc(nbytes)
        with self._lock:
            self.owned.append(address)
        return address

    def release(self, address: int) -> None:
        """Free a block from `allocate` now (nothing if the pool was closed and freed it already)."""
        with self._lock:
            if address not in self.owned:
                return
            self.owned.remove(address)
        with contextlib.suppress(CortexcError):  # the context may already be gone at interpreter exit
            self.memory.free(address)

    def give_back(self, block: tuple[int, int]) -> None:
        with self._lock:
            self.idle.append(block)

    def close(self) -> None:
        with self._lock:
            owned, self.owned, self.idle = self.owned, [], []
        for address in owned:
            with contextlib.suppress(CortexcError):  # the context may already be gone at interpreter exit
                self.memory.free(address)


class DeviceParams:
    """The params and packed weights on the device: one block, and where each array starts in it.

    Replaced whole by `set_params` (one attribute store), and taken once by each call, which keeps it
    alive: a `load_params` from another thread while a call runs (the kernels run without the GIL)
    neither mixes old and new params in that call nor frees the ones it reads. The block is freed when
    the last holder lets go (the executor, running calls, and forwards kept for a backward, whose
    device-side call struct points at these params)."""

    def __init__(self, pool: ArenaPool, block: int, params: list[int], packed: list[int]):
        self.block = block
        self.params = params
        self.packed = packed
        if block:
            weakref.finalize(self, pool.release, block)


def _layout(
    uploads: Mapping[str, np.ndarray],
    tables: Mapping[str, int],
    struct: tuple[str, int],
    zeroed: Mapping[str, tuple[int, ...]],
) -> tuple[Layout, int]:
    """One call's arena: the uploaded arrays, the pointer tables (their entry counts) and the call's struct
    first (one copy up), then the float32 arrays to zero (one memset); also where the zeroed part starts."""
    layout = Layout()
    for key, array in uploads.items():
        layout.place(key, array.nbytes)
    for table, count in tables.items():
        layout.place(f"table/{table}", 8 * max(count, 1))
    layout.place(*struct)
    uploaded = layout.size
    for key, shape in zeroed.items():
        layout.place(key, 4 * int(np.prod(shape)))
    return layout, uploaded


def _staging(
    layout: Layout,
    uploaded: int,
    uploads: Mapping[str, np.ndarray],
    tables: Mapping[str, list[int]],
    struct: tuple[str, ctypes.Structure],
) -> np.ndarray:
    """The host bytes of the uploaded part of an arena."""
    staging = np.zeros(uploaded, np.uint8)
    pieces = list(uploads.items())
    pieces += [(f"table/{table}", np.array(addresses or [0], np.uint64)) for table, addresses in tables.items()]
    pieces.append((struct[0], np.frombuffer(bytes(struct[1]), np.uint8)))
    for key, array in pieces:
        offset = layout.offsets[key]
        staging[offset : offset + array.nbytes] = _bytes(array)
    return staging


class DeviceSaved:
    """What a forward keeps for its backward: its arena (returned to the pool when this is dropped),
    the `cx_call` over it, and the shapes of what lives there."""

    def __init__(
        self,
        lin: Linearized,
        call: ctypes.Structure,
        device_call: int,
        layout: Layout,
        base: int,
        inputs: dict[str, np.ndarray],
        hoisted_shapes: list[tuple[int, int]],
        params: DeviceParams,
    ):
        self.lin = lin
        self.params = params  # the device call struct points at them: kept alive with it
        self.call = call
        self.device_call = device_call
        self.layout = layout
        self.base = base
        self.input_shapes = {name: array.shape for name, array in inputs.items()}
        self.hoisted_shapes = hoisted_shapes


class DeviceExecutor:
    """Runs one compiled cell's CUDA library. `spec` is the cell's entry of the package's `cell.json`; it
    reads the CUDA target's section (`TARGET`). `launch` fixes the launch options (else they come from the
    environment, read once per call)."""

    TARGET = "cuda"

    #: the calls on caller-allocated arrays (`run_forward_at`/`run_backward_at`) take device addresses
    on_device: Literal[True] = True

    def __init__(self, spec: CellSpec, library_path: Path, launch: LaunchOptions | None = None):
        self.spec = spec
        self.section = spec.target(self.TARGET)
        self.launch = launch
        self.lib = load_library(library_path)
        launch_arg = ctypes.POINTER(CxLaunch)
        self.lib.cx_forward.argtypes = [ctypes.POINTER(CxCall), ctypes.c_void_p, ctypes.c_void_p, launch_arg]
        self.lib.cx_forward.restype = ctypes.c_int
        if hasattr(self.lib, "cx_backward"):
            self.lib.cx_backward.argtypes = [
                ctypes.POINTER(CxCall),
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_int64,
                launch_arg,
            ]
            self.lib.cx_backward.restype = ctypes.c_int
        self.memory = DeviceMemory(self.lib)
        self.pool = ArenaPool(self.memory)
        self._params = DeviceParams(self.pool, 0, [], [])
        weakref.finalize(self, ArenaPool.close, self.pool)

    def array_calls(self) -> HostArrayCalls | DeviceArrayCalls | None:
        """Itself: `run_forward_at`/`run_backward_at` on device addresses, with `upload_packed`
        (`executor.DeviceArrayCalls`)."""
        return self

    def _launch_struct(self, stream: int = 0) -> ctypes.Structure:
        """Explicit options, else the package's (its compile options) with the environment's changes; and
        the call's stream."""
        if self.launch is not None:
            return self.launch.struct(stream)
        return LaunchOptions.from_environment(default=self.spec.launch).struct(stream)

    # --- params ----------------------------------------------------------------
    def set_params(self, params: Mapping[str, np.ndarray]) -> None:
        """Upload the params and their packed GEMM weights, in one copy, once, into a new block; calls that
        began before keep the old one (`DeviceParams`)."""
        names = self.spec.abi.params
        arrays = [np.ascontiguousarray(params[name], np.float32) for name in names]
        self._params = self._upload(arrays, packed_weights(self.lib, self.section.packed, params))

    def upload_packed(self, params: Mapping[str, np.ndarray], stream: int = 0) -> DeviceParams:
        """The packed GEMM weights of these (host) params in a block of their own, for callers that keep
        the params themselves on the device (`cortexc.torch`: torch's CUDA tensors) and pass them per call;
        copied on `stream` (the calls' stream, which orders the copy before their kernels) and waited for."""
        return self._upload([], packed_weights(self.lib, self.section.packed, params), stream)

    def _upload(self, params: list[np.ndarray], packed: list[np.ndarray], stream: int = 0) -> DeviceParams:
        """Params and packed weights in one new block, in one copy (done when this returns: the staging
        buffer is a local)."""
        arrays = params + packed
        layout = Layout()
        for index, array in enumerate(arrays):
            layout.place(str(index), array.nbytes)
        staging = np.zeros(layout.size, np.uint8)
        for index, array in enumerate(arrays):
            offset = layout.offsets[str(index)]
            staging[offset : offset + array.nbytes] = _bytes(array)
        block = self.pool.allocate(layout.size)
        try:
            self.memory.upload(block, staging, stream)
            self.memory.sync(stream)
        except BaseException:
            self.pool.release(block)  # cudaFree waits for the device
            raise
        addresses = [block + layout.offsets[str(i)] for i in range(len(arrays))]
        return DeviceParams(self.pool, block, addresses[: len(params)], addresses[len(params) :])

    # --- forward -----------------------------------------------------------------
    def forward(
        self,
        lin: Linearized,
        inputs: Mapping[str, np.ndarray],
        keep: bool = False,
        host: bool = True,
        dropout: Dropout = EVAL,
    ) -> tuple[dict[str, Any], DeviceSaved | None]:
        abi, n = self.spec.abi, lin.num_nodes
        device_params = self._params  # once: a concurrent set_params neither mixes nor frees them
        uploads = {
            field: getattr(lin, field) for field in ("level_order", "level_ptr", "edge_ptr", "edge_child", "roots")
        }
        uploads |= {f"input/{name}": np.ascontiguousarray(inputs[name]) for name in abi.inputs}
        shapes: dict[str, tuple[int, ...]] = {}
        for name, state in zip(abi.states, self.spec.signature.states):
            # row n: zeros, what a missing child reads (a graph cell's inference: its two steps' rows, then that)
            shapes[f"state/{name}"] = (lin.state_rows + 1, *state.shape)
        for name, out in zip(abi.outputs, self.spec.signature.outputs):
            shapes[f"output/{name}"] = (len(lin.roots) if out.at_root else n, *out.shape)
        internal = max(n - lin.num_leaves, 1)
        hoisted_shapes = [(internal, width) for width in self.spec.hoisted_widths]
        for name, shape in zip(abi.hoisted, hoisted_shapes):
            shapes[f"hoisted/{name}"] = shape
        arena_tables = {  # the pointer tables that list arrays of this arena
            "inputs": [f"input/{name}" for name in abi.inputs],
            "states": [f"state/{name}" for name in abi.states],
            "hoisted": [f"hoisted/{name}" for name in abi.hoisted],
            "outputs": [f"output/{name}" for name in abi.outputs],
        }
        counts = {"params": len(device_params.params), "packed": len(device_params.packed)}
        counts |= {table: len(keys) for table, keys in arena_tables.items()}
        # states, then outputs, then hoisted rows: the results are one span
        layout, uploaded = _layout(uploads, counts, ("call", ctypes.sizeof(CxCall)), shapes)

        size, base = self.pool.take(layout.size)
        try:

            def at(key: str) -> int:
                return base + layout.offsets[key]

            addresses = {"params": device_params.params, "packed": device_params.packed}
            addresses |= {table: [at(key) for key in keys] for table, keys in arena_tables.items()}
            call = CxCall(
                num_nodes=n,
                num_levels=lin.num_levels,
                max_children=lin.max_children,
                num_roots=len(lin.roots),
                step_nodes=lin.step_nodes,
                state_rows=lin.state_rows,
                **{field: at(field) for field in uploads if "/" not in field},
                **{table: at(f"table/{table}") for table in counts},
                dropout_seed=dropout.seed,  # the backward reuses this call: it replays the masks
                dropout_train=int(dropout.train),
            )
            staging = _staging(layout, uploaded, uploads, addresses, ("call", call))  # kept: see `upload`
            self.memory.upload(base, staging)
            self.memory.zero(base + uploaded, layout.size - uploaded)
            launch = self._launch_struct()
            forward = self.lib.cx_forward
            if n and (
                status := forward(ctypes.byref(call), at("call"), lin.level_ptr.ctypes.data, ctypes.byref(launch))
            ):
                raise CortexcError(f"the CUDA forward failed with cudaError {status}")

            # a state's first n rows (row n is the zero row missing children read)
            result_shapes = {
                key: (lin.state_rows, *shape[1:]) if key.startswith("state/") else shape
                for key, shape in shapes.items()
                if not key.startswith("hoisted/")
            }
            if host:
                result = self._download(layout, base, result_shapes)
            else:
                result = self._on_device({key: (at(key), shape) for key, shape in result_shapes.items()})
            result = {key.split("/", 1)[1]: value for key, value in result.items()}
        except BaseException:
            self._quiesce()  # a failed call may leave its copies queued: the block waits for them
            self.pool.give_back((size, base))
            raise
        if not keep:
            self.pool.give_back((size, base))
            return result, None
        kept_inputs = {name: uploads[f"input/{name}"] for name in abi.inputs}
        saved = DeviceSaved(lin, call, at("call"), layout, base, kept_inputs, hoisted_shapes, device_params)
        weakref.finalize(saved, self.pool.give_back, (size, base))
        return result, saved

    # --- calls on caller-allocated device arrays (cortexc.torch) ------------------------------------
    def run_forward_at(
        self,
        lin: Linearized,
        packed: DeviceParams,
        arrays: Mapping[str, list[int]],
        dropout: Dropout = EVAL,
        stream: int = 0,
    ) -> None:
        """The forward into device arrays the caller allocated, given by address in the ABI's orders:
        `arrays` maps "params", "inputs", "states" (N + 1 rows, zeroed), "hoisted" and "outputs" to
        addresses; `packed` from `upload_packed`; `dropout` the call's mode. Only the forest, the pointer
        tables and the call go up (one copy, into a pooled arena); nothing comes back. Everything runs on
        `stream` (a cudaStream_t; 0: the default stream), after the work already queued there, and is done
        when this returns."""
        if not lin.num_nodes:
            return
        call, layout, base, block, staging = self._call_arena(lin, packed, arrays, None, dropout, stream)
        status = self.lib.cx_forward(
            ctypes.byref(call),
            base + layout.offsets["call"],
            lin.level_ptr.ctypes.data,
            ctypes.byref(self._launch_struct(stream)),
        )
        self._finish(block, staging, stream, status, "forward")

    def run_backward_at(
        self,
        lin: Linearized,
        packed: DeviceParams,
        arrays: Mapping[str, list[int]],
        grads: Mapping[str, list[int]],
        dropout: Dropout = EVAL,
        stream: int = 0,
    ) -> None:
        """The backward into caller-allocated device arrays (`dropout`: the forward's mode, whose masks it
        recomputes): `arrays` as for `run_forward_at` (the forward's
        states and hoisted rows; "outputs" may be empty), `grads` maps "d_params", "d_inputs" (0 for an
        index input), "d_states" (holding the states' upstream gradients), "d_hoisted", "upstream" (0
        for an output without one) and "deferred" (zeroed, `deferred_shapes`) to addresses; `stream` as
        for `run_forward_at`."""
        if not lin.num_nodes:
            return
        call, layout, base, block, staging = self._call_arena(lin, packed, arrays, grads, dropout, stream)
        mask = sum(1 << index for index, address in enumerate(grads["upstream"]) if address)
        status = self.lib.cx_backward(
            ctypes.byref(call),
            base + layout.offsets["call"],
            base + layout.offsets["grad"],
            lin.level_ptr.ctypes.data,
            mask,
            ctypes.byref(self._launch_struct(stream)),
        )
        self._finish(block, staging, stream, status, "backward")

    def _quiesce(self, stream: int = 0) -> None:
        """Wait for `stream` after a failure, so that its arena can go back to the pool (a sync error is
        not the one to report)."""
        with contextlib.suppress(CortexcError):
            self.memory.sync(stream)

    def _finish(self, block: tuple[int, int], staging: np.ndarray, stream: int, status: int, what: str) -> None:
        """After an entry point: its arena back to the pool and its host staging buffer let go, only once
        `stream` is done with them. A successful entry point synchronised the stream itself; after a failure
        it is synchronised here (a launch error leaves the upload, or earlier kernels, maybe in flight)."""
        try:
            if status:
                self._quiesce(stream)
                raise CortexcError(f"the CUDA {what} failed with cudaError {status}")
        finally:
            self.pool.give_back(block)
            del staging  # held until here: the copy up read it

    def deferred_shapes(self, lin: Linearized) -> list[tuple[int, int]]:
        """The shapes of the deferred weight gradients' factor rows a backward needs (one per node, or per
        child edge)."""
        edges = int(lin.edge_ptr[-1]) if len(lin.edge_ptr) else 0
        return [
            (max(edges if term.rows == "child" else lin.num_nodes, 1), term.m + term.k)
            for term in self.section.deferred
        ]

    def _call_arena(
        self,
        lin: Linearized,
        packed: DeviceParams,
        arrays: Mapping[str, list[int]],
        grads: Mapping[str, list[int]] | None,
        dropout: Dropout,
        stream: int,
    ) -> tuple[ctypes.Structure, Layout, int, tuple[int, int], np.ndarray]:
        """An arena holding the forest, the pointer tables of `arrays` (and `grads`), the `cx_call` (and
        `cx_grad`) over them, their copy up queued on `stream`: the host call struct, the layout, its base,
        its block and the host staging buffer (which the caller keeps until the stream has run the copy)."""
        uploads = {f: getattr(lin, f) for f in ("level_order", "level_ptr", "edge_ptr", "edge_child", "roots")}
        tables = {"params": list(arrays["params"]), "packed": packed.packed}
        tables |= {name: list(arrays[name]) for name in CALL_TABLES}
        grad_tables = ("d_params", "d_inputs", "d_states", "d_hoisted", "upstream", "deferred")
        if grads is not None:
            tables |= {f"grad/{name}": list(grads[name]) for name in grad_tables}
        layout = Layout()
        for key, array in uploads.items():
            layout.place(key, array.nbytes)
        for table, addresses in tables.items():
            layout.place(f"table/{table}", 8 * max(len(addresses), 1))
        layout.place("call", ctypes.sizeof(CxCall))
        if grads is not None:
            layout.place("grad", ctypes.sizeof(CxGrad))
        block = self.pool.take(layout.size)
        base = block[1]
        try:
            call = CxCall(
                num_nodes=lin.num_nodes,
                num_levels=lin.num_levels,
                max_children=lin.max_children,
                num_roots=len(lin.roots),
                step_nodes=lin.step_nodes,
                state_rows=lin.state_rows,
                **{field: base + layout.offsets[field] for field in uploads},
                **{t: base + layout.offsets[f"table/{t}"] for t in ("params", "packed", *CALL_TABLES)},
                dropout_seed=dropout.seed,
                dropout_train=int(dropout.train),
            )
            pieces = list(uploads.items())
            pieces += [(f"table/{t}", np.array(addresses or [0], np.uint64)) for t, addresses in tables.items()]
            pieces.append(("call", np.frombuffer(bytes(call), np.uint8)))
            if grads is not None:
                grad = CxGrad(*(base + layout.offsets[f"table/grad/{name}"] for name in grad_tables))
                pieces.append(("grad", np.frombuffer(bytes(grad), np.uint8)))
            staging = np.zeros(layout.size, np.uint8)
            for key, array in pieces:
                offset = layout.offsets[key]
                staging[offset : offset + array.nbytes] = _bytes(array)
            self.memory.upload(base, staging, stream)
        except BaseException:
            self._quiesce(stream)
            self.pool.give_back(block)
            raise
        return call, layout, base, block, staging

    def _download(self, layout: Layout, base: int, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
        """The arrays `shapes` names (consecutive in the arena; each may be a leading part of its place) in
        one copy to the host."""
        if not shapes:
            return {}
        keys = list(shapes)
        start, length = layout.span(keys[0], keys[-1])
        buffer = np.empty(length, np.uint8)
        self.memory.download(buffer, base + start)
        arrays = {}
        for key, shape in shapes.items():
            offset = layout.offsets[key] - start
            nbytes = 4 * int(np.prod(shape))
            arrays[key] = buffer[offset : offset + nbytes].view(np.float32).reshape(shape)
        return arrays

    def _on_device(self, where: Mapping[str, tuple[int, tuple[int, ...]]]) -> dict[str, Any]:
        """Results left on the device (``host=False``); here (no GPU arrays to give) the host copies."""
        arrays = {}
        for key, (address, shape) in where.items():
            host = np.empty(shape, np.float32)
            self.memory.download(host, address)
            arrays[key] = host
        return arrays

    # --- backward ----------------------------------------------------------------
    def backward(
        self, saved: DeviceSaved, upstream: Mapping[str, np.ndarray], param_shapes: Mapping[str, tuple[int, ...]]
    ) -> dict[str, np.ndarray]:
        abi, lin = self.spec.abi, saved.lin
        n = lin.num_nodes
        index_inputs = {i.name for i in self.spec.signature.inputs if i.is_index}
        float_inputs = [name for name in abi.inputs if name not in index_inputs]

        uploads: dict[str, np.ndarray] = {}
        for name, state in zip(abi.states, self.spec.signature.states):
            d_state = np.zeros((n + 1, *state.shape), np.float32)
            if name in upstream:
                d_state[:n] = upstream[name]
            uploads[f"d_state/{name}"] = d_state
        for name in abi.outputs:
            if name in upstream:
                uploads[f"upstream/{name}"] = np.ascontiguousarray(upstream[name], np.float32)
        zeroed = {f"d_param/{name}": tuple(param_shapes[name]) for name in abi.params}
        zeroed |= {f"d_input/{name}": saved.input_shapes[name] for name in float_inputs}
        zeroed |= {f"d_hoisted/{name}": shape for name, shape in zip(abi.hoisted, saved.hoisted_shapes)}
        # the deferred weight gradients' factor rows: one per node position, or per child edge
        edges = int(lin.edge_ptr[-1]) if len(lin.edge_ptr) else 0
        for index, term in enumerate(self.section.deferred):
            rows = max(edges if term.rows == "child" else n, 1)
            zeroed[f"deferred/{index}"] = (rows, term.m + term.k)
        tables: dict[str, list[str | None]] = {
            "d_params": [f"d_param/{name}" for name in abi.params],
            "d_inputs": [None if name in index_inputs else f"d_input/{name}" for name in abi.inputs],
            "d_states": [f"d_state/{name}" for name in abi.states],
            "d_hoisted": [f"d_hoisted/{name}" for name in abi.hoisted],
            "upstream": [f"upstream/{name}" if name in upstream else None for name in abi.outputs],
            "deferred": [f"deferred/{index}" for index in range(len(self.section.deferred))],
        }

        # d_params, then d_inputs: the results are one span
        layout, uploaded = _layout(
            uploads, {table: len(keys) for table, keys in tables.items()}, ("grad", ctypes.sizeof(CxGrad)), zeroed
        )

        size, base = self.pool.take(layout.size)
        try:
            addresses = {
                table: [0 if key is None else base + layout.offsets[key] for key in keys]
                for table, keys in tables.items()
            }
            grad = CxGrad(*(base + layout.offsets[f"table/{table}"] for table in tables))
            staging = _staging(layout, uploaded, uploads, addresses, ("grad", grad))  # kept: see `upload`
            self.memory.upload(base, staging)
            self.memory.zero(base + uploaded, layout.size - uploaded)
            mask = sum(1 << index for index, name in enumerate(abi.outputs) if name in upstream)
            if (
                n
                and (
                    status := self.lib.cx_backward(
                        ctypes.byref(saved.call),
                        saved.device_call,
                        base + layout.offsets["grad"],
                        lin.level_ptr.ctypes.data,
                        mask,
                        ctypes.byref(self._launch_struct()),
                    )
                )
                != 0
            ):
                raise CortexcError(f"the CUDA backward failed with cudaError {status}")
            arrays = self._download(
                layout, base, {key: shape for key, shape in zeroed.items() if key.startswith(("d_param/", "d_input/"))}
            )
        except BaseException:
            self._quiesce()
            raise
        finally:
            self.pool.give_back((size, base))
        return {key.split("/", 1)[1]: array for key, array in arrays.items()}
