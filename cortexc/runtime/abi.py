"""The kernel ABI, written once: the structs the executors fill and the generated code reads.

Each struct is an ordered tuple of `Field`s. The executors build their ctypes structures from it and
the code generator renders the C typedefs from it (`c_typedef`), so the two sides cannot drift apart.
This module is part of the runtime and imports nothing from the compiler; the compiler imports it.
Also here: the one host routine that packs the GEMM weights (`packed_weights`), used by every executor.
"""

from __future__ import annotations

import ctypes
import enum
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from cortexc.errors import CortexcError

if TYPE_CHECKING:
    from cortexc.runtime.package import PackedWeight


@dataclass(frozen=True)
class Field:
    """One member of an ABI struct: its name, its C type (a 64-bit integer or a pointer) and what it holds."""

    name: str
    c_type: str
    doc: str = ""

    @property
    def ctype(self) -> Any:
        """The ctypes type of the member: int64 for `int64_t`, uint64 for `uint64_t`, an address for every pointer."""
        if self.c_type == "int64_t":
            return ctypes.c_int64
        if self.c_type == "uint64_t":
            return ctypes.c_uint64
        if self.c_type.endswith("*"):
            return ctypes.c_void_p
        raise ValueError(f"ABI field {self.name}: no ctypes type for C type {self.c_type!r}")


#: `cx_call`: the forest, and tables of pointers (params, packed weights, inputs, states, hoisted rows,
#: outputs) in the order the generated module's JSON names under "abi"
CALL_FIELDS: tuple[Field, ...] = (
    Field("num_nodes", "int64_t", "N; every state array has N + 1 rows, the last all zeros"),
    Field("num_levels", "int64_t"),
    Field("max_children", "int64_t"),
    Field("num_roots", "int64_t"),
    Field("level_order", "const int64_t *", "node ids by level, children's levels first"),
    Field("level_ptr", "const int64_t *", "[num_levels + 1] offsets into level_order"),
    Field("edge_ptr", "const int64_t *", "[N + 1] by level-order position: its children in edge_child"),
    Field("edge_child", "const int64_t *", "child node ids, child 0 first"),
    Field("roots", "const int64_t *"),
    Field("params", "float *const *"),
    Field("packed", "const float *const *"),
    Field("inputs", "const void *const *"),
    Field("states", "float *const *"),
    Field("hoisted", "float *const *"),
    Field("outputs", "float *const *"),
    Field("dropout_seed", "uint64_t", "the masks' Philox key (seed mod 2^32, seed div 2^32)"),
    Field("dropout_train", "int64_t", "1: training mode (dropout masks); 0: dropout(e, p) is e"),
    Field("folded", "const float *const *", 'NULL, or per fold (JSON "folds") its table or NULL (run the GEMM)'),
    Field("hoisted_rows", "int64_t", "rows of each hoisted array: 0: one per internal node; fewer: a window (C)"),
    Field("hoisted_first", "int64_t", "the internal node (position - level_ptr[1]) of hoisted row 0 (0 but in C)"),
    Field("saved", "float *const *", 'NULL, or per saved array (JSON "saved") its [N, width] rows: a training forward'),
    Field(
        "direct", "int64_t", "an inference's node kernel: 0 by the level widths (cx_direct), 1 hoisted, 2 direct (C)"
    ),
    Field("step_nodes", "int64_t", "a graph cell's nodes per unrolled step, else 0"),
    Field("state_rows", "int64_t", "the states' rows node ids address: N, or 2 steps' (a graph cell's inference)"),
)

#: `cx_grad`: the gradient arrays of a backward call
GRAD_FIELDS: tuple[Field, ...] = (
    Field("d_params", "float *const *", "zeroed; embedding rows and accumulated weight gradients land here"),
    Field("d_inputs", "float *const *", "float inputs: [N, X] zeroed; NULL for index inputs"),
    Field("d_states", "float *const *", "[N + 1] rows, the upstream gradients of the states (row N: a sink)"),
    Field("d_hoisted", "float *const *", "[internal nodes] rows"),
    Field("upstream", "const float *const *", "per output: its upstream gradient, or NULL"),
    Field("deferred", "float *const *", "per deferred weight gradient, its factors' rows (see driver)"),
    Field("narrow_rows", "int64_t", "C: launches of fewer rows keep narrow terms' rows (0: CX_NARROW_ROWS; 1: none)"),
)

