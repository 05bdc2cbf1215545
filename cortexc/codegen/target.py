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
    atomic_add_pragma: str  # what makes the next `x += y` atomic (shared rows in backward scatters)


#: gcc with OpenMP; `-march=native` picks AVX-512 or AVX2 for the vector extensions of the GEMM.
C = Target(name="c", source_suffix=".c", helper="static inline", restrict="__restrict__",
           gemm_nr=16, gemm_mr=6, tile_rows=32, atomic_add_pragma="#pragma omp atomic")

TARGETS = {"c": C}
