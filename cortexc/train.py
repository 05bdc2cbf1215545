"""Training helpers in NumPy: optimizers over a params dict, cross-entropy, accuracy, batches.

A model's params are read-only arrays, so an optimizer never writes the arrays a model holds:
``step`` returns new arrays (handed over: `load_params` keeps them without a copy), and one
training step is::

    out = model(forest, grad=True, word=ids)
    loss, d_logits = softmax_cross_entropy(out["logits"], forest.labels)
    grads = model.backward(out, {"logits": d_logits})
    model.load_params(opt.step(model.params, grads))

The optimizers follow ``torch.optim`` (`SGD`, `Adagrad`, `Adam`, with the same defaults and
update rules, weight decay included), keep their state per param name in the param's own dtype, and
return arrays of each param's own dtype. A param without a gradient is returned unchanged.

A sparse step (a `SparseRows` gradient: an embedding table) costs the rows, not the table: the
optimizer keeps two buffers of the table and writes the new value into the one the model let go of
at the previous step (bringing it up to date with the rows changed since), so no table is copied —
when nothing else holds that buffer (a running call, a `model.params` kept by the caller: its
reference count says so); else it copies the table, as a dense step would.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from cortexc.errors import ForestError, InputError
from cortexc.runtime.csr import counts_to_ptr, gather_segments
from cortexc.runtime.forest import Forest
from cortexc.runtime.model import SparseRows
from cortexc.runtime.params import hand_over

__all__ = [
    "SGD",
    "Adagrad",
    "Adam",
    "Optimizer",
    "SparseRows",
    "accuracy",
    "batches",
    "softmax_cross_entropy",
    "Treebank",
]

T = TypeVar("T")


@dataclass(eq=False)
class _Table:
    """The two buffers of a sparsely updated table: `current`, what the last step returned (and the model
    now holds), `previous`, the one before, which differs from `current` at `rows` (`None`: unknown)."""

    current: np.ndarray
    previous: np.ndarray | None = None
    rows: np.ndarray | None = None
    probe: object = None  # held like `previous`: the reference count of an object nobody else holds


def _held_elsewhere(table: _Table) -> bool:
    """Whether anything but `table` holds `table.previous` (compared with `table.probe`, held alike)."""
    table.probe = object()
    previous, probe = table.previous, table.probe
    held = sys.getrefcount(previous) > sys.getrefcount(probe)
    del previous, probe
    table.probe = None
    return held


class Optimizer:
    """Base class: checks the names and shapes of the gradients, keeps per-param state by name."""

    def __init__(self, lr: float, weight_decay: float = 0.0):
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        self.lr = float(lr)
        self.weight_decay = float(weight_decay)
        self.state: dict[str, dict[str, np.ndarray | int]] = {}
        self._tables: dict[str, _Table] = {}
        self.table_copies = 0  # sparse steps that had to copy the whole table (tests, benchmarks)

    def step(
        self, params: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray | SparseRows]
    ) -> dict[str, np.ndarray]:
        """New values of every param (copies of those without a gradient). A `SparseRows` gradient
        (`model.backward(..., sparse=True)`) updates only its rows, as torch.optim does for a sparse
        gradient (no weight decay then: torch refuses it too)."""
        unknown = sorted(set(grads) - set(params))
        if unknown:
            raise InputError(f"gradients for unknown params: {', '.join(unknown)}")
        new: dict[str, np.ndarray] = {}
        for name, value in params.items():
            value = np.asarray(value)
            if name not in grads:
                new[name] = value.copy()
                continue
            # in the param's own precision, as torch.optim does (float32 for models: no float64 copies
            # of a large embedding table on every step)
            dtype = value.dtype if np.issubdtype(value.dtype, np.floating) else np.float64
            given = grads[name]
            if isinstance(given, SparseRows):
                new[name] = self._sparse(name, value, given)
                continue
            grad = np.asarray(given, dtype=dtype)
            if grad.shape != value.shape:
                raise InputError(f"the gradient of {name} has shape {grad.shape}, the param {value.shape}")
            p = value.astype(dtype, copy=False)
            if self.weight_decay:
                grad = grad + self.weight_decay * p
            state = self.state.setdefault(name, {})
            updated = self._update(p, grad, state)
            fresh = updated.dtype != value.dtype
            updated = updated.astype(value.dtype, copy=False)
            # a result nothing else holds goes to load_params without a copy
            new[name] = hand_over(updated) if fresh or updated.base is None and updated is not p else updated
        return new

    def _update(self, p: np.ndarray, grad: np.ndarray, state: dict) -> np.ndarray:  # pragma: no cover
        raise NotImplementedError

    def _sparse(self, name: str, value: np.ndarray, grad: SparseRows) -> np.ndarray:
        """A sparse step: the rows' slice of the param and of every state, updated by `_update`."""
        if grad.shape != value.shape:
            raise InputError(f"the gradient of {name} has shape {grad.shape}, the param {value.shape}")
        if self.weight_decay:
            raise InputError(f"{type(self).__name__}: weight decay with a sparse gradient (of {name})")
        if not self._sparse_ok():
            raise InputError(f"{type(self).__name__} has no sparse update (of {name}): use dense gradients")
        state = self.state.setdefault(name, {})
        rows = grad.rows
        full = {key: array for key, array in state.items() if isinstance(array, np.ndarray)}
        view = {key: array[rows] for key, array in full.items()}
        updated = self._update(value[rows], grad.values.astype(value.dtype), view)
        new = self._spare(name, value)
        new[rows] = updated
        self._tables[name] = _Table(hand_over(new), value, rows)
        for key, array in view.items():
            if key in full:
                full[key][rows] = array
            else:  # first step: the state is made whole, untouched rows at their start
                whole = self._initial_state(key, value)
                whole[rows] = array
                state[key] = whole
        return new

    def _spare(self, name: str, value: np.ndarray) -> np.ndarray:
        """A writeable array equal to `value` for the sparse step to write its rows into: the table's
        previous buffer brought up to date (the rows the last step changed), when `value` is what the last
        step returned and nothing else holds that buffer; else a copy of `value`."""
        table = self._tables.get(name)
        if (
            table is None
            or table.current is not value
            or table.previous is None
            or table.rows is None
            or table.previous.shape != value.shape
            or table.previous.dtype != value.dtype
            or table.previous.base is not None
            or _held_elsewhere(table)
        ):
            self.table_copies += 1
            return value.copy()
        spare, rows = table.previous, table.rows
        del self._tables[name]  # drops its references: `spare` is ours alone now
        spare.flags.writeable = True  # it owns its memory
        spare[rows] = value[rows]
        return spare

    def _sparse_ok(self) -> bool:
        return False

    def _initial_state(self, key: str, value: np.ndarray) -> np.ndarray:  # pragma: no cover
        raise NotImplementedError


