"""Deferred weight gradients: a per-target program pass.

Why: in a backward sweep a level near the top of a forest has a few nodes, so the weight gradients of its
tiles (``outer(g, x)`` summed over the rows) run on a few thread blocks, and adding them into the
gradients from every tile costs M x K atomics per tile. A GPU does better to keep each term's factor rows
during the recursion and, after the last level, run one GEMM per term over all those rows, shared by
every block. The CPU keeps per-thread accumulators (a tile there is already a core's whole share).

Requires: a scheduled program. Guarantees: ``program.deferred`` lists every `AccumOuter` of a gradient
kernel, in kernel and step order; nothing else changes.
"""

from __future__ import annotations

from dataclasses import replace

from cortexc.ir.program import AccumOuter, DeferredOuter, Program


def defer_outer_products(program: Program) -> Program:
    terms = tuple(
        DeferredOuter(kernel.name, number, step.param, step.m, step.k, step.rows)
        for kernel in program.kernels
        for number, step in enumerate(kernel.steps)
        if isinstance(step, AccumOuter)
    )
    return replace(program, deferred=terms)
