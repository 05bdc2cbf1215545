"""Code-generation targets. C and CUDA share every template; what differs is here."""

from __future__ import annotations

from dataclasses import dataclass


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
    defer_outer_products: bool = False  # weight gradients (AccumOuter) as one GEMM per term after the recursion
    defer_min_width: int = 0  # ... those with m * k / (m + k) >= this (smaller ones: summed per tile, in cache)
    defer_narrow: bool = False  # C: ... and the smaller ones in launches of few rows (DeferredOuter.narrow)
    fold_lookups: bool = False  # C: GEMMs of table rows may read a folded table in an inference (passes.fold)
    save_activations: bool = False  # C: a training forward keeps what the gradient kernels read (passes.saving)
    direct_max_k: int = 0  # C: an inference of wide levels may run the node kernel without hoisting, its sums of
    # products as one GEMM over the params side by side where they have at most this many columns (passes.direct)
    hoist_window_bytes: int = 0  # C: an inference computes its hoisted rows a window of levels at a time, in
    # a buffer of about this size that stays in cache (0: all rows before the recursion)
    gemm_isas: tuple[GemmIsa, ...] = ()  # C: the GEMM builds, the first whose condition holds is compiled
    gemm_nr: int = 0  # CUDA: the GEMM's panel width in floats (the packing of its weights)
    gemm_mr: int = 0  # CUDA: rows per register tile


#: C's GEMM per vector ISA. Results do not depend on which one runs: every element is one sum over k in
#: order whatever the panel width or tile (tests/test_gemm.py checks the builds bitwise against each other).
C_GEMM_ISAS = (
    GemmIsa("defined(__AVX512F__)", nr=16, mr=8, vregs=32),
    GemmIsa("defined(__AVX__)", nr=8, mr=6, vregs=16),
    GemmIsa("defined(__aarch64__)", nr=4, mr=8, vregs=32),
    GemmIsa("1", nr=4, mr=6, vregs=16),
)


#: C: weight gradients deferred when m * k / (m + k) >= 96 (e.g. 450 x 300: 180; 256 x 64: 51). Below it the
#: m x k accumulator a tile adds into stays in L1/L2 and costs less than writing and reading m + k floats
#: per row (measured: benchmarks/results/cpu_deferred.txt, the chain LSTM at H=64 is 10% slower deferred)
DEFER_MIN_WIDTH_C = 96

#: gcc with OpenMP; `-march=native` picks the GEMM build (gemm_isas) and the vector extensions' instructions.
C = Target(
    name="c",
    source_suffix=".c",
    helper="static inline",
    tile_rows=32,
    private_accumulators=True,
    column_split=True,
    column_granule=16,  # each thread's columns are whole GEMM panels of every gemm_isas build (a multiple of each nr)
    whole_width_copy=True,  # most calls (and every level below the threshold) run whole: no per-panel loops
    defer_outer_products=True,
    defer_min_width=DEFER_MIN_WIDTH_C,
    defer_narrow=True,
    fold_lookups=True,
    save_activations=True,
    # measured, 2 cores, direct / hoisted forward: chain LSTM X=32 H=64 (K = 96) 0.75-0.87 on levels of 3-100
    # rows; X=256 H=256 (512) 0.90-1.03 and X=300 H=128 (428) 0.89-1.05 (noise-level); the child-sum
    # Tree-LSTM X=300 H=256 (556) on SST batches of 10 and 50 1.04 and 1.06: a wide K is already efficient
    direct_max_k=256,
    # half of a 1-2 MiB L2: a chain LSTM of 1000 x 10 (10 MB of hoisted rows) ran 1.37x faster with a window
    # of 256 rows (256 KiB) than with all of them written before the recursion and read back from L3
    hoist_window_bytes=512 * 1024,
    gemm_isas=C_GEMM_ISAS,
)

#: nvcc; a tile of a level is one thread block, its threads share the rows x columns of every step.
CUDA = Target(
    name="cuda",
    source_suffix=".cu",
    helper="__device__ inline",
    gemm_nr=16,
    gemm_mr=1,
    tile_rows=16,
    private_accumulators=False,
    threads_per_block=128,
    column_split=True,
    defer_outer_products=True,
)

TARGETS = {"c": C, "cuda": CUDA}
