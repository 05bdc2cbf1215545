"""Binary Tree-LSTM on SST dev on one GPU: cortexc's device="cuda" against PyTorch on the same GPU.

With the same weights (``init_params(cell, seed=0)`` of ``examples/binary_treelstm.cell`` at H = 256) and the
same trees (SST dev, one vocabulary built from dev itself: the GPU machine carries no train split), this times

- ``compiled``: the cortexc module, ``BinaryTreeLSTM(device="cuda")``: one call per batch, which validates,
  linearizes, uploads the forest, runs every level on the GPU and copies h, c and logits of every node back
  (so it synchronises inside);
- ``compiled_rows`` (GPU only): the same module with ``CORTEXC_CUDA_MODE=persistent``, i.e. every level by
  row tiles, without the split mode's column sharing and weights kept in shared memory;
- ``torch_per_node``: `peers.TorchPerNode`'s recursion (one Python call and a few tiny kernels per node) with
  the weights on the GPU, on at most ``--per-node-trees`` trees per batch size;
- ``torch_level_batched``: `peers.TorchLevelBatched` (one gather + GEMM + gates per level of the whole batch,
  TF Fold / DGL style) with the weights on the GPU; the batch's index arrays go up in one copy per call.

Every implementation returns h, c and logits of every node as host NumPy arrays, like the compiled call. Batch
sizes are 1, 10, 100 and all trees; batches of one size cover ``max(size, --max-trees)`` trees. Each batch is
timed ``--repeats`` times after a warm-up (``torch.cuda.synchronize()`` before and after each torch call) and
its median kept; trees/s is trees over the sum of the medians. Before timing, each implementation is checked
against cortexc's interpreter on the first 20 trees.

The compiled model and the PyTorch peers run in two child processes, one after the other: PyCUDA's context
(``pycuda.autoinit``) and PyTorch's primary context are kept apart, and a hang in one cannot stop the other
(each has ``--worker-timeout``). The table comes last, with the ratios compiled/per-node and
compiled/level-batched and the targets at batch 10 (>= 14x per node, >= 3x level batched).

Usage (from the repository root, with PyCUDA and cortexc installed)::

    python benchmarks/bench_gpu.py                              # the GPU check (scripts/gpu_check.sh)
    python benchmarks/bench_gpu.py --device cpu --hidden 64 --batches 1 10 --max-trees 10   # smoke test, no GPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

CELL = REPO / "examples" / "binary_treelstm.cell"
IMPLS = ("compiled", "torch_per_node", "torch_level_batched")
WORKERS = {"torch": ("torch_per_node", "torch_level_batched"), "compiled": ("compiled",)}
TARGETS = {"torch_per_node": 14.0, "torch_level_batched": 3.0}  # compiled trees/s over the peer's, at TARGET_BATCH
TARGET_BATCH = "10"
CHECK_TREES = 20
CHECK_RTOL = 1e-4


def default_sst_dir() -> Path:
    if os.environ.get("CORTEXC_SST_DIR"):
        return Path(os.environ["CORTEXC_SST_DIR"])
    for candidate in (REPO / ".gpu" / "sst", REPO.parent / "shared" / "data" / "sst"):
        if (candidate / "dev.txt").is_file():
            return candidate
    return REPO / ".gpu" / "sst"


# ------------------------------------------------------------- the shared setup


@dataclass
class Setup:
    """What every process builds the same way: the cell, its params, the vocabulary and the batches."""

    cell: Any
    params: dict[str, np.ndarray]
    lines: list[str]
    vocab: Any
    batches: dict[str, list[list[str]]]  # batch spec -> groups of tree lines


def batch_groups(lines: list[str], size: int, max_trees: int) -> list[list[str]]:
    """Consecutive groups of ``size`` trees covering min(all, max(size, max_trees)) trees."""
    wanted = min(len(lines), max(size, max_trees))
    return [lines[k * size : (k + 1) * size] for k in range(math.ceil(wanted / size))]


def make_setup(args: argparse.Namespace) -> Setup:
    from cortexc.frontend import lower_source
    from cortexc.runtime.forest import Forest
    from cortexc.runtime.params import init_params
    from cortexc.runtime.vocab import Vocab

    path = args.sst_dir / "dev.txt"
    if not path.is_file():
        raise SystemExit(f"SST dev trees not found at {path} (set CORTEXC_SST_DIR or --sst-dir)")
    with open(path, encoding="utf-8") as handle:
        lines = [line.rstrip("\n") for line in handle if line.strip()]
    vocab = Vocab.build([Forest.from_ptb(lines)])
    cell = lower_source(CELL.read_text(), str(CELL), defines={"H": args.hidden})[0]
    params = init_params(cell, seed=0)
    if len(vocab) > params["E"].shape[0]:
        raise SystemExit(f"the vocabulary ({len(vocab)} words) is larger than the cell's V")
    batches = {
        spec: batch_groups(lines, len(lines) if spec == "all" else int(spec), args.max_trees) for spec in args.batches
    }
    return Setup(cell=cell, params=params, lines=lines, vocab=vocab, batches=batches)


def capped(groups: list[list[str]], cap: int) -> list[list[str]]:
    """The first ``cap`` trees of the groups, batch boundaries kept (the last group cut short if needed)."""
    chosen, taken = [], 0
    for group in groups:
        if taken >= cap:
            break
        chosen.append(group[: cap - taken])
        taken += len(chosen[-1])
    return chosen


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    """Normwise relative error: max |got - ref| over max |ref|."""
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    if got.shape != ref.shape:
        return float("inf")
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30)) if ref.size else 0.0


def median_time(call: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> float:
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        call()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


# ------------------------------------------------------------- the PyTorch peers on a device


def torch_peers(params: Mapping[str, np.ndarray], device: str):
    """`peers.TorchPerNode` and `peers.TorchLevelBatched`, same math, weights and work on ``device``."""
    import torch

    from benchmarks.peers import LevelPlan, TorchLevelBatched, TorchPerNode, leaf_step, node_step

    dev = torch.device(device)

    class PerNodeOnDevice(TorchPerNode):
        """The per-node recursion of `TorchPerNode`, every tensor on the device."""

        def __init__(self, params: Mapping[str, np.ndarray]) -> None:
            super().__init__(params)
            self.weights = {name: w.to(dev) for name, w in self.weights.items()}

        def run(self, prepared):
            children, ids, roots = prepared
            w = self.weights
            hidden = self.dims.H
            n = len(children)
            h_out: list[Any] = [None] * n
            c_out: list[Any] = [None] * n
            logits_out: list[Any] = [None] * n
            zero = torch.zeros(hidden, device=dev)
            linear = torch.nn.functional.linear

            def forward(node: int):
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
                return {
                    "h": torch.stack(h_out).cpu().numpy(),
                    "c": torch.stack(c_out).cpu().numpy(),
                    "logits": torch.stack(logits_out).cpu().numpy(),
                }

    @dataclass(frozen=True)
    class HostPlan:
        """A `LevelPlan` whose index arrays are one host tensor, sent to the device in one copy per call."""

        plan: LevelPlan
        indices: Any  # int64: leaf words, node rows, then every level's child rows
        sizes: tuple[int, ...]

    class LevelBatchedOnDevice(TorchLevelBatched):
        """`TorchLevelBatched` with the weights on the device and the batch's indices uploaded per call."""

        def __init__(self, params: Mapping[str, np.ndarray]) -> None:
            super().__init__(params)
            for name in ("E", "W_iou", "b_iou", "U", "b", "W_s", "b_s"):
                setattr(self, name, getattr(self, name).to(dev))

        def prepare(self, forest, word) -> HostPlan:
            plan = super().prepare(forest, word)
            parts = (plan.leaf_words, plan.node_rows, *plan.child_rows)
            indices = torch.cat(parts)
            return HostPlan(
                plan, indices.pin_memory() if dev.type == "cuda" else indices, tuple(int(p.numel()) for p in parts)
            )

        def run(self, host: HostPlan) -> dict[str, np.ndarray]:
            plan = host.plan
            n, hidden = plan.num_nodes, self.dims.H
            with torch.no_grad():
                leaf_words, node_rows, *child_rows = torch.split(host.indices.to(dev, non_blocking=True), host.sizes)
                h = torch.zeros(n + 1, hidden, device=dev)
                c = torch.zeros(n + 1, hidden, device=dev)
                num_leaves = plan.level_ptr[1]
                x = self.E.index_select(0, leaf_words)
                iou = torch.addmm(self.b_iou, x, self.W_iou.t())
                gate = torch.sigmoid(iou[:, : 2 * hidden])
                c_new = gate[:, :hidden] * torch.tanh(iou[:, 2 * hidden :])
                c[:num_leaves] = c_new
                h[:num_leaves] = gate[:, hidden:] * torch.tanh(c_new)
                for k, rows in enumerate(child_rows, start=1):
                    lo, hi = plan.level_ptr[k], plan.level_ptr[k + 1]
                    count = hi - lo
                    hc = h.index_select(0, rows).view(count, 2 * hidden)
                    cc = c.index_select(0, rows).view(count, 2, hidden)
                    g = torch.addmm(self.b, hc, self.U.t())  # [count, 5H]: i, o, u, f_left, f_right
                    io = torch.sigmoid(g[:, : 2 * hidden])
                    u = torch.tanh(g[:, 2 * hidden : 3 * hidden])
                    f = torch.sigmoid(g[:, 3 * hidden :]).view(count, 2, hidden)
                    c_new = io[:, :hidden] * u + (f * cc).sum(dim=1)
                    c[lo:hi] = c_new
                    h[lo:hi] = io[:, hidden:] * torch.tanh(c_new)
                h_nodes = h.index_select(0, node_rows)
                c_nodes = c.index_select(0, node_rows)
                logits = torch.addmm(self.b_s, h_nodes, self.W_s.t())
                return {"h": h_nodes.cpu().numpy(), "c": c_nodes.cpu().numpy(), "logits": logits.cpu().numpy()}

    return PerNodeOnDevice(params), LevelBatchedOnDevice(params)