#: `cx_launch`: how the CUDA driver launches (see `LaunchOptions` below), and on which stream
LAUNCH_FIELDS: tuple[Field, ...] = (
    Field("mode", "int64_t", "LAUNCH_MODES: 0 split (the default), 1 persistent by rows, 2 one grid per level"),
    Field("max_blocks", "int64_t", "caps the grid of a persistent or column launch (0: no cap)"),
    Field("weights_global", "int64_t", "split mode: weight slices stay in global memory"),
    Field("stream", "void *", "the cudaStream_t of every launch, copy and sync of the call (NULL: default)"),
)

#: the values of `cx_launch.mode`, by the name `CORTEXC_CUDA_MODE` and `LaunchOptions.mode` use
LAUNCH_MODES: Mapping[str, int] = {"split": 0, "persistent": 1, "levels": 2}

#: the device-memory functions every CUDA library exports for the runtime (`device.DeviceMemory`); the
#: copies, memsets and the sync take the call's stream last (a library without `cx_mem_sync` predates that)
DEVICE_MEMORY_EXPORTS: tuple[str, ...] = (
    "cx_mem_alloc",
    "cx_mem_free",
    "cx_mem_upload",
    "cx_mem_zero",
    "cx_mem_download",
    "cx_mem_sync",
)

#: every struct of the ABI by its C name
STRUCTS: Mapping[str, tuple[Field, ...]] = {"cx_call": CALL_FIELDS, "cx_grad": GRAD_FIELDS, "cx_launch": LAUNCH_FIELDS}


def structure(name: str, fields: tuple[Field, ...]) -> type[ctypes.Structure]:
    """A ctypes structure laid out as the C struct of these fields."""
    return type(name, (ctypes.Structure,), {"_fields_": [(f.name, f.ctype) for f in fields]})


def c_typedef(name: str, fields: tuple[Field, ...]) -> str:
    """The C typedef of a struct (what the generated code declares)."""
    lines = ["typedef struct {"]
    for field in fields:
        space = "" if field.c_type.endswith("*") else " "
        member = f"    {field.c_type}{space}{field.name};"
        lines.append(f"{member:<40}/* {field.doc} */" if field.doc else member)
    lines.append(f"}} {name};")
    return "\n".join(lines)


CxCall = structure("CxCall", CALL_FIELDS)
CxGrad = structure("CxGrad", GRAD_FIELDS)
CxLaunch = structure("CxLaunch", LAUNCH_FIELDS)


#: where every array the kernels stream through vector loads starts: on a cache line (and an AVX-512 vector)
ALIGN_BYTES = 64


