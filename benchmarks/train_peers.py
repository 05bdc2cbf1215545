"""Hand-written PyTorch *training* peers of the binary Tree-LSTM cell, for `bench_train.py`.

The cell is ``BinaryTreeLSTM`` of ``examples/binary_treelstm.cell``; the
forward math is that of `benchmarks.peers` (which is checked against
cortexc's interpreter), here with autograd and an optimizer:

- `TorchPerNodeTrain`: the usual research code, one recursive Python call
  per node (a handful of small torch ops each), logits per node, autograd
  through the whole recursion.
- `TorchLevelBatchedTrain`: the TF Fold / DGL way, one batched step per level
  of the whole forest (one ``index_select`` of the children's states, one GEMM
  with ``U_iou`` and ``U_f`` stacked, the gates elementwise), autograd through
  it. The index arrays are made in NumPy, once per batch, by `prepare`
  (timed apart from the compute by the benchmark).

Both hold the params as float32 leaf tensors with the cell's names and
shapes (``E [V, X], W_iou [3H, X], b_iou [3H], U_iou [3H, 2H], U_f [2H, 2H],
b_f [2H], W_s [C, H], b_s [C]``), train with the mean over *every node* of the
softmax cross-entropy of the node's logits against its label (Tai et al. 2015
on SST), and step with ``torch.optim.Adagrad`` (lr 0.05 by default). The
embedding gradient is dense, as cortexc's is. Gate order inside ``iou`` is
the cell's: ``i = iou[0:H]``, ``o = iou[H:2H]``, ``u = iou[2H:3H]``. A
node with fewer than two children reads zeros for the missing child (SST
trees have none such).

API, for both classes::

    model = TorchLevelBatchedTrain(params, lr=0.05)
    loss = model.step(forest, word_ids, labels)     # forward, loss, backward, Adagrad step
    grads = model.grads(forest, word_ids, labels)   # {name: ndarray}, no step taken
    logits = model.logits(forest, word_ids)         # [N, C] ndarray, node order, no autograd
    model.numpy_params()                            # {name: ndarray} copies
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from benchmarks.peers import PARAM_NAMES, TreeDims, _check_arity, _check_words, leaf_step, node_step
from cortexc.runtime.forest import Forest

__all__ = ["TorchLevelBatchedTrain", "TorchPerNodeTrain", "TrainLevelPlan", "TrainPerNodePlan"]


def _check_labels(forest: Forest, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """Labels as int64, one per node, every one in ``[0, C)``."""
    array = np.asarray(labels)
    if array.shape != (forest.num_nodes,):
        raise ValueError(f"labels must have one entry per node ({forest.num_nodes}), got shape {array.shape}")
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"labels must be integers, got dtype {array.dtype}")
    if array.size and (array.min() < 0 or array.max() >= num_classes):
        raise ValueError(f"labels must be in [0, {num_classes})")
    return array.astype(np.int64)


class _TrainPeer:
    """Params as leaf tensors, an Adagrad optimizer, and the step / grads / logits API on a prepared plan."""

    def __init__(self, params: Mapping[str, np.ndarray], lr: float = 0.05) -> None:
        self.dims = TreeDims.of(params)
        self.weights: dict[str, torch.Tensor] = {
            name: torch.nn.Parameter(torch.from_numpy(np.array(params[name], dtype=np.float32, copy=True)))
            for name in PARAM_NAMES
        }
        # torch's defaults otherwise: eps 1e-10, initial accumulator 0, no lr decay (as cortexc.train.Adagrad).
        self.optimizer = torch.optim.Adagrad(list(self.weights.values()), lr=lr)

    # Subclasses: `prepare` (NumPy/Python index work) and `_logits_and_targets` (torch compute).
    def prepare(self, forest: Forest, word: np.ndarray, labels: np.ndarray | None = None):
        raise NotImplementedError

    def _logits_and_targets(self, plan) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def _node_logits(self, plan) -> torch.Tensor:
        raise NotImplementedError

    def loss(self, plan) -> torch.Tensor:
        """Mean over all nodes of the softmax cross-entropy (a scalar tensor with autograd)."""
        logits, targets = self._logits_and_targets(plan)
        if targets is None:
            raise ValueError("the plan has no labels: prepare(forest, word, labels)")
        return torch.nn.functional.cross_entropy(logits, targets)

    def step_prepared(self, plan, timings: dict[str, float] | None = None) -> float:
        """One training step on a prepared batch: forward, loss, backward, Adagrad. Returns the loss.

        With ``timings``, adds the seconds of each phase to its ``"forward"`` (forward and loss),
        ``"backward"`` and ``"optimizer"`` (zero_grad and step) entries.
        """
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(plan)
        forward_end = time.perf_counter()
        loss.backward()
        backward_end = time.perf_counter()
        self.optimizer.step()
        end = time.perf_counter()
        if timings is not None:
            for key, seconds in (
                ("forward", forward_end - start),
                ("backward", backward_end - forward_end),
                ("optimizer", end - backward_end),
            ):
                timings[key] = timings.get(key, 0.0) + seconds
        return float(loss.detach())

    def step(self, forest: Forest, word: np.ndarray, labels: np.ndarray) -> float:
        """`prepare` then `step_prepared`."""
        return self.step_prepared(self.prepare(forest, word, labels))

    def grads(self, forest: Forest, word: np.ndarray, labels: np.ndarray) -> dict[str, np.ndarray]:
        """Gradient of the mean per-node cross-entropy with respect to every param (no step taken)."""
        plan = self.prepare(forest, word, labels)
        for weight in self.weights.values():
            weight.grad = None
        self.loss(plan).backward()
        out = {}
        for name, weight in self.weights.items():
            grad = weight.grad
            out[name] = np.zeros(tuple(weight.shape), np.float32) if grad is None else grad.numpy().copy()
            weight.grad = None
        return out

    def logits(self, forest: Forest, word: np.ndarray) -> np.ndarray:
        """``[N, C]`` logits in the forest's node order, without autograd (for evaluation)."""
        with torch.no_grad():
            return self._node_logits(self.prepare(forest, word)).numpy()

    def numpy_params(self) -> dict[str, np.ndarray]:
        """Copies of the current params, by the cell's names."""
        return {name: weight.detach().numpy().copy() for name, weight in self.weights.items()}


