"""Train a GGNN (examples/graphs/ggnn_distance.cell) to tell each node's distance from one marked node.

A task with a known answer that needs T steps of message passing: on random connected graphs of 20 to 60
nodes (a random tree plus about half as many extra edges, every edge in both directions; ``--directed``
keeps one direction of each, the distance then following the edges, from the node read to the reader),
one node is marked (input ``x`` is the one-hot flag ``[marked, not marked]``) and every node is classified
by its shortest-path distance from it: ``0 .. T``, or ``T + 1`` for "more than T" (unreachable included).
A T-step GGNN can do this exactly (distance d is when the mark first arrives, at step d) and no model of
fewer steps can tell distance T from farther, so high accuracy at every distance up to T shows information
travelling T hops. Accuracies are given per true distance on held-out graphs, with the chance level (the
share of the largest class) beside them. A second model of T - 1 steps, trained alike on the same classes
(``--no-baseline`` skips it), shows the other side: it gets distances below T right and cannot tell
distance T from "more than T".

Training: cortexc's compiled CPU model, batches of graphs joined with `Forest.concat`, softmax
cross-entropy on every node, `cortexc.train.Adam`. With ``--out DIR``: DIR/results.json (settings,
per-distance accuracy and counts, the loss per epoch, timings, the T - 1 model's the same) and
DIR/params.npz (the T-step model's params).

    python examples/ggnn_distance.py                       # T = 4, under a minute on 2 cores
    python examples/ggnn_distance.py --steps 6 --epochs 40 --out /tmp/ggnn_distance
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from pathlib import Path

import numpy as np

import cortexc
from cortexc import Forest
from cortexc.train import Adam, softmax_cross_entropy

HERE = Path(__file__).resolve().parent
CELL = HERE / "graphs" / "ggnn_distance.cell"


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="T: message-passing steps (classes 0..T and > T)")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write DIR/results.json and DIR/params.npz")
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--train-graphs", type=int, default=2000)
    parser.add_argument("--test-graphs", type=int, default=500)
    parser.add_argument("--batch", type=int, default=50, help="graphs per batch")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--min-nodes", type=int, default=20)
    parser.add_argument("--max-nodes", type=int, default=60)
    parser.add_argument("--directed", action="store_true", help="one direction per edge, distances along them")
    parser.add_argument(
        "--no-baseline",
        dest="baseline",
        action="store_false",
        help="skip the model of T - 1 steps (trained alike: it cannot tell distance T from farther)",
    )
    return parser.parse_args()


class Graph:
    """One random graph, its marked node and every node's class (capped distance from the mark)."""

    def __init__(self, rng: np.random.Generator, args: argparse.Namespace):
        n = int(rng.integers(args.min_nodes, args.max_nodes + 1))
        tree_src = np.array([rng.integers(0, v) for v in range(1, n)], dtype=np.int64)  # a random tree
        tree_dst = np.arange(1, n, dtype=np.int64)
        extra = n // 2
        src = np.concatenate([tree_src, rng.integers(0, n, extra)])
        dst = np.concatenate([tree_dst, rng.integers(0, n, extra)])
        keep = src != dst
        src, dst = src[keep], dst[keep]
        if args.directed:
            flip = rng.random(src.size) < 0.5
            src, dst = np.where(flip, dst, src), np.where(flip, src, dst)
        else:
            src, dst = np.concatenate([src, dst]), np.concatenate([dst, src])
        self.n, self.src, self.dst = n, src, dst
        self.mark = int(rng.integers(0, n))
        self.distance = bfs(n, src, dst, self.mark)  # -1: unreachable
        self.x = np.zeros((n, 2), dtype=np.float32)
        self.x[:, 1] = 1
        self.x[self.mark] = (1, 0)


def bfs(n: int, src: np.ndarray, dst: np.ndarray, start: int) -> np.ndarray:
    """Hops from `start` to every node along edges src -> dst (the direction information flows), -1 if none."""
    out: list[list[int]] = [[] for _ in range(n)]
    for s, d in zip(src.tolist(), dst.tolist()):
        out[s].append(d)
    distance = np.full(n, -1, dtype=np.int64)
    distance[start] = 0
    queue = deque([start])
    while queue:
        u = queue.popleft()
        for v in out[u]:
            if distance[v] < 0:
                distance[v] = distance[u] + 1
                queue.append(v)
    return distance


def classes(distance: np.ndarray, steps: int) -> np.ndarray:
    """0 .. T for distances up to T, T + 1 for farther or unreachable."""
    return np.where((distance < 0) | (distance > steps), steps + 1, distance).astype(np.int32)


class Batch:
    def __init__(self, graphs: list[Graph], steps: int):
        self.forest = Forest.concat([Forest.from_edges(g.src, g.dst, num_nodes=g.n) for g in graphs])
        self.x = np.concatenate([g.x for g in graphs])
        self.distance = np.concatenate([g.distance for g in graphs])
        self.labels = classes(self.distance, steps)


