"""What a code-generation target is: the knobs of the shared kernel skeleton and its program passes. Each
target defines its `Target` in its own folder (`cortexc/targets/<name>/target.py`); `TARGETS` has them all."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from importlib import import_module

from cortexc.ir.program import Program
from cortexc.targets import NAMES


@dataclass(frozen=True)
class GemmIsa:
    """One build of the C GEMM micro-kernels, chosen by the preprocessor when the package's C is compiled on
    the user's machine (`-march=native`): a 16-float panel on a 16-register ISA spills its accumulators
    (measured on Zen 3, AVX2: the chain LSTM 30x slower than with 8-float panels)."""

    condition: str  # a preprocessor expression that selects it; the last one is the fallback ("1")
    nr: int  # panel width in floats: the vector width
    mr: int  # rows per register tile
    vregs: int  # vector registers, which bound the accumulators of a tile


@dataclass(frozen=True)
class Target:
    name: str
    source_suffix: str
    helper: str  # qualifiers of small math helpers
    tile_rows: int  # rows (nodes) per tile inside a kernel
    private_accumulators: bool  # per-tile weight gradients summed per chunk (C) or added atomically (CUDA)
    threads_per_block: int = 1  # CUDA: threads that share a tile
    column_split: bool = False  # small levels may be shared among blocks (CUDA) or threads (C) by columns
    column_granule: int = 1  # ... in whole runs of this many columns; a period it does not divide: no split
    whole_width_copy: bool = False  # a split step also has its whole-width loop, for calls that do not split
    # weight gradients (AccumOuter) as one GEMM per term after the recursion, where the target's passes
    # marked them (`passes.deferred`: which, and the narrow ones, are that pass's arguments)
    defer_outer_products: bool = False
    direct_max_k: int = 0  # C: an inference of wide levels may run the node kernel without hoisting, its sums of
    # products as one GEMM over the params side by side where they have at most this many columns (passes.direct)
    hoist_window_bytes: int = 0  # C: an inference computes its hoisted rows a window of levels at a time, in
    # a buffer of about this size that stays in cache (0: all rows before the recursion)
    gemm_isas: tuple[GemmIsa, ...] = ()  # C: the GEMM builds, the first whose condition holds is compiled
    gemm_nr: int = 0  # CUDA: the GEMM's panel width in floats (the packing of its weights)
    gemm_mr: int = 0  # CUDA: rows per register tile
    #: the program passes of this target, in order (`pipeline.target_stage` runs them on each scheduled program)
    passes: tuple[Callable[[Program], Program], ...] = ()


class _Registered(Mapping[str, Target]):
    """Each registered target's `Target` by name, read from its folder (`cortexc/targets/<name>/target.py`)
    when first asked for: a target module imports this one, so the table cannot be built at import."""

    def __getitem__(self, name: str) -> Target:
        if name not in NAMES:
            raise KeyError(name)
        return import_module(f"cortexc.targets.{name}.target").TARGET

    def __iter__(self) -> Iterator[str]:
        return iter(NAMES)

    def __len__(self) -> int:
        return len(NAMES)


TARGETS: Mapping[str, Target] = _Registered()
