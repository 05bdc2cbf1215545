"""Binary Tree-LSTM training on SST: cortexc's compiled forward + backward against PyTorch autograd.

The setting of Tai et al. (2015): SST train, fine-grained labels (5 classes),
softmax cross-entropy on every node (the mean over all nodes of a batch),
batches of 25 trees, Adagrad lr 0.05, random embeddings (``E ~ normal(0,
0.1)`` as ``examples/binary_treelstm.cell`` declares), H=150, X=300, a
vocabulary of every train word. Every implementation starts from the same
weights (the compiled model's seed-0 init) and sees the batches in the same
order (one seeded permutation of the train trees per epoch).

Two parts:

1. Throughput, trees/s of a whole training step (forward, loss, backward,
   optimizer step) over the first ``--timed-batches`` batches, after one
   untimed forward + backward (no step) as warm-up; in ``--rounds`` rounds in
   which the implementations take turns (each from the initial weights), the
   median round kept:

   - ``cortexc``: the compiled model (``device="cpu"``): ``model(forest,
     grad=True)``, `cortexc.train.softmax_cross_entropy`, ``model.backward``,
     `cortexc.train.Adagrad` and ``model.load_params`` (which re-packs the GEMM
     weights); its linearization is inside the forward call;
   - ``cortexc_f32adagrad``: the same but with `Float32Adagrad` below, torch's
     Adagrad update in float32 NumPy, in place (`cortexc.train.Adagrad` computes
     in float64 and allocates new arrays: on the dense ``[V, X]`` embedding it is
     most of a step);
   - ``cortexc_sparse``: ``cortexc`` with the embedding's gradient as `SparseRows`
     (``model.backward(..., sparse=True)``), which `cortexc.train.Adagrad` applies to the looked-up
     rows only: the native path at its best, the one the torch path's overhead is stated against;
   - ``cortexc_torch``: the torch path, `cortexc.torch.CellModule` with a sparse embedding
     gradient, ``F.cross_entropy`` and ``torch.optim.Adagrad`` (the same kernels in an autograd graph);
     the time its forward spends packing the GEMM weights again after each optimizer step (a param's
     version changed) is timed as ``repack``;
   - ``torch_per_node``: recursive PyTorch autograd (`train_peers.TorchPerNodeTrain`),
     on only ``--per-node-batches`` batches (it is slow);
   - ``torch_level_batched``: PyTorch autograd level by level
     (`train_peers.TorchLevelBatchedTrain`); its NumPy index preparation is timed
     apart and reported both ways.

   Batch assembly (``Forest.concat`` and ``Vocab.encode`` of the batch) is done
   before timing, for all alike. Before timing, the gradients of the three on
   the first batch are compared (normwise relative error per param).
2. Accuracy: cortexc (both optimizers) and the level-batched PyTorch model
   trained identically for ``--epochs`` epochs over train (or its first
   ``--limit`` trees), taking turns epoch by epoch; the fine-grained root
   accuracy on dev after each epoch, and the time taken.
3. ``--dropout`` (instead of 1 and 2): the cost of dropout, ``examples/treelstm_dropout.cell`` (the same
   Tree-LSTM with four dropout sites, masks computed inline from Philox) forward with ``grad=True`` +
   backward per batch, in training mode (``train=True``, a seed per batch) against evaluation mode, and
   against the cell without dropout (``examples/binary_treelstm.cell``) — the three take turns batch by
   batch in every round; the median round's ms per batch and the ratios (goal: training <= 1.10 x eval).

OMP_NUM_THREADS is set to ``--threads`` before numpy, torch or cortexc are
imported (cortexc's OpenMP kernels read it), and ``torch.set_num_threads`` too.

Usage (from the repository root)::

    python benchmarks/bench_train.py --quick
    python benchmarks/bench_train.py --epochs 3 --json bench_train.json
    python benchmarks/bench_train.py --dropout --timed-batches 20 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__":  # before numpy / torch / cortexc load their OpenMP runtimes
    _pre = argparse.ArgumentParser(add_help=False)
    _pre.add_argument("--threads", type=int, default=2)
    os.environ["OMP_NUM_THREADS"] = str(max(1, _pre.parse_known_args()[0].threads))

import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make `benchmarks` and `cortexc` importable
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import cortexc  # noqa: E402
from benchmarks.train_peers import TorchLevelBatchedTrain, TorchPerNodeTrain  # noqa: E402
from cortexc.runtime.forest import Forest  # noqa: E402
from cortexc.runtime.vocab import Vocab  # noqa: E402
from cortexc.train import Adagrad, SparseRows, softmax_cross_entropy  # noqa: E402

CELL = REPO / "examples" / "binary_treelstm.cell"
DROPOUT_CELL = REPO / "examples" / "treelstm_dropout.cell"
SST_DIR = Path(os.environ.get("CORTEXC_SST_DIR", REPO.parent / "shared" / "data" / "sst"))
IMPLS = ("cortexc", "cortexc_f32adagrad", "cortexc_sparse", "cortexc_torch", "torch_per_node", "torch_level_batched")
CORTEXC_IMPLS = ("cortexc", "cortexc_f32adagrad")  # the ratio columns of the table
NATIVE_IMPLS = ("cortexc", "cortexc_f32adagrad", "cortexc_sparse")  # `CortexcTrainer`
NUM_CLASSES = 5
GRAD_RTOL = 1e-4  # normwise relative gradient error above which a param is flagged


# ------------------------------------------------------------- data


def read_trees(path: Path, limit: int | None = None) -> list[Forest]:
    """One Forest per non-blank line of a PTB file (the first ``limit``)."""
    trees: list[Forest] = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                trees.append(Forest.from_ptb(line))
                if limit is not None and len(trees) >= limit:
                    break
    return trees


@dataclass
class Batch:
    """A batch of trees as one forest, its word ids (int32) and per-node labels."""

    forest: Forest
    ids: np.ndarray
    labels: np.ndarray
    trees: int


def make_batch(trees: Sequence[Forest], vocab: Vocab) -> Batch:
    forest = Forest.concat(trees)
    return Batch(forest, vocab.encode(forest), np.asarray(forest.labels), len(trees))


def epoch_batches(
    trees: Sequence[Forest], vocab: Vocab, batch_size: int, order: np.ndarray, max_batches: int | None = None
) -> list[Batch]:
    """The batches of one epoch in the order ``order`` (the first ``max_batches``)."""
    starts = range(0, len(order), batch_size)
    if max_batches is not None:
        starts = starts[:max_batches]
    return [make_batch([trees[int(i)] for i in order[s : s + batch_size]], vocab) for s in starts]


# ------------------------------------------------------------- trainers


class Float32Adagrad:
    """``torch.optim.Adagrad`` (eps 1e-10, accumulator from 0, no lr decay) in float32 NumPy, in place.

    ``s += g * g; p -= lr * g / (sqrt(s) + eps)``, as `cortexc.train.Adagrad`,
    but on float32 copies of the params it owns, with one scratch array per
    param, as torch does it. `step` returns the updated params (its own arrays).
    """

    def __init__(self, params: dict[str, np.ndarray], lr: float, eps: float = 1e-10) -> None:
        self.lr = np.float32(lr)
        self.eps = np.float32(eps)
        self.params = {name: np.array(value, dtype=np.float32) for name, value in params.items()}
        self.sums = {name: np.zeros_like(value) for name, value in self.params.items()}
        self.scratch = {name: np.empty_like(value) for name, value in self.params.items()}

    def step(self, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        for name, grad in grads.items():
            total, tmp = self.sums[name], self.scratch[name]
            np.multiply(grad, grad, out=tmp)
            total += tmp
            np.sqrt(total, out=tmp)
            tmp += self.eps
            np.divide(grad, tmp, out=tmp)
            tmp *= self.lr
            self.params[name] -= tmp
        return self.params


class CortexcTrainer:
    """The compiled model with `cortexc.train`'s cross-entropy, and its Adagrad or `Float32Adagrad`."""

    def __init__(self, name: str, module: Any, params: dict[str, np.ndarray], lr: float) -> None:
        self.name = name
        self.model = module.BinaryTreeLSTM(device="cpu", seed=0)
        self.model.load_params(params)
        self.opt = Float32Adagrad(params, lr) if name == "cortexc_f32adagrad" else Adagrad(lr)
        self.sparse = name == "cortexc_sparse"

    def _update(self, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if isinstance(self.opt, Adagrad):
            return self.opt.step(self.model.params, grads)
        return self.opt.step(grads)

    def warm_up(self, batch: Batch) -> None:
        out = self.model(batch.forest, grad=True, word=batch.ids)
        _, d_logits = softmax_cross_entropy(out["logits"], batch.labels)
        self.model.backward(out, {"logits": d_logits})

    def grads(self, batch: Batch) -> dict[str, np.ndarray]:
        out = self.model(batch.forest, grad=True, word=batch.ids)
        _, d_logits = softmax_cross_entropy(out["logits"], batch.labels)
        grads = self.model.backward(out, {"logits": d_logits}, sparse=self.sparse)
        return {name: g.to_dense() if isinstance(g, SparseRows) else g for name, g in grads.items()}

    def step(self, batch: Batch, timings: dict[str, float]) -> float:
        t0 = time.perf_counter()
        out = self.model(batch.forest, grad=True, word=batch.ids)
        t1 = time.perf_counter()
        loss, d_logits = softmax_cross_entropy(out["logits"], batch.labels)
        t2 = time.perf_counter()
        grads = self.model.backward(out, {"logits": d_logits}, sparse=self.sparse)
        t3 = time.perf_counter()
        self.model.load_params(self._update(grads))
        t4 = time.perf_counter()
        for key, seconds in (("forward", t2 - t0), ("backward", t3 - t2), ("optimizer", t4 - t3), ("loss", t2 - t1)):
            timings[key] = timings.get(key, 0.0) + seconds
        return loss

    def root_logits(self, batch: Batch) -> np.ndarray:
        return self.model(batch.forest, word=batch.ids)["logits"][batch.forest.roots]


class CellModuleTrainer:
    """The torch path: `cortexc.torch.CellModule` (the embedding's gradient sparse, as
    ``nn.Embedding(sparse=True)``), ``F.cross_entropy`` over every node and ``torch.optim.Adagrad``."""

    def __init__(self, name: str, module: Any, params: dict[str, np.ndarray], lr: float) -> None:
        from cortexc.torch import CellModule

        self.name = name
        self.net = CellModule(module.BinaryTreeLSTM, seed=0, sparse=True)
        self.net.load_state_dict({key: torch.from_numpy(np.array(value)) for key, value in params.items()})
        self.opt = torch.optim.Adagrad(self.net.parameters(), lr=lr)
        executor, self.repack_s = self.net.runner.executor, [0.0]
        repack = executor.repack

        def timed_repack(params: Any) -> None:  # the forward's `_Runner.prepare` after a param changed
            start = time.perf_counter()
            repack(params)
            self.repack_s[0] += time.perf_counter() - start

        executor.repack = timed_repack  # type: ignore[method-assign]

    def _loss(self, batch: Batch) -> torch.Tensor:
        out = self.net(batch.forest, word=torch.from_numpy(batch.ids))
        return torch.nn.functional.cross_entropy(out["logits"], torch.tensor(batch.labels, dtype=torch.long))

    def warm_up(self, batch: Batch) -> None:
        self._loss(batch).backward()
        self.opt.zero_grad(set_to_none=True)

    def grads(self, batch: Batch) -> dict[str, np.ndarray]:
        self.opt.zero_grad(set_to_none=True)
        self._loss(batch).backward()
        found = {}
        for name, param in self.net.named_parameters():
            grad = param.grad
            if grad is None:
                found[name] = np.zeros(tuple(param.shape), np.float32)
            else:
                found[name] = (grad.to_dense() if grad.is_sparse else grad).numpy()
        return found

    def step(self, batch: Batch, timings: dict[str, float]) -> float:
        t0 = time.perf_counter()
        repacked = self.repack_s[0]
        self.opt.zero_grad(set_to_none=True)
        loss = self._loss(batch)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.opt.step()
        t3 = time.perf_counter()
        timings["repack"] = timings.get("repack", 0.0) + self.repack_s[0] - repacked
        for key, seconds in (("forward", t1 - t0), ("backward", t2 - t1), ("optimizer", t3 - t2)):
            timings[key] = timings.get(key, 0.0) + seconds
        return float(loss.detach())

    def root_logits(self, batch: Batch) -> np.ndarray:
        with torch.no_grad():
            return self.net(batch.forest, word=torch.from_numpy(batch.ids))["logits"].numpy()[batch.forest.roots]


class TorchTrainer:
    """A `train_peers` model; its index preparation is timed as ``prepare``."""

    def __init__(self, name: str, peer_class: type, params: dict[str, np.ndarray], lr: float) -> None:
        self.name = name
        self.peer = peer_class(params, lr=lr)

    def warm_up(self, batch: Batch) -> None:
        self.peer.grads(batch.forest, batch.ids, batch.labels)

    def grads(self, batch: Batch) -> dict[str, np.ndarray]:
        return self.peer.grads(batch.forest, batch.ids, batch.labels)

    def step(self, batch: Batch, timings: dict[str, float]) -> float:
        t0 = time.perf_counter()
        plan = self.peer.prepare(batch.forest, batch.ids, batch.labels)
        timings["prepare"] = timings.get("prepare", 0.0) + time.perf_counter() - t0
        return self.peer.step_prepared(plan, timings)

    def root_logits(self, batch: Batch) -> np.ndarray:
        return self.peer.logits(batch.forest, batch.ids)[batch.forest.roots]


def make_trainer(name: str, module: Any, params: dict[str, np.ndarray], lr: float):
    if name in NATIVE_IMPLS:
        return CortexcTrainer(name, module, params, lr)
    if name == "cortexc_torch":
        return CellModuleTrainer(name, module, params, lr)
    if name == "torch_per_node":
        return TorchTrainer(name, TorchPerNodeTrain, params, lr)
    return TorchTrainer(name, TorchLevelBatchedTrain, params, lr)


# ------------------------------------------------------------- parts


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    """Normwise relative error: max |got - ref| over max |ref|."""
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30)) if ref.size else 0.0


