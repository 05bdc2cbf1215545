"""Code-generation targets. C and CUDA share every template; what differs is here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    name: str
    source_suffix: str
    helper: str  # qualifiers of small math helpers
    restrict: str
    gemm_nr: int  # GEMM panel width in floats (the SIMD width for C)
    gemm_mr: int  # GEMM rows per register tile
    tile_rows: int  # rows (nodes) per tile inside a kernel
    private_accumulators: bool  # weight gradients summed per thread (C) or added atomically (CUDA)
    threads_per_block: int = 1  # CUDA: threads that share a tile
    column_split: bool = False  # CUDA: small levels may be shared among blocks by columns (ColumnSplit)
    defer_outer_products: bool = False  # CUDA: weight gradients as one GEMM after the recursion (its only way)
    fold_lookups: bool = False  # C: GEMMs of table rows may read a folded table in an inference (passes.fold)


#: gcc with OpenMP; `-march=native` picks AVX-512 or AVX2 for the vector extensions of the GEMM.
C = Target(
    name="c",
    source_suffix=".c",
    helper="static inline",
    restrict="__restrict__",
    gemm_nr=16,
    gemm_mr=8,
    tile_rows=32,
    private_accumulators=True,
    fold_lookups=True,
)

#: nvcc; a tile of a level is one thread block, its threads share the rows x columns of every step.
CUDA = Target(
    name="cuda",
    source_suffix=".cu",
    helper="__device__ inline",
    restrict="__restrict__",
    gemm_nr=16,
    gemm_mr=1,
    tile_rows=16,
    private_accumulators=False,
    threads_per_block=128,
    column_split=True,
    defer_outer_products=True,
)

TARGETS = {"c": C, "cuda": CUDA}
