"""RNTN training on SST: cortexc's compiled cell against PyTorch level by level and per node.

The model is the Recursive Neural Tensor Network of Socher et al. 2013 as `examples/sst/rntn.cell` writes it
(``SSTRNTN``): a phrase is ``h = tanh(hc' V[1:d] hc + W hc + b)`` with ``hc = [left; right]`` and ``V`` a 3-D
param ``[d, 2d, 2d]`` (``T`` in the cell), a leaf ``h = tanh(L[word])`` (the cell's leaf; the paper uses the
word vector as it is), and every node classified, ``logits = W_s h + b_s``; d=30 as in the paper. Three
implementations, with the same weights, the same trees and the same word ids:

- ``cortexc``: the cell compiled for the CPU (``device="cpu"``);
- ``level``: PyTorch level by level, TF Fold / DGL style (`LevelRNTN`): the rows in the forest's level order
  (leaves first, index arrays made once per batch in NumPy), the leaves in one gather and ``tanh``, then per
  level one gather of the children's ``h`` into ``hc`` ``[n, 2d]``, the bilinear term of every node of the
  level in one GEMM and one ``bmm`` (``(hc @ V') . hc``, V' the ``[2d, d*2d]`` view of V), ``W hc + b`` in one
  GEMM, ``tanh``, the rows written into the states; the logits of every node in one GEMM at the end;
- ``per_node``: PyTorch one node at a time (`PerNodeRNTN`), the usual research code: a Python loop over the
  nodes, children first, ``torch.einsum("i,kij,j->k", hc, V, hc)`` for the bilinear term, the logits per node.

The batches are SST train trees (``$CORTEXC_SST_DIR``, else ``../shared/data/sst`` beside the checkout) in
consecutive minibatches of ``--batch`` trees; ``--batches`` of them, spread evenly over the split, are timed;
the vocabulary is that of the whole train split. A training step is a forward that keeps what the backward
needs plus the backward of the mean over every node (every phrase) of the softmax cross-entropy of its logits
against its SST label: every param's gradient (the word table ``L`` dense, in every implementation); no
optimizer step. Inference (a forward without gradients: ``h`` and the logits of every node, in node order) is
timed too. The peers' index arrays are made once per batch before the timing, as cortexc's linearization is
made once per forest and kept in it.

Before any timing, on a few trees, every implementation is checked to give the same ``h`` and logits and the
same gradient of every param (each to 1e-4 relative to its largest value), else the script stops. Times are
medians of ``--repeats`` calls, the implementations taking turns (each timed call follows an untimed call of
its own, as in `bench_ggnn.py`); one call runs every timed batch once, and ms are per batch. Ratios are peer
ms / cortexc ms (above 1: cortexc is faster). Every implementation runs on ``--threads`` threads (default 2:
``torch.set_num_threads``, ``OMP_NUM_THREADS`` and ``CORTEXC_NUM_THREADS``; cortexc's cap by other processes'
load is turned off with ``CORTEXC_ADAPT_THREADS=0`` unless ``--adapt``). torch and the compiled code share
one libgomp, loaded by torch (imported first), which reads its spin count once as it loads: both get
cortexc's own default, ``GOMP_SPINCOUNT=10000`` (what cortexc's runtime sets when it loads libgomp itself),
unless ``--spin-default`` or the caller sets ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` (``passive`` makes
the PyTorch peers' small ops 3-4x slower on a 2-CPU machine).
The results record the host, its CPU, the 1-min load average at the start and the end, and the CPUs that other
processes used on average during the run (from /proc/stat, less this process's own CPU time), with a caution
when the machine was busy.

Usage (from the repository root)::

    python benchmarks/bench_rntn.py --quick
    python benchmarks/bench_rntn.py --out benchmarks/results/rntn.json     # and rntn.md beside it
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
    parser.add_argument("--hidden", type=int, default=30, help="d")
    parser.add_argument("--batch", type=int, default=25, help="trees per minibatch")
    parser.add_argument("--batches", type=int, default=24, help="minibatches timed, spread over the split")
    parser.add_argument("--split", default="train")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--check-trees", type=int, default=5)
    parser.add_argument("--adapt", action="store_true", help="let cortexc cap its threads by the machine's load")
    parser.add_argument("--spin-default", action="store_true", help="leave libgomp's spin count as it is")
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats: a smoke test")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write JSON here and a markdown table beside it (.md)")
    parser.add_argument("--note", help="a remark on the run for the results (e.g. why these threads)")
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.batches, args.repeats, args.check_trees = 8, 3, 2, 3
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
from cortexc import Forest, Vocab  # noqa: E402

SST = Path(os.environ.get("CORTEXC_SST_DIR") or REPO.parent / "shared" / "data" / "sst")
CELL_FILE = REPO / "examples" / "sst" / "rntn.cell"
PARAMS = ("L", "T", "W", "b", "W_s", "b_s")


def load_cell(work: Path, hidden: int, vocab_size: int) -> Any:
    """The compiled cell's class (`SSTRNTN` of examples/sst/rntn.cell) at these dims."""
    return cortexc.load(CELL_FILE, out_dir=work / "rntn", H=hidden, V=vocab_size).SSTRNTN