class SGD(Optimizer):
    """``p -= lr * g``; with momentum ``b = momentum * b + g`` (b = g at the first step), ``p -= lr * b``
    (torch.optim.SGD with dampening 0, not Nesterov)."""

    def __init__(self, lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
        super().__init__(lr, weight_decay)
        if momentum < 0:
            raise ValueError(f"momentum must be >= 0, got {momentum}")
        self.momentum = float(momentum)

    def _sparse_ok(self) -> bool:
        return not self.momentum

    def _update(self, p: np.ndarray, grad: np.ndarray, state: dict) -> np.ndarray:
        if self.momentum:
            buf = state.get("momentum_buffer")
            buf = grad.copy() if buf is None else self.momentum * buf + grad
            state["momentum_buffer"] = buf
            grad = buf
        return p - self.lr * grad


class Adagrad(Optimizer):
    """``s += g * g``; ``p -= lr * g / (sqrt(s) + eps)``, s starting at ``initial_accumulator``
    (torch.optim.Adagrad, lr_decay 0)."""

    def __init__(
        self, lr: float = 0.01, eps: float = 1e-10, initial_accumulator: float = 0.0, weight_decay: float = 0.0
    ):
        super().__init__(lr, weight_decay)
        if initial_accumulator < 0:
            raise ValueError(f"initial_accumulator must be >= 0, got {initial_accumulator}")
        self.eps = float(eps)
        self.initial_accumulator = float(initial_accumulator)

    def _sparse_ok(self) -> bool:
        return True

    def _initial_state(self, key: str, value: np.ndarray) -> np.ndarray:
        return np.full(value.shape, self.initial_accumulator, dtype=value.dtype)

    def _update(self, p: np.ndarray, grad: np.ndarray, state: dict) -> np.ndarray:
        total = state.get("sum")
        if total is None:
            total = state["sum"] = np.full(p.shape, self.initial_accumulator, dtype=p.dtype)
        total += grad * grad  # the state is ours: updated in place
        step = np.sqrt(total)
        step += self.eps
        np.divide(grad, step, out=step)
        step *= -self.lr
        step += p
        return step


class Adam(Optimizer):
    """Adam with bias correction (torch.optim.Adam, not AMSGrad): ``m``, ``v`` moving averages of
    ``g`` and ``g * g``; ``p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``."""

    def __init__(
        self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0
    ):
        super().__init__(lr, weight_decay)
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)

    def _update(self, p: np.ndarray, grad: np.ndarray, state: dict) -> np.ndarray:
        b1, b2 = self.betas
        t = int(state.get("step", 0)) + 1
        m = b1 * state.get("exp_avg", np.zeros(p.shape, p.dtype)) + (1 - b1) * grad
        v = b2 * state.get("exp_avg_sq", np.zeros(p.shape, p.dtype)) + (1 - b2) * grad * grad
        state.update(step=t, exp_avg=m, exp_avg_sq=v)
        denom = np.sqrt(v) / math.sqrt(1 - b2**t) + self.eps
        return p - (self.lr / (1 - b1**t)) * m / denom