def evaluate(model: object, batches: list[Batch], steps: int) -> dict:
    """Accuracy overall and per true distance (0 .. T, and the farther ones one by one and together)."""
    predicted, distance, labels = [], [], []
    for b in batches:
        logits = model(b.forest, x=b.x)["logits"]  # type: ignore[operator]
        predicted.append(logits.argmax(axis=1))
        distance.append(b.distance)
        labels.append(b.labels)
    pred, dist, lab = np.concatenate(predicted), np.concatenate(distance), np.concatenate(labels)
    per: dict[str, dict] = {}
    groups = [(str(d), dist == d) for d in range(steps + 1)]
    groups.append((f">{steps}", lab == steps + 1))
    groups += [(str(d), dist == d) for d in range(steps + 1, int(dist.max()) + 1)]
    groups.append(("unreachable", dist < 0))
    for name, where in groups:
        if where.any():
            per[name] = {"accuracy": float(np.mean(pred[where] == lab[where])), "nodes": int(where.sum())}
    counts = np.bincount(lab, minlength=steps + 2)
    return {"accuracy": float(np.mean(pred == lab)), "chance": float(counts.max() / counts.sum()), "per_distance": per}


def train(args: argparse.Namespace, steps: int, train_graphs: list[Graph], test: list[Batch]) -> tuple[object, list]:
    """A model of `steps` steps trained on the classes of ``--steps`` (0 .. T and > T); its per-epoch log."""
    T = args.steps
    module = cortexc.load(CELL, H=args.hidden, T=steps, C=T + 2)
    model = module.GGNN(device="cpu", seed=args.seed)
    opt = Adam(lr=args.lr)
    rng = np.random.default_rng(args.seed + 1)
    log = []
    for epoch in range(1, args.epochs + 1):
        tick = time.perf_counter()
        order = rng.permutation(len(train_graphs))
        losses = []
        for i in range(0, len(order), args.batch):
            b = Batch([train_graphs[j] for j in order[i : i + args.batch]], T)
            out = model(b.forest, grad=True, x=b.x)
            loss, d_logits = softmax_cross_entropy(out["logits"], b.labels)
            grads = model.backward(out, {"logits": d_logits})
            model.load_params(opt.step(model.params, {k: grads[k] for k in model.params}))
            losses.append(loss)
        point = {"epoch": epoch, "loss": float(np.mean(losses)), "s": time.perf_counter() - tick}
        if epoch % 5 == 0 or epoch == args.epochs:
            point["test_accuracy"] = evaluate(model, test, T)["accuracy"]
        log.append(point)
        shown = f", test accuracy {point['test_accuracy']:.3f}" if "test_accuracy" in point else ""
        print(f"  epoch {epoch:>3}: loss {point['loss']:.4f} ({point['s']:.1f} s){shown}")
    return model, log


def show(result: dict) -> None:
    print(f"held-out accuracy {result['accuracy']:.3f} (chance, the largest class: {result['chance']:.3f})")
    print(f"{'distance':>12} {'accuracy':>9} {'nodes':>7}")
    for name, row in result["per_distance"].items():
        print(f"{name:>12} {row['accuracy']:>9.3f} {row['nodes']:>7}")


def main() -> None:
    args = parse()
    T = args.steps
    start = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    train_graphs = [Graph(rng, args) for _ in range(args.train_graphs)]
    test_graphs = [Graph(rng, args) for _ in range(args.test_graphs)]
    test = [Batch(test_graphs[i : i + 200], T) for i in range(0, len(test_graphs), 200)]
    kind = "directed" if args.directed else "both directions"
    sizes = f"{args.min_nodes}-{args.max_nodes} nodes ({kind})"
    print(f"{args.train_graphs} train / {args.test_graphs} test graphs of {sizes}, {T + 2} classes (0..{T}, >{T})")

    print(f"GGNN T={T} H={args.hidden}")
    tick = time.perf_counter()
    model, log = train(args, T, train_graphs, test)
    train_s = time.perf_counter() - tick
    final = evaluate(model, test, T)
    show(final)
    baseline = None
    if args.baseline and T > 1:
        print(f"\nthe same with T={T - 1} steps: distance {T} should look like farther")
        tick = time.perf_counter()
        short, short_log = train(args, T - 1, train_graphs, test)
        baseline = {"steps": T - 1, **evaluate(short, test, T), "log": short_log, "train_s": time.perf_counter() - tick}
        show(baseline)
    total = time.perf_counter() - start
    print(f"\ntraining {train_s:.1f} s (T={T}), total {total:.1f} s")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        np.savez(args.out / "params.npz", **{k: np.asarray(v) for k, v in model.params.items()})
        result = {
            "steps": T, "hidden": args.hidden, "epochs": args.epochs, "seed": args.seed, "lr": args.lr,
            "batch": args.batch, "train_graphs": args.train_graphs, "test_graphs": args.test_graphs,
            "nodes": [args.min_nodes, args.max_nodes], "directed": args.directed, "classes": T + 2,
            **final, "log": log, "train_s": train_s, "baseline_fewer_steps": baseline, "total_s": total,
        }  # fmt: skip
        (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}/results.json and params.npz")


if __name__ == "__main__":
    main()
