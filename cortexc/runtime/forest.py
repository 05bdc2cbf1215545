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
"""

from __future__ import annotations

import os
import re
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import numpy as np

from cortexc.errors import ForestError

__all__ = ["Forest"]

# Byte values used by the PTB tokenizer.
_OPEN_BYTE = ord("(")
_CLOSE_BYTE = ord(")")
_SPACE_BYTE = ord(" ")
_NEWLINE_BYTE = ord("\n")

# Token kinds in the PTB token stream; _NONE marks "no token" (line start/end).
_OPEN, _CLOSE, _ATOM, _NONE = 0, 1, 2, -1

# An atom is a label or a word: anything up to an ASCII space, a bracket or a
# line end. Only ASCII space separates tokens (SST words contain U+00A0).
_ATOM_RE = re.compile(r"[^ ()\n]+")

_INT32_MIN = int(np.iinfo(np.int32).min)
_INT32_MAX = int(np.iinfo(np.int32).max)


def _readonly(array: np.ndarray) -> np.ndarray:
    """Mark an array the forest owns as read-only (the forest is immutable)."""
    array.flags.writeable = False
    return array


def _gather_segments(ptr: np.ndarray, idx: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """Concatenate ``idx[ptr[n]:ptr[n+1]]`` for every n in ``nodes``, without a loop."""
    starts = ptr[nodes]
    lengths = ptr[nodes + 1] - starts
    total = int(lengths.sum())
    if total == 0:
        return idx[:0]
    # Position k of the output belongs to segment s; its source is starts[s] + (k - first_k[s]).
    first_k = np.cumsum(lengths) - lengths
    positions = np.repeat(starts - first_k, lengths) + np.arange(total, dtype=np.int64)
    return idx[positions]


def _counts_to_ptr(counts: np.ndarray) -> np.ndarray:
    """CSR offsets (length n+1, starting at 0) from per-row counts."""
    ptr = np.zeros(counts.shape[0] + 1, dtype=np.int64)
    np.cumsum(counts, out=ptr[1:])
    return ptr


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


def _kahn_levels(num_children: np.ndarray, parent_ptr: np.ndarray, parent_idx: np.ndarray) -> np.ndarray:
    """Levels by Kahn's algorithm, one NumPy step per level.

    A node is ready once all its children are done; the nodes made ready at
    step k have level k (their last child finished at step k-1, so k is one
    more than their highest child). Nodes on or above a cycle never become
    ready and keep level -1.
    """
    num_nodes = num_children.shape[0]
    level = np.full(num_nodes, -1, dtype=np.int32)
    pending = num_children.astype(np.int64, copy=True)
    frontier = np.flatnonzero(pending == 0)
    step = 0
    while frontier.size:
        level[frontier] = step
        readers = _gather_segments(parent_ptr, parent_idx, frontier)
        if readers.size == 0:
            break
        touched, hits = np.unique(readers, return_counts=True)
        pending[touched] -= hits
        frontier = touched[pending[touched] == 0]
        step += 1
    return level


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
    num_nodes: int
    num_trees: int
    num_levels: int
    max_children: int
    is_tree: bool

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
    ) -> None:
        """Derive every array from a valid-range children CSR; checks self-loops and cycles.

        ``names`` (the caller's node names, e.g. networkx nodes) only make error
        messages readable. ``level`` may be passed when already known (concat).
        """
        num_nodes = child_ptr.size - 1
        num_children = np.diff(child_ptr)
        owner = np.repeat(np.arange(num_nodes, dtype=np.int64), num_children)
        self_loops = np.flatnonzero(owner == child_idx)
        if self_loops.size:
            node = int(owner[self_loops[0]])
            raise ForestError(f"{_node_name(node, names)} reads itself (it is its own child)")

        # Edges are listed by owner, so a stable sort by child keeps each
        # child's parents in increasing order.
        by_child = np.argsort(child_idx, kind="stable")
        parent_idx = owner[by_child]
        num_parents = np.bincount(child_idx, minlength=num_nodes).astype(np.int64)
        parent_ptr = _counts_to_ptr(num_parents)
        parents = np.full(num_nodes, -1, dtype=np.int64)
        has_parent = num_parents > 0
        parents[has_parent] = parent_idx[parent_ptr[:-1][has_parent]]

        if level is None:
            level = _kahn_levels(num_children, parent_ptr, parent_idx)
            unfinished = np.flatnonzero(level < 0)
            if unfinished.size:
                raise ForestError(_cycle_message(int(unfinished[0]), level, child_ptr, child_idx, names))
        num_levels = int(level.max()) + 1 if num_nodes else 0
        level_order = np.argsort(level, kind="stable").astype(np.int64)
        level_ptr = _counts_to_ptr(np.bincount(level, minlength=num_levels).astype(np.int64))

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
        set_(self, "is_tree", bool(num_nodes == 0 or num_parents.max() <= 1))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Forest is immutable; cannot set {name!r}")

    def __repr__(self) -> str:
        kind = "" if self.is_tree else ", dag"
        return f"Forest(num_trees={self.num_trees}, num_nodes={self.num_nodes}, num_levels={self.num_levels}{kind})"

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
        child_ptr = _counts_to_ptr(np.bincount(owner, minlength=num_nodes).astype(np.int64))
        forest = cls.__new__(cls)
        forest._setup(child_ptr, child[order].astype(np.int64), labels, words, None, None)
        return forest

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
        """A forest (trees or a DAG) from a ``networkx.DiGraph``.

        An edge ``u -> v`` means v reads u (u is a child of v). Nodes are
        numbered in ``graph.nodes`` order; the children of v are in the order of
        ``graph.predecessors(v)`` (edge insertion order). With ``label_attr``
        every node must have that integer attribute; with ``word_attr`` a node's
        word is that attribute (None where absent).
        """
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
                raise ForestError(f"{_node_name(i, names)} reads itself (self-loop)")
            counts[i] = len(kids)
            child_list.extend(index[kid] for kid in kids)
        labels = None
        if label_attr is not None:
            label_values = []
            for i, name in enumerate(names):
                attrs = graph.nodes[name]
                if label_attr not in attrs:
                    raise ForestError(f"{_node_name(i, names)} has no {label_attr!r} attribute")
                label_values.append(attrs[label_attr])
            labels = label_values
        words = None
        if word_attr is not None:
            words = [graph.nodes[name].get(word_attr) for name in names]
        forest = cls.__new__(cls)
        forest._setup(
            _counts_to_ptr(counts),
            np.asarray(child_list, dtype=np.int64),
            labels,
            words,
            names,
            None,
        )
        return forest

    @classmethod
    def from_nested(cls, tree: Any) -> Forest:
        """ONE tree from nested tuples/lists.

        A tuple or list is an internal node whose items are its children (an
        empty one is a leaf with no value); anything else is a leaf whose value
        goes, as given, to ``words``. Nodes are numbered in post-order (children
        before parents, child 0 first), like ``from_ptb``. For several trees use
        ``Forest.concat([Forest.from_nested(t) for t in trees])``.
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
        return cls._from_parent_array(np.asarray(parents, dtype=np.int64), None, words)

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
        level = np.concatenate([np.zeros(0, dtype=np.int32)] + [f.level for f in parts])
        labels = None
        if all(f.labels is not None for f in parts):
            labels = np.concatenate([np.zeros(0, dtype=np.int32)] + [f.labels for f in parts])
        words = None
        if all(f.words is not None for f in parts):
            words = [word for f in parts for word in f.words]
        forest = cls.__new__(cls)
        forest._setup(child_ptr, child_idx, labels, words, None, level)
        return forest

    # --------------------------------------------------------------- PTB

    @classmethod
    def from_ptb_file(cls, path: str | os.PathLike[str]) -> Forest:
        """``from_ptb`` on a UTF-8 file, one bracketed tree per line."""
        with open(path, encoding="utf-8") as handle:
            return cls.from_ptb(handle)

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
        if isinstance(lines, bytes):
            lines = lines.decode("utf-8")
        if isinstance(lines, str):
            lines = lines.split("\n")
        rows: list[str] = []
        for line in lines:
            if isinstance(line, bytes):
                line = line.decode("utf-8")
            if not isinstance(line, str):
                raise ForestError(f"line {len(rows) + 1}: expected a str, got {type(line).__name__}")
            line = line.rstrip("\r\n")
            if "\n" in line:
                rows.extend(part.rstrip("\r") for part in line.split("\n"))
            else:
                rows.append(line)
        return _parse_ptb("\n".join(rows))

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
        return cls._from_parent_array(parents, labels, words)

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
        return cls(_counts_to_ptr(counts), np.concatenate(chosen), labels=labels, words=words)


# ---------------------------------------------------------------- helpers


def _node_name(node: int, names: Sequence[Hashable] | None) -> str:
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
    return f"cycle through {_node_name(node, names)} (each reads the next: {chain})"


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


def _parse_ptb(text: str) -> Forest:
    """Parse PTB text (lines joined by newlines) with vectorised bracket matching.

    Tokens are found on the UTF-8 bytes with NumPy masks; atom strings come
    from one regex pass over the text (the same atom definition, so the i-th
    atom token is the i-th regex match). Depth is a cumsum of +1/-1; sorting
    brackets by (depth, position) makes each open immediately followed by its
    close; the post-order id of a node is the rank of its close bracket, and
    its parent is the last open one level up before its own open.
    """
    data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    is_open = data == _OPEN_BYTE
    is_close = data == _CLOSE_BYTE
    is_atom_byte = ~(is_open | is_close | (data == _SPACE_BYTE) | (data == _NEWLINE_BYTE))
    atom_start = is_atom_byte.copy()
    atom_start[1:] &= ~is_atom_byte[:-1]
    tok_pos = np.flatnonzero(is_open | is_close | atom_start)
    num_tokens = tok_pos.size
    if num_tokens == 0:
        return Forest.from_parents(np.zeros(0, dtype=np.int64), labels=[], words=[])

    tok_byte = data[tok_pos]
    kind = np.full(num_tokens, _ATOM, dtype=np.int8)
    kind[tok_byte == _OPEN_BYTE] = _OPEN
    kind[tok_byte == _CLOSE_BYTE] = _CLOSE
    newline_pos = np.flatnonzero(data == _NEWLINE_BYTE)
    line = np.searchsorted(newline_pos, tok_pos)  # 0-based line of each token
    atoms = _ATOM_RE.findall(text)
    atom_objects = np.array(atoms, dtype=object)
    is_atom = kind == _ATOM
    atom_rank = np.cumsum(is_atom) - 1  # index into `atoms` for atom tokens
    if len(atoms) != int(is_atom.sum()):  # cannot happen: both use the same atom definition
        raise RuntimeError("PTB tokenizer out of step with its regex")

    first = np.ones(num_tokens, dtype=bool)
    first[1:] = line[1:] != line[:-1]
    last = np.ones(num_tokens, dtype=bool)
    last[:-1] = first[1:]
    delta = (kind == _OPEN).astype(np.int64) - (kind == _CLOSE).astype(np.int64)
    # Bracket depth counted from the start of the text. Up to the first
    # unbalanced line every line starts at depth 0, so it is the depth within
    # the line wherever it matters: at the first error reported, and
    # everywhere when there is no error.
    depth_after = np.cumsum(delta)
    depth_before = depth_after - delta
    prev_kind = np.empty(num_tokens, dtype=np.int8)
    prev_kind[0] = _NONE
    prev_kind[1:] = kind[:-1]
    prev_kind[first] = _NONE
    next_kind = np.empty(num_tokens, dtype=np.int8)
    next_kind[-1] = _NONE
    next_kind[:-1] = kind[1:]
    next_kind[last] = _NONE
    is_label = is_atom & (prev_kind == _OPEN)
    after_label = np.zeros(num_tokens, dtype=bool)
    after_label[1:] = is_label[:-1]
    is_word = is_atom & after_label & ~first

    def token_text(t: int) -> str:
        if kind[t] == _ATOM:
            return repr(atoms[int(atom_rank[t])])
        return "'('" if kind[t] == _OPEN else "')'"

    # (mask, message) pairs in priority order; the earliest flagged token wins.
    checks: list[tuple[np.ndarray, Any]] = [
        (
            first & (kind == _ATOM),
            lambda t: f"text outside brackets: {token_text(t)}",
        ),
        (
            (kind == _CLOSE) & (depth_after < 0),
            lambda t: "unbalanced brackets: ')' closes nothing",
        ),
        (
            ~first & (depth_before == 0) & (kind == _OPEN),
            lambda t: "a second tree starts on the line (one tree per line)",
        ),
        (
            ~first & (depth_before == 0) & (kind == _ATOM),
            lambda t: f"text outside brackets after the tree: {token_text(t)}",
        ),
        (
            (kind == _OPEN) & (next_kind == _OPEN),
            lambda t: "node has no label ('(' followed by '(')",
        ),
        (
            (kind == _OPEN) & (next_kind == _CLOSE),
            lambda t: "empty node '()'",
        ),
        (
            is_label & (next_kind == _CLOSE),
            lambda t: f"node ({atoms[int(atom_rank[t])]}) has neither a word nor children",
        ),
        (
            is_atom & ~is_label & ~is_word & (prev_kind == _ATOM),
            lambda t: f"leaf has more than one word: {token_text(t - 1)} then {token_text(t)}",
        ),
        (
            is_atom & ~is_label & ~is_word & (prev_kind == _CLOSE) & (depth_before > 0),
            lambda t: f"word {token_text(t)} after a child node (a node has a word or children)",
        ),
        (
            is_word & (next_kind == _OPEN),
            lambda t: f"word {token_text(t)} followed by a child node (a node has a word or children)",
        ),
        (
            last & (depth_after > 0),
            lambda t: f"unbalanced brackets: {int(depth_after[t])} '(' not closed by the end of the line",
        ),
    ]
    worst: tuple[int, int] | None = None
    for priority, (mask, _) in enumerate(checks):
        if mask.any():
            candidate = (int(np.argmax(mask)), priority)
            if worst is None or candidate < worst:
                worst = candidate
    if worst is not None:
        token, priority = worst
        where = _ptb_where(text, newline_pos, tok_pos, line, token)
        raise ForestError(where + checks[priority][1](token))

    label_tok = np.flatnonzero(is_label)
    label_text = atom_objects[atom_rank[label_tok]]
    try:
        label_values = label_text.astype(np.int64)  # int() on each label, in C
        labels_ok = not np.any((label_values < _INT32_MIN) | (label_values > _INT32_MAX))
    except (ValueError, OverflowError):
        labels_ok = False
    if not labels_ok:  # find the first bad label to report it
        for k, value in enumerate(label_text.tolist()):
            try:
                number = int(value)
            except ValueError:
                problem = "is not an integer"
            else:
                if _INT32_MIN <= number <= _INT32_MAX:
                    continue
                problem = "does not fit in int32"
            where = _ptb_where(text, newline_pos, tok_pos, line, int(label_tok[k]))
            raise ForestError(where + f"label {value!r} {problem}")

    # Pair brackets: within one depth, opens and closes alternate in position order.
    bracket_tok = np.flatnonzero(~is_atom)
    bracket_depth = np.where(kind[bracket_tok] == _OPEN, depth_after[bracket_tok], depth_before[bracket_tok])
    pairs = bracket_tok[np.lexsort((bracket_tok, bracket_depth))].reshape(-1, 2)
    close_rank = np.cumsum(kind == _CLOSE) - 1
    node_of_token = np.full(num_tokens, -1, dtype=np.int64)
    node_of_token[pairs[:, 0]] = close_rank[pairs[:, 1]]

    open_tok = np.flatnonzero(kind == _OPEN)  # label_tok == open_tok + 1, same order
    open_depth = depth_after[open_tok]
    stride = num_tokens + 1
    keys = open_depth * stride + open_tok
    key_order = np.argsort(keys)
    sorted_keys = keys[key_order]
    before = np.searchsorted(sorted_keys, (open_depth - 1) * stride + open_tok) - 1
    parent_open = open_tok[key_order[np.maximum(before, 0)]]
    num_nodes = open_tok.size
    open_node = node_of_token[open_tok]
    parents = np.empty(num_nodes, dtype=np.int64)
    parents[open_node] = np.where(open_depth > 1, node_of_token[parent_open], -1)
    labels = np.empty(num_nodes, dtype=np.int32)
    labels[open_node] = label_values

    leaf_open = open_tok[kind[open_tok + 2] == _ATOM]
    words = np.full(num_nodes, None, dtype=object)
    words[node_of_token[leaf_open]] = atom_objects[atom_rank[leaf_open + 2]]
    return Forest._from_parent_array(parents, labels, words.tolist())


def _ptb_where(text: str, newline_pos: np.ndarray, tok_pos: np.ndarray, line: np.ndarray, token: int) -> str:
    """``line L, column C: `` for an error at a token (1-based, columns in characters)."""
    line_no = int(line[token])
    start = 0 if line_no == 0 else int(newline_pos[line_no - 1]) + 1
    prefix = text.encode("utf-8")[start : int(tok_pos[token])]
    return f"line {line_no + 1}, column {len(prefix.decode('utf-8')) + 1}: "
