"""Typed DAG-LSTM on random DAGs: cortexc's compiled cell against PyTorch level by level, grouped by relation.

The model is `examples/typed_daglstm.cell` (``TypedDagLSTM``, after Peng et al. 2017): every edge into a node
carries a relation ``rel`` (one of R=4) and a feature vector ``w`` [D], and a child reaches its parent through
its relation's matrices, ``U[edge.rel] @ child.h`` for the gates i, o, u and ``U_f[edge.rel] @ child.h`` for a
forget gate of its own; ``V @ edge.w`` is added to the gates. Two implementations, with the same weights, the
same DAG and the same inputs (``x`` per node, ``rel`` and ``w`` per edge in the forest's edge order):

- ``cortexc``: the cell compiled for the CPU (``device="cpu"``);
- ``level``: hand-written PyTorch level by level (`LevelDagLSTM`): the levels (the forest's, leaves first) and
  the edges of each level grouped by relation are index arrays made once per DAG in NumPy (vectorised); the
  node terms ``W @ x + b`` and ``W_f @ x + b_f`` of every node in one GEMM, the edge terms ``V @ w`` of every
  edge in one GEMM summed into their parents with ``index_add``; then per level: the children's ``h`` and
  ``c`` gathered once for all the level's edges, one GEMM per relation group (``U[r]`` and ``U_f[r]`` stacked,
  ``[4H, H]``), the gate terms summed into the parents with ``index_add``, the forget gates per edge, their
  products with the children's ``c`` summed with ``index_add``, the gates, the rows written into the states.

The DAGs are `Forest.random_dag` (each node reads up to ``--max-children`` earlier nodes, each node read by up
to ``--max-parents``), ``--nodes`` nodes, then a sweep over ``--sweep-nodes`` and, at ``--nodes`` nodes, over
the hidden sizes of ``--sweep-hidden`` (each after the same check). Inference is a forward without
gradients (``h`` and ``c`` of every node, node order). A training step is a forward that keeps what the
backward needs plus the backward of the MSE loss ``mean((h - target)^2)``: every weight's gradient and those
of the float inputs ``x`` and ``w`` (cortexc always returns them: the peer computes them too, so the work is
the same); no optimizer step. The peer's index arrays are made once per DAG before the timing, as cortexc's
linearization is made once per forest and kept in it; their cost is reported apart.

Before any timing, on a small DAG, both are checked to give the same ``h`` and ``c`` and the same gradients
(each to 1e-4 relative to its largest value), else the script stops. Times are medians of ``--repeats`` calls,
the implementations taking turns (each timed call follows an untimed call of its own, as in `bench_ggnn.py`).
Ratios are peer ms / cortexc ms (above 1: cortexc is faster). Every implementation runs on ``--threads``
threads (default 2: ``torch.set_num_threads``, ``OMP_NUM_THREADS`` and ``CORTEXC_NUM_THREADS``; cortexc's cap
by other processes' load is turned off with ``CORTEXC_ADAPT_THREADS=0`` unless ``--adapt``). torch and the
compiled code share one libgomp, loaded by torch (imported first), which reads its spin count once as it
loads: both get cortexc's own default, ``GOMP_SPINCOUNT=10000`` (what cortexc's runtime sets when it loads
libgomp itself), unless ``--spin-default`` or the caller sets ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY``
(``passive`` makes the PyTorch peer's small ops 3-4x slower on a 2-CPU machine).
The results record the host, its CPU, the 1-min load average at the start and the end, and the CPUs that other
processes used on average during the run (from /proc/stat, less this process's own CPU time), with a caution
when the machine was busy.

Usage (from the repository root)::

    python benchmarks/bench_daglstm.py --quick
    python benchmarks/bench_daglstm.py --out benchmarks/results/daglstm.json     # and daglstm.md beside it
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

from benchmarks.harness import busy, host, machine_busy_s, max_rel_diff, own_cpu_s, spin  # noqa: E402


def _parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4000)
    parser.add_argument("--max-children", type=int, default=3)
    parser.add_argument("--max-parents", type=int, default=3)
    parser.add_argument("--input", type=int, default=32, help="X, the size of x")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--relations", type=int, default=4)
    parser.add_argument("--edge-features", type=int, default=4, help="D, the size of w")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--sweep-repeats", type=int, default=7)
    parser.add_argument("--sweep-nodes", default="1000,16000", help="more DAG sizes (the main one is in the table)")
    parser.add_argument("--sweep-hidden", default="256", help="more hidden sizes, at --nodes nodes")
    parser.add_argument("--check-nodes", type=int, default=300)
    parser.add_argument("--adapt", action="store_true", help="let cortexc cap its threads by the machine's load")
    parser.add_argument("--spin-default", action="store_true", help="leave libgomp's spin count as it is")
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats: a smoke test")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write JSON here and a markdown table beside it (.md)")
    parser.add_argument("--note", help="a remark on the run for the results (e.g. why these threads)")
    args = parser.parse_args(argv)
    if args.quick:
        args.nodes, args.hidden, args.input, args.repeats, args.sweep_repeats = 500, 16, 8, 2, 2
        args.sweep_nodes, args.sweep_hidden, args.check_nodes = "200", "8", 100
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

CELL_FILE = REPO / "examples" / "typed_daglstm.cell"
PARAMS = ("W", "U", "V", "b", "W_f", "U_f", "b_f")


def load_cell(work: Path, inputs: int, hidden: int, relations: int, edge_features: int) -> Any:
    """The compiled cell's class (`TypedDagLSTM` of examples/typed_daglstm.cell) at these dims."""
    module = cortexc.load(CELL_FILE, out_dir=work / "daglstm", X=inputs, H=hidden, R=relations, D=edge_features)
    return module.TypedDagLSTM


