"""Top-down Tree-LSTM on SST: cortexc's compiled `down` cell against PyTorch level by level and per node.

The model is the top-down half of a bidirectional Tree-LSTM (Teng & Zhang 2017; `examples/bitreelstm.cell`'s
``BiTreeLSTMDown`` made standalone): every node reads its parent's top-down ``h`` and ``c`` through the
recurrent matrix of its own side, ``U[edge.position]`` (``U[0]`` for a left child, ``U[1]`` for a right one),
the roots run a ``root`` block of their own, and every node is classified (`CELL` below; gates i, f, o, u in
that order). Its input is a float ``x[X]`` per node (X=300: the size of GloVe word vectors; in a bidirectional
model, the node's bottom-up state), random here, one row per node. Three implementations, with the same
weights, the same trees and the same ``x``:

- ``cortexc``: the cell compiled for the CPU (``device="cpu"``);
- ``level``: PyTorch level by level, TF Fold / DGL style (`LevelTopDown`): the depth of every node from its
  root computed once per batch with NumPy (vectorised, no Python per node), the rows ordered by depth and,
  within a depth, by side; ``W @ x + b`` of every node in one GEMM; then per depth, the parents' ``h`` and
  ``c`` gathered from the depth above (one ``index_select`` each) and one GEMM per side (the left children's
  rows with ``U[0]``, the right children's with ``U[1]``: contiguous, so no masking and no wasted FLOPs), the
  gates elementwise; the logits of every node in one GEMM at the end;
- ``per_node``: PyTorch one node at a time (`PerNodeTopDown`), the usual research code: a Python loop over
  the nodes, roots first, a handful of small torch ops each (two ``addmv`` for the gates, the logits).

The batches are SST dev trees (``$CORTEXC_SST_DIR``, else ``../shared/data/sst`` beside the checkout), in
consecutive batches of ``--batch`` trees; ``--batches`` of them, spread evenly over the split, are timed.
Inference is a forward without gradients that gives ``h``, ``c`` and the logits of every node in node order.
A training step is a forward that keeps what the backward needs plus the backward of the mean over every node
of the softmax cross-entropy of its logits against its SST label: every weight's gradient, and the gradient
of ``x`` (cortexc always returns the gradient of every float input, and a bidirectional model needs it to
reach its bottom-up half: the peers compute it too, so the work is the same); no optimizer step. The peers'
index arrays (depths, orders, parents) are made once per batch before the timing, as cortexc's
linearization is made once per forest and kept in it; their cost is reported apart (``plan ms``, against
cortexc's first `linearize_down` of the same trees).

Before any timing, on a few trees, every implementation is checked to give the same ``h``, ``c`` and logits
and the same gradients of every weight and of ``x`` (each to 1e-4 relative to its largest value), else the
script stops. Times are medians of ``--repeats`` calls, the implementations taking turns (each timed call
follows an untimed call of its own, as in `bench_ggnn.py`); one call runs every timed batch once, and ms are
per batch. Ratios are peer ms / cortexc ms (above 1: cortexc is faster). Then the same batches are timed at
the hidden sizes of ``--sweep-hidden`` (``--sweep-repeats`` each, after the same check). Every implementation
runs on ``--threads`` threads (default 2: ``torch.set_num_threads``, ``OMP_NUM_THREADS`` and
``CORTEXC_NUM_THREADS``; cortexc's cap by other processes' load is turned off with ``CORTEXC_ADAPT_THREADS=0``
unless ``--adapt``).
torch and the compiled code share one libgomp, loaded by torch (imported first), which reads its spin count
once as it loads: both get cortexc's own default, ``GOMP_SPINCOUNT=10000`` (what cortexc's runtime sets when
it loads libgomp itself), unless ``--spin-default`` or the caller sets ``GOMP_SPINCOUNT`` or
``OMP_WAIT_POLICY`` (``passive`` makes the PyTorch peers' small ops 3-4x slower on a 2-CPU machine).
The results record the host, its CPU, the 1-min load average at the start and the end, and the CPUs that other
processes used on average during the run (from /proc/stat, less this process's own CPU time), with a caution
when the machine was busy.

Usage (from the repository root)::

    python benchmarks/bench_topdown.py --quick
    python benchmarks/bench_topdown.py --out benchmarks/results/topdown.json     # and topdown.md beside it
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.harness import (  # noqa: E402
    busy,
    cross_entropy_grad,
    host,
    interleaved,
    machine_busy_s,
    max_rel_diff,
    own_cpu_s,
    spin,
)


def _parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--input", type=int, default=300, help="X, the size of x")
    parser.add_argument("--batch", type=int, default=10, help="trees per batch")
    parser.add_argument("--batches", type=int, default=20, help="batches timed, spread over the split")
    parser.add_argument("--split", default="dev")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--check-trees", type=int, default=4)
    parser.add_argument("--sweep-hidden", default="64,150", help="more hidden sizes, timed on the same batches")
    parser.add_argument("--sweep-repeats", type=int, default=3)
    parser.add_argument("--adapt", action="store_true", help="let cortexc cap its threads by the machine's load")
    parser.add_argument("--spin-default", action="store_true", help="leave libgomp's spin count as it is")
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats: a smoke test")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write JSON here and a markdown table beside it (.md)")
    parser.add_argument("--note", help="a remark on the run for the results (e.g. why these threads)")
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.input, args.batches, args.repeats, args.check_trees = 32, 16, 3, 2, 2
        args.sweep_hidden, args.sweep_repeats = "8", 1
    return args


if __name__ == "__main__":
    ARGS = _parse()
    os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)  # before any OpenMP library loads
    os.environ["CORTEXC_NUM_THREADS"] = str(ARGS.threads)
    if not ARGS.adapt:
        os.environ["CORTEXC_ADAPT_THREADS"] = "0"
    if not ARGS.spin_default and "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = "10000"  # cortexc's own default (cortexc.targets.c.threads.SPIN_COUNT)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import cortexc  # noqa: E402
from cortexc import Forest  # noqa: E402

SST = Path(os.environ.get("CORTEXC_SST_DIR") or REPO.parent / "shared" / "data" / "sst")

#: the top-down Tree-LSTM: BiTreeLSTMDown of examples/bitreelstm.cell without the bottom-up half
CELL = """\
# Top-down binary Tree-LSTM (after Teng & Zhang 2017): roots first, each node reading its parent's h and c
# through the matrix of its own side; gates i, f, o, u; every node classified
cell TopDownTreeLSTM on tree(arity = 2) down {
    dim X = 300, H = 256, C = 5
    input x[X]
    param W[4*H, X], U[2, 4*H, H], b[4*H]
    param W_s[C, H], b_s[C]
    state h[H], c[H]
    root {
        g = W @ x + b
        c = sigmoid(g[0:H]) * tanh(g[3*H:4*H])
        h = sigmoid(g[2*H:3*H]) * tanh(c)
    }
    node {
        g = W @ x + U[edge.position] @ parent.h + b
        c = sigmoid(g[0:H]) * tanh(g[3*H:4*H]) + sigmoid(g[H:2*H]) * parent.c
        h = sigmoid(g[2*H:3*H]) * tanh(c)
    }
    output logits[C] = W_s @ h + b_s
}
"""
PARAMS = ("W", "U", "b", "W_s", "b_s")


def load_cell(work: Path, hidden: int, inputs: int) -> Any:
    """The compiled cell's class (`TopDownTreeLSTM`) at these dims."""
    work.mkdir(parents=True, exist_ok=True)
    source = work / "topdown.cell"
    source.write_text(CELL)
    return cortexc.load(source, out_dir=work / "topdown", H=hidden, X=inputs).TopDownTreeLSTM


