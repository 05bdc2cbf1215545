"""Random forests for tests, demos and benchmarks: trees (any arity or full binary) and shared DAGs.

Each generator draws from one NumPy ``Generator`` so a seed reproduces the
forest; ``Forest.random`` and ``Forest.random_dag`` document the shapes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cortexc.errors import ForestError
from cortexc.runtime.csr import counts_to_ptr
from cortexc.runtime.forest import Forest

__all__ = ["random_dag", "random_trees"]


def random_trees(
    num_trees: int,
    rng: np.random.Generator | int | None = None,
    *,
    max_children: int = 3,
    min_nodes: int = 1,
    max_nodes: int = 30,
    binary: bool = False,
    num_labels: int = 5,
    vocab_size: int = 50,
) -> Forest:
    """``num_trees`` random trees, one after the other, each numbered in post-order."""
    gen = np.random.default_rng(rng)
    if num_trees < 0:
        raise ForestError(f"num_trees must be >= 0, got {num_trees}")
    if not 1 <= min_nodes <= max_nodes:
        raise ForestError(f"need 1 <= min_nodes <= max_nodes, got {min_nodes}, {max_nodes}")
    if binary:
        low_leaves = (min_nodes + 2) // 2  # smallest L with 2L-1 >= min_nodes
        high_leaves = (max_nodes + 1) // 2
        if low_leaves > high_leaves:
            raise ForestError(f"no odd node count in {min_nodes}..{max_nodes} for a full binary tree")
    elif max_children < 1 and max_nodes > 1:
        raise ForestError("max_children must be >= 1 for trees with more than one node")
    pieces: list[np.ndarray] = []
    offset = 0
    for _ in range(num_trees):
        if binary:
            size = 2 * int(gen.integers(low_leaves, high_leaves + 1)) - 1
        else:
            size = int(gen.integers(min_nodes, max_nodes + 1))
        tree = _random_tree_parents(size, gen, max_children, binary)
        pieces.append(np.where(tree >= 0, tree + offset, -1))
        offset += size
    parents = np.concatenate([np.zeros(0, dtype=np.int64), *pieces])
    labels = gen.integers(0, num_labels, parents.size).astype(np.int32)
    is_leaf = np.bincount(parents[parents >= 0], minlength=parents.size) == 0
    words = _random_words(is_leaf, gen, vocab_size)
    return Forest._from_parent_array(parents, labels, words)


def random_dag(
    num_nodes: int,
    rng: np.random.Generator | int | None = None,
    *,
    max_children: int = 3,
    max_parents: int = 3,
    num_labels: int = 5,
    vocab_size: int = 50,
) -> Forest:
    """A DAG of ``num_nodes`` nodes, each reading earlier nodes that still have a free parent slot."""
    gen = np.random.default_rng(rng)
    if num_nodes < 0 or max_children < 0 or max_parents < 1:
        raise ForestError("random_dag needs num_nodes >= 0, max_children >= 0, max_parents >= 1")
    reader_count = np.zeros(num_nodes, dtype=np.int64)
    counts = np.zeros(num_nodes, dtype=np.int64)
    chosen: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
    for node in range(num_nodes):
        free = np.flatnonzero(reader_count[:node] < max_parents)
        take = int(gen.integers(0, min(max_children, free.size) + 1))
        kids = gen.choice(free, size=take, replace=False).astype(np.int64)
        reader_count[kids] += 1
        counts[node] = take
        chosen.append(kids)
    labels = gen.integers(0, num_labels, num_nodes).astype(np.int32)
    words = _random_words(counts == 0, gen, vocab_size)
    return Forest(counts_to_ptr(counts), np.concatenate(chosen), labels=labels, words=words)


def _random_words(is_leaf: np.ndarray, gen: np.random.Generator, vocab_size: int) -> list[Any]:
    """Random words ``w<k>`` on the leaves, None on internal nodes."""
    words = np.full(is_leaf.size, None, dtype=object)
    picks = gen.integers(0, max(vocab_size, 1), int(is_leaf.sum()))
    words[is_leaf] = [f"w{k}" for k in picks.tolist()]
    return words.tolist()


def _random_tree_parents(size: int, gen: np.random.Generator, max_children: int, binary: bool) -> np.ndarray:
    """Parent array of one random tree of ``size`` nodes, numbered in post-order.

    The tree is drawn top-down in pre-order (each node splits its remaining
    nodes among its children), then renumbered: a node's post-order index is
    its pre-order index + subtree size - 1 - depth.
    """
    pre_parent = np.empty(size, dtype=np.int64)
    subtree = np.empty(size, dtype=np.int64)
    depth = np.empty(size, dtype=np.int64)
    stack = [(size, -1, 0)]  # (subtree size, parent's pre-order index, depth)
    next_pre = 0
    while stack:
        nodes, parent, dep = stack.pop()
        here = next_pre
        next_pre += 1
        pre_parent[here], subtree[here], depth[here] = parent, nodes, dep
        below = nodes - 1
        if below == 0:
            continue
        if binary:
            left = 2 * int(gen.integers(1, (below + 2) // 2)) - 1  # odd, leaves >= 1 on the right
            sizes = [left, below - left]
        else:
            count = int(gen.integers(1, min(max_children, below) + 1))
            cuts = np.sort(gen.choice(np.arange(1, below), size=count - 1, replace=False))
            sizes = np.diff(np.concatenate(([0], cuts, [below]))).tolist()
        stack.extend((int(s), here, dep + 1) for s in reversed(sizes))
    post = np.arange(size, dtype=np.int64) + subtree - 1 - depth
    parents = np.full(size, -1, dtype=np.int64)
    has_parent = pre_parent >= 0
    parents[post[has_parent]] = post[pre_parent[has_parent]]
    return parents