# ------------------------------------------------------------- a worker: one side, in its own process


def run_worker(args: argparse.Namespace, which: str) -> dict[str, Any]:
    """Check and time the implementations of one worker; their results by name (status, check, batches)."""
    from cortexc import reference
    from cortexc.runtime.forest import Forest

    setup = make_setup(args)
    results: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    runners: dict[str, tuple[Callable[[Forest, np.ndarray], Any], Callable[[Any], Any], int | None]] = {}
    sync: Callable[[], None] = lambda: None  # noqa: E731
    if which == "torch":
        import torch

        per_node, level = torch_peers(setup.params, args.device)
        if args.device == "cuda":
            sync = torch.cuda.synchronize
            meta["gpu"] = torch.cuda.get_device_name()
        else:
            meta["gpu"] = f"CPU, {torch.get_num_threads()} torch threads"
        meta["torch"] = torch.__version__
        runners["torch_per_node"] = (per_node.prepare, per_node.run, args.per_node_trees)
        runners["torch_level_batched"] = (level.prepare, level.run, None)
    else:
        try:
            import cortexc

            module = cortexc.load(CELL, H=args.hidden)
            model = module.BinaryTreeLSTM(device="cuda" if args.device == "cuda" else "cpu", seed=0)
            model.load_params(setup.params)
        except Exception as err:  # no PyCUDA, no GPU, a build error: reported in the table, the peers still run
            return {
                "compiled": {"status": f"n/a ({type(err).__name__}: {str(err).splitlines()[0][:200]})"},
                "_meta": meta,
            }

        def prepare(forest: Forest, ids: np.ndarray) -> tuple[Forest, np.ndarray]:
            return forest, ids

        runners["compiled"] = (prepare, lambda work: model(work[0], word=work[1]), None)
        if args.device == "cuda":  # the same kernels with the split mode off: what model persistence buys
            runners["compiled_rows"] = (prepare, lambda work: in_cuda_mode("persistent", model, work), None)

    check_forest = Forest.from_ptb(setup.lines[:CHECK_TREES])
    check_ids = setup.vocab.encode(check_forest)
    reference = reference.run(setup.cell, check_forest, setup.params, {"word": check_ids})
    for name, (prepare, run, cap) in runners.items():
        started = time.perf_counter()
        try:
            out = run(prepare(check_forest, check_ids))  # also the first call: builds, uploads, warms up
            check = {key: rel_err(out[key], reference[key]) for key in ("h", "c", "logits")}
        except Exception as err:
            results[name] = {"status": f"n/a (first call: {type(err).__name__}: {str(err).splitlines()[0][:200]})"}
            continue
        entry: dict[str, Any] = {
            "status": "ok",
            "check": check,
            "first_call_s": time.perf_counter() - started,
            "batches": {},
        }
        for spec, groups in setup.batches.items():
            chosen = capped(groups, cap) if cap is not None else groups
            work = []
            for group in chosen:
                forest = Forest.from_ptb(group)
                work.append((prepare(forest, setup.vocab.encode(forest)), len(group)))
            sync()
            run(work[0][0])  # warm-up of this batch size
            seconds = sum(median_time(lambda w=w, run=run: run(w), args.repeats, sync) for w, _ in work)
            trees = sum(count for _, count in work)
            entry["batches"][spec] = {"trees": trees, "seconds": seconds, "trees_per_s": trees / seconds}
            print(f"  [{name} batch={spec}] {trees} trees, {trees / seconds:.1f} trees/s", file=sys.stderr, flush=True)
        results[name] = entry
    if which == "compiled" and args.device == "cuda":
        try:
            import ctypes

            import pycuda.autoinit

            meta["gpu_pycuda"] = pycuda.autoinit.device.name()
            model(check_forest, word=check_ids)
            plan = (ctypes.c_int64 * 3)()
            model._executor_for_device().lib.cx_last_plan(plan)
            meta["plan"] = {"grid": plan[0], "units": plan[1], "slice_bytes": plan[2]}
        except Exception:
            pass
    results["_meta"] = meta
    return results