def softmax_cross_entropy(logits: np.ndarray, labels: np.ndarray, reduction: str = "mean") -> tuple[float, np.ndarray]:
    """Cross-entropy of ``logits [R, C]`` against integer ``labels [R]`` (torch's
    ``F.cross_entropy``): the loss (mean over rows, or ``reduction="sum"``) and its gradient
    with respect to the logits, ``(softmax(logits) - onehot(labels)) / R`` for the mean, in the
    dtype of ``logits``. Zero rows give a loss of 0 and an empty gradient."""
    logits = np.asarray(logits)
    labels = np.asarray(labels)
    if logits.ndim != 2:
        raise InputError(f"logits must be [rows, classes], got shape {logits.shape}")
    rows, classes = logits.shape
    if labels.shape != (rows,):
        raise InputError(f"labels must have shape ({rows},) (one per row of the logits), got {labels.shape}")
    if not np.issubdtype(labels.dtype, np.integer):
        raise InputError(f"labels must be integers, got dtype {labels.dtype}")
    if rows and (labels.min() < 0 or labels.max() >= classes):
        bad = int(np.flatnonzero((labels < 0) | (labels >= classes))[0])
        raise InputError(f"label {int(labels[bad])} of row {bad} is outside [0, {classes})")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    out_dtype = logits.dtype if np.issubdtype(logits.dtype, np.floating) else np.float64
    if rows == 0:
        return 0.0, np.zeros((0, classes), out_dtype)
    z = logits.astype(np.float64)
    shifted = z - z.max(axis=1, keepdims=True)
    log_norm = np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    log_probs = shifted - log_norm
    picked = np.arange(rows), labels.astype(np.int64)
    scale = 1.0 / rows if reduction == "mean" else 1.0
    loss = float(-log_probs[picked].sum() * scale)
    grad = np.exp(log_probs)
    grad[picked] -= 1.0
    return loss, (grad * scale).astype(out_dtype)


def accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    """The fraction of rows whose largest logit is at the label (0.0 for no rows)."""
    logits = np.asarray(logits)
    labels = np.asarray(labels)
    if logits.ndim != 2 or labels.shape != (logits.shape[0],):
        raise InputError(f"accuracy needs logits [R, C] and labels [R], got {logits.shape} and {labels.shape}")
    if not len(labels):
        return 0.0
    return float(np.mean(logits.argmax(axis=1) == labels))