# ------------------------------------------------------------ per node


@dataclass(frozen=True)
class TrainPerNodePlan:
    """The "tree object" the recursion walks: children lists, leaf rows, roots, plus word ids and labels."""

    children: list[list[int]]
    roots: list[int]
    leaf_row: list[int]  # node -> row of `leaf_words` (-1 for internal nodes)
    leaf_words: torch.Tensor  # int64 [leaves]
    labels: torch.Tensor | None  # int64 [N], node order


class TorchPerNodeTrain(_TrainPeer):
    """One recursive call per node, autograd through all of it, as research Tree-LSTM code does.

    The leaves' embeddings are gathered once per batch (one ``index_select``,
    split into rows), as ``nn.Embedding`` over a sentence's tokens is in such
    code; everything else is per node: ``F.linear`` on one vector, the gates,
    and the node's logits.
    """

    def prepare(self, forest: Forest, word: np.ndarray, labels: np.ndarray | None = None) -> TrainPerNodePlan:
        _check_arity(forest)
        ids = _check_words(forest, word, self.dims.V)
        ptr = forest.child_ptr.tolist()
        idx = forest.child_idx.tolist()
        n = forest.num_nodes
        children = [idx[ptr[i] : ptr[i + 1]] for i in range(n)]
        is_leaf = np.asarray(forest.num_children) == 0
        leaf_row = np.full(n, -1, dtype=np.int64)
        leaf_row[is_leaf] = np.arange(int(is_leaf.sum()), dtype=np.int64)
        targets = None if labels is None else torch.from_numpy(_check_labels(forest, labels, self.dims.C))
        return TrainPerNodePlan(
            children=children,
            roots=forest.roots.tolist(),
            leaf_row=leaf_row.tolist(),
            leaf_words=torch.from_numpy(ids[is_leaf]),
            labels=targets,
        )

    def _node_logits(self, plan: TrainPerNodePlan) -> torch.Tensor:
        w = self.weights
        hidden = self.dims.H
        n = len(plan.children)
        if n == 0:
            return torch.zeros(0, self.dims.C)
        children, leaf_row = plan.children, plan.leaf_row
        x_rows = w["E"].index_select(0, plan.leaf_words).unbind(0)
        logits_out: list[torch.Tensor | None] = [None] * n
        zero = torch.zeros(hidden)
        linear = torch.nn.functional.linear

        def forward(node: int) -> tuple[torch.Tensor, torch.Tensor]:
            kids = children[node]
            if not kids:
                h, c = leaf_step(x_rows[leaf_row[node]], w, hidden)
            else:
                h_left, c_left = forward(kids[0])
                h_right, c_right = forward(kids[1]) if len(kids) > 1 else (zero, zero)
                h, c = node_step(h_left, c_left, h_right, c_right, w, hidden)
            logits_out[node] = linear(h, w["W_s"], w["b_s"])
            return h, c

        for root in plan.roots:
            forward(root)
        return torch.stack(logits_out)

    def _logits_and_targets(self, plan: TrainPerNodePlan) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._node_logits(plan), plan.labels


# ------------------------------------------------------- level batched