def check_grads(module: Any, params: dict[str, np.ndarray], lr: float, batch: Batch) -> dict[str, dict[str, float]]:
    """Per param, the relative error of each torch peer's gradient against cortexc's on one batch."""
    ref = make_trainer("cortexc_f32adagrad", module, params, lr).grads(batch)
    errors = {}
    for name in ("cortexc_sparse", "cortexc_torch", "torch_level_batched", "torch_per_node"):
        got = make_trainer(name, module, params, lr).grads(batch)
        errors[name] = {param: rel_err(got[param], ref[param]) for param in ref}
    return errors


def time_training(trainer, batches: list[Batch]) -> dict[str, Any]:
    """Trees/s of whole training steps over ``batches`` (one untimed forward + backward first)."""
    trainer.warm_up(batches[0])
    timings: dict[str, float] = {}
    losses = []
    step_s = []
    start = time.perf_counter()
    for batch in batches:
        step_start = time.perf_counter()
        losses.append(trainer.step(batch, timings))
        step_s.append(time.perf_counter() - step_start)
    wall = time.perf_counter() - start
    trees = sum(b.trees for b in batches)
    nodes = sum(b.forest.num_nodes for b in batches)
    prepare = timings.get("prepare", 0.0)
    return {
        "batches": len(batches),
        "trees": trees,
        "nodes": nodes,
        "seconds": wall,
        "trees_per_s": trees / wall,
        "trees_per_s_compute": trees / (wall - prepare),  # without the peer's index preparation
        "ms_per_batch": {key: 1e3 * value / len(batches) for key, value in timings.items()},
        "step_s": step_s,
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }


def summarize_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median round (by trees/s) of a throughput measurement, every round's trees/s, and "best":
    the trees over the sum, batch by batch, of the fastest step of that batch across rounds.

    On a shared machine a slow step mostly measures other processes (a 2-thread OpenMP fork-join
    waits for its slowest thread to get a core), so "best" estimates a quiet machine, the median
    this machine as it was.
    """
    rates = [run["trees_per_s"] for run in runs]
    median = sorted(runs, key=lambda run: run["trees_per_s"])[(len(runs) - 1) // 2]
    best_s = float(np.sum(np.min([run["step_s"] for run in runs], axis=0)))
    return {
        **median,
        "rounds_trees_per_s": rates,
        "min_trees_per_s": min(rates),
        "max_trees_per_s": max(rates),
        "best_trees_per_s": median["trees"] / best_s,
    }


def dropout_cost(args: argparse.Namespace, vocab: Vocab, batches: list[Batch], progress) -> dict[str, Any]:
    """Part 3: ms per batch of forward (grad=True) + backward with dropout in training mode, in evaluation
    mode, and of the same cell without dropout; the three take turns batch by batch (same load for all)."""
    dims = {"V": len(vocab), "X": args.embed, "H": args.hidden, "C": NUM_CLASSES}
    dropout_cls = cortexc.load(str(DROPOUT_CELL), **dims).DropoutTreeLSTM
    plain_cls = cortexc.load(str(CELL), **dims).BinaryTreeLSTM
    models = {"train": dropout_cls(device="cpu", seed=args.seed), "plain": plain_cls(device="cpu", seed=args.seed)}
    models["eval"] = models["train"]
    models["plain"].load_params(models["train"].params)

    def step(name: str, batch: Batch, seed: int) -> float:
        model = models[name]
        t0 = time.perf_counter()
        out = model(batch.forest, grad=True, train=name == "train", dropout_seed=seed, word=batch.ids)
        _, d_logits = softmax_cross_entropy(out["logits"], batch.labels)
        model.backward(out, {"logits": d_logits})
        return time.perf_counter() - t0

    for name in models:  # warm-up: builds, first-touch of the scratch
        step(name, batches[0], 0)
    rounds: dict[str, list[float]] = {name: [] for name in models}
    for r in range(args.rounds):
        total = dict.fromkeys(models, 0.0)
        for k, batch in enumerate(batches):
            for name in models:
                total[name] += step(name, batch, r * len(batches) + k)
        for name in models:
            rounds[name].append(1e3 * total[name] / len(batches))
        progress(f"  dropout round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {rounds[n][-1]:.1f} ms" for n in models))
    median = {name: float(np.median(values)) for name, values in rounds.items()}
    best = {name: float(np.min(values)) for name, values in rounds.items()}

    def paired(mine: str, other: str) -> float:
        """The median over rounds of the round's ratio (the two measured under the same load)."""
        return float(np.median(np.asarray(rounds[mine]) / np.asarray(rounds[other])))

    return {
        "batches": len(batches),
        "nodes_per_batch": float(np.mean([b.forest.num_nodes for b in batches])),
        "ms_per_batch_median": median,
        "ms_per_batch_best": best,
        "rounds_ms_per_batch": rounds,
        "train/eval_paired": paired("train", "eval"),
        "eval/plain_paired": paired("eval", "plain"),
        "train/plain_paired": paired("train", "plain"),
        "train/eval_median": median["train"] / median["eval"],
        "train/eval_best": best["train"] / best["eval"],
        "eval/plain_median": median["eval"] / median["plain"],
        "train/plain_median": median["train"] / median["plain"],
    }