def in_cuda_mode(mode: str, model: Any, work: tuple[Any, np.ndarray]) -> Any:
    """One compiled call with CORTEXC_CUDA_MODE set (the driver reads it at every call)."""
    before = os.environ.get("CORTEXC_CUDA_MODE")
    os.environ["CORTEXC_CUDA_MODE"] = mode
    try:
        return model(work[0], word=work[1])
    finally:
        if before is None:
            del os.environ["CORTEXC_CUDA_MODE"]
        else:
            os.environ["CORTEXC_CUDA_MODE"] = before


def spawn_worker(args: argparse.Namespace, which: str) -> dict[str, Any]:
    """Run one worker in a child process; its results, or every one of its implementations n/a and why."""
    with tempfile.TemporaryDirectory() as scratch:
        result_path = Path(scratch) / "result.json"
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            which,
            "--result",
            str(result_path),
            "--device",
            args.device,
            "--hidden",
            str(args.hidden),
            "--batches",
            *args.batches,
            "--max-trees",
            str(args.max_trees),
            "--per-node-trees",
            str(args.per_node_trees),
            "--repeats",
            str(args.repeats),
            "--sst-dir",
            str(args.sst_dir),
        ]
        started = time.perf_counter()
        try:
            process = subprocess.run(command, timeout=args.worker_timeout)
            failure = None if process.returncode == 0 else f"worker exited with status {process.returncode}"
        except subprocess.TimeoutExpired:
            failure = f"worker timed out after {args.worker_timeout} s"
        print(f"  [{which} worker] {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
        if failure is None and result_path.is_file():
            return json.loads(result_path.read_text())
    return {name: {"status": f"n/a ({failure or 'no result'})"} for name in WORKERS[which]}


# ------------------------------------------------------------- the report


def forward_flops(forest: Any, params: Mapping[str, np.ndarray]) -> int:
    """GEMM FLOPs of one forward, as `peers.forward_flops` counts them (here without importing torch)."""
    v, x = params["E"].shape
    c, h = params["W_s"].shape
    leaves = int(np.count_nonzero(forest.num_children == 0))
    internal = forest.num_nodes - leaves
    return leaves * 2 * x * 3 * h + internal * 2 * (2 * h) * (5 * h) + forest.num_nodes * 2 * h * c


def render_table(args: argparse.Namespace, setup: Setup, results: Mapping[str, Any], meta: Mapping[str, Any]) -> str:
    from cortexc.runtime.forest import Forest

    (V, X), (C, H) = setup.params["E"].shape, setup.params["W_s"].shape
    full = Forest.from_ptb(setup.lines)
    out = []
    out.append(
        f"Binary Tree-LSTM H={H} X={X} C={C} V={V} (vocabulary {len(setup.vocab)} words), "
        f"SST dev: {len(setup.lines)} trees, {full.num_nodes} nodes, {full.num_levels} levels"
    )
    out.append(
        f"device {args.device}: {meta.get('gpu', meta.get('gpu_pycuda', '?'))}; torch {meta.get('torch', '?')}; "
        f"median of {args.repeats} timed calls per batch; per-node peer on <= {args.per_node_trees} trees "
        f"per batch size; batches of one size cover max(size, {args.max_trees}) trees"
    )
    if "plan" in meta:
        plan = meta["plan"]
        out.append(
            f"compiled launch plan (first 20 trees): persistent grid {plan['grid']} blocks, "
            f"{plan['units']} hidden unit(s) per block in split levels (0: rows only), "
            f"{plan['slice_bytes']} bytes of weights per block in shared memory"
        )
    for name in IMPLS + (("compiled_rows",) if "compiled_rows" in results else ()):
        entry = results.get(name, {"status": "n/a (not run)"})
        if entry["status"] != "ok":
            out.append(f"{name:20s} {entry['status']}")
            continue
        worst = max(entry["check"].values())
        flag = "  MISMATCH" if not worst < CHECK_RTOL else ""
        out.append(
            f"{name:20s} max rel err vs interp on {CHECK_TREES} trees {worst:.1e} (h, c, logits){flag}; "
            f"first call {entry['first_call_s']:.1f} s"
        )
    header = (
        f"{'batch':>5} {'trees':>5} | {'compiled tr/s':>13} {'per-node tr/s':>13} {'level tr/s':>12} | "
        f"{'compiled GF/s':>13} | {'comp/per-node':>13} {'comp/level':>10} | targets at batch {TARGET_BATCH}"
    )
    out.append(header)
    out.append("-" * len(header))
    met = []
    for spec in args.batches:
        groups = setup.batches[spec]
        trees = sum(len(g) for g in groups)
        rates: dict[str, float | None] = {}
        for name in IMPLS:
            entry = results.get(name, {})
            stats = entry.get("batches", {}).get(spec) if entry.get("status") == "ok" else None
            rates[name] = stats["trees_per_s"] if stats else None
        flops = sum(forward_flops(Forest.from_ptb(g), setup.params) for g in groups)

        def cell(value: float | None, width: int, fmt: str = ".1f", unit: str = "") -> str:
            text = "n/a" if value is None else f"{value:{fmt}}{unit}"
            return f"{text:>{width}}"

        compiled = rates["compiled"]
        gflops = flops / trees * compiled / 1e9 if compiled else None
        ratios = {name: (compiled / rates[name] if compiled and rates[name] else None) for name in TARGETS}
        target = ""
        if spec == TARGET_BATCH:
            parts = []
            for name, goal in TARGETS.items():
                ratio = ratios[name]
                verdict = "n/a" if ratio is None else ("MET" if ratio >= goal else "MISSED")
                parts.append(f"{'per-node' if name == 'torch_per_node' else 'level'} >= {goal:g}x: {verdict}")
                met.append(verdict)
            target = "; ".join(parts)
        out.append(
            f"{spec:>5} {trees:>5} | {cell(compiled, 13)} {cell(rates['torch_per_node'], 13)} "
            f"{cell(rates['torch_level_batched'], 12)} | {cell(gflops, 13, '.2f')} | "
            f"{cell(ratios['torch_per_node'], 13, '.2f', 'x')} "
            f"{cell(ratios['torch_level_batched'], 10, '.2f', 'x')} | "
            f"{target}"
        )
    rows_entry = results.get("compiled_rows", {})
    if rows_entry.get("status") == "ok" and results.get("compiled", {}).get("status") == "ok":
        speedups = []
        for spec in args.batches:
            split_rate = results["compiled"]["batches"][spec]["trees_per_s"]
            rows_rate = rows_entry["batches"][spec]["trees_per_s"]
            speedups.append(f"batch {spec}: {split_rate / rows_rate:.2f}x")
        out.append(
            "split mode (model persistence) over row tiles only (CORTEXC_CUDA_MODE=persistent): " + ", ".join(speedups)
        )
    if met:
        out.append(
            f"targets at batch {TARGET_BATCH}: compiled >= {TARGETS['torch_per_node']:g}x per-node and >= "
            f"{TARGETS['torch_level_batched']:g}x level-batched trees/s: {', '.join(met)}"
        )
    return "\n".join(out)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--hidden", type=int, default=256, help="H (default 256)")
    parser.add_argument(
        "--batches",
        nargs="+",
        default=["1", "10", "100", "all"],
        help="batch sizes in trees, or 'all' (default 1 10 100 all)",
    )
    parser.add_argument(
        "--max-trees",
        type=int,
        default=100,
        help="trees timed per batch size, whole batches (default 100; 'all' is all of dev)",
    )
    parser.add_argument(
        "--per-node-trees",
        type=int,
        default=50,
        help="at most this many trees per batch size for torch_per_node (default 50)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per batch, median kept (default 5)")
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cuda (default), or cpu: the compiled C and CPU torch, a smoke test of this script",
    )
    parser.add_argument(
        "--sst-dir",
        type=Path,
        default=default_sst_dir(),
        help="folder with dev.txt (default $CORTEXC_SST_DIR, .gpu/sst, ../shared/data/sst)",
    )
    parser.add_argument("--worker-timeout", type=float, default=180, help="seconds per child process")
    parser.add_argument("--json", type=Path, help="write every number here")
    parser.add_argument("--table", type=Path, help="write the table here too")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for spec in args.batches:
        if spec != "all" and not (spec.isdigit() and int(spec) > 0):
            parser.error(f"--batches takes positive integers or 'all', got {spec!r}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        args.result.write_text(json.dumps(run_worker(args, args.worker)))
        return 0
    started = time.perf_counter()
    setup = make_setup(args)
    results: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    for which in ("torch", "compiled"):
        part = spawn_worker(args, which)
        meta.update(part.pop("_meta", {}))
        results.update(part)
    table = render_table(args, setup, results, meta)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "meta": meta,
                    "results": results,
                    "elapsed_s": time.perf_counter() - started,
                },
                indent=1,
            )
        )
    if args.table:
        args.table.write_text(table + "\n")
    print(f"\n(total {time.perf_counter() - started:.1f} s)\n")
    print(table)
    return 0 if all(results.get(name, {}).get("status") == "ok" for name in IMPLS) else 1


if __name__ == "__main__":
    sys.exit(main())