@dataclass(frozen=True)
class TrainLevelPlan:
    """Index arrays for a level-batched forward and backward, made once per batch (see `peers.LevelPlan`).

    States live in a buffer in level order (``forest.level_order``) plus one
    zero row at the end (what a missing child reads); level k is rows
    ``level_ptr[k]:level_ptr[k+1]``; ``child_rows[k-1]`` are the buffer rows
    of level k's children interleaved ``[left0, right0, left1, ...]``.
    ``labels`` are in the same level order, so the loss needs no gather;
    ``node_rows`` (buffer row of each node) gives node order for evaluation.
    """

    num_nodes: int
    leaf_words: torch.Tensor
    level_ptr: tuple[int, ...]
    child_rows: tuple[torch.Tensor, ...]
    node_rows: torch.Tensor
    labels: torch.Tensor | None  # int64 [N], level order


class TorchLevelBatchedTrain(_TrainPeer):
    """The forest level by level with autograd: per level one gather, one GEMM, the gates.

    Leaves: one embedding ``index_select`` and one GEMM with ``W_iou``.
    Internal levels: ``index_select`` of the children's ``h`` and ``c`` rows,
    one GEMM with ``[U_iou; U_f]`` (``[5H, 2H]``, concatenated once per
    forward so that each param keeps its own Adagrad state), gates
    elementwise, written into the level's slice of the state buffers. Logits:
    one GEMM over all nodes.
    """

    def prepare(self, forest: Forest, word: np.ndarray, labels: np.ndarray | None = None) -> TrainLevelPlan:
        """Index arrays for every level, in NumPy (vectorised, no work per node in Python)."""
        _check_arity(forest)
        ids = _check_words(forest, word, self.dims.V)
        n = forest.num_nodes
        order = np.asarray(forest.level_order, dtype=np.int64)
        row_of = np.empty(n, dtype=np.int64)
        row_of[order] = np.arange(n, dtype=np.int64)
        level_ptr = tuple(int(p) for p in forest.level_ptr)
        pair = np.full((n, 2), n, dtype=np.int64)  # the zero row (n) where a child is missing
        counts = forest.num_children
        owners = np.repeat(np.arange(n, dtype=np.int64), counts)
        slots = np.arange(forest.child_idx.size, dtype=np.int64) - forest.child_ptr[owners]
        pair[owners, slots] = row_of[forest.child_idx]
        child_rows = tuple(
            torch.from_numpy(np.ascontiguousarray(pair[order[level_ptr[k] : level_ptr[k + 1]]].reshape(-1)))
            for k in range(1, len(level_ptr) - 1)
        )
        leaves = order[level_ptr[0] : level_ptr[1]] if n else order
        targets = None
        if labels is not None:
            targets = torch.from_numpy(_check_labels(forest, labels, self.dims.C)[order])
        return TrainLevelPlan(
            num_nodes=n,
            leaf_words=torch.from_numpy(ids[leaves]),
            level_ptr=level_ptr,
            child_rows=child_rows,
            node_rows=torch.from_numpy(row_of),
            labels=targets,
        )

    def _level_logits(self, plan: TrainLevelPlan) -> torch.Tensor:
        """``[N, C]`` logits in level order."""
        w = self.weights
        n = plan.num_nodes
        hidden = self.dims.H
        if n == 0:
            return torch.zeros(0, self.dims.C)
        h = torch.zeros(n + 1, hidden)
        c = torch.zeros(n + 1, hidden)
        num_leaves = plan.level_ptr[1]
        x = w["E"].index_select(0, plan.leaf_words)
        iou = torch.addmm(w["b_iou"], x, w["W_iou"].t())
        gate = torch.sigmoid(iou[:, : 2 * hidden])
        c_new = gate[:, :hidden] * torch.tanh(iou[:, 2 * hidden :])
        c[:num_leaves] = c_new
        h[:num_leaves] = gate[:, hidden:] * torch.tanh(c_new)
        if plan.child_rows:
            U = torch.cat((w["U_iou"], w["U_f"]))  # [5H, 2H]: i, o, u, f_left, f_right
            b = torch.cat((w["b_iou"], w["b_f"]))
            Ut = U.t()
        for k, rows in enumerate(plan.child_rows, start=1):
            lo, hi = plan.level_ptr[k], plan.level_ptr[k + 1]
            count = hi - lo
            hc = h.index_select(0, rows).view(count, 2 * hidden)
            cc = c.index_select(0, rows).view(count, 2, hidden)
            g = torch.addmm(b, hc, Ut)  # [count, 5H]
            io = torch.sigmoid(g[:, : 2 * hidden])
            u = torch.tanh(g[:, 2 * hidden : 3 * hidden])
            f = torch.sigmoid(g[:, 3 * hidden :]).view(count, 2, hidden)
            c_new = io[:, :hidden] * u + (f * cc).sum(dim=1)
            c[lo:hi] = c_new
            h[lo:hi] = io[:, hidden:] * torch.tanh(c_new)
        return torch.addmm(w["b_s"], h[:n], w["W_s"].t())

    def _node_logits(self, plan: TrainLevelPlan) -> torch.Tensor:
        return self._level_logits(plan).index_select(0, plan.node_rows)

    def _logits_and_targets(self, plan: TrainLevelPlan) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._level_logits(plan), plan.labels