def aligned_empty(shape: int | tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
    """`np.empty` whose data starts on an `ALIGN_BYTES` boundary (numpy aligns to 16). Why: a packed weight at
    16 mod 64 makes every 64-byte panel load of the GEMM span two cache lines; a chain LSTM of 1000 x 1,
    whose steps stream the recurrent weight from L2, took 1.65-1.7 ms a forward so and 1.06 ms aligned."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN_BYTES, np.uint8)
    start = -raw.ctypes.data % ALIGN_BYTES
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def _as_matrix(param: np.ndarray) -> np.ndarray:
    """A param as GEMMs multiply it: a 3-D family [R, M, K] as its R*M rows of K (`W @ v`)."""
    return param.reshape(-1, param.shape[-1]) if param.ndim == 3 else param


def packed_weights(
    lib: ctypes.CDLL, packed: Sequence[PackedWeight], params: Mapping[str, np.ndarray]
) -> list[np.ndarray]:
    """Every GEMM weight a target's program names (its section's `packed`): its block rows
    (`PackedWeight.blocks`: params side by side, each transposed where the backward multiplies by W^T)
    stacked by rows, and packed into panels by the library's own `cx_pack_weight`, on the host. The one
    packing routine: the CPU executor keeps the result, the device executor uploads it."""
    lib.cx_packed_floats.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.cx_packed_floats.restype = ctypes.c_int64
    lib.cx_pack_weight.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.cx_pack_weight.restype = None
    packed_all = []
    for weight in packed:
        matrices = {
            p: params[p].reshape(-1, params[p].shape[-1]) if params[p].ndim == 3 else params[p] for p in weight.params
        }
        block_rows = [
            np.concatenate([matrices[p].T if t else matrices[p] for p, t in row], axis=1) for row in weight.block_rows()
        ]
        stacked = np.ascontiguousarray(np.concatenate(block_rows, axis=0), dtype=np.float32)
        array = aligned_empty(int(lib.cx_packed_floats(weight.m, weight.k)))
        lib.cx_pack_weight(stacked.ctypes.data, weight.m, weight.k, array.ctypes.data)
        packed_all.append(array)
    return packed_all


class LaunchMode(enum.Enum):
    """How the CUDA driver launches the phases of a forward or backward (`cuda/driver.j2`)."""

    SPLIT = "split"  # persistent, small levels shared by columns where the cell splits (the default)
    PERSISTENT = "persistent"  # one cooperative launch, by row tiles only
    LEVELS = "levels"  # one grid per kernel and level (small levels still split by columns)


@dataclass(frozen=True)
class LaunchOptions:
    """Launch options of the CUDA target, passed to the generated entry points as a `cx_launch`.

    `max_blocks` caps the grid (0: as many as fit); `weights_global` keeps the split mode's weight slices
    in global memory. `from_environment` reads `CORTEXC_CUDA_MODE`, `CORTEXC_CUDA_BLOCKS` and
    `CORTEXC_CUDA_WEIGHTS=global`; an executor given no options reads them once per call.
    """

    mode: LaunchMode = LaunchMode.SPLIT
    max_blocks: int = 0
    weights_global: bool = False

    def __post_init__(self) -> None:
        if self.max_blocks < 0:
            raise CortexcError(f"LaunchOptions.max_blocks must be 0 (no cap) or positive, not {self.max_blocks}")

    @classmethod
    def from_environment(
        cls, environ: Mapping[str, str] | None = None, default: LaunchOptions | None = None
    ) -> LaunchOptions:
        """`default` (the package's, from its compile options) with what the environment sets instead."""
        environ = os.environ if environ is None else environ
        default = default or cls()
        mode = environ.get("CORTEXC_CUDA_MODE") or default.mode.value
        if mode not in LAUNCH_MODES:
            raise CortexcError(f"CORTEXC_CUDA_MODE={mode!r} is not a launch mode (one of {', '.join(LAUNCH_MODES)})")
        blocks = environ.get("CORTEXC_CUDA_BLOCKS") or str(default.max_blocks)
        try:
            max_blocks = int(blocks)
        except ValueError:
            raise CortexcError(f"CORTEXC_CUDA_BLOCKS={blocks!r} is not a number of blocks") from None
        weights = environ.get("CORTEXC_CUDA_WEIGHTS")
        weights_global = default.weights_global if weights is None else weights == "global"
        return cls(LaunchMode(mode), max(max_blocks, 0), weights_global)

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode.value, "max_blocks": self.max_blocks, "weights_global": self.weights_global}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LaunchOptions:
        try:
            return cls(LaunchMode(data["mode"]), int(data["max_blocks"]), bool(data["weights_global"]))
        except (KeyError, TypeError, ValueError) as err:
            raise CortexcError(f"malformed launch options {dict(data)!r} ({err})") from None

    def struct(self, stream: int = 0) -> ctypes.Structure:
        """The `cx_launch` the entry points take; `stream` is the call's cudaStream_t (0: the default
        stream), not an option: a call's, filled in per call."""
        return CxLaunch(
            mode=LAUNCH_MODES[self.mode.value],
            max_blocks=self.max_blocks,
            weights_global=int(self.weights_global),
            stream=stream or None,
        )
