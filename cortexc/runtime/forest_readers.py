"""Forests from Python objects: edge lists (graphs), a networkx DiGraph and one nested tuple/list tree.

These walk the caller's objects, so they cost Python work per node; the
resulting children CSR goes to the same checks as every other constructor.
``networkx`` is imported only when a graph is converted.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cortexc.errors import ForestError
from cortexc.runtime.csr import counts_to_ptr
from cortexc.runtime.forest import Forest, node_name

__all__ = ["from_edges", "from_nested", "from_networkx"]


def from_networkx(graph: Any, *, label_attr: str | None = None, word_attr: str | None = None) -> Forest:
    """A forest from a ``networkx.DiGraph`` whose edge ``u -> v`` means v reads u; see ``Forest.from_networkx``."""
    import networkx as nx

    if not isinstance(graph, nx.DiGraph) or graph.is_multigraph():
        raise ForestError(f"from_networkx needs a networkx.DiGraph, got {type(graph).__name__}")
    names = list(graph.nodes)
    index = {name: i for i, name in enumerate(names)}
    counts = np.zeros(len(names), dtype=np.int64)
    child_list: list[int] = []
    pred = graph.pred
    for i, name in enumerate(names):
        kids = pred[name]
        counts[i] = len(kids)
        child_list.extend(index[kid] for kid in kids)
    labels = None
    if label_attr is not None:
        label_values = []
        for i, name in enumerate(names):
            attrs = graph.nodes[name]
            if label_attr not in attrs:
                raise ForestError(f"{node_name(i, names)} has no {label_attr!r} attribute")
            label_values.append(attrs[label_attr])
        labels = label_values
    words = None
    if word_attr is not None:
        words = [graph.nodes[name].get(word_attr) for name in names]
    child_idx = np.asarray(child_list, dtype=np.int64)
    return Forest._from_csr(counts_to_ptr(counts), child_idx, labels, words, names=names, graph=True)


def from_edges(src: Any, dst: Any, num_nodes: Any = None) -> Forest:
    """A graph from edge lists (``src[i] -> dst[i]``: dst reads src); see ``Forest.from_edges``."""
    sources = _edge_ids(src, "src")
    targets = _edge_ids(dst, "dst")
    if sources.shape != targets.shape:
        raise ForestError(f"src and dst must have one id per edge alike, got {sources.size} and {targets.size}")
    largest = int(max(sources.max(), targets.max())) if sources.size else -1
    if num_nodes is None:
        count = largest + 1
    else:
        if isinstance(num_nodes, bool) or not isinstance(num_nodes, int | np.integer) or num_nodes < 0:
            raise ForestError(f"num_nodes must be a non-negative integer, got {num_nodes!r}")
        count = int(num_nodes)
        if largest >= count:
            edge = int(np.flatnonzero((sources >= count) | (targets >= count))[0])
            raise ForestError(
                f"edge {edge} ({int(sources[edge])} -> {int(targets[edge])}) names a node outside 0..{count - 1} "
                f"(num_nodes={count})"
            )
    by_reader = np.argsort(targets, kind="stable")  # each node's in-edges together, in the order given
    ptr = counts_to_ptr(np.bincount(targets, minlength=count).astype(np.int64))
    return Forest._from_csr(ptr, np.ascontiguousarray(sources[by_reader], dtype=np.int64), graph=True)


def _edge_ids(values: Any, what: str) -> np.ndarray:
    """A 1-D array of non-negative node ids, else a `ForestError` naming the first bad edge."""
    try:
        array = np.asarray(values)
    except (TypeError, ValueError) as err:
        raise ForestError(f"{what} cannot be read as an array of node ids ({err})") from None
    if array.ndim != 1:
        raise ForestError(f"{what} must be a 1-D array of node ids, got shape {array.shape}")
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(array.dtype, np.integer):
        raise ForestError(f"{what} must hold integer node ids, got dtype {array.dtype}")
    if array.min() < 0:
        edge = int(np.flatnonzero(array < 0)[0])
        raise ForestError(f"{what}[{edge}] is {int(array[edge])}: node ids are 0 or more")
    return array.astype(np.int64)


def from_nested(tree: Any) -> Forest:
    """ONE tree from nested tuples/lists, numbered in post-order; see ``Forest.from_nested``.

    Walked with an explicit stack (deep trees do not hit the recursion limit).
    """
    parents: list[int] = []
    words: list[Any] = []
    finished: list[int] = []  # ids of done nodes whose parent is not done yet
    on_path: set[int] = set()  # containers being expanded, to catch self-containment
    # Stack entries: (item, None) to visit, (container, n_children) to finish.
    stack: list[tuple[Any, int | None]] = [(tree, None)]
    while stack:
        item, num_kids = stack.pop()
        if num_kids is None and isinstance(item, (list, tuple)) and len(item) > 0:
            if id(item) in on_path:
                raise ForestError(f"nested tree contains itself (a {type(item).__name__} inside its own items)")
            on_path.add(id(item))
            kids = tuple(item)
            stack.append((item, len(kids)))
            stack.extend((kid, None) for kid in reversed(kids))
            continue
        node = len(parents)
        parents.append(-1)
        if num_kids is not None:
            on_path.discard(id(item))
            for kid in finished[-num_kids:]:
                parents[kid] = node
            del finished[-num_kids:]
            words.append(None)
        else:
            words.append(None if isinstance(item, (list, tuple)) else item)
        finished.append(node)
    return Forest._from_parent_array(np.asarray(parents, dtype=np.int64), None, words)
