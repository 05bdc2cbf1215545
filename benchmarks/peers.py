"""Hand-written PyTorch peers of the binary Tree-LSTM cell, for the benchmarks.

The cell is ``BinaryTreeLSTM`` of ``examples/binary_treelstm.cell`` (Tai et
al. 2015, N-ary with N = 2, words only at leaves). The peers are the two ways
people run it without a compiler, so cortexc's numbers mean something:

- `TorchPerNode`: the usual research code, one recursive Python call and a
  handful of small torch ops per node.
- `TorchLevelBatched`: the TF Fold / DGL way, one batched step per level of
  the whole forest (gather children, one GEMM, elementwise gates).

Both take the same params dict as cortexc (``E, W_iou, b_iou, U_iou, U_f,
b_f, W_s, b_s`` with the cell's shapes), the same `Forest` and the same word
ids, and return NumPy ``h``, ``c`` ``[N, H]`` and ``logits`` ``[N, C]`` in the
forest's node order, so they can be checked against `cortexc.reference.run`.

`matmul_roofline` and `forward_flops` turn a timing into a fraction of what
``torch.matmul`` reaches on the very GEMM shapes a level-batched forward needs.

A node with fewer than two children reads zeros for the missing child, as the
cell language defines ``child[k].s``; SST trees never have such nodes.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from cortexc.runtime.forest import Forest

__all__ = [
    "ATTN_PARAM_NAMES",
    "AttnLevelPlan",
    "PARAM_NAMES",
    "LevelPlan",
    "TorchLevelBatched",
    "TorchLevelBatchedAttn",
    "TorchPerNode",
    "TreeDims",
    "forward_flops",
    "level_gemm_shapes",
    "matmul_roofline",
]

PARAM_NAMES = ("E", "W_iou", "b_iou", "U_iou", "U_f", "b_f", "W_s", "b_s")


@dataclass(frozen=True)
class TreeDims:
    """The cell's dims (V words, X embedding, H hidden, C classes), read off the params."""

    V: int
    X: int
    H: int
    C: int

    @classmethod
    def of(cls, params: Mapping[str, np.ndarray]) -> TreeDims:
        """Dims from the param shapes, checking every shape against the cell's declarations."""
        missing = [name for name in PARAM_NAMES if name not in params]
        if missing:
            raise ValueError(f"missing params: {', '.join(missing)}")
        v, x = np.shape(params["E"])
        c, h = np.shape(params["W_s"])
        expected = {
            "E": (v, x),
            "W_iou": (3 * h, x),
            "b_iou": (3 * h,),
            "U_iou": (3 * h, 2 * h),
            "U_f": (2 * h, 2 * h),
            "b_f": (2 * h,),
            "W_s": (c, h),
            "b_s": (c,),
        }
        for name, shape in expected.items():
            if np.shape(params[name]) != shape:
                raise ValueError(f"param {name} must have shape {shape}, got {np.shape(params[name])}")
        return cls(V=int(v), X=int(x), H=int(h), C=int(c))


