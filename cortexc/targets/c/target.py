"""The C target's compile side: gcc with OpenMP, a tile of a level per thread's chunk. Its program passes, in
order: saved activations, the direct node kernel, the column split, deferred weight gradients, folded
look-ups, grouped products (Triton's `add_stages`: the target lists what runs, `pipeline.target_stage` runs it)."""

from __future__ import annotations

from functools import partial

from cortexc.codegen.target import GemmIsa, Target
from cortexc.passes.columns import split_columns
from cortexc.passes.deferred import defer_outer_products
from cortexc.passes.direct import direct_node
from cortexc.passes.fold import fold_lookups
from cortexc.passes.grouping import group_products
from cortexc.passes.saving import save_activations

#: C's GEMM per vector ISA. Results do not depend on which one runs: every element is one sum over k in
#: order whatever the panel width or tile (tests/targets/c/test_gemm.py checks the builds bitwise against each other).
C_GEMM_ISAS = (
    GemmIsa("defined(__AVX512F__)", nr=16, mr=8, vregs=32),
    GemmIsa("defined(__AVX__)", nr=8, mr=6, vregs=16),
    GemmIsa("defined(__aarch64__)", nr=4, mr=8, vregs=32),
    GemmIsa("1", nr=4, mr=6, vregs=16),
)

#: weight gradients deferred when m * k / (m + k) >= 96 (e.g. 450 x 300: 180; 256 x 64: 51). Below it the
#: m x k accumulator a tile adds into stays in L1/L2 and costs less than writing and reading m + k floats
#: per row (measured: benchmarks/results/cpu_deferred.txt, the chain LSTM at H=64 is 10% slower deferred)
DEFER_MIN_WIDTH_C = 96

#: each thread's columns are whole GEMM panels of every gemm_isas build (a multiple of each nr)
COLUMN_GRANULE = 16

#: measured, 2 cores, direct / hoisted forward: chain LSTM X=32 H=64 (K = 96) 0.75-0.87 on levels of 3-100
#: rows; X=256 H=256 (512) 0.90-1.03 and X=300 H=128 (428) 0.89-1.05 (noise-level); the child-sum
#: Tree-LSTM X=300 H=256 (556) on SST batches of 10 and 50 1.04 and 1.06: a wide K is already efficient
DIRECT_MAX_K = 256

#: gcc with OpenMP; `-march=native` picks the GEMM build (gemm_isas) and the vector extensions' instructions.
TARGET = Target(
    name="c",
    source_suffix=".c",
    helper="static inline",
    tile_rows=32,
    private_accumulators=True,
    column_split=True,
    column_granule=COLUMN_GRANULE,
    whole_width_copy=True,  # most calls (and every level below the threshold) run whole: no per-panel loops
    defer_outer_products=True,
    direct_max_k=DIRECT_MAX_K,
    # half of a 1-2 MiB L2: a chain LSTM of 1000 x 10 (10 MB of hoisted rows) ran 1.37x faster with a window
    # of 256 rows (256 KiB) than with all of them written before the recursion and read back from L3
    hoist_window_bytes=512 * 1024,
    gemm_isas=C_GEMM_ISAS,
    passes=(
        save_activations,
        partial(direct_node, max_k=DIRECT_MAX_K),
        partial(split_columns, granule=COLUMN_GRANULE),
        partial(defer_outer_products, min_width=DEFER_MIN_WIDTH_C, narrow=True),
        fold_lookups,
        group_products,
    ),
)
