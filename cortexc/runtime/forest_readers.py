"""Forests from Python objects: a networkx DiGraph (trees or a DAG) and one nested tuple/list tree.

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

__all__ = ["from_nested", "from_networkx"]


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
        if name in kids:
            raise ForestError(f"{node_name(i, names)} reads itself (self-loop)")
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
    return Forest._from_csr(counts_to_ptr(counts), np.asarray(child_list, dtype=np.int64), labels, words, names=names)


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
