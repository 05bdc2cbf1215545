"""Deferred weight gradients: a per-target program pass.

Why: in a backward sweep a level near the top of a forest has a few nodes, so the weight gradients of its
tiles (``outer(g, x)`` summed over the rows) run on a few thread blocks (CUDA) or stream the whole m x k
accumulator through the cache for a few rows (C), and adding them into the gradients from every tile costs
M x K atomics (CUDA) or M x K loads and stores (C) per tile. Better keep each term's factor rows during the
recursion and, after the last level, run one GEMM per term over all those rows, shared by every block or
thread. Keeping the rows costs m + k floats per row written and read again: for a small weight
(m * k / (m + k) below `min_width`, its accumulator stays in cache) the per-tile sum is cheaper where a
tile has many rows, but a tile of one row (a level of a single chain) still loads and stores the whole
accumulator for one rank-1 update (a chain LSTM of 1000 x 1 at H=64 spent a quarter of its backward so).
So with `narrow` such a term is deferred too, marked narrow: a target then defers it only in launches of
few rows, chosen by the launch's row count alone (so never by the threads).

Requires: a scheduled program. Guarantees: ``program.deferred`` lists every `AccumOuter` of a gradient
kernel with ``m * k >= min_width * (m + k)``, and with `narrow` every other one as a narrow term, in kernel
and step order; nothing else changes.
"""

from __future__ import annotations

from dataclasses import replace

from cortexc.ir.program import AccumOuter, DeferredOuter, Program


def defer_outer_products(program: Program, min_width: int = 0, narrow: bool = False) -> Program:
    terms = []
    for kernel in program.kernels:
        for number, step in enumerate(kernel.steps):
            if not isinstance(step, AccumOuter):
                continue
            wide = step.m * step.k >= min_width * (step.m + step.k)
            if wide or narrow:
                terms.append(DeferredOuter(kernel.name, number, step.param, step.m, step.k, step.rows, not wide))
    return replace(program, deferred=tuple(terms))