def random_params(shapes: dict[str, tuple[int, ...]], hidden: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Every param (biases too, so that a bias slip shows) uniform in +-1/sqrt(H), torch.nn.LSTM's init."""
    bound = 1 / np.sqrt(hidden)
    return {k: rng.uniform(-bound, bound, shape).astype(np.float32) for k, shape in shapes.items()}


# ------------------------------------------------------------------ the peer


@dataclass
class LevelPlan:
    """A DAG's rows (nodes in the forest's level order, leaves first) and its edges by level and relation."""

    num_nodes: int
    order: torch.Tensor  # [N] node of each row
    row_of: torch.Tensor  # [N] row of each node
    level_ptr: tuple[int, ...]  # rows of level k: level_ptr[k]:level_ptr[k + 1]
    edge_rows: torch.Tensor  # [E] row of each edge's parent, forest edge order
    groups: tuple[tuple[int, ...], ...]  # per level k >= 1: its edges per relation (sorted so)
    child_rows: tuple[torch.Tensor, ...]  # per level k >= 1: [E_k] row of each edge's child
    parent_local: tuple[torch.Tensor, ...]  # per level k >= 1: [E_k] each edge's parent among the level's rows


class LevelDagLSTM:
    """The typed DAG-LSTM in PyTorch, one batched step per level (see the module's docstring)."""

    def __init__(self, params: dict[str, np.ndarray]):
        self.p = {k: torch.tensor(np.array(params[k], dtype=np.float32), requires_grad=True) for k in PARAMS}
        self.relations, _, self.hidden = self.p["U_f"].shape

    def prepare(self, forest: Forest, rel: np.ndarray) -> LevelPlan:
        """Index arrays for every level, in NumPy (vectorised)."""
        n, R = forest.num_nodes, self.relations
        rel = np.asarray(rel, dtype=np.int64)
        if rel.shape != (forest.num_edges,) or (rel.size and (rel.min() < 0 or rel.max() >= R)):
            raise ValueError(f"rel must be one int in [0, {R}) per edge")
        order = np.array(forest.level_order, dtype=np.int64)  # a writable copy, for torch.from_numpy
        row_of = np.empty(n, dtype=np.int64)
        row_of[order] = np.arange(n, dtype=np.int64)
        ptr = np.asarray(forest.level_ptr, dtype=np.int64)
        parent = np.asarray(forest.edge_parent, dtype=np.int64)
        child = np.asarray(forest.edge_child, dtype=np.int64)
        edge_level = np.asarray(forest.level, dtype=np.int64)[parent]
        by = np.lexsort((rel, edge_level))  # edges by their parent's level, then by relation
        bounds = np.searchsorted(edge_level[by], np.arange(len(ptr)))  # level k's edges: bounds[k]:bounds[k + 1]
        groups, child_rows, parent_local = [], [], []
        for k in range(1, len(ptr) - 1):
            edges = by[bounds[k] : bounds[k + 1]]
            groups.append(tuple(int(c) for c in np.bincount(rel[edges], minlength=R)))
            child_rows.append(torch.from_numpy(row_of[child[edges]]))
            parent_local.append(torch.from_numpy(row_of[parent[edges]] - ptr[k]))
        return LevelPlan(
            n,
            torch.from_numpy(order),
            torch.from_numpy(row_of),
            tuple(int(p) for p in ptr),
            torch.from_numpy(row_of[parent]),
            tuple(groups),
            tuple(child_rows),
            tuple(parent_local),
        )

    def rows(self, plan: LevelPlan, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``h`` and ``c`` of every node, in row order."""
        p, H, ptr, n = self.p, self.hidden, plan.level_ptr, plan.num_nodes
        w_node = torch.cat((p["W"], p["W_f"]))  # [4H, X]: gates i, o, u, then the forget gate's x term
        xw = torch.addmm(torch.cat((p["b"], p["b_f"])), x.index_select(0, plan.order), w_node.t())
        edge_terms = w @ p["V"].t()  # [E, 3H]: V @ w of every edge
        pre = xw[:, : 3 * H].index_add(0, plan.edge_rows, edge_terms)  # W x + b + sum over edges of V w
        u_all = torch.cat((p["U"], p["U_f"]), dim=1)  # [R, 4H, H]
        h_buf, c_buf = torch.zeros(n, H), torch.zeros(n, H)

        def cell(g: torch.Tensor, fc: torch.Tensor | None, lo: int, hi: int) -> None:
            c = torch.sigmoid(g[:, :H]) * torch.tanh(g[:, 2 * H :])
            if fc is not None:
                c = c + fc
            c_buf[lo:hi] = c
            h_buf[lo:hi] = torch.sigmoid(g[:, H : 2 * H]) * torch.tanh(c)

        cell(pre[: ptr[1]], None, 0, ptr[1])
        for k, (groups, rows, local) in enumerate(zip(plan.groups, plan.child_rows, plan.parent_local), start=1):
            lo, hi = ptr[k], ptr[k + 1]
            hch = h_buf.index_select(0, rows)
            parts, start = [], 0
            for r, count in enumerate(groups):
                if count:
                    parts.append(hch[start : start + count] @ u_all[r].t())  # [E_r, 4H]
                    start += count
            z = torch.cat(parts) if len(parts) > 1 else parts[0]
            g = pre[lo:hi].index_add(0, local, z[:, : 3 * H])
            f = torch.sigmoid(xw[lo:hi, 3 * H :].index_select(0, local) + z[:, 3 * H :])
            fc = torch.zeros(hi - lo, H).index_add(0, local, f * c_buf.index_select(0, rows))
            cell(g, fc, lo, hi)
        return h_buf, c_buf

    def infer(self, plan: LevelPlan, x: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            h, c = self.rows(plan, x, w)
            return {"h": h[plan.row_of], "c": c[plan.row_of]}

    def loss(self, plan: LevelPlan, x: torch.Tensor, w: torch.Tensor, target_rows: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.rows(plan, x, w)[0], target_rows)


# ------------------------------------------------------------------ DAGs, the check, the timing


class Case:
    """One random DAG with its inputs and target, the peer's plan, and every implementation's steps on it."""

    def __init__(self, model: Any, peer: LevelDagLSTM, nodes: int, args: argparse.Namespace, seed: int):
        rng = np.random.default_rng(seed)
        self.forest = Forest.random_dag(nodes, rng=rng, max_children=args.max_children, max_parents=args.max_parents)
        E = self.forest.num_edges
        self.x = rng.standard_normal((nodes, args.input)).astype(np.float32)
        self.rel = rng.integers(0, args.relations, E).astype(np.int32)
        self.w = rng.standard_normal((E, args.edge_features)).astype(np.float32)
        self.target = (0.5 * rng.standard_normal((nodes, args.hidden))).astype(np.float32)
        self.model, self.peer = model, peer
        start = time.perf_counter()
        self.plan = peer.prepare(self.forest, self.rel)
        self.plan_ms = 1e3 * (time.perf_counter() - start)
        self.tx = torch.tensor(self.x, requires_grad=True)
        self.tw = torch.tensor(self.w, requires_grad=True)
        self.target_rows = torch.from_numpy(self.target).index_select(0, self.plan.order)

    def cortexc_infer(self) -> Any:
        return self.model(self.forest, x=self.x, rel=self.rel, w=self.w)

    def cortexc_forward_grad(self) -> Any:
        return self.model(self.forest, grad=True, x=self.x, rel=self.rel, w=self.w)

    def cortexc_train(self) -> dict[str, np.ndarray]:
        out = self.cortexc_forward_grad()
        h = out["h"]
        return self.model.backward(out, {"h": (2.0 / h.size) * (h - self.target)})  # d mean((h - target)^2)

    def level_infer(self) -> dict[str, torch.Tensor]:
        return self.peer.infer(self.plan, torch.from_numpy(self.x), torch.from_numpy(self.w))

    def level_train(self) -> dict[str, np.ndarray]:
        for t in (*self.peer.p.values(), self.tx, self.tw):
            t.grad = None
        self.peer.loss(self.plan, self.tx, self.tw, self.target_rows).backward()
        leaves = {**self.peer.p, "x": self.tx, "w": self.tw}  # no gradient reached (no edges): zero, as cortexc's
        return {k: (t.grad if t.grad is not None else torch.zeros_like(t)).numpy() for k, t in leaves.items()}

    def functions(self) -> dict[str, Callable[[], Any]]:
        return {
            "cortexc_infer": self.cortexc_infer,
            "level_infer": self.level_infer,
            "cortexc_train": self.cortexc_train,
            "level_train": self.level_train,
            "cortexc_forward_grad": self.cortexc_forward_grad,
        }


def check(case: Case) -> dict[str, float]:
    """cortexc's and the peer's h, c and gradients agree (raises SystemExit if not)."""
    out = case.cortexc_infer()
    report = {
        f"{k}_level_vs_cortexc": d
        for k, d in max_rel_diff({k: v.numpy() for k, v in case.level_infer().items()}, out, ("h", "c")).items()
    }
    theirs, ours = case.level_train(), case.cortexc_train()
    report |= {f"d{k}_level_vs_cortexc": d for k, d in max_rel_diff(theirs, ours, (*PARAMS, "x", "w")).items()}
    bad = {k: d for k, d in report.items() if not d <= 1e-4}
    if bad:
        raise SystemExit(f"the implementations disagree: {bad}")
    return report


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median ms per call of each function, taking turns within every repeat; each timed call follows an
    untimed call of the same function (see `bench_ggnn.interleaved`)."""
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            fn()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(values) for name, values in times.items()}


def linearize_ms(forest: Forest) -> float:
    """ms of cortexc's first linearization of the DAG (on a copy: nothing derived yet)."""
    from cortexc.runtime.linearize import linearize

    fresh = Forest(np.asarray(forest.child_ptr), np.asarray(forest.child_idx))
    start = time.perf_counter()
    linearize(fresh)
    return 1e3 * (time.perf_counter() - start)


# ------------------------------------------------------------------ main


def measure(model: Any, peer: LevelDagLSTM, nodes: int, args: argparse.Namespace, repeats: int) -> dict[str, Any]:
    case = Case(model, peer, nodes, args, seed=args.seed + nodes)
    ms = interleaved(case.functions(), repeats)
    return {
        "nodes": nodes,
        "edges": case.forest.num_edges,
        "levels": case.forest.num_levels,
        "ms": ms,
        "ratios": {f"level_{w}": ms[f"level_{w}"] / ms[f"cortexc_{w}"] for w in ("infer", "train")},
        "plan_ms": {"level": case.plan_ms, "cortexc": linearize_ms(case.forest)},
    }


def setup(work: Path, args: argparse.Namespace) -> tuple[Any, LevelDagLSTM]:
    """The compiled model and the peer at ``args``' dims, with the same random params."""
    X, H, R, D = args.input, args.hidden, args.relations, args.edge_features
    model = load_cell(work / f"H{H}", X, H, R, D)(device="cpu", seed=args.seed)
    params = random_params({k: np.shape(v) for k, v in model.params.items()}, H, np.random.default_rng(args.seed))
    model.load_params(params)
    return model, LevelDagLSTM(params)


def main(args: argparse.Namespace) -> None:
    started, load_start = time.time(), os.getloadavg()[0]
    busy_start, own_start = machine_busy_s(), own_cpu_s()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    X, H, R, D, th = args.input, args.hidden, args.relations, args.edge_features, args.threads
    work = Path(tempfile.mkdtemp(prefix="bench_daglstm_"))
    model, peer = setup(work, args)
    checked = check(Case(model, peer, args.check_nodes, args, seed=args.seed + 1))
    print(f"typed DAG-LSTM X={X} H={H} R={R} D={D}, {th} threads for every implementation; ms per call (median)")
    print(f"check at {args.check_nodes} nodes: largest relative difference {max(checked.values()):.1e}")

    plan = [(H, args.nodes, args.repeats)]
    plan += [(H, int(n), args.sweep_repeats) for n in args.sweep_nodes.split(",") if n.strip()]
    plan += [(int(h), args.nodes, args.sweep_repeats) for h in args.sweep_hidden.split(",") if h.strip()]
    print(f"{'H':>4} {'nodes':>7} {'edges':>7} {'levels':>6} {'what':<6} {'cortexc':>9} {'level':>9}  level/cx")
    rows = []
    for hidden, nodes, repeats in plan:
        dims = argparse.Namespace(**{**vars(args), "hidden": hidden})
        if hidden != H:
            model, peer = setup(work, dims)
            worst = max(check(Case(model, peer, args.check_nodes, dims, seed=args.seed + 1)).values())
            print(f"(H={hidden} checked: {worst:.1e})")
        row = {"H": hidden, **measure(model, peer, nodes, dims, repeats)}
        rows.append(row)
        for what in ("infer", "train"):
            ms = row["ms"]
            print(
                f"{hidden:>4} {nodes:>7} {row['edges']:>7} {row['levels']:>6} {what:<6} {ms[f'cortexc_{what}']:>9.2f} "
                f"{ms[f'level_{what}']:>9.2f}  {row['ratios'][f'level_{what}']:>6.2f}x"
            )
        fwd = row["ms"]["cortexc_forward_grad"]
        print(
            f"{'':>27} cortexc training step: forward(grad) {fwd:.2f} + backward and loss "
            f"{row['ms']['cortexc_train'] - fwd:.2f} ms; plan ms: level {row['plan_ms']['level']:.2f}, cortexc "
            f"linearize {row['plan_ms']['cortexc']:.2f}"
        )

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
            "X": X, "H": H, "R": R, "D": D, "max_children": args.max_children, "max_parents": args.max_parents,
            "cell": str(CELL_FILE.relative_to(REPO)), "repeats": args.repeats, "sweep_repeats": args.sweep_repeats,
            "check": checked, "sizes": rows, "load_average_start": load_start, "load_average_end": load,
            "other_processes_cpus": others, "wall_s": wall, "note": args.note,
        }  # fmt: skip
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(markdown(result))
        print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