def random_params(shapes: dict[str, tuple[int, ...]], hidden: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Every param (biases too, so that a bias slip shows) uniform in +-1/sqrt(H), torch.nn.LSTM's init."""
    bound = 1 / np.sqrt(hidden)
    return {k: rng.uniform(-bound, bound, shape).astype(np.float32) for k, shape in shapes.items()}


def read_trees(split: str) -> list[str]:
    path = SST / f"{split}.txt"
    if not path.exists():
        raise SystemExit(f"{path} not found: set CORTEXC_SST_DIR to the SST directory")
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


# ------------------------------------------------------------------ the peers


def depths(forest: Forest) -> np.ndarray:
    """Each node's depth from its root (0 at a root), by pointer jumping: O(max depth) NumPy steps over all
    nodes, no Python per node."""
    parents = np.asarray(forest.parents, dtype=np.int64)
    depth = np.zeros(forest.num_nodes, dtype=np.int64)
    up = parents.copy()
    while True:
        live = up >= 0
        if not live.any():
            return depth
        depth += live
        up[live] = parents[up[live]]


def positions(forest: Forest) -> np.ndarray:
    """Each node's place among its parent's children (0 at a root), from the forest's edge arrays."""
    pos = np.zeros(forest.num_nodes, dtype=np.int64)
    edge_parent = np.asarray(forest.edge_parent, dtype=np.int64)
    pos[forest.edge_child] = np.arange(forest.num_edges, dtype=np.int64) - np.asarray(forest.edge_ptr)[edge_parent]
    return pos


def _tensors(params: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Own float32 copies of the params, as autograd leaves."""
    return {k: torch.tensor(np.array(params[k], dtype=np.float32), requires_grad=True) for k in PARAMS}


def lstm_gates(g: torch.Tensor, hidden: int, c_parent: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``c`` and ``h`` from the gates ``g`` (i, f, o, u along the last dim), the parent's ``c`` or none."""
    s = torch.sigmoid(g[..., : 3 * hidden])
    c = s[..., :hidden] * torch.tanh(g[..., 3 * hidden :])
    if c_parent is not None:
        c = c + s[..., hidden : 2 * hidden] * c_parent
    return c, s[..., 2 * hidden : 3 * hidden] * torch.tanh(c)


@dataclass
class LevelPlan:
    """A batch's rows: nodes by depth, and within a depth by side (left children, then right ones)."""

    num_nodes: int
    order: torch.Tensor  # [N] node of each row
    row_of: torch.Tensor  # [N] row of each node
    level_ptr: tuple[int, ...]  # rows of depth k: level_ptr[k]:level_ptr[k + 1]
    sides: tuple[tuple[int, ...], ...]  # per depth k >= 1: rows per side (position 0, 1)
    parent_rows: tuple[torch.Tensor, ...]  # per depth k >= 1: each row's parent among the rows of depth k - 1
    labels: torch.Tensor | None  # [N] in row order


class LevelTopDown:
    """The top-down Tree-LSTM in PyTorch, one batched step per depth (see the module's docstring)."""

    def __init__(self, params: dict[str, np.ndarray]):
        self.p = _tensors(params)
        self.hidden = self.p["b"].shape[0] // 4
        self.sides = self.p["U"].shape[0]

    def prepare(self, forest: Forest) -> LevelPlan:
        """Index arrays for every depth, in NumPy (vectorised)."""
        depth, pos = depths(forest), positions(forest)
        if pos.size and pos.max() >= self.sides:
            raise ValueError(f"a node has more than {self.sides} children")
        order = np.lexsort((pos, depth))
        row_of = np.empty(forest.num_nodes, dtype=np.int64)
        row_of[order] = np.arange(forest.num_nodes, dtype=np.int64)
        levels = np.bincount(depth) if forest.num_nodes else np.zeros(0, dtype=np.int64)
        level_ptr = np.concatenate([[0], np.cumsum(levels)]).astype(np.int64)
        parents = np.asarray(forest.parents, dtype=np.int64)
        sides, parent_rows = [], []
        for k in range(1, levels.size):
            nodes = order[level_ptr[k] : level_ptr[k + 1]]
            sides.append(tuple(int(n) for n in np.bincount(pos[nodes], minlength=self.sides)))
            parent_rows.append(torch.from_numpy(row_of[parents[nodes]] - level_ptr[k - 1]))
        labels = None if forest.labels is None else torch.from_numpy(np.asarray(forest.labels, np.int64)[order])
        return LevelPlan(
            forest.num_nodes,
            torch.from_numpy(order),
            torch.from_numpy(row_of),
            tuple(int(p) for p in level_ptr),
            tuple(sides),
            tuple(parent_rows),
            labels,
        )

    def rows(self, plan: LevelPlan, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``h``, ``c`` and logits of every node, in row order."""
        p, H, ptr = self.p, self.hidden, plan.level_ptr
        xw = torch.addmm(p["b"], x.index_select(0, plan.order), p["W"].t())  # [N, 4H]: W @ x + b, every node
        c, h = lstm_gates(xw[: ptr[1]], H, None)
        hs, cs = [h], [c]
        for k, (sides, parent_rows) in enumerate(zip(plan.sides, plan.parent_rows), start=1):
            hp, cp = h.index_select(0, parent_rows), c.index_select(0, parent_rows)
            parts, start = [], 0
            for side, count in enumerate(sides):
                if count:
                    lo, hi = ptr[k] + start, ptr[k] + start + count
                    parts.append(torch.addmm(xw[lo:hi], hp[start : start + count], p["U"][side].t()))
                    start += count
            c, h = lstm_gates(torch.cat(parts) if len(parts) > 1 else parts[0], H, cp)
            hs.append(h)
            cs.append(c)
        h_rows, c_rows = torch.cat(hs), torch.cat(cs)
        return h_rows, c_rows, torch.addmm(p["b_s"], h_rows, p["W_s"].t())

    def infer(self, plan: LevelPlan, x: torch.Tensor) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            h, c, logits = self.rows(plan, x)
            return {"h": h[plan.row_of], "c": c[plan.row_of], "logits": logits[plan.row_of]}

    def loss(self, plan: LevelPlan, x: torch.Tensor) -> torch.Tensor:
        assert plan.labels is not None
        return torch.nn.functional.cross_entropy(self.rows(plan, x)[2], plan.labels)


@dataclass
class PerNodePlan:
    """A batch as Python lists: nodes roots first, each node's parent (-1 at a root) and side."""

    num_nodes: int
    order: list[int]
    parent: list[int]
    side: list[int]
    labels: torch.Tensor | None  # [N] in node order


class PerNodeTopDown:
    """The top-down Tree-LSTM in PyTorch, one node at a time, roots first (see the module's docstring)."""

    def __init__(self, params: dict[str, np.ndarray]):
        self.p = _tensors(params)
        self.hidden = self.p["b"].shape[0] // 4

    def prepare(self, forest: Forest) -> PerNodePlan:
        labels = None if forest.labels is None else torch.from_numpy(np.asarray(forest.labels, np.int64))
        order = np.argsort(depths(forest), kind="stable")
        return PerNodePlan(
            forest.num_nodes,
            order.tolist(),
            np.asarray(forest.parents).tolist(),
            positions(forest).tolist(),
            labels,
        )

    def nodes(self, plan: PerNodePlan, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``h``, ``c`` and logits of every node, in node order."""
        p, H = self.p, self.hidden
        xs, us = x.unbind(0), p["U"].unbind(0)
        hs: list[Any] = [None] * plan.num_nodes
        cs: list[Any] = [None] * plan.num_nodes
        logits: list[Any] = [None] * plan.num_nodes
        for v in plan.order:
            g = torch.addmv(p["b"], p["W"], xs[v])
            up = plan.parent[v]
            if up >= 0:
                g = torch.addmv(g, us[plan.side[v]], hs[up])
            cs[v], hs[v] = lstm_gates(g, H, cs[up] if up >= 0 else None)
            logits[v] = torch.addmv(p["b_s"], p["W_s"], hs[v])
        return torch.stack(hs), torch.stack(cs), torch.stack(logits)

    def infer(self, plan: PerNodePlan, x: torch.Tensor) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            h, c, logits = self.nodes(plan, x)
            return {"h": h, "c": c, "logits": logits}

    def loss(self, plan: PerNodePlan, x: torch.Tensor) -> torch.Tensor:
        assert plan.labels is not None
        return torch.nn.functional.cross_entropy(self.nodes(plan, x)[2], plan.labels)


def torch_grads(peer: LevelTopDown | PerNodeTopDown, plan: Any, x: np.ndarray) -> dict[str, np.ndarray]:
    """The weight gradients and that of ``x`` of the mean cross-entropy (one forward and backward)."""
    for t in peer.p.values():
        t.grad = None
    tx = torch.tensor(x, requires_grad=True)
    peer.loss(plan, tx).backward()
    return {**{k: t.grad.numpy().copy() for k, t in peer.p.items() if t.grad is not None}, "x": tx.grad.numpy()}


def cortexc_grads(model: Any, forest: Forest, x: np.ndarray) -> dict[str, np.ndarray]:
    """cortexc's training step: forward keeping what backward needs, the loss's upstream, backward."""
    out = model(forest, grad=True, x=x)
    labels = np.asarray(forest.labels, dtype=np.int64)
    return model.backward(out, {"logits": cross_entropy_grad(out["logits"], labels)})


# ------------------------------------------------------------------ batches, the check, the timing


@dataclass
class Batch:
    forest: Forest
    x: np.ndarray
    tx: torch.Tensor  # x as a leaf that asks for its gradient
    level: LevelPlan
    node: PerNodePlan


def make_batch(lines: Sequence[str], level: LevelTopDown, node: PerNodeTopDown, inputs: int, seed: int) -> Batch:
    forest = Forest.from_ptb(lines)
    x = (0.5 * np.random.default_rng(seed).standard_normal((forest.num_nodes, inputs))).astype(np.float32)
    return Batch(forest, x, torch.tensor(x, requires_grad=True), level.prepare(forest), node.prepare(forest))


def check(model: Any, level: LevelTopDown, node: PerNodeTopDown, batch: Batch) -> dict[str, float]:
    """Every implementation's h, c, logits and gradients agree (raises SystemExit if not)."""
    names = ("h", "c", "logits")
    out = model(batch.forest, x=batch.x)
    want = {k: out[k] for k in names}
    report: dict[str, float] = {}
    tx = torch.from_numpy(batch.x)
    for name, got in (("level", level.infer(batch.level, tx)), ("per_node", node.infer(batch.node, tx))):
        for k, d in max_rel_diff({k: v.numpy() for k, v in got.items()}, want, names).items():
            report[f"{k}_{name}_vs_cortexc"] = d
    grads = cortexc_grads(model, batch.forest, batch.x)
    for name, peer, plan in (("level", level, batch.level), ("per_node", node, batch.node)):
        theirs = torch_grads(peer, plan, batch.x)
        for k, d in max_rel_diff(theirs, grads, (*PARAMS, "x")).items():
            report[f"d{k}_{name}_vs_cortexc"] = d
    bad = {k: d for k, d in report.items() if not d <= 1e-4}
    if bad:
        raise SystemExit(f"the implementations disagree: {bad}")
    return report


def functions(model: Any, level: LevelTopDown, node: PerNodeTopDown, batches: list[Batch]) -> dict[str, Callable]:
    """One call of each: every batch once (inference, or a training step)."""

    def cortexc_infer() -> None:
        for b in batches:
            model(b.forest, x=b.x)

    def cortexc_forward_grad() -> None:
        for b in batches:
            model(b.forest, grad=True, x=b.x)

    def cortexc_train() -> None:
        for b in batches:
            cortexc_grads(model, b.forest, b.x)

    def torch_infer(peer: Any, which: str) -> None:
        for b in batches:
            peer.infer(getattr(b, which), b.tx)

    def torch_train(peer: Any, which: str) -> None:
        for b in batches:
            for t in (*peer.p.values(), b.tx):
                t.grad = None
            peer.loss(getattr(b, which), b.tx).backward()

    return {
        "cortexc_infer": cortexc_infer,
        "level_infer": lambda: torch_infer(level, "level"),
        "per_node_infer": lambda: torch_infer(node, "node"),
        "cortexc_train": cortexc_train,
        "level_train": lambda: torch_train(level, "level"),
        "per_node_train": lambda: torch_train(node, "node"),
        "cortexc_forward_grad": cortexc_forward_grad,
    }


def plan_ms(lines: list[list[str]], level: LevelTopDown, node: PerNodeTopDown) -> dict[str, float]:
    """ms per batch of making each one's index arrays on freshly read trees (cortexc: `linearize_down`)."""
    from cortexc.runtime.topdown import linearize_down

    spent = {"cortexc": 0.0, "level": 0.0, "per_node": 0.0}
    for group in lines:
        for name, make in (("cortexc", linearize_down), ("level", level.prepare), ("per_node", node.prepare)):
            forest = Forest.from_ptb(group)  # fresh: nothing derived yet
            start = time.perf_counter()
            make(forest)
            spent[name] += time.perf_counter() - start
    return {k: 1e3 * v / len(lines) for k, v in spent.items()}


# ------------------------------------------------------------------ main


def measure(
    model: Any, level: LevelTopDown, node: PerNodeTopDown, batches: list[Batch], repeats: int
) -> dict[str, dict[str, float]]:
    """ms per batch of every function (median of `repeats`, taking turns) and the ratios."""
    seconds = interleaved(functions(model, level, node, batches), repeats)
    ms = {k: 1e3 * v / len(batches) for k, v in seconds.items()}
    ratios = {f"{peer}_{what}": ms[f"{peer}_{what}"] / ms[f"cortexc_{what}"] for peer in ("level", "per_node")
              for what in ("infer", "train")}  # fmt: skip
    return {"ms": ms, "ratios": ratios}


def print_table(m: dict[str, dict[str, float]]) -> None:
    ms, ratios = m["ms"], m["ratios"]
    print(f"{'what':<6} {'cortexc':>9} {'level':>9} {'per_node':>9}  level/cx  per_node/cx")
    for what in ("infer", "train"):
        cells = " ".join(f"{ms[f'{n}_{what}']:>9.2f}" for n in ("cortexc", "level", "per_node"))
        print(f"{what:<6} {cells}  {ratios[f'level_{what}']:>7.2f}x  {ratios[f'per_node_{what}']:>9.2f}x")
    fwd = ms["cortexc_forward_grad"]
    print(f"cortexc training step: forward(grad) {fwd:.2f} ms + backward and loss {ms['cortexc_train'] - fwd:.2f} ms")


def setup(work: Path, hidden: int, inputs: int, seed: int) -> tuple[Any, LevelTopDown, PerNodeTopDown]:
    """The compiled model and the two peers, with the same random params."""
    model = load_cell(work / f"H{hidden}", hidden, inputs)(device="cpu", seed=seed)
    params = random_params({k: np.shape(v) for k, v in model.params.items()}, hidden, np.random.default_rng(seed))
    model.load_params(params)
    return model, LevelTopDown(params), PerNodeTopDown(params)


def main(args: argparse.Namespace) -> None:
    started, load_start = time.time(), os.getloadavg()[0]
    busy_start, own_start = machine_busy_s(), own_cpu_s()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    H, X, th = args.hidden, args.input, args.threads
    work = Path(tempfile.mkdtemp(prefix="bench_topdown_"))
    model, level, node = setup(work, H, X, args.seed)

    trees = read_trees(args.split)
    groups = [trees[i : i + args.batch] for i in range(0, len(trees), args.batch)]
    picked = sorted({int(i) for i in np.linspace(0, len(groups) - 1, min(args.batches, len(groups)))})
    check_batch = make_batch(trees[: args.check_trees], level, node, X, args.seed + 1)
    checked = check(model, level, node, check_batch)
    print(f"top-down Tree-LSTM X={X} H={H}, {th} threads for every implementation; ms per batch (median, turns)")
    print(f"check on {args.check_trees} trees: largest relative difference {max(checked.values()):.1e}")

    batches = [make_batch(groups[i], level, node, X, args.seed + 100 + i) for i in picked]
    nodes = [b.forest.num_nodes for b in batches]
    depth = [len(b.level.level_ptr) - 1 for b in batches]
    print(
        f"{len(batches)} batches of {args.batch} {args.split} trees (of {len(groups)}): {statistics.mean(nodes):.0f} "
        f"nodes and {statistics.mean(depth):.1f} depths per batch on average; median of {args.repeats}"
    )
    main_run = measure(model, level, node, batches, args.repeats)
    print_table(main_run)
    plans = plan_ms([groups[i] for i in picked], level, node)
    print("plan ms per batch (not in the times above): " + ", ".join(f"{k} {v:.2f}" for k, v in plans.items()))

    sweep = []
    for hidden in (int(v) for v in args.sweep_hidden.split(",") if v.strip()):
        m, lv, nd = setup(work, hidden, X, args.seed)
        worst = max(check(m, lv, nd, check_batch).values())  # the plans do not depend on the params: reused
        print(f"\nH={hidden} (checked: {worst:.1e}), median of {args.sweep_repeats}")
        row = measure(m, lv, nd, batches, args.sweep_repeats)
        print_table(row)
        sweep.append({"H": hidden, "check_max": worst, **row})

    load = os.getloadavg()[0]
    wall = time.time() - started
    others = (machine_busy_s() - busy_start - (own_cpu_s() - own_start)) / wall
    print(f"\n1-min load average {load_start:.2f} at the start, {load:.2f} at the end on {os.cpu_count()} CPUs; "
          f"other processes used {others:.2f} CPUs on average during the run")  # fmt: skip
    print(f"{wall:.0f} s")
    if args.out:
        result = {
            "host": host(), "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.executable).name, *sys.argv]), "quick": args.quick,
            "threads": th, "adapt_threads": args.adapt, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"), "H": H, "X": X, "split": args.split,
            "batch_trees": args.batch, "batches": len(batches), "batch_indices": picked,
            "mean_nodes_per_batch": statistics.mean(nodes), "mean_depths_per_batch": statistics.mean(depth),
            "repeats": args.repeats, "sweep_repeats": args.sweep_repeats, "cell": CELL, "check": checked,
            "ms_per_batch": main_run["ms"], "ratios": main_run["ratios"], "sweep_hidden": sweep,
            "plan_ms_per_batch": plans, "load_average_start": load_start, "load_average_end": load,
            "other_processes_cpus": others, "wall_s": wall, "note": args.note,
        }  # fmt: skip
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(markdown(result))
        print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


def markdown(r: dict[str, Any]) -> str:
    h, ms, q = r["host"], r["ms_per_batch"], r["ratios"]
    fwd = ms["cortexc_forward_grad"]
    lines = [
        f"# Top-down Tree-LSTM: cortexc against PyTorch level-batched and per node (X={r['X']}, H={r['H']})",
        "",
        f"Measured {r['date']} on `{h['node']}` ({h['cpu']}, {h['cpus']} CPUs), {r['threads']} threads for every "
        f"implementation ({spin(r)}), torch {h['torch']}; 1-min load average {r['load_average_start']:.2f} at "
        f"the start, {r['load_average_end']:.2f} at the end; `{r['command']}`. The cell is a `down` Tree-LSTM reading "
        "`U[edge.position] @ parent.h` with a `root` block and logits at every node (`CELL` in "
        "`benchmarks/bench_topdown.py`). ms per batch are medians; ratios are peer ms / cortexc ms (above 1: "
        "cortexc faster), measured in the same run. Inference = forward without gradients (h, c, logits of every "
        "node); training step = forward + backward of the mean cross-entropy at every node (every weight's "
        "gradient and that of x, in every implementation), no optimizer. Outputs and gradients checked equal "
        "(to 1e-4 relative) before timing.",
        *busy(r),
        "",
        f"## {r['batches']} batches of {r['batch_trees']} SST {r['split']} trees "
        f"({r['mean_nodes_per_batch']:.0f} nodes, {r['mean_depths_per_batch']:.1f} depths per batch on average; "
        f"median of {r['repeats']})",
        "",
        "| | cortexc | PyTorch level-batched | PyTorch per node | level / cortexc | per node / cortexc |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for what, title in (("infer", "inference ms"), ("train", "training step ms")):
        lines.append(
            f"| {title} | {ms[f'cortexc_{what}']:.2f} | {ms[f'level_{what}']:.2f} | {ms[f'per_node_{what}']:.2f} | "
            f"{q[f'level_{what}']:.2f}x | {q[f'per_node_{what}']:.2f}x |"
        )
    p = r["plan_ms_per_batch"]
    lines += [
        "",
        f"cortexc's training step: forward(grad) {fwd:.2f} ms, backward and loss {ms['cortexc_train'] - fwd:.2f} ms.",
        f"Index arrays per batch, made once per batch and not in the times above: cortexc `linearize_down` "
        f"{p['cortexc']:.2f} ms, level-batched plan {p['level']:.2f} ms, per-node plan {p['per_node']:.2f} ms.",
    ]
    if r["sweep_hidden"]:
        lines += [
            "",
            f"## Other hidden sizes (X={r['X']}, the same batches; median of {r['sweep_repeats']})",
            "",
            "| H | cortexc infer ms | level / cx infer | per node / cx infer | cortexc train ms | level / cx train "
            "| per node / cx train |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in r["sweep_hidden"]:
            m, rq = row["ms"], row["ratios"]
            lines.append(
                f"| {row['H']} | {m['cortexc_infer']:.2f} | {rq['level_infer']:.2f}x | {rq['per_node_infer']:.2f}x | "
                f"{m['cortexc_train']:.2f} | {rq['level_train']:.2f}x | {rq['per_node_train']:.2f}x |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main(ARGS)