def batches(items: Sequence[T], batch_size: int, rng: np.random.Generator | None = None) -> Iterator[list[T]]:
    """Consecutive lists of up to ``batch_size`` items (the last may be shorter), in a random
    order drawn from ``rng`` when given. Concatenate a batch of trees with `Forest.concat`."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = np.arange(len(items)) if rng is None else rng.permutation(len(items))
    for start in range(0, len(items), batch_size):
        yield [items[int(i)] for i in order[start : start + batch_size]]


class Treebank:
    """The trees of one forest parsed once (``Treebank(Forest.from_ptb_file(path))``), from which
    batches are cut in a few vectorised steps (`select`), instead of one `Forest.from_ptb` per line and
    `Forest.concat` over one Forest per tree. The trees must be consecutive node ranges ending at their
    roots, as `Forest.from_ptb` numbers them (post-order within a tree, trees in order)."""

    def __init__(self, forest: Forest):
        if not isinstance(forest, Forest):
            raise ForestError(f"Treebank needs a cortexc.Forest, got {type(forest).__name__}")
        if not forest.is_tree:
            raise ForestError("Treebank needs a forest of trees (no node with two parents)")
        roots = np.asarray(forest.roots)
        n = forest.num_nodes
        if forest.num_trees and roots[-1] != n - 1:
            raise ForestError(f"node {n - 1} is not a root: the trees must be consecutive node ranges ending at roots")
        tree = np.searchsorted(roots, np.arange(n))  # the tree each node would belong to
        child = np.asarray(forest.child_idx)
        owner = np.repeat(np.arange(n), np.asarray(forest.num_children))
        crossing = np.flatnonzero(tree[owner] != tree[child])
        if crossing.size:
            edge = int(crossing[0])
            raise ForestError(
                f"node {int(owner[edge])} and its child {int(child[edge])} are in different trees' node ranges: the "
                "trees must be consecutive node ranges ending at their roots"
            )
        self.forest = forest
        self.starts = np.concatenate([[0], roots[:-1] + 1]).astype(np.int64)
        self.ends = roots + 1

    def __len__(self) -> int:
        return self.forest.num_trees

    def select(self, trees: Sequence[int] | np.ndarray) -> Forest:
        """The forest of the given trees (positions in ``forest.roots``), in that order, labels and words
        kept; as `Forest.concat` of those trees, in time proportional to their nodes."""
        forest = self.forest
        chosen = np.asarray(trees, dtype=np.int64).reshape(-1)
        if chosen.size and (chosen.min() < 0 or chosen.max() >= len(self)):
            bad = int(chosen[(chosen < 0) | (chosen >= len(self))][0])
            raise ForestError(f"tree {bad} is outside 0..{len(self) - 1}")
        first = self.starts[chosen]
        sizes = self.ends[chosen] - first
        offsets = np.cumsum(sizes) - sizes
        shift = np.repeat(offsets - first, sizes)  # a node's new id is its old id plus this (within a tree)
        nodes = np.arange(int(sizes.sum()), dtype=np.int64) - shift  # the old ids, tree after tree
        child_ptr = np.asarray(forest.child_ptr)
        counts = child_ptr[nodes + 1] - child_ptr[nodes]
        child_idx = gather_segments(child_ptr, np.asarray(forest.child_idx), nodes) + np.repeat(shift, counts)
        labels = None if forest.labels is None else np.asarray(forest.labels)[nodes]
        words = None if forest.words is None else [forest.words[i] for i in nodes.tolist()]
        level = np.asarray(forest.level)[nodes]
        return Forest._from_csr(counts_to_ptr(counts), child_idx.astype(np.int64), labels, words, level=level)

    def batches(self, batch_size: int, rng: np.random.Generator | None = None) -> Iterator[Forest]:
        """`batches` over the trees, each batch a `select`ed Forest."""
        for chosen in batches(range(len(self)), batch_size, rng):
            yield self.select(chosen)