def evaluate(trainer, dev: list[Batch]) -> float:
    """Fine-grained root accuracy on the dev batches."""
    hits = total = 0
    for batch in dev:
        roots = batch.forest.roots
        hits += int(np.sum(trainer.root_logits(batch).argmax(axis=1) == batch.labels[roots]))
        total += len(roots)
    return hits / max(total, 1)


def train_epoch(
    trainer, k: int, batches: list[Batch], dev: list[Batch], progress: Callable[[str], None]
) -> dict[str, float]:
    """Train one epoch over ``batches``, then evaluate on dev."""
    timings: dict[str, float] = {}
    loss_sum = nodes = 0.0
    start = time.perf_counter()
    for batch in batches:
        loss = trainer.step(batch, timings)
        loss_sum += loss * batch.forest.num_nodes
        nodes += batch.forest.num_nodes
    train_s = time.perf_counter() - start
    start = time.perf_counter()
    acc = evaluate(trainer, dev)
    eval_s = time.perf_counter() - start
    trees = sum(b.trees for b in batches)
    entry = {
        "epoch": k,
        "train_loss": loss_sum / max(nodes, 1),
        "dev_root_acc": acc,
        "train_s": train_s,
        "eval_s": eval_s,
        "trees_per_s": trees / train_s,
        "loadavg_1min": os.getloadavg()[0],
    }
    progress(
        f"  [{trainer.name}] epoch {k}: loss {entry['train_loss']:.4f}, dev root acc {acc:.4f}, "
        f"{train_s:.1f} s train ({entry['trees_per_s']:.1f} trees/s), {eval_s:.1f} s eval "
        f"(load {entry['loadavg_1min']:.2f})"
    )
    return entry