def markdown(r: dict[str, Any]) -> str:
    h = r["host"]
    lines = [
        f"# Typed DAG-LSTM: cortexc against PyTorch level-batched, grouped by relation "
        f"(X={r['X']}, H={r['H']}, R={r['R']}, D={r['D']})",
        "",
        f"Measured {r['date']} on `{h['node']}` ({h['cpu']}, {h['cpus']} CPUs), {r['threads']} threads for every "
        f"implementation ({spin(r)}), torch {h['torch']}; 1-min load "
        f"average {r['load_average_start']:.2f} at the start, {r['load_average_end']:.2f} at the end; "
        f"`{r['command']}`. The cell is `{r['cell']}` (`U[edge.rel] @ child.h`, a forget gate per edge through "
        f"`U_f[edge.rel]`, an edge feature `V @ edge.w`), on `Forest.random_dag` DAGs (up to {r['max_children']} "
        f"children and {r['max_parents']} parents per node). ms per call are medians (the first row of "
        f"{r['repeats']}, the others of {r['sweep_repeats']}); ratios are peer ms / cortexc ms (above 1: cortexc "
        "faster), measured in the same run. Inference = forward without gradients (h and c of every node); "
        "training step = forward + backward of an MSE loss on h (every weight's gradient and those of x and w, in "
        "both), no optimizer. The peer's index arrays are made once per DAG (as cortexc's linearization), not "
        "timed. Outputs and gradients checked equal (to 1e-4 relative) before timing.",
        *busy(r),
        "",
        "| H | nodes | edges | levels | cortexc infer ms | level infer ms | level / cortexc infer "
        "| cortexc train ms | level train ms | level / cortexc train |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in r["sizes"]:
        ms, q = row["ms"], row["ratios"]
        lines.append(
            f"| {row['H']} | {row['nodes']} | {row['edges']} | {row['levels']} | {ms['cortexc_infer']:.2f} | "
            f"{ms['level_infer']:.2f} | {q['level_infer']:.2f}x | {ms['cortexc_train']:.2f} | "
            f"{ms['level_train']:.2f} | {q['level_train']:.2f}x |"
        )
    lines += ["", "cortexc's training step split, and the index arrays made once per DAG (ms):", ""]
    for row in r["sizes"]:
        fwd = row["ms"]["cortexc_forward_grad"]
        lines.append(
            f"- H={row['H']}, {row['nodes']} nodes: forward(grad) {fwd:.2f}, backward and loss "
            f"{row['ms']['cortexc_train'] - fwd:.2f}; "
            f"peer plan {row['plan_ms']['level']:.2f}, cortexc linearization {row['plan_ms']['cortexc']:.2f}"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main(ARGS)