def _tensors(params: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Float32 torch copies of the params, made once (not per call) like an nn.Module's weights."""
    return {name: torch.from_numpy(np.array(params[name], dtype=np.float32, copy=True)) for name in PARAM_NAMES}


def _check_words(forest: Forest, word: np.ndarray, vocab_size: int) -> np.ndarray:
    """Word ids as int64, one per node, every one in ``[0, V)`` (torch would fail less clearly)."""
    ids = np.asarray(word)
    if ids.shape != (forest.num_nodes,):
        raise ValueError(f"word must have one id per node ({forest.num_nodes}), got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"word ids must be integers, got dtype {ids.dtype}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        node = int(np.flatnonzero((ids < 0) | (ids >= vocab_size))[0])
        raise ValueError(f"node {node} has word id {int(ids[node])}, outside [0, {vocab_size})")
    return ids.astype(np.int64)


def _check_arity(forest: Forest) -> None:
    """The cell is ``tree(arity = 2)``: reject DAG nodes and nodes with more than two children."""
    if not forest.is_tree:
        raise ValueError("the binary Tree-LSTM runs on trees; this forest has a node with several parents")
    if forest.num_nodes and int(forest.num_children.max()) > 2:
        node = int(np.argmax(forest.num_children))
        raise ValueError(f"node {node} has {int(forest.num_children[node])} children; the cell's arity is 2")


# ------------------------------------------------------------ per node


def leaf_step(x: torch.Tensor, w: Mapping[str, torch.Tensor], hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cell's leaf block for one word vector: (h, c)."""
    iou = torch.nn.functional.linear(x, w["W_iou"], w["b_iou"])
    c = torch.sigmoid(iou[:hidden]) * torch.tanh(iou[2 * hidden :])
    return torch.sigmoid(iou[hidden : 2 * hidden]) * torch.tanh(c), c


def node_step(
    h_left: torch.Tensor,
    c_left: torch.Tensor,
    h_right: torch.Tensor,
    c_right: torch.Tensor,
    w: Mapping[str, torch.Tensor],
    hidden: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cell's node block for one node from its children's states: (h, c)."""
    linear = torch.nn.functional.linear
    hc = torch.cat((h_left, h_right))
    iou = linear(hc, w["U_iou"], w["b_iou"])
    f = torch.sigmoid(linear(hc, w["U_f"], w["b_f"]))
    c = torch.sigmoid(iou[:hidden]) * torch.tanh(iou[2 * hidden :]) + f[:hidden] * c_left + f[hidden:] * c_right
    return torch.sigmoid(iou[hidden : 2 * hidden]) * torch.tanh(c), c


class TorchPerNode:
    """One recursive call per node, as in the reference Tree-LSTM code people start from.

    Each call computes the node's children first, then its own gates with
    ``F.linear`` on one vector, and the node's logits right there, the way
    an ``nn.Module`` with a ``forward(tree)`` recursion does it.
    """

    def __init__(self, params: Mapping[str, np.ndarray]) -> None:
        self.dims = TreeDims.of(params)
        self.weights = _tensors(params)

    def prepare(self, forest: Forest, word: np.ndarray) -> tuple[list[list[int]], list[int], list[int]]:
        """Children lists, word ids and roots as Python objects: the "tree object" the recursion walks."""
        _check_arity(forest)
        ids = _check_words(forest, word, self.dims.V)
        ptr = forest.child_ptr.tolist()
        idx = forest.child_idx.tolist()
        children = [idx[ptr[i] : ptr[i + 1]] for i in range(forest.num_nodes)]
        return children, ids.tolist(), forest.roots.tolist()

    def run(self, prepared: tuple[list[list[int]], list[int], list[int]]) -> dict[str, np.ndarray]:
        """States and logits of every node, in node order."""
        children, ids, roots = prepared
        w = self.weights
        dims = self.dims
        hidden = dims.H
        n = len(children)
        h_out: list[torch.Tensor | None] = [None] * n
        c_out: list[torch.Tensor | None] = [None] * n
        logits_out: list[torch.Tensor | None] = [None] * n
        zero = torch.zeros(hidden)
        linear = torch.nn.functional.linear

        def forward(node: int) -> tuple[torch.Tensor, torch.Tensor]:
            kids = children[node]
            if not kids:
                h, c = leaf_step(w["E"][ids[node]], w, hidden)
            else:
                h_left, c_left = forward(kids[0])
                h_right, c_right = forward(kids[1]) if len(kids) > 1 else (zero, zero)
                h, c = node_step(h_left, c_left, h_right, c_right, w, hidden)
            h_out[node], c_out[node] = h, c
            logits_out[node] = linear(h, w["W_s"], w["b_s"])
            return h, c

        with torch.no_grad():
            for root in roots:
                forward(root)
            if n == 0:
                return _empty(dims)
            return {
                "h": torch.stack(h_out).numpy(),
                "c": torch.stack(c_out).numpy(),
                "logits": torch.stack(logits_out).numpy(),
            }

    def __call__(self, forest: Forest, word: np.ndarray) -> dict[str, np.ndarray]:
        return self.run(self.prepare(forest, word))


def _empty(dims: TreeDims) -> dict[str, np.ndarray]:
    """The result for a forest without nodes."""
    return {
        "h": np.zeros((0, dims.H), np.float32),
        "c": np.zeros((0, dims.H), np.float32),
        "logits": np.zeros((0, dims.C), np.float32),
    }


# ------------------------------------------------------- level batched


@dataclass(frozen=True)
class LevelPlan:
    """Index arrays for a level-batched forward, computed once per forest.

    States live in a buffer laid out in *level order* (``forest.level_order``)
    with one extra zero row at the end, so each level writes one contiguous
    slice (no scatter), a missing child points at the zero row, and the
    forest's node order is one gather at the end.

    - ``leaf_words``: word id of each leaf (level 0), in level order.
    - ``level_ptr``: Python ints, level k is rows ``level_ptr[k]:level_ptr[k+1]``.
    - ``child_rows``: per level >= 1, buffer rows of the children interleaved
      ``[left0, right0, left1, right1, ...]``, so one gather gives ``[n, 2H]``.
    - ``node_rows``: buffer row of each node, in node order.
    """

    num_nodes: int
    leaf_words: torch.Tensor
    level_ptr: tuple[int, ...]
    child_rows: tuple[torch.Tensor, ...]
    node_rows: torch.Tensor


class TorchLevelBatched:
    """The forest run level by level, every node of a level in one batched step.

    Leaves: one embedding gather and one GEMM with ``W_iou``. Internal levels:
    one gather of the children's ``h`` and ``c``, one GEMM with ``U_iou`` and
    ``U_f`` stacked into a ``[5H, 2H]`` weight, the gates elementwise. Logits:
    one GEMM over all nodes at the end.
    """

    def __init__(self, params: Mapping[str, np.ndarray]) -> None:
        self.dims = TreeDims.of(params)
        w = _tensors(params)
        self.E = w["E"]
        self.W_iou = w["W_iou"]
        self.b_iou = w["b_iou"]
        self.U = torch.cat((w["U_iou"], w["U_f"]))  # [5H, 2H]: i, o, u, f_left, f_right
        self.b = torch.cat((w["b_iou"], w["b_f"]))
        self.W_s = w["W_s"]
        self.b_s = w["b_s"]

    def prepare(self, forest: Forest, word: np.ndarray) -> LevelPlan:
        """Index arrays for every level, in NumPy (vectorised, no work per node in Python)."""
        _check_arity(forest)
        ids = _check_words(forest, word, self.dims.V)
        n = forest.num_nodes
        order = forest.level_order
        row_of = np.empty(n, dtype=np.int64)
        row_of[order] = np.arange(n, dtype=np.int64)
        level_ptr = tuple(int(p) for p in forest.level_ptr)
        # Children of each node as two columns, the zero row (n) where a child is missing.
        pair = np.full((n, 2), n, dtype=np.int64)
        counts = forest.num_children
        owners = np.repeat(np.arange(n, dtype=np.int64), counts)
        slots = np.arange(forest.child_idx.size, dtype=np.int64) - forest.child_ptr[owners]
        pair[owners, slots] = row_of[forest.child_idx]
        child_rows = []
        for k in range(1, len(level_ptr) - 1):
            nodes = order[level_ptr[k] : level_ptr[k + 1]]
            child_rows.append(torch.from_numpy(pair[nodes].reshape(-1)))
        leaves = order[level_ptr[0] : level_ptr[1]] if n else order
        return LevelPlan(
            num_nodes=n,
            leaf_words=torch.from_numpy(ids[leaves]),
            level_ptr=level_ptr,
            child_rows=tuple(child_rows),
            node_rows=torch.from_numpy(row_of),
        )

    def run(self, plan: LevelPlan) -> dict[str, np.ndarray]:
        """States and logits of every node, in node order."""
        n = plan.num_nodes
        hidden = self.dims.H
        if n == 0:
            return _empty(self.dims)
        with torch.no_grad():
            h = torch.zeros(n + 1, hidden)
            c = torch.zeros(n + 1, hidden)
            num_leaves = plan.level_ptr[1]
            x = self.E.index_select(0, plan.leaf_words)
            iou = torch.addmm(self.b_iou, x, self.W_iou.t())
            gate = torch.sigmoid(iou[:, : 2 * hidden])
            c_new = gate[:, :hidden] * torch.tanh(iou[:, 2 * hidden :])
            c[:num_leaves] = c_new
            h[:num_leaves] = gate[:, hidden:] * torch.tanh(c_new)
            for k, rows in enumerate(plan.child_rows, start=1):
                lo, hi = plan.level_ptr[k], plan.level_ptr[k + 1]
                count = hi - lo
                hc = h.index_select(0, rows).view(count, 2 * hidden)
                cc = c.index_select(0, rows).view(count, 2, hidden)
                g = torch.addmm(self.b, hc, self.U.t())  # [count, 5H]
                io = torch.sigmoid(g[:, : 2 * hidden])
                u = torch.tanh(g[:, 2 * hidden : 3 * hidden])
                f = torch.sigmoid(g[:, 3 * hidden :]).view(count, 2, hidden)
                c_new = io[:, :hidden] * u + (f * cc).sum(dim=1)
                c[lo:hi] = c_new
                h[lo:hi] = io[:, hidden:] * torch.tanh(c_new)
            h_nodes = h.index_select(0, plan.node_rows)
            c_nodes = c.index_select(0, plan.node_rows)
            logits = torch.addmm(self.b_s, h_nodes, self.W_s.t())
            return {"h": h_nodes.numpy(), "c": c_nodes.numpy(), "logits": logits.numpy()}

    def __call__(self, forest: Forest, word: np.ndarray) -> dict[str, np.ndarray]:
        return self.run(self.prepare(forest, word))


# ------------------------------------------------------------ roofline


def level_gemm_shapes(forest: Forest, dims: TreeDims) -> list[tuple[int, int, int]]:
    """``(M, K, N)`` of every GEMM a level-batched forward does on ``forest``.

    The leaf GEMM (rows = leaves, K = X, N = 3H), one recurrent GEMM per
    internal level (rows = nodes of the level, K = 2H, N = 5H: U_iou and U_f
    stacked) and the logits GEMM (rows = all nodes, K = H, N = C).
    """
    if forest.num_nodes == 0:
        return []
    sizes = np.diff(forest.level_ptr).tolist()
    shapes = [(int(sizes[0]), dims.X, 3 * dims.H)]
    shapes += [(int(m), 2 * dims.H, 5 * dims.H) for m in sizes[1:]]
    shapes.append((forest.num_nodes, dims.H, dims.C))
    return shapes


def forward_flops(forest: Forest, dims: TreeDims) -> int:
    """GEMM FLOPs of one forward: 2*X*3H per leaf, 2*2H*5H per internal node, 2*H*C per node's logits.

    Elementwise work is left out: it is O(H) per node against O(H^2) for the GEMMs.
    """
    leaves = int(np.count_nonzero(forest.num_children == 0))
    internal = forest.num_nodes - leaves
    h, x, c = dims.H, dims.X, dims.C
    return leaves * 2 * x * 3 * h + internal * 2 * (2 * h) * (5 * h) + forest.num_nodes * 2 * h * c


def _time_matmul(m: int, k: int, n: int, repeats: int, budget_s: float, generator: torch.Generator) -> float:
    """Best seconds of one float32 ``torch.matmul`` of ``[m, k] @ [k, n]`` (after one warm-up call).

    The minimum over single calls, not a median: a roofline is what the
    hardware can reach, and on a shared machine the slower calls measure other
    processes (a multi-threaded GEMM waits for its slowest thread to be
    scheduled). At least ``repeats`` calls, more while under ``budget_s``.
    """
    a = torch.randn(m, k, generator=generator)
    b = torch.randn(k, n, generator=generator)
    torch.matmul(a, b)
    best = float("inf")
    spent = 0.0
    calls = 0
    while calls < repeats or (spent < budget_s and calls < 1000):
        start = time.perf_counter()
        torch.matmul(a, b)
        elapsed = time.perf_counter() - start
        best = min(best, elapsed)
        spent += elapsed
        calls += 1
    return best


def matmul_roofline(shapes: Iterable[tuple[int, int, int]], repeats: int = 5, budget_s: float = 0.03) -> float:
    """GFLOP/s that ``torch.matmul`` (float32, current thread count) reaches on these GEMM shapes.

    It is the total FLOPs of the shapes over their total measured time (each
    distinct shape timed once, counted as often as it occurs), so it is what a
    level-batched forward could reach if it did nothing but its GEMMs. Divide
    an implementation's GFLOP/s (`forward_flops` / time) by it for the
    fraction of roofline.
    """
    counts = Counter((int(m), int(k), int(n)) for m, k, n in shapes if m > 0)
    if not counts:
        return float("nan")
    generator = torch.Generator().manual_seed(0)
    total_flops = 0.0
    total_time = 0.0
    with torch.no_grad():
        for (m, k, n), count in sorted(counts.items()):
            total_flops += count * 2.0 * m * k * n
            total_time += count * _time_matmul(m, k, n, repeats, budget_s, generator)
    return total_flops / total_time / 1e9


# ------------------------------------------------------------ the attentive Tree-LSTM

ATTN_PARAM_NAMES = ("W_iou", "U_iou", "b_iou", "W_f", "U_f", "b_f", "W_a", "w_a")


@dataclass(frozen=True)
class AttnLevelPlan:
    """Index tensors of a forest for `TorchLevelBatchedAttn`: rows in level order, per level its child
    edges (the child's row and the parent's place in the level)."""

    num_nodes: int
    level_ptr: tuple[int, ...]
    order: torch.Tensor  # node id of each row
    node_rows: torch.Tensor  # row of each node id
    child_rows: tuple[torch.Tensor, ...]  # per internal level: the rows of its child edges
    parents: tuple[torch.Tensor, ...]  # per internal level: the parent of each edge (0..count-1)


class TorchLevelBatchedAttn:
    """The attentive Tree-LSTM of ``examples/attn_treelstm.cell`` level by level, DGL style.

    The input projections ``W_iou @ x`` and ``W_f @ x`` of every node are one GEMM each (as the compiled
    code hoists them); then per level: gather the children's ``h`` and ``c``, the scores
    ``w_a tanh(W_a h_k)`` (two GEMMs over the edges), the softmax across each node's children as a
    segmented max (``scatter_reduce``), exponentials and a segmented sum (``index_add``), the attended
    ``h_att``, the forget gates (one GEMM over the edges), ``U_iou @ h_att`` (one GEMM over the nodes).
    Any number of children per node.
    """

    def __init__(self, params: Mapping[str, np.ndarray]) -> None:
        w = {k: torch.from_numpy(np.array(params[k], dtype=np.float32)) for k in ATTN_PARAM_NAMES}  # own copies
        self.w = w
        self.W_x = torch.cat((w["W_iou"], w["W_f"]))  # [4H, X]
        self.b_x = torch.cat((w["b_iou"], w["b_f"]))
        self.hidden = w["U_f"].shape[0]

    def prepare(self, forest: Forest) -> AttnLevelPlan:
        n = forest.num_nodes
        order = forest.level_order
        row_of = np.empty(n, dtype=np.int64)
        row_of[order] = np.arange(n, dtype=np.int64)
        level_ptr = tuple(int(p) for p in forest.level_ptr)
        child_rows, parents = [], []
        for k in range(1, len(level_ptr) - 1):
            nodes = order[level_ptr[k] : level_ptr[k + 1]]
            counts = forest.num_children[nodes]
            starts = forest.child_ptr[nodes]
            edges = np.repeat(starts - np.r_[0, np.cumsum(counts)[:-1]], counts) + np.arange(counts.sum())
            child_rows.append(torch.from_numpy(row_of[forest.child_idx[edges]]))
            parents.append(torch.from_numpy(np.repeat(np.arange(len(nodes), dtype=np.int64), counts)))
        return AttnLevelPlan(
            n, level_ptr, torch.from_numpy(np.array(order)), torch.from_numpy(row_of), tuple(child_rows), tuple(parents)
        )

    def run(self, plan: AttnLevelPlan, x: np.ndarray) -> dict[str, np.ndarray]:
        H, w, n = self.hidden, self.w, plan.num_nodes
        with torch.no_grad():
            xs = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).index_select(0, plan.order)
            wx = torch.addmm(self.b_x, xs, self.W_x.t())  # [N, 4H] in level order: iou, f
            h = torch.empty(n, H)
            c = torch.empty(n, H)
            leaves = plan.level_ptr[1] if n else 0
            gate = torch.sigmoid(wx[:leaves, : 2 * H])
            c[:leaves] = gate[:, :H] * torch.tanh(wx[:leaves, 2 * H : 3 * H])
            h[:leaves] = gate[:, H : 2 * H] * torch.tanh(c[:leaves])
            for k, (rows, parent) in enumerate(zip(plan.child_rows, plan.parents), start=1):
                lo, hi = plan.level_ptr[k], plan.level_ptr[k + 1]
                count = hi - lo
                ch, cc = h.index_select(0, rows), c.index_select(0, rows)
                scores = torch.tanh(ch @ w["W_a"].t()) @ w["w_a"].t()  # [E, 1]
                top = torch.full((count, 1), -torch.inf).scatter_reduce(0, parent[:, None], scores, "amax")
                e = torch.exp(scores - top.index_select(0, parent))
                total = torch.zeros(count, 1).index_add_(0, parent, e)
                a = e / total.index_select(0, parent)
                h_att = torch.zeros(count, H).index_add_(0, parent, a * ch)
                f = torch.sigmoid(torch.addmm(wx[lo:hi, 3 * H :].index_select(0, parent), ch, w["U_f"].t()))
                fc = torch.zeros(count, H).index_add_(0, parent, f * cc)
                iou = torch.addmm(wx[lo:hi, : 3 * H], h_att, w["U_iou"].t())
                gate = torch.sigmoid(iou[:, : 2 * H])
                c[lo:hi] = gate[:, :H] * torch.tanh(iou[:, 2 * H :]) + fc
                h[lo:hi] = gate[:, H : 2 * H] * torch.tanh(c[lo:hi])
            return {"h": h.index_select(0, plan.node_rows).numpy(), "c": c.index_select(0, plan.node_rows).numpy()}

    def __call__(self, forest: Forest, x: np.ndarray) -> dict[str, np.ndarray]:
        return self.run(self.prepare(forest), x)