# ------------------------------------------------------------- report


def print_report(result: dict[str, Any]) -> None:
    setup = result["setup"]
    print()
    print(
        f"SST train: {setup['train_trees']} trees used, V={setup['V']} X={setup['X']} H={setup['H']} "
        f"C={setup['C']}, batch {setup['batch']}, Adagrad lr {setup['lr']}, {setup['threads']} thread(s)"
    )
    print(f"gradient check on batch 1 ({setup['check_nodes']} nodes), max normwise rel err vs cortexc:")
    for name, errs in result["grad_check"].items():
        worst = max(errs, key=errs.get)
        flag = "  MISMATCH" if errs[worst] > GRAD_RTOL else ""
        print(f"  {name:<20} {errs[worst]:.1e} ({worst}){flag}")
    print()
    print(
        f"training throughput (forward + loss + backward + optimizer step), trees/s: median of "
        f"{len(result['throughput']['cortexc']['rounds_trees_per_s'])} round(s), [min, max] of rounds"
    )
    header = (
        f"{'impl':<20} {'batches':>7} {'trees':>6} {'median':>8} {'[min, max]':>12} {'w/o prep':>9} "
        f"{'best':>8} {'cortexc/impl':>13} {'c_f32/impl':>13} | ms/batch: {'prep':>5} {'fwd':>6} {'bwd':>6} "
        f"{'opt':>6}"
    )
    print(header)
    print("-" * len(header))
    tp = result["throughput"]
    for name in IMPLS:
        stats = tp[name]
        ms = stats["ms_per_batch"]
        spread = f"[{stats['min_trees_per_s']:.0f}, {stats['max_trees_per_s']:.0f}]"
        ratios = [
            f"{tp[mine][key] / stats[key]:.2f}" for mine in CORTEXC_IMPLS for key in ("trees_per_s", "best_trees_per_s")
        ]
        print(
            f"{name:<20} {stats['batches']:>7} {stats['trees']:>6} {stats['trees_per_s']:>8.1f} {spread:>12} "
            f"{stats['trees_per_s_compute']:>9.1f} {stats['best_trees_per_s']:>8.1f} "
            f"{ratios[0] + ' / ' + ratios[1]:>13} {ratios[2] + ' / ' + ratios[3]:>13} | {'':9} "
            f"{ms.get('prepare', 0.0):>5.2f} {ms['forward']:>6.1f} {ms['backward']:>6.1f} {ms['optimizer']:>6.1f}"
        )
    print(
        "(median: the median round; w/o prep: that round without the torch index preparation; best: per batch the "
        "fastest step over the rounds, a quiet-machine estimate;\n ratios: trees/s of cortexc (with "
        "cortexc.train.Adagrad) or cortexc_f32adagrad over the row's, median / best; ms/batch of the median round; "
        "cortexc fwd includes\n linearization and the NumPy cross-entropy "
        f"({tp['cortexc']['ms_per_batch'].get('loss', 0.0):.2f} ms); "
        "cortexc opt includes load_params; torch prep is the NumPy index preparation)"
    )
    path = result["torch_path"]
    print(
        f"\ntorch path (cortexc_torch) vs native (cortexc_sparse), time per tree, median / best: "
        f"{path['overhead_median']:.3f} / {path['overhead_best']:.3f} (goal <= 1.10); "
        f"vs level-batched {path['vs_level_batched_median']:.2f} / {path['vs_level_batched_best']:.2f} (goal >= 2); "
        f"vs per node {path['vs_per_node_median']:.1f} / {path['vs_per_node_best']:.1f} (goal >= 20)\n"
        f"packing the GEMM weights again after each optimizer step: {path['repack_ms_per_step']:.2f} ms per step "
        f"({100 * path['repack_fraction']:.1f}% of the torch path's step)"
    )
    if result.get("accuracy"):
        print()
        acc = result["accuracy"]
        print(
            f"accuracy: {acc['epochs']} epoch(s) over {setup['train_trees']} train trees, "
            f"dev {acc['dev_trees']} trees, fine-grained root accuracy"
        )
        header = (
            f"{'epoch':>5} {'impl':<20} {'train loss':>10} {'dev root acc':>12} {'train s':>8} {'trees/s':>8} "
            f"{'eval s':>7} {'load':>5}"
        )
        print(header)
        print("-" * len(header))
        for k in range(acc["epochs"]):
            for name, history in acc["history"].items():
                e = history[k]
                print(
                    f"{e['epoch']:>5} {name:<20} {e['train_loss']:>10.4f} {e['dev_root_acc']:>12.4f} "
                    f"{e['train_s']:>8.1f} {e['trees_per_s']:>8.1f} {e['eval_s']:>7.1f} {e['loadavg_1min']:>5.2f}"
                )
        for name, seconds in acc["wall_s"].items():
            print(f"{name}: {seconds:.1f} s for the accuracy part (training + evaluation, batch assembly excluded)")