def random_params(shapes: dict[str, tuple[int, ...]], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Every param random (biases too, so that a bias slip shows): uniform in +-1/sqrt(fan-in) (the last
    dim), the word table normal(0, 0.1) as the cell declares."""
    out = {}
    for k, shape in shapes.items():
        if k == "L":
            out[k] = 0.1 * rng.standard_normal(shape)
        else:
            bound = 1 / np.sqrt(shape[-1])
            out[k] = rng.uniform(-bound, bound, shape)
    return {k: v.astype(np.float32) for k, v in out.items()}


def read_trees(split: str) -> list[str]:
    path = SST / f"{split}.txt"
    if not path.exists():
        raise SystemExit(f"{path} not found: set CORTEXC_SST_DIR to the SST directory")
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


# ------------------------------------------------------------------ the peers


def _tensors(params: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Own float32 copies of the params, as autograd leaves."""
    return {k: torch.tensor(np.array(params[k], dtype=np.float32), requires_grad=True) for k in PARAMS}


def _binary(forest: Forest) -> None:
    if forest.num_nodes and not set(np.unique(forest.num_children).tolist()) <= {0, 2}:
        raise ValueError("the RNTN peers need binary trees (every node 0 or 2 children)")


@dataclass
class LevelPlan:
    """A batch's rows: nodes in the forest's level order (leaves first)."""

    num_nodes: int
    row_of: torch.Tensor  # [N] row of each node
    level_ptr: tuple[int, ...]  # rows of level k: level_ptr[k]:level_ptr[k + 1]
    leaf_words: torch.Tensor  # [leaves] word ids of the level-0 rows
    child_rows: tuple[torch.Tensor, ...]  # per level k >= 1: [2 n_k] rows of each node's left, right child
    labels: torch.Tensor | None  # [N] in row order


class LevelRNTN:
    """The RNTN in PyTorch, one batched step per level (see the module's docstring)."""

    def __init__(self, params: dict[str, np.ndarray]):
        self.p = _tensors(params)
        self.hidden = self.p["b"].shape[0]

    def prepare(self, forest: Forest, words: np.ndarray) -> LevelPlan:
        """Index arrays for every level, in NumPy (vectorised)."""
        _binary(forest)
        n = forest.num_nodes
        order = np.asarray(forest.level_order, dtype=np.int64)
        row_of = np.empty(n, dtype=np.int64)
        row_of[order] = np.arange(n, dtype=np.int64)
        ptr = tuple(int(p) for p in forest.level_ptr)
        child_ptr, child_idx = np.asarray(forest.child_ptr), np.asarray(forest.child_idx, dtype=np.int64)
        child_rows = []
        for k in range(1, len(ptr) - 1):
            nodes = order[ptr[k] : ptr[k + 1]]
            first = child_ptr[nodes]
            pairs = np.stack([child_idx[first], child_idx[first + 1]], axis=1)  # [n_k, 2]: left, right
            child_rows.append(torch.from_numpy(row_of[pairs].reshape(-1)))
        labels = None if forest.labels is None else torch.from_numpy(np.asarray(forest.labels, np.int64)[order])
        leaves = order[: ptr[1]] if n else order
        return LevelPlan(
            n,
            torch.from_numpy(row_of),
            ptr,
            torch.from_numpy(np.asarray(words, dtype=np.int64)[leaves]),
            tuple(child_rows),
            labels,
        )

    def rows(self, plan: LevelPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """``h`` and logits of every node, in row order."""
        p, d, ptr = self.p, self.hidden, plan.level_ptr
        v_flat = p["T"].permute(1, 0, 2).reshape(2 * d, d * 2 * d)  # [2d, d*2d]: (hc @ v_flat)[k*2d + j]
        h = torch.zeros(plan.num_nodes, d)
        h[: ptr[1]] = torch.tanh(p["L"].index_select(0, plan.leaf_words))
        for k, rows in enumerate(plan.child_rows, start=1):
            n = ptr[k + 1] - ptr[k]
            hc = h.index_select(0, rows).view(n, 2 * d)
            bilinear = torch.bmm((hc @ v_flat).view(n, d, 2 * d), hc.unsqueeze(2)).squeeze(2)  # hc' V[k] hc
            h[ptr[k] : ptr[k + 1]] = torch.tanh(torch.addmm(p["b"], hc, p["W"].t()) + bilinear)
        return h, torch.addmm(p["b_s"], h, p["W_s"].t())

    def infer(self, plan: LevelPlan) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            h, logits = self.rows(plan)
            return {"h": h[plan.row_of], "logits": logits[plan.row_of]}

    def loss(self, plan: LevelPlan) -> torch.Tensor:
        assert plan.labels is not None
        return torch.nn.functional.cross_entropy(self.rows(plan)[1], plan.labels)


@dataclass
class PerNodePlan:
    """A batch as Python lists: nodes children first, each node's children and word id."""

    num_nodes: int
    order: list[int]
    children: list[list[int]]
    words: list[int]
    labels: torch.Tensor | None  # [N] in node order


class PerNodeRNTN:
    """The RNTN in PyTorch, one node at a time, children first (see the module's docstring)."""

    def __init__(self, params: dict[str, np.ndarray]):
        self.p = _tensors(params)

    def prepare(self, forest: Forest, words: np.ndarray) -> PerNodePlan:
        _binary(forest)
        ptr, idx = np.asarray(forest.child_ptr), np.asarray(forest.child_idx)
        labels = None if forest.labels is None else torch.from_numpy(np.asarray(forest.labels, np.int64))
        return PerNodePlan(
            forest.num_nodes,
            np.asarray(forest.level_order).tolist(),
            [idx[ptr[v] : ptr[v + 1]].tolist() for v in range(forest.num_nodes)],
            np.asarray(words).tolist(),
            labels,
        )

    def nodes(self, plan: PerNodePlan) -> tuple[torch.Tensor, torch.Tensor]:
        """``h`` and logits of every node, in node order."""
        p = self.p
        hs: list[Any] = [None] * plan.num_nodes
        logits: list[Any] = [None] * plan.num_nodes
        for v in plan.order:
            kids = plan.children[v]
            if kids:
                hc = torch.cat((hs[kids[0]], hs[kids[1]]))
                bilinear = torch.einsum("i,kij,j->k", hc, p["T"], hc)
                hs[v] = torch.tanh(torch.addmv(p["b"], p["W"], hc) + bilinear)
            else:
                hs[v] = torch.tanh(p["L"][plan.words[v]])
            logits[v] = torch.addmv(p["b_s"], p["W_s"], hs[v])
        return torch.stack(hs), torch.stack(logits)

    def infer(self, plan: PerNodePlan) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            h, logits = self.nodes(plan)
            return {"h": h, "logits": logits}

    def loss(self, plan: PerNodePlan) -> torch.Tensor:
        assert plan.labels is not None
        return torch.nn.functional.cross_entropy(self.nodes(plan)[1], plan.labels)


def torch_grads(peer: LevelRNTN | PerNodeRNTN, plan: Any) -> dict[str, np.ndarray]:
    """Every param's gradient of the mean cross-entropy (one forward and backward)."""
    for t in peer.p.values():
        t.grad = None
    peer.loss(plan).backward()
    return {k: t.grad.numpy().copy() for k, t in peer.p.items() if t.grad is not None}


def cortexc_grads(model: Any, forest: Forest, words: np.ndarray) -> dict[str, np.ndarray]:
    """cortexc's training step: forward keeping what backward needs, the loss's upstream, backward."""
    out = model(forest, grad=True, word=words)
    labels = np.asarray(forest.labels, dtype=np.int64)
    return model.backward(out, {"logits": cross_entropy_grad(out["logits"], labels)})


# ------------------------------------------------------------------ batches, the check, the timing


@dataclass
class Batch:
    forest: Forest
    words: np.ndarray
    level: LevelPlan
    node: PerNodePlan


def make_batch(lines: Sequence[str], vocab: Vocab, level: LevelRNTN, node: PerNodeRNTN) -> Batch:
    forest = Forest.from_ptb(lines)
    words = vocab.encode(forest)
    return Batch(forest, words, level.prepare(forest, words), node.prepare(forest, words))


def check(model: Any, level: LevelRNTN, node: PerNodeRNTN, batch: Batch) -> dict[str, float]:
    """Every implementation's h, logits and gradients agree (raises SystemExit if not)."""
    out = model(batch.forest, word=batch.words)
    want = {k: out[k] for k in ("h", "logits")}
    report: dict[str, float] = {}
    for name, got in (("level", level.infer(batch.level)), ("per_node", node.infer(batch.node))):
        for k, d in max_rel_diff({k: v.numpy() for k, v in got.items()}, want, list(want)).items():
            report[f"{k}_{name}_vs_cortexc"] = d
    grads = cortexc_grads(model, batch.forest, batch.words)
    for name, peer, plan in (("level", level, batch.level), ("per_node", node, batch.node)):
        for k, d in max_rel_diff(torch_grads(peer, plan), grads, PARAMS).items():
            report[f"d{k}_{name}_vs_cortexc"] = d
    bad = {k: d for k, d in report.items() if not d <= 1e-4}
    if bad:
        raise SystemExit(f"the implementations disagree: {bad}")
    return report


def functions(model: Any, level: LevelRNTN, node: PerNodeRNTN, batches: list[Batch]) -> dict[str, Callable]:
    """One call of each: every batch once (inference, or a training step)."""

    def cortexc_infer() -> None:
        for b in batches:
            model(b.forest, word=b.words)

    def cortexc_forward_grad() -> None:
        for b in batches:
            model(b.forest, grad=True, word=b.words)

    def cortexc_train() -> None:
        for b in batches:
            cortexc_grads(model, b.forest, b.words)

    def torch_infer(peer: Any, which: str) -> None:
        for b in batches:
            peer.infer(getattr(b, which))

    def torch_train(peer: Any, which: str) -> None:
        for b in batches:
            for t in peer.p.values():
                t.grad = None
            peer.loss(getattr(b, which)).backward()

    return {
        "cortexc_infer": cortexc_infer,
        "level_infer": lambda: torch_infer(level, "level"),
        "per_node_infer": lambda: torch_infer(node, "node"),
        "cortexc_train": cortexc_train,
        "level_train": lambda: torch_train(level, "level"),
        "per_node_train": lambda: torch_train(node, "node"),
        "cortexc_forward_grad": cortexc_forward_grad,
    }


# ------------------------------------------------------------------ main


def main(args: argparse.Namespace) -> None:
    started, load_start = time.time(), os.getloadavg()[0]
    busy_start, own_start = machine_busy_s(), own_cpu_s()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    d, th = args.hidden, args.threads
    trees = read_trees(args.split)
    vocab = Vocab.build([Forest.from_ptb(trees)])
    work = Path(tempfile.mkdtemp(prefix="bench_rntn_"))
    model = load_cell(work, d, len(vocab))(device="cpu", seed=args.seed)
    params = random_params({k: np.shape(v) for k, v in model.params.items()}, np.random.default_rng(args.seed))
    model.load_params(params)
    level, node = LevelRNTN(params), PerNodeRNTN(params)

    groups = [trees[i : i + args.batch] for i in range(0, len(trees), args.batch)]
    picked = sorted({int(i) for i in np.linspace(0, len(groups) - 1, min(args.batches, len(groups)))})
    checked = check(model, level, node, make_batch(trees[: args.check_trees], vocab, level, node))
    print(f"RNTN d={d}, vocab {len(vocab)}, {th} threads for every implementation; ms per minibatch (median, turns)")
    print(f"check on {args.check_trees} trees: largest relative difference {max(checked.values()):.1e}")

    batches = [make_batch(groups[i], vocab, level, node) for i in picked]
    nodes = [b.forest.num_nodes for b in batches]
    levels = [b.forest.num_levels for b in batches]
    print(
        f"{len(batches)} minibatches of {args.batch} {args.split} trees (of {len(groups)}): "
        f"{statistics.mean(nodes):.0f} nodes and {statistics.mean(levels):.1f} levels per minibatch on average; "
        f"median of {args.repeats}"
    )
    seconds = interleaved(functions(model, level, node, batches), args.repeats)
    ms = {k: 1e3 * v / len(batches) for k, v in seconds.items()}
    ratios = {f"{peer}_{what}": ms[f"{peer}_{what}"] / ms[f"cortexc_{what}"] for peer in ("level", "per_node")
              for what in ("infer", "train")}  # fmt: skip
    print(f"{'what':<6} {'cortexc':>9} {'level':>9} {'per_node':>9}  level/cx  per_node/cx")
    for what in ("infer", "train"):
        cells = " ".join(f"{ms[f'{n}_{what}']:>9.2f}" for n in ("cortexc", "level", "per_node"))
        print(f"{what:<6} {cells}  {ratios[f'level_{what}']:>7.2f}x  {ratios[f'per_node_{what}']:>9.2f}x")
    fwd = ms["cortexc_forward_grad"]
    print(f"cortexc training step: forward(grad) {fwd:.2f} ms + backward and loss {ms['cortexc_train'] - fwd:.2f} ms")

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
            "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
            "d": d, "vocab": len(vocab), "cell": str(CELL_FILE.relative_to(REPO)), "split": args.split,
            "batch_trees": args.batch, "batches": len(batches), "batch_indices": picked,
            "mean_nodes_per_batch": statistics.mean(nodes), "mean_levels_per_batch": statistics.mean(levels),
            "repeats": args.repeats, "check": checked, "ms_per_batch": ms, "ratios": ratios,
            "load_average_start": load_start, "load_average_end": load, "other_processes_cpus": others,
            "wall_s": wall, "note": args.note,
        }  # fmt: skip
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(markdown(result))
        print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


def markdown(r: dict[str, Any]) -> str:
    h, ms, q = r["host"], r["ms_per_batch"], r["ratios"]
    fwd = ms["cortexc_forward_grad"]
    lines = [
        f"# RNTN: cortexc against PyTorch level-batched and per node (d={r['d']})",
        "",
        f"Measured {r['date']} on `{h['node']}` ({h['cpu']}, {h['cpus']} CPUs), {r['threads']} threads for every "
        f"implementation ({spin(r)}), torch {h['torch']}; 1-min load "
        f"average {r['load_average_start']:.2f} at the start, {r['load_average_end']:.2f} at the end; "
        f"`{r['command']}`. The cell is `{r['cell']}` (Socher et al. 2013: `h = tanh(hc' V hc + W hc + b)`, V a "
        f"3-D param; vocabulary {r['vocab']} words). ms per minibatch are medians; ratios are peer ms / cortexc ms "
        "(above 1: cortexc faster), measured in the same run. Training step = forward + backward of the mean "
        "cross-entropy at every node (every phrase; every param's gradient, the word table's dense), no "
        "optimizer; inference = forward without gradients (h and logits of every node). Outputs and gradients "
        "checked equal (to 1e-4 relative) before timing.",
        *busy(r),
        "",
        f"## {r['batches']} minibatches of {r['batch_trees']} SST {r['split']} trees "
        f"({r['mean_nodes_per_batch']:.0f} nodes, {r['mean_levels_per_batch']:.1f} levels per minibatch on "
        f"average; median of {r['repeats']})",
        "",
        "| | cortexc | PyTorch level-batched | PyTorch per node | level / cortexc | per node / cortexc |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for what, title in (("train", "training step ms"), ("infer", "inference ms")):
        lines.append(
            f"| {title} | {ms[f'cortexc_{what}']:.2f} | {ms[f'level_{what}']:.2f} | {ms[f'per_node_{what}']:.2f} | "
            f"{q[f'level_{what}']:.2f}x | {q[f'per_node_{what}']:.2f}x |"
        )
    lines += [
        "",
        f"cortexc's training step: forward(grad) {fwd:.2f} ms, backward and loss {ms['cortexc_train'] - fwd:.2f} ms.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main(ARGS)
