"""The CUDA target's compile side: nvcc; a tile of a level is one thread block, its threads share the rows x
columns of every step. Its program passes: the column split, then deferred weight gradients."""

from __future__ import annotations

from cortexc.codegen.target import Target
from cortexc.passes.columns import split_columns
from cortexc.passes.deferred import defer_outer_products

TARGET = Target(
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
    passes=(split_columns, defer_outer_products),
)