# ------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=150, help="H")
    parser.add_argument("--embed", type=int, default=300, help="X")
    parser.add_argument("--batch", type=int, default=25, help="trees per batch")
    parser.add_argument("--lr", type=float, default=0.05, help="Adagrad learning rate")
    parser.add_argument("--seed", type=int, default=0, help="initial weights and batch order")
    parser.add_argument(
        "--timed-batches", type=int, default=40, help="batches timed for cortexc and torch_level_batched"
    )
    parser.add_argument("--per-node-batches", type=int, default=8, help="batches timed for torch_per_node")
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="throughput rounds (the implementations take turns; the median round is kept)",
    )
    parser.add_argument("--epochs", type=int, default=3, help="epochs of the accuracy part (0 skips it)")
    parser.add_argument(
        "--accuracy-impls",
        nargs="+",
        choices=["cortexc", "cortexc_f32adagrad", "cortexc_sparse", "cortexc_torch", "torch_level_batched"],
        default=["cortexc", "cortexc_f32adagrad", "torch_level_batched"],
        help="what the accuracy part trains",
    )
    parser.add_argument("--limit", type=int, default=None, help="use the first N train trees")
    parser.add_argument("--dev-limit", type=int, default=None, help="evaluate on the first N dev trees")
    parser.add_argument(
        "--threads", type=int, default=2, help="torch.set_num_threads and OMP_NUM_THREADS (cortexc's OpenMP)"
    )
    parser.add_argument("--data-dir", type=Path, default=SST_DIR)
    parser.add_argument("--cell", type=Path, default=CELL)
    parser.add_argument(
        "--dropout", action="store_true", help="only part 3: the cost of dropout in training mode over evaluation mode"
    )
    parser.add_argument("--json", type=Path, default=Path("bench_train.json"), help="write the results here")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a reduced run: 8 (per node 2) timed batches, 2 rounds, 1 epoch on 500 train trees, "
        "300 dev trees (other options given still apply)",
    )
    if parser.parse_known_args(argv)[0].quick:  # new defaults; options given explicitly still win
        parser.set_defaults(timed_batches=8, per_node_batches=2, rounds=2, epochs=1, limit=500, dev_limit=300)
    args = parser.parse_args(argv)
    if min(args.threads, args.batch, args.timed_batches, args.per_node_batches, args.rounds) < 1:
        parser.error("--threads, --batch, --timed-batches, --per-node-batches and --rounds must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # when main() is called without the script preamble
    torch.set_num_threads(args.threads)

    def progress(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    for split in ("train", "dev"):
        if not (args.data_dir / f"{split}.txt").exists():
            print(
                f"SST split not found: {args.data_dir / split}.txt (set CORTEXC_SST_DIR or --data-dir)", file=sys.stderr
            )
            return 1
    load_before = os.getloadavg()
    cpus = os.cpu_count() or 1
    if load_before[0] > cpus - args.threads + 1.5:
        # On a shared 2-CPU machine every OpenMP fork-join then waits for a core: multi-threaded torch
        # steps slow down by up to 10-30x and the timings say little (see bench_treelstm.py).
        print(
            f"warning: 1-min load average {load_before[0]:.2f} on {cpus} CPUs with {args.threads} thread(s): "
            "other processes share the cores and timings will be noisy",
            file=sys.stderr,
        )
    started = time.perf_counter()
    all_train = read_trees(args.data_dir / "train.txt")
    train = all_train[: args.limit] if args.limit else all_train
    dev_trees = read_trees(args.data_dir / "dev.txt", args.dev_limit)
    vocab = Vocab.build(all_train)  # every train word, whatever --limit: the same V (and E) always
    progress(
        f"read {len(all_train)} train trees ({len(train)} used), {len(dev_trees)} dev trees, "
        f"vocabulary {len(vocab)} in {time.perf_counter() - started:.1f} s"
    )

    module = cortexc.load(str(args.cell), V=len(vocab), X=args.embed, H=args.hidden, C=NUM_CLASSES)
    init = {name: np.array(value) for name, value in module.BinaryTreeLSTM(device="cpu", seed=args.seed).params.items()}
    rng = np.random.default_rng(args.seed)
    orders = [rng.permutation(len(train)) for _ in range(max(args.epochs, 1))]

    if args.dropout:  # part 3 only
        batches = epoch_batches(train, vocab, args.batch, orders[0], args.timed_batches)
        cost = dropout_cost(args, vocab, batches, progress)
        setup = {"V": len(vocab), "X": args.embed, "H": args.hidden, "batch": args.batch, "threads": args.threads}
        report = {"setup": setup, "dropout": cost, "loadavg": os.getloadavg()}
        print(json.dumps(report, indent=1))
        args.json.write_text(json.dumps(report, indent=1))
        return 0

    # Part 1: gradient check and throughput, on the first batches of epoch 1.
    timed = epoch_batches(train, vocab, args.batch, orders[0], max(args.timed_batches, args.per_node_batches))
    grad_check = check_grads(module, init, args.lr, timed[0])
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in IMPLS}
    for r in range(args.rounds):  # the implementations take turns, so a change of load hits all of them
        for name in IMPLS:
            count = args.per_node_batches if name == "torch_per_node" else args.timed_batches
            trainer = make_trainer(name, module, init, args.lr)
            rounds[name].append(time_training(trainer, timed[:count]))
            progress(
                f"  round {r + 1}/{args.rounds} [{name}] {rounds[name][-1]['trees_per_s']:.1f} trees/s "
                f"over {count} batches (load {os.getloadavg()[0]:.2f})"
            )
    throughput = {name: summarize_rounds(runs) for name, runs in rounds.items()}
    result: dict[str, Any] = {
        "setup": {
            "train_trees": len(train),
            "dev_trees": len(dev_trees),
            "V": len(vocab),
            "X": args.embed,
            "H": args.hidden,
            "C": NUM_CLASSES,
            "batch": args.batch,
            "lr": args.lr,
            "threads": args.threads,
            "seed": args.seed,
            "check_nodes": timed[0].forest.num_nodes,
        },
        "grad_check": grad_check,
        "throughput": throughput,
        "ratios_median": {
            f"{mine}/{name}": throughput[mine]["trees_per_s"] / throughput[name]["trees_per_s"]
            for mine in CORTEXC_IMPLS
            for name in IMPLS
            if name != mine
        },
        "ratios_best": {
            f"{mine}/{name}": throughput[mine]["best_trees_per_s"] / throughput[name]["best_trees_per_s"]
            for mine in CORTEXC_IMPLS
            for name in IMPLS
            if name != mine
        },
    }

    torch_path, native = throughput["cortexc_torch"], throughput["cortexc_sparse"]
    result["torch_path"] = {
        "overhead_median": native["trees_per_s"] / torch_path["trees_per_s"],
        "overhead_best": native["best_trees_per_s"] / torch_path["best_trees_per_s"],
        **{
            f"vs_{peer}_{kind}": torch_path[key] / throughput[f"torch_{peer}"][key]
            for peer in ("level_batched", "per_node")
            for kind, key in (("median", "trees_per_s"), ("best", "best_trees_per_s"))
        },
        "repack_ms_per_step": torch_path["ms_per_batch"]["repack"],
        "repack_fraction": torch_path["ms_per_batch"]["repack"] * 1e-3 * torch_path["batches"] / torch_path["seconds"],
    }

    # Part 2: accuracy, cortexc and level-batched torch trained identically.
    if args.epochs > 0:
        dev = [make_batch(dev_trees[s : s + 256], vocab) for s in range(0, len(dev_trees), 256)]
        epochs = [epoch_batches(train, vocab, args.batch, order) for order in orders[: args.epochs]]
        trainers = {name: make_trainer(name, module, init, args.lr) for name in args.accuracy_impls}
        history: dict[str, list[dict[str, float]]] = {name: [] for name in trainers}
        for k, batches in enumerate(epochs, start=1):  # epoch by epoch, the implementations taking turns
            for name, trainer in trainers.items():
                history[name].append(train_epoch(trainer, k, batches, dev, progress))
        wall = {name: sum(e["train_s"] + e["eval_s"] for e in entries) for name, entries in history.items()}
        result["accuracy"] = {"epochs": args.epochs, "dev_trees": len(dev_trees), "history": history, "wall_s": wall}

    elapsed = time.perf_counter() - started
    load_after = os.getloadavg()
    print_report(result)
    print(
        f"\ntotal {elapsed:.1f} s; torch {torch.__version__}, {torch.get_num_threads()} threads "
        f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}), {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs; load average (1/5/15 min) {'/'.join(f'{x:.2f}' for x in load_before)} "
        f"before, {'/'.join(f'{x:.2f}' for x in load_after)} after"
    )
    result["meta"] = {
        "torch": torch.__version__,
        "numpy": np.__version__,
        "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "timed_batches": args.timed_batches,
        "per_node_batches": args.per_node_batches,
        "limit": args.limit,
        "dev_limit": args.dev_limit,
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "elapsed_s": elapsed,
    }
    args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
