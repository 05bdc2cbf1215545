"""What a graph cell runs on: its T + 1 steps unrolled into levels, so that cycles need no new kernels.

A graph cell (`cell G on graph(steps = T)`) computes every node's states at step 0 (`init`, the leaf body)
and then, T times, every node from its in-neighbours' states one step earlier (`child.s`) and its own
(`prev.s`). Unrolled, step t is one level of ``N`` nodes: node ``v`` of step ``t`` is row ``t * N + v``, its
children are its in-neighbours' rows of step ``t - 1`` (edges in the graph's order), and its `prev` row is
``t * N + v - N`` (`Linearized.step_nodes`), so the levels, kernels and executors of acyclic cells run it in
one call with no Python per step. A forward a backward follows keeps the states of every step ((T + 1) * N
rows: the backward reads them); an inference's steps take two blocks of N rows in turn (2 * N rows whatever
T: `Linearized.state_rows`; the kernels read `prev` modulo the rows).

The caller's view is the graph's: node inputs ``[N, ...]`` (every step of node v reads row v: the kernels
read row ``n % step_nodes``, `codegen.exprs.input_row`, and add its gradients there), edge inputs ``[E, ...]``
(tiled per step by the kernel edge order, `edge_order_steps`, their gradients summed back), states and
outputs ``[N, ...]`` after step T (the unrolled forest's roots are step T's nodes, in node order).
Vectorised; the unrolling is computed once per forest and steps count.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from cortexc.runtime.csr import counts_to_ptr
from cortexc.runtime.forest import Forest
from cortexc.runtime.linearize import Linearized, readonly
from cortexc.runtime.signature import CellSignature


def linearize_steps(forest: Forest, steps: int, every_step: bool = True) -> Linearized:
    """The unrolled linearization of a graph for `steps` steps after step 0 (kept on the forest).

    ``every_step``: step t's nodes are rows t * N + v, every step's states kept (a backward reads them).
    Without it (an inference) the steps use two blocks of N rows in turn, step t block t % 2 (the states
    double-buffered: 2 N rows whatever T, `Linearized.state_rows`); positions, edges and the hoisted rows
    stay one per step."""
    every_step = every_step or steps < 2
    key = f"linearized_steps/{steps}/{'every' if every_step else 'two'}"
    cached = forest.derived.get(key)
    if cached is None:
        n = forest.num_nodes
        child_idx = np.asarray(forest.child_idx, dtype=np.int64)
        counts = np.concatenate([np.zeros(n, dtype=np.int64), np.tile(np.asarray(forest.num_children), steps)])
        step = np.arange(steps + 1, dtype=np.int64)
        block = step if every_step else step % 2  # where step t's states are, in blocks of n rows
        shifts = np.repeat(block[:-1] * n, child_idx.size)  # step t reads step t - 1's rows
        cached = Linearized(
            num_nodes=(steps + 1) * n,
            num_levels=steps + 1,
            max_children=int(forest.max_children),
            level_order=readonly(np.repeat(block * n, n) + np.tile(np.arange(n, dtype=np.int64), steps + 1)),
            level_ptr=readonly(np.arange(steps + 2, dtype=np.int64) * n),
            edge_ptr=readonly(counts_to_ptr(counts)),
            edge_child=readonly(np.tile(child_idx, steps) + shifts),
            roots=readonly(np.arange(n, dtype=np.int64) + block[-1] * n),
            step_nodes=n,
            state_rows=(steps + 1 if every_step else 2) * n,
        )
        cached.addresses  # noqa: B018  # read once here, not per call
        forest.derived[key] = cached
    return cached


def edge_order_steps(forest: Forest, steps: int) -> np.ndarray:
    """For each child edge the unrolled steps walk, the graph's number of that edge: each step walks the
    graph's edges in their own order (step t's nodes are in node order, their edges by node)."""
    key = f"edge_order_steps/{steps}"
    cached = forest.derived.get(key)
    if cached is None:
        cached = readonly(np.tile(np.arange(forest.num_edges, dtype=np.int64), steps))
        forest.derived[key] = cached
    return cached


def last_step(signature: CellSignature, out: dict[str, Any], lin: Linearized) -> dict[str, Any]:
    """The states after the last step (the unrolled roots' rows, one block), copies (the caller then holds N
    rows, not every step's: a backward reads the executor's own); the outputs are read there already."""
    first = int(lin.roots[0]) if len(lin.roots) else 0
    for state in signature.states:
        out[state.name] = out[state.name][first : first + len(lin.roots)].copy()
    return out


def upstream_to_steps(
    signature: CellSignature, upstream: Mapping[str, np.ndarray], lin: Linearized
) -> dict[str, np.ndarray]:
    """Upstream gradients of states ``[N, ...]`` (after the last step) as the unrolled rows': zero before."""
    states = {s.name for s in signature.states}
    padded = dict(upstream)
    for name, grad in upstream.items():
        if name in states:
            full = np.zeros((lin.num_nodes, *grad.shape[1:]), dtype=grad.dtype)
            full[lin.num_nodes - len(grad) :] = grad
            padded[name] = full
    return padded
