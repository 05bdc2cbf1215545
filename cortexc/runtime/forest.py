"""Forests of trees or DAGs stored as flat integer arrays.

A :class:`Forest` is what a compiled cell runs on. It holds every node of
every tree (or DAG) of a batch in one numbering, with the edges in CSR form
and each node's *level*, so that the runtime can run every node of a level,
across the whole forest, as one batched step.

Node numbering is the forest's own; each constructor documents it. The edge
direction is the data-flow one: a node *reads* its children, so a child is
computed before its parents.

All arrays are read-only NumPy arrays and the object itself cannot be changed
after construction, so a forest can be shared between runs and threads.
Building one is vectorised NumPy (no Python work per node) except where the
input itself is Python objects (``from_nested``, ``from_networkx``) or the
constructor is a test helper (``random``, ``random_dag``).

This module is the structure itself (derivation of parents and levels, its
checks, ``from_parents`` and ``concat``). The other constructors live by
idea and are reached through the classmethods here: ``ptb`` (the bracket
reader), ``forest_readers`` (networkx graphs, nested tuples),
``forest_random`` (generators); ``csr`` holds the CSR steps they share.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import numpy as np

from cortexc.errors import ForestError
from cortexc.runtime.csr import counts_to_ptr, gather_segments

__all__ = ["Forest"]

_INT32_MIN = int(np.iinfo(np.int32).min)
_INT32_MAX = int(np.iinfo(np.int32).max)


def _readonly(array: np.ndarray) -> np.ndarray:
    """A read-only view of an array the forest owns, over a read-only base: the forest is immutable, and
    what is derived from it once (`derived`) is kept, so its arrays must not be made writeable again
    (NumPy refuses ``flags.writeable = True`` on a view whose base is read-only)."""
    array.flags.writeable = False
    view = array.view()
    view.flags.writeable = False
    return view


def _as_index_array(values: Any, what: str) -> np.ndarray:
    """A 1-D int64 copy of ``values``; rejects floats, bools and other non-integers."""
    array = np.asarray(values)
    if array.ndim != 1:
        raise ForestError(f"{what} must be 1-D, got shape {array.shape}")
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.dtype.kind not in "iu":
        raise ForestError(f"{what} must hold integers, got dtype {array.dtype}")
    if array.dtype.kind == "u" and array.size and int(array.max()) > np.iinfo(np.int64).max:
        raise ForestError(f"{what} has values too large for int64")
    return np.array(array, dtype=np.int64, copy=True)


class _Kahn:
    """Levels by Kahn's algorithm, one NumPy step per level, resumable (``run`` takes a step budget).

    A node is ready once all its children are done; the nodes made ready at step k have level k (their last
    child finished at step k-1, so k is one more than their highest child). Nodes on or above a cycle never
    become ready and keep level -1.
    """

    def __init__(self, num_children: np.ndarray, parent_ptr: np.ndarray, parent_idx: np.ndarray):
        self.parent_ptr, self.parent_idx = parent_ptr, parent_idx
        self.level = np.full(num_children.shape[0], -1, dtype=np.int32)
        self.pending = num_children.astype(np.int64, copy=True)
        self.frontier = np.flatnonzero(self.pending == 0)
        self.step = 0
        self.done = 0

    def run(self, budget: int | None = None) -> bool:
        """Up to ``budget`` steps (all when None); True once no node can become ready any more."""
        steps = 0
        while self.frontier.size and (budget is None or steps < budget):
            self.level[self.frontier] = self.step
            self.done += self.frontier.size
            readers = gather_segments(self.parent_ptr, self.parent_idx, self.frontier)
            self.step += 1
            steps += 1
            if readers.size == 0:
                self.frontier = readers
                break
            touched, hits = np.unique(readers, return_counts=True)
            self.pending[touched] -= hits
            self.frontier = touched[self.pending[touched] == 0]
        return self.frontier.size == 0


def _path_lengths(point: np.ndarray) -> np.ndarray | None:
    """Each node's number of steps along ``point`` (-1: the path ends) by pointer jumping, ~log2(length)
    NumPy passes; None when some path never ends (the pointers have a cycle)."""
    n = point.size
    jump = np.empty(n + 1, np.int32 if n < 2**31 - 2 else np.int64)  # node n: the end, pointing at itself
    jump[:n] = np.where(point < 0, n, point)
    jump[n] = n
    dist = np.ones(n + 1, np.int32)
    dist[:n][point < 0] = 0
    dist[n] = 0
    for _ in range(n.bit_length() + 1):
        if bool((jump == n).all()):
            return dist[:n]
        dist += dist[jump]
        jump = jump[jump]
    return None


def _pointer_levels(child_ptr: np.ndarray, child_idx: np.ndarray, max_rounds: int) -> np.ndarray | None:
    """DAG levels by guessing each node's deepest child and pointer jumping along the guesses.

    Following one child per node, ``_path_lengths`` gives every node the length of a real path down to a
    node without children: a lower bound of its level. A node whose highest child is above that bound
    points at that child next round. The bounds only grow (by induction along the new pointers) and stop
    exactly at the levels (level = 1 + highest child), each round ~log2(depth) passes over the nodes, so a
    deep DAG costs a few such rounds instead of one NumPy step per level. The first guess is the child of
    highest index (the deepest one when nodes are numbered children first, as every reader here does).
    None when ``max_rounds`` do not settle it or the pointers close a cycle (the caller falls back to Kahn).
    """
    num_nodes = child_ptr.size - 1
    num_children = np.diff(child_ptr)
    internal = np.flatnonzero(num_children > 0)
    if internal.size == 0:
        return np.zeros(num_nodes, np.int32)
    starts = child_ptr[:-1][internal]
    owner = np.repeat(np.arange(internal.size), num_children[internal])  # edge -> its internal node
    point = np.full(num_nodes, -1, np.int64)
    point[internal] = np.maximum.reduceat(child_idx, starts)
    for _ in range(max_rounds):
        bound = _path_lengths(point)
        if bound is None:
            return None
        below = bound[child_idx]
        highest = np.maximum.reduceat(below, starts)
        short = highest + 1 > bound[internal]
        if not bool(short.any()):
            return bound
        deeper = np.flatnonzero(short[owner] & (below == highest[owner]))
        point[internal[owner[deeper]]] = child_idx[deeper]  # one of the highest children (the last listed)
    return None


#: Kahn steps before a DAG's depth is judged, and between judgements
_KAHN_PROBE = 64
#: a Kahn step (~25 us) against a node of pointer jumping (~0.5 us a round, a few rounds): pointer jumping
#: once the projected remaining steps exceed this share of the nodes
_POINTER_SHARE = 0.02
#: pointer rounds before falling back to Kahn (a cycle, or guesses that settle slowly)
_POINTER_ROUNDS = 16


def _dag_levels(
    child_ptr: np.ndarray,
    child_idx: np.ndarray,
    num_children: np.ndarray,
    parent_ptr: np.ndarray,
    parent_idx: np.ndarray,
    share: float = _POINTER_SHARE,
) -> np.ndarray:
    """Levels of a DAG (-1 on or above a cycle): Kahn's algorithm while the DAG looks shallow, pointer
    jumping (``_pointer_levels``) once the steps Kahn would still take, projected from its last probe's
    nodes per step, cost more; Kahn again to the end if that does not settle (and always for a cycle, whose
    message names what Kahn never reached)."""
    kahn = _Kahn(num_children, parent_ptr, parent_idx)
    num_nodes = num_children.shape[0]
    before = 0
    while not kahn.run(_KAHN_PROBE):
        remaining, rate = num_nodes - kahn.done, max(kahn.done - before, 1)  # nodes per _KAHN_PROBE steps
        before = kahn.done
        if _KAHN_PROBE * remaining > share * num_nodes * rate:
            level = _pointer_levels(child_ptr, child_idx, _POINTER_ROUNDS)
            if level is not None:
                return level
            kahn.run()
            break
    return kahn.level


def _tree_levels(parents: np.ndarray) -> np.ndarray | None:
    """Levels of a forest of trees by pointer jumping: ~2 log2(depth) NumPy passes, whatever the depth.

    ``jump`` holds each node's 2^k-th ancestor (-1 past its root) and ``level`` the longest path down
    from each node over descendants less than 2^k steps below. Round k adds those exactly 2^k below:
    ``level[jump[w]] = max(level[jump[w]], 2^k + level[w])``, then ``jump = jump[jump]``. None when the
    parents have a cycle (some node never gets past a root), for the caller's message.
    """
    index = np.int32 if parents.size < 2**31 - 1 else np.int64
    jump = parents.astype(index)
    level = np.zeros(parents.size, np.int32)
    active = np.flatnonzero(jump >= 0).astype(index)
    step = 1
    for _ in range(parents.size.bit_length() + 1):
        if active.size == 0:
            return level
        up = jump[active]
        np.maximum.at(level, up, level[active] + step)
        after = jump[up]
        jump[active] = after
        active = active[after >= 0]
        step *= 2
    return None if active.size else level


class Forest:
    """Trees or DAGs of a batch, flattened into integer arrays (read-only).

    Arrays (N nodes, E edges):

    - ``child_ptr`` (int64 [N+1]), ``child_idx`` (int64 [E]): the children of
      node i are ``child_idx[child_ptr[i]:child_ptr[i+1]]``, child 0 first.
    - ``parent_ptr`` (int64 [N+1]), ``parent_idx`` (int64 [E]): the parents of
      node i, in increasing node order (a DAG node may have several).
    - ``parents`` (int64 [N]): node i's parent, -1 for a root; for a DAG node
      with several parents this is the first (lowest-numbered) one, so it is
      only the whole story when ``is_tree``.
    - ``num_children``, ``num_parents`` (int64 [N]).
    - ``roots`` (int64): nodes that no node reads, in increasing node order.
    - ``level`` (int32 [N]): 0 for a node without children, else one more than
      its highest child: the height in a tree, the longest path from a source
      in a DAG. Every node of a level can run once the levels below are done.
    - ``level_order`` (int64 [N]): node ids sorted by level (stable, so by node
      id within a level); ``level_ptr`` (int64 [num_levels+1]): level k is
      ``level_order[level_ptr[k]:level_ptr[k+1]]``.
    - ``labels`` (int32 [N] or None): a label per node, when the input has them.
    - ``words`` (list of length N or None): the word (or leaf value) of each
      leaf, None for internal nodes. Treat it as read-only.

    Scalars: ``num_nodes``, ``num_trees`` (number of roots), ``num_levels``,
    ``max_children``, ``is_tree`` (no node has more than one parent).

    A graph with cycles or self-loops (``Forest.from_edges``, ``from_networkx``, ``concat`` of such graphs) is
    a forest too, for graph cells: ``cycle`` is then the message naming a node on a cycle (None for trees and
    DAGs), it has no levels (``level`` -1, ``num_levels`` 0), and a tree or dag cell refuses it when called.
    The other constructors (children arrays, parent arrays, PTB, nested tuples) describe trees and DAGs and
    refuse a cycle at once, as ever.

    Edges (Version 3 of the language): ``num_edges``, ``edge_ptr``, ``edge_child``, ``edge_parent``: edge e
    joins ``edge_parent[e]`` to its child ``edge_child[e]``, numbered by parent, then in children order.

    ``derived`` holds what the runtime computes from the structure once and reuses on every call (the
    linearization, by `cortexc.runtime.linearize`); it is not pickled.
    """

    child_ptr: np.ndarray
    child_idx: np.ndarray
    parent_ptr: np.ndarray
    parent_idx: np.ndarray
    parents: np.ndarray
    num_children: np.ndarray
    num_parents: np.ndarray
    roots: np.ndarray
    level: np.ndarray
    level_order: np.ndarray
    level_ptr: np.ndarray
    labels: np.ndarray | None
    words: list[Any] | None
    derived: dict[str, Any]
    num_nodes: int
    num_trees: int
    num_levels: int
    max_children: int
    is_tree: bool
    cycle: str | None

    def __init__(
        self,
        child_ptr: Any,
        child_idx: Any,
        *,
        labels: Any = None,
        words: Sequence[Any] | None = None,
    ) -> None:
        """Build from children CSR arrays (copied); node i's children are in the given order."""
        ptr = _as_index_array(child_ptr, "child_ptr")
        idx = _as_index_array(child_idx, "child_idx")
        if ptr.size == 0 or ptr[0] != 0:
            raise ForestError("child_ptr must start with 0 (it has one entry per node plus one)")
        num_nodes = ptr.size - 1
        if num_nodes and np.any(np.diff(ptr) < 0):
            bad = int(np.flatnonzero(np.diff(ptr) < 0)[0])
            raise ForestError(f"child_ptr decreases at node {bad}")
        if ptr[-1] != idx.size:
            raise ForestError(f"child_ptr ends at {int(ptr[-1])} but child_idx has {idx.size} entries")
        if idx.size and (idx.min() < 0 or idx.max() >= num_nodes):
            edge = int(np.flatnonzero((idx < 0) | (idx >= num_nodes))[0])
            owner = int(np.searchsorted(ptr, edge, side="right") - 1)
            raise ForestError(f"node {owner} has child {int(idx[edge])}, outside 0..{num_nodes - 1}")
        self._setup(ptr, idx, labels, words, names=None, level=None)

    # ------------------------------------------------------------------ core

    def _setup(
        self,
        child_ptr: np.ndarray,
        child_idx: np.ndarray,
        labels: Any,
        words: Sequence[Any] | None,
        names: Sequence[Hashable] | None,
        level: np.ndarray | None,
        graph: bool = False,
    ) -> None:
        """Derive every array from a valid-range children CSR; checks self-loops and cycles.

        ``names`` (the caller's node names, e.g. networkx nodes) only make error
        messages readable. ``level`` may be passed when already known (concat).
        A self-loop or a cycle is an error, unless ``graph`` (the graph readers: `from_edges`,
        `from_networkx`, `concat` of such forests): then ``cycle`` names it for the cells that refuse it.
        """
        num_nodes = child_ptr.size - 1
        num_children = np.diff(child_ptr)
        owner = np.repeat(np.arange(num_nodes, dtype=np.int64), num_children)
        cycle: str | None = None
        self_loops = np.flatnonzero(owner == child_idx)
        if self_loops.size:
            node = int(owner[self_loops[0]])
            cycle = f"{node_name(node, names)} reads itself (it is its own child)"

        # Edges are listed by owner, so a stable sort by child keeps each
        # child's parents in increasing order.
        by_child = np.argsort(child_idx, kind="stable")
        parent_idx = owner[by_child]
        num_parents = np.bincount(child_idx, minlength=num_nodes).astype(np.int64)
        parent_ptr = counts_to_ptr(num_parents)
        parents = np.full(num_nodes, -1, dtype=np.int64)
        has_parent = num_parents > 0
        parents[has_parent] = parent_idx[parent_ptr[:-1][has_parent]]

        if level is None and cycle is None and (num_nodes == 0 or num_parents.max() <= 1):
            level = _tree_levels(parents)
        if level is None:
            level = _dag_levels(child_ptr, child_idx, num_children, parent_ptr, parent_idx)
            unfinished = np.flatnonzero(level < 0)
            if unfinished.size and cycle is None:
                cycle = _cycle_message(int(unfinished[0]), level, child_ptr, child_idx, names)
        if cycle is None:
            num_levels = int(level.max()) + 1 if num_nodes else 0
            level_order = np.argsort(level, kind="stable").astype(np.int64)
            level_ptr = counts_to_ptr(np.bincount(level, minlength=num_levels).astype(np.int64))
        elif not graph:
            raise ForestError(cycle)
        else:  # a graph: no levels (only a graph cell runs on it, on its own unrolled levels: `runtime.graph`)
            level = np.full(num_nodes, -1, dtype=np.int32)
            num_levels = 0
            level_order = np.arange(num_nodes, dtype=np.int64)
            level_ptr = np.zeros(1, dtype=np.int64)

        set_ = object.__setattr__
        set_(self, "child_ptr", _readonly(child_ptr))
        set_(self, "child_idx", _readonly(child_idx))
        set_(self, "parent_ptr", _readonly(parent_ptr))
        set_(self, "parent_idx", _readonly(parent_idx))
        set_(self, "parents", _readonly(parents))
        set_(self, "num_children", _readonly(num_children))
        set_(self, "num_parents", _readonly(num_parents))
        set_(self, "roots", _readonly(np.flatnonzero(~has_parent).astype(np.int64)))
        set_(self, "level", _readonly(level))
        set_(self, "level_order", _readonly(level_order))
        set_(self, "level_ptr", _readonly(level_ptr))
        set_(self, "labels", _check_labels(labels, num_nodes))
        set_(self, "words", _check_words(words, num_nodes))
        set_(self, "num_nodes", num_nodes)
        set_(self, "num_trees", int(self.roots.size))
        set_(self, "num_levels", num_levels)
        set_(self, "max_children", int(num_children.max()) if num_nodes else 0)
        set_(self, "is_tree", bool(cycle is None and (num_nodes == 0 or num_parents.max() <= 1)))
        set_(self, "cycle", cycle)
        set_(self, "derived", {})

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without `derived` (the receiver derives it again)."""
        return {name: value for name, value in self.__dict__.items() if name != "derived"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickled arrays come back writeable: made read-only again, as the forest's own are."""
        for name, value in state.items():
            object.__setattr__(self, name, _readonly(value) if isinstance(value, np.ndarray) else value)
        object.__setattr__(self, "derived", {})

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Forest is immutable; cannot set {name!r}")

    def __repr__(self) -> str:
        kind = "" if self.is_tree else ", dag" if self.cycle is None else ", graph with cycles"
        return f"Forest(num_trees={self.num_trees}, num_nodes={self.num_nodes}, num_levels={self.num_levels}{kind})"

    # ------------------------------------------------------------------ edges (Version 3)

    @property
    def num_edges(self) -> int:
        """How many edges join a node to a child (a DAG child shared by two parents has one to each)."""
        return int(self.child_idx.size)

    @property
    def edge_ptr(self) -> np.ndarray:
        """CSR offsets (int64 [N+1]) of the edges by parent: edges are numbered by their parent's id, and within
        a parent in `children` order, so node p's edges are ``edge_ptr[p]:edge_ptr[p + 1]``."""
        return self.child_ptr

    @property
    def edge_child(self) -> np.ndarray:
        """The node each edge reads (int64 [E]): ``edge_child[edge_ptr[p]:edge_ptr[p + 1]]`` is ``children(p)``."""
        return self.child_idx

    @property
    def edge_parent(self) -> np.ndarray:
        """The node that reads through each edge (int64 [E], nondecreasing)."""
        return np.repeat(np.arange(self.num_nodes, dtype=np.int64), self.num_children)

    def children(self, node: int) -> np.ndarray:
        """The children of ``node`` in order (a read-only view)."""
        node = self._check_node(node)
        return self.child_idx[self.child_ptr[node] : self.child_ptr[node + 1]]

    def parents_of(self, node: int) -> np.ndarray:
        """Every parent of ``node`` in increasing order (several for a shared DAG node)."""
        node = self._check_node(node)
        return self.parent_idx[self.parent_ptr[node] : self.parent_ptr[node + 1]]

    def level_nodes(self, level: int) -> np.ndarray:
        """The nodes of one level, in increasing node order (a read-only view)."""
        if not 0 <= level < self.num_levels:
            raise IndexError(f"level {level} out of range 0..{self.num_levels - 1}")
        return self.level_order[self.level_ptr[level] : self.level_ptr[level + 1]]

    def _check_node(self, node: int) -> int:
        node = int(node)
        if not 0 <= node < self.num_nodes:
            raise IndexError(f"node {node} out of range 0..{self.num_nodes - 1}")
        return node

    def check_structure(self, is_dag: bool, arity: int | None, cell_name: str | None = None) -> None:
        """Refuse a forest a cell cannot run on, naming the first offending node.

        A tree cell keeps one state per node for its single parent, so a shared
        node (several parents) needs a dag cell; a cell with a fixed arity has
        weights for that many children only.
        """
        cell = f"cell {cell_name}" if cell_name else "the cell"
        if self.cycle is not None:
            raise ForestError(f"{self.cycle}, but {cell} runs on a {'dag' if is_dag else 'tree'}; use a graph cell")
        if not is_dag and not self.is_tree:
            node = int(np.flatnonzero(self.num_parents > 1)[0])
            readers = ", ".join(str(int(p)) for p in self.parents_of(node))
            raise ForestError(
                f"node {node} has {int(self.num_parents[node])} parents ({readers}) "
                f"but {cell} runs on a tree; use a dag cell"
            )
        if arity is not None and self.max_children > arity:
            node = int(np.flatnonzero(self.num_children > arity)[0])
            owner = f"cell {cell_name}'s" if cell_name else "the cell's"
            raise ForestError(f"node {node} has {int(self.num_children[node])} children but {owner} arity is {arity}")

    # ---------------------------------------------------------- constructors

    @classmethod
    def _from_csr(
        cls,
        child_ptr: np.ndarray,
        child_idx: np.ndarray,
        labels: Any = None,
        words: Sequence[Any] | None = None,
        *,
        names: Sequence[Hashable] | None = None,
        level: np.ndarray | None = None,
        graph: bool = False,
    ) -> Forest:
        """Build from int64 children CSR arrays (owned, not copied) whose values are already in range.

        The path of the runtime's own readers, which have checked the ranges
        themselves; ``_setup`` still checks self-loops and cycles (kept, named, with ``graph``).
        """
        forest = cls.__new__(cls)
        forest._setup(child_ptr, child_idx, labels, words, names, level, graph)
        return forest

    @classmethod
    def _from_parent_array(
        cls,
        parents: np.ndarray,
        labels: Any = None,
        words: Sequence[Any] | None = None,
    ) -> Forest:
        """Build from an int64 parent array whose values are already in range."""
        num_nodes = parents.size
        child = np.flatnonzero(parents >= 0)
        owner = parents[child]
        order = np.argsort(owner, kind="stable")  # children stay in increasing order
        child_ptr = counts_to_ptr(np.bincount(owner, minlength=num_nodes).astype(np.int64))
        return cls._from_csr(child_ptr, child[order].astype(np.int64), labels, words)

    @classmethod
    def from_parents(
        cls,
        parents: Any,
        *,
        labels: Any = None,
        words: Sequence[Any] | None = None,
    ) -> Forest:
        """A forest of trees from ``parents[i]`` = node i's parent, or -1 for a root.

        Nodes keep their indices; a node's children are in increasing index order.
        """
        array = _as_index_array(parents, "parents")
        num_nodes = array.size
        out_of_range = np.flatnonzero((array < -1) | (array >= num_nodes))
        if out_of_range.size:
            node = int(out_of_range[0])
            raise ForestError(f"node {node} has parent {int(array[node])}, outside -1..{num_nodes - 1}")
        own = np.flatnonzero(array == np.arange(num_nodes))
        if own.size:
            raise ForestError(f"node {int(own[0])} is its own parent")
        return cls._from_parent_array(array, labels, words)

    @classmethod
    def from_networkx(
        cls,
        graph: Any,
        *,
        label_attr: str | None = None,
        word_attr: str | None = None,
    ) -> Forest:
        """A forest (trees, a DAG, or a graph with cycles and self-loops) from a ``networkx.DiGraph``.

        An edge ``u -> v`` means v reads u (u is a child of v). Nodes are
        numbered in ``graph.nodes`` order; the children of v are in the order of
        ``graph.predecessors(v)`` (edge insertion order). With ``label_attr``
        every node must have that integer attribute; with ``word_attr`` a node's
        word is that attribute (None where absent).
        """
        from cortexc.runtime.forest_readers import from_networkx

        return from_networkx(graph, label_attr=label_attr, word_attr=word_attr)

    @classmethod
    def from_edges(cls, src: Any, dst: Any, num_nodes: int | None = None) -> Forest:
        """A graph from its edges: edge ``src[i] -> dst[i]`` means ``dst[i]`` reads ``src[i]``.

        A node's children are its in-neighbours in the order their edges appear; cycles, self-loops and
        repeated edges are allowed (a repeated edge is read twice). ``num_nodes`` defaults to one more than
        the largest id; nodes without edges are allowed. Vectorised (a stable sort of the edges)."""
        from cortexc.runtime.forest_readers import from_edges

        return from_edges(src, dst, num_nodes)

    @classmethod
    def from_nested(cls, tree: Any) -> Forest:
        """ONE tree from nested tuples/lists.

        A tuple or list is an internal node whose items are its children (an
        empty one is a leaf with no value); anything else is a leaf whose value
        goes, as given, to ``words``. Nodes are numbered in post-order (children
        before parents, child 0 first), like ``from_ptb``. For several trees use
        ``Forest.concat([Forest.from_nested(t) for t in trees])``.
        """
        from cortexc.runtime.forest_readers import from_nested

        return from_nested(tree)

    @classmethod
    def concat(cls, forests: Iterable[Forest]) -> Forest:
        """The nodes of the first forest, then of the second, ...; roots likewise.

        Labels (words) are kept when every forest has them, else None.
        """
        parts = list(forests)
        for part in parts:
            if not isinstance(part, Forest):
                raise ForestError(f"concat needs Forests, got {type(part).__name__}")
        if not parts:
            return cls.from_parents(np.zeros(0, dtype=np.int64))
        node_offsets = np.cumsum([0] + [f.num_nodes for f in parts])
        edge_offsets = np.cumsum([0] + [f.child_idx.size for f in parts])
        child_ptr = np.concatenate(
            [np.zeros(1, dtype=np.int64)] + [f.child_ptr[1:] + edge_offsets[k] for k, f in enumerate(parts)]
        )
        child_idx = np.concatenate(
            [np.zeros(0, dtype=np.int64)] + [f.child_idx + node_offsets[k] for k, f in enumerate(parts)]
        )
        level = None  # a graph's parts have no levels: derived again, with its cycle named
        if all(f.cycle is None for f in parts):
            level = np.concatenate([np.zeros(0, dtype=np.int32)] + [f.level for f in parts])
        labels = None
        if all(f.labels is not None for f in parts):
            labels = np.concatenate([np.zeros(0, dtype=np.int32)] + [f.labels for f in parts])
        words = None
        if all(f.words is not None for f in parts):
            words = [word for f in parts for word in f.words or ()]
        return cls._from_csr(child_ptr, child_idx, labels, words, level=level, graph=level is None)

    # --------------------------------------------------------------- PTB

    @classmethod
    def from_ptb_file(cls, path: str | os.PathLike[str], limit: int | None = None) -> Forest:
        """``from_ptb`` on a UTF-8 file, one bracketed tree per line (its first ``limit`` lines; all if
        None); an error in the text names the file, its line and column."""
        from cortexc.runtime.ptb import read_ptb_file

        return read_ptb_file(path, limit)

    @classmethod
    def from_ptb(cls, lines: Iterable[str] | str | bytes) -> Forest:
        """Trees in PTB bracket format, one per line (SST: ``(3 (2 It) (4 ...))``).

        ``lines`` is an iterable of lines (an open file) or one string holding
        them all. A node is ``(label child...)`` or, for a leaf, ``(label word)``;
        labels are integers. Tokens are split on ASCII space only and words are
        kept exactly as written (``-LRB-``, ``\\/``, a U+00A0 inside a word).
        Blank lines are skipped. Nodes are numbered in post-order within each
        tree (children before parents, child 0 = leftmost first), trees in input
        order, so each tree's root is its last node. Malformed input raises
        ForestError naming the (1-based) line and column.
        """
        from cortexc.runtime.ptb import read_ptb

        return read_ptb(lines)

    # ------------------------------------------------------------- random

    @classmethod
    def random(
        cls,
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
        """Random trees for tests and demos, numbered in post-order like ``from_ptb``.

        Each tree has between ``min_nodes`` and ``max_nodes`` nodes (an odd count
        when ``binary``, where every internal node has exactly 2 children, as in
        SST) and at most ``max_children`` children per node. Labels are uniform
        in ``0..num_labels-1``; leaves get words ``w0``..``w{vocab_size-1}``.
        """
        from cortexc.runtime.forest_random import random_trees

        return random_trees(
            num_trees,
            rng,
            max_children=max_children,
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            binary=binary,
            num_labels=num_labels,
            vocab_size=vocab_size,
        )

    @classmethod
    def random_dag(
        cls,
        num_nodes: int,
        rng: np.random.Generator | int | None = None,
        *,
        max_children: int = 3,
        max_parents: int = 3,
        num_labels: int = 5,
        vocab_size: int = 50,
    ) -> Forest:
        """A random DAG whose nodes may be read by up to ``max_parents`` nodes.

        Node i reads 0..``max_children`` distinct earlier nodes in a random
        order, so nodes are numbered children-first and many are shared.
        """
        from cortexc.runtime.forest_random import random_dag

        return random_dag(
            num_nodes,
            rng,
            max_children=max_children,
            max_parents=max_parents,
            num_labels=num_labels,
            vocab_size=vocab_size,
        )


# ---------------------------------------------------------------- helpers


def node_name(node: int, names: Sequence[Hashable] | None) -> str:
    """How an error names a node: its index, plus the caller's name when it differs."""
    if names is None or names[node] == node:
        return f"node {node}"
    return f"node {names[node]!r} (index {node})"


def _cycle_message(
    start: int,
    level: np.ndarray,
    child_ptr: np.ndarray,
    child_idx: np.ndarray,
    names: Sequence[Hashable] | None,
) -> str:
    """Name a node on a cycle, given one node that Kahn's algorithm never reached.

    Every unreached node has an unreached child (else it would have become
    ready), so following unreached children must revisit a node: that node is
    on a cycle. This walk only runs to report an error.
    """
    seen: dict[int, int] = {}
    path: list[int] = []
    node = start
    while node not in seen:
        seen[node] = len(path)
        path.append(node)
        kids = child_idx[child_ptr[node] : child_ptr[node + 1]]
        node = int(kids[level[kids] < 0][0])
    cycle = path[seen[node] :]
    shown = [str(n) if names is None else repr(names[n]) for n in cycle[:8]]
    more = " -> ..." if len(cycle) > 8 else ""
    chain = " -> ".join(shown) + more + f" -> {shown[0]}"
    return f"cycle through {node_name(node, names)} (each reads the next: {chain})"


def _check_labels(labels: Any, num_nodes: int) -> np.ndarray | None:
    """Labels as a read-only int32 array of one label per node."""
    if labels is None:
        return None
    array = np.asarray(labels)
    if array.shape != (num_nodes,):
        raise ForestError(f"labels must have shape ({num_nodes},), got {array.shape}")
    if array.size == 0:
        return _readonly(np.zeros(0, dtype=np.int32))
    if array.dtype.kind not in "iu":
        raise ForestError(f"labels must be integers, got dtype {array.dtype}")
    low, high = int(array.min()), int(array.max())
    if low < _INT32_MIN or high > _INT32_MAX:
        node = int(np.flatnonzero((array < _INT32_MIN) | (array > _INT32_MAX))[0])
        raise ForestError(f"node {node} has label {int(array[node])}, outside int32")
    return _readonly(np.array(array, dtype=np.int32, copy=True))


def _check_words(words: Sequence[Any] | None, num_nodes: int) -> list[Any] | None:
    """Words as a list of one entry per node (None for internal nodes)."""
    if words is None:
        return None
    result = list(words)
    if len(result) != num_nodes:
        raise ForestError(f"words must have one entry per node ({num_nodes}), got {len(result)}")
    return result
