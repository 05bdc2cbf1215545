"""What a graph cell runs on: its T + 1 steps unrolled into levels, so that cycles need no new kernels.

A graph cell (`cell G on graph(steps = T)`) computes every node's states at step 0 (`init`, the leaf body)
and then, T times, every node from its in-neighbours' states one step earlier (`child.s`) and its own
(`prev.s`). Unrolled, step t is one level of ``N`` nodes: node ``v`` of step ``t`` is row ``t * N + v``, its
children are its in-neighbours' rows of step ``t - 1`` (edges in the graph's order), and its `prev` row is
``t * N + v - N`` (`Linearized.step_nodes`), so the levels, kernels and executors of acyclic cells run it in
one call with no Python per step. The states of every step are kept ((T + 1) * N rows): the backward reads
them, and the whole recursion is one call.

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
from cortexc.runtime.linearize import Linearized
from cortexc.runtime.signature import CellSignature


def linearize_steps(forest: Forest, steps: int) -> Linearized:
    """The unrolled linearization of a graph for `steps` steps after step 0 (kept on the forest)."""
    key = f"linearized_steps/{steps}"
    cached = forest.derived.get(key)
    if cached is None:
        n = forest.num_nodes
        child_idx = np.asarray(forest.child_idx, dtype=np.int64)
        counts = np.concatenate([np.zeros(n, dtype=np.int64), np.tile(np.asarray(forest.num_children), steps)])
        shifts = np.repeat(np.arange(steps, dtype=np.int64) * n, child_idx.size)
        cached = Linearized(
            num_nodes=(steps + 1) * n,
            num_levels=steps + 1,
            max_children=int(forest.max_children),
            level_order=_readonly(np.arange((steps + 1) * n, dtype=np.int64)),
            level_ptr=_readonly(np.arange(steps + 2, dtype=np.int64) * n),
            edge_ptr=_readonly(counts_to_ptr(counts)),
            edge_child=_readonly(np.tile(child_idx, steps) + shifts),
            roots=_readonly(np.arange(steps * n, (steps + 1) * n, dtype=np.int64)),
            step_nodes=n,
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
        cached = _readonly(np.tile(np.arange(forest.num_edges, dtype=np.int64), steps))
        forest.derived[key] = cached
    return cached


def last_step(signature: CellSignature, out: dict[str, Any], num_nodes: int) -> dict[str, Any]:
    """The states after the last step, copies (the caller then holds N rows, not all the steps': a backward
    reads the executor's own); the outputs are read there already (they run on the roots)."""
    for state in signature.states:
        out[state.name] = out[state.name][len(out[state.name]) - num_nodes :].copy()
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


def _readonly(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array
