"""Binary Tree-LSTM on SST: trees/s of cortexc against the usual ways of running it.

In one run, with the same weights and the same trees, this times

- ``interp``: cortexc's reference interpreter (NumPy, one node at a time), the eager baseline;
- ``torch_per_node``: recursive PyTorch, one call per node (`peers.TorchPerNode`);
- ``torch_level_batched``: PyTorch level by level, TF Fold / DGL style (`peers.TorchLevelBatched`);
- ``compiled``: the cortexc compiled module, when ``cortexc.load`` exists (else "n/a"), as users get it:
  its inferences read the leaves' ``W_iou @ E[word]`` from a folded table (`cortexc.passes.fold`);
- ``compiled_unfolded``: the same with ``fold=False`` (every leaf GEMM run).

GFLOP/s always counts the FLOPs the original cell needs (the folded leaf GEMMs included); the table says
which share of them folding replaces by row copies, the table's memory and its one-time build.

Trees are taken in consecutive batches of 1, 10, 100 or all trees of a split,
as many batches as cover ``--max-trees`` trees (or one batch, if larger).
Each implementation is first warmed up (calls over its batches for at least
``WARMUP_CALLS`` calls and ``WARMUP_S`` seconds: the first calls of a process
pay for thread start, first-touch page faults and allocator growth — 20-45 ms
each for the first few batch-1 calls of the compiled model, against 0.7 ms
later — which one warm-up call does not absorb), then timed in ``--repeats``
rounds, each round over all its batches; a batch keeps its fastest round (a
burst of load from another process hits one round, not the result) and
trees/s is the trees timed over the sum of those times. The two
implementations that work one node at a time whatever the batch (``interp``,
``torch_per_node``) are timed on only the first ``--interp-trees`` /
``--per-node-trees`` trees of those batches, to keep the run short.
``ms/batch`` is the time of one batch (at batch 1, the latency per tree).
With ``--loaded``, ``compiled`` and ``torch_level_batched`` are timed again next to one competing busy
process that the benchmark starts and stops (`benchmarks.load.Busy`), and each one's loaded / quiet time is
reported side by side.
Linearization (``Forest.from_ptb`` of the batch's lines and the level-batched
``prepare``) is timed separately from compute. Each implementation's GFLOP/s (GEMM FLOPs of the forward over
its time) is given against the best sgemm rate measured in the same run (``% best sgemm``: the
fastest ``torch.matmul`` float32 rate over large shapes of every hidden size and the level-batch
GEMM shapes of every batch; a fixed roof that no implementation can pass), and the level GEMM rate
(``lvl GEMM``: what ``torch.matmul`` reaches on the level-batch GEMM shapes of those batches alone,
`peers.matmul_roofline` — tiny for batch 1, so not a roof).

Usage (from the repository root)::

    python benchmarks/bench_treelstm.py --quick
    python benchmarks/bench_treelstm.py --hidden 150 256 --splits dev --json out.json --png out.png
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make `benchmarks` and `cortexc` importable
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.load import Busy  # noqa: E402
from benchmarks.peers import (  # noqa: E402
    TorchLevelBatched,
    TorchPerNode,
    TreeDims,
    forward_flops,
    level_gemm_shapes,
    matmul_roofline,
)
from cortexc import reference  # noqa: E402
from cortexc.errors import CortexcError  # noqa: E402
from cortexc.frontend import lower_source  # noqa: E402
from cortexc.ir.cell import Cell  # noqa: E402
from cortexc.runtime.forest import Forest  # noqa: E402
from cortexc.runtime.params import init_params  # noqa: E402
from cortexc.runtime.vocab import Vocab  # noqa: E402

CELL = REPO / "examples" / "binary_treelstm.cell"
SST_DIR = Path(os.environ.get("CORTEXC_SST_DIR", REPO.parent / "shared" / "data" / "sst"))
IMPLS = ("interp", "torch_per_node", "torch_level_batched", "compiled_unfolded", "compiled")
LOADED_IMPLS = ("torch_level_batched", "compiled")  # timed again next to a busy process with --loaded
LOADED_LABELS = {"torch_level_batched": "torch_level (busy)", "compiled": "compiled (busy)"}
CHECK_TREES = 20  # trees on which every implementation is checked against the interpreter
CHECK_RTOL = 1e-4  # normwise relative error above which a result is flagged as a mismatch
WARMUP_CALLS = 10  # calls of an implementation before it is timed, at least ...
WARMUP_S = 0.3  # ... and at least this long (cycling over its batches)

Runner = Callable[[Forest, np.ndarray], Any]
# What a not-yet-finished compiled path raises; anything else is a real failure and stops the run.
COMPILED_UNAVAILABLE = (AttributeError, ImportError, NotImplementedError, CortexcError)


# ------------------------------------------------------------- loading


def read_trees(path: Path) -> list[str]:
    """The non-blank lines of a PTB file, one tree each."""
    with open(path, encoding="utf-8") as handle:
        return [line.rstrip("\n") for line in handle if line.strip()]


def build_vocab(data_dir: Path, split_lines: Sequence[str]) -> tuple[Vocab, str]:
    """The SST train vocabulary (as a trained model would have), or the split's own if train is absent."""
    train = data_dir / "train.txt"
    if train.exists():
        return Vocab.build([Forest.from_ptb_file(train)]), "train"
    return Vocab.build([Forest.from_ptb(split_lines)]), "split"


def load_cell(cell_path: Path, dims: Mapping[str, int]) -> Cell:
    """The BinaryTreeLSTM cell with the given dims."""
    return lower_source(cell_path.read_text(), str(cell_path), defines=dict(dims))[0]


def load_compiled(cell_path: Path, dims: Mapping[str, int], fold: bool = True) -> tuple[Any | None, str]:
    """The compiled ``BinaryTreeLSTM`` model (seed 0, CPU), or None and why not.

    The compiled path is still being built, so a missing ``cortexc.load``, a
    missing generated class or an op codegen does not handle yet is expected
    and reported as "n/a" rather than stopping the benchmark.
    """
    try:
        import cortexc

        module = cortexc.load(str(cell_path), **dims)
        model = module.BinaryTreeLSTM(device="cpu", seed=0, fold=fold)
    except COMPILED_UNAVAILABLE as err:
        return None, f"n/a ({type(err).__name__}: {err})"
    return model, "ok"


def compiled_runner(model: Any, params: Mapping[str, np.ndarray]) -> Runner:
    """A call of the compiled model on the benchmark's params, returning its outputs dict."""
    model.load_params(dict(params))

    def run(forest: Forest, ids: np.ndarray) -> Any:
        return model(forest, word=ids)

    return run


# ------------------------------------------------------------- timing


def median_time(call: Callable[[], Any], repeats: int) -> float:
    """Median wall time of ``repeats`` calls (seconds)."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


@dataclass
class Batch:
    """One batch of consecutive trees, linearized, with its timings."""

    lines: list[str]
    forest: Forest
    ids: np.ndarray
    parse_s: float = 0.0
    encode_s: float = 0.0
    prepare_s: float = 0.0
    flops: int = 0
    shapes: list[tuple[int, int, int]] = field(default_factory=list)


def make_batch(lines: list[str], vocab: Vocab, dims: TreeDims, level: TorchLevelBatched, repeats: int) -> Batch:
    """Parse, encode and level-prepare one batch, timing each step (median over repeats)."""
    forest = Forest.from_ptb(lines)
    ids = vocab.encode(forest)
    batch = Batch(lines=lines, forest=forest, ids=ids)
    batch.parse_s = median_time(lambda: Forest.from_ptb(lines), repeats)
    batch.encode_s = median_time(lambda: vocab.encode(forest), repeats)
    batch.prepare_s = median_time(lambda: level.prepare(forest, ids), repeats)
    batch.flops = forward_flops(forest, dims)
    batch.shapes = level_gemm_shapes(forest, dims)
    return batch


def batch_groups(lines: list[str], size: int, max_trees: int) -> list[list[str]]:
    """Consecutive groups of ``size`` trees covering at least min(all, max(size, max_trees)) trees."""
    wanted = min(len(lines), max(size, max_trees))
    count = math.ceil(wanted / size)
    return [lines[k * size : (k + 1) * size] for k in range(count)]


def capped_batches(batches: list[Batch], cap: int, vocab: Vocab) -> list[tuple[Forest, np.ndarray, int]]:
    """The first ``cap`` trees of the batches, batch boundaries kept, the last batch cut short if needed.

    For the per-node implementations (interp, torch per node): their time per
    tree does not depend on the batch size, and timing them on a whole large
    batch would take most of the run.
    """
    chosen: list[tuple[Forest, np.ndarray, int]] = []
    taken = 0
    for batch in batches:
        if taken >= cap:
            break
        lines = batch.lines[: cap - taken]
        if len(lines) == len(batch.lines):
            chosen.append((batch.forest, batch.ids, len(lines)))
        else:
            forest = Forest.from_ptb(lines)
            chosen.append((forest, vocab.encode(forest), len(lines)))
        taken += len(lines)
    return chosen


def warm_up(run: Runner, work: list[tuple[Any, int, int]]) -> int:
    """Call ``run`` over the items, cycling, for at least WARMUP_CALLS calls and WARMUP_S seconds; the count."""
    calls = 0
    started = time.perf_counter()
    while calls < WARMUP_CALLS or time.perf_counter() - started < WARMUP_S:
        run(*work[calls % len(work)][0])
        calls += 1
    return calls


def time_runner(run: Runner, work: list[tuple[Any, int, int]], repeats: int) -> dict[str, float]:
    """Trees/s and GFLOP/s of ``run`` over (argument, trees, flops) items: warmed up, then ``repeats`` rounds
    over all items, each item's fastest round kept."""
    warm_calls = warm_up(run, work)
    best = [math.inf] * len(work)
    for _ in range(repeats):
        for k, (args, _count, _flops) in enumerate(work):
            start = time.perf_counter()
            run(*args)
            best[k] = min(best[k], time.perf_counter() - start)
    total_s = sum(best)
    trees = sum(count for _, count, _ in work)
    flops = sum(batch_flops for _, _, batch_flops in work)
    return {
        "trees": trees,
        "seconds": total_s,
        "trees_per_s": trees / total_s,
        "gflops": flops / total_s / 1e9,
        "warmup_calls": warm_calls,
    }


def best_sgemm(hidden: Sequence[int], repeats: int) -> float:
    """The best ``torch.matmul`` float32 GFLOP/s over large shapes: the level GEMMs of a big batch at each
    hidden size (4096 rows, [x; h] -> 5 gates) and a square 1024 product (at the current thread count)."""
    shapes = [(4096, 2 * h, 5 * h) for h in hidden] + [(1024, 1024, 1024)]
    return max(matmul_roofline([shape], repeats=repeats) for shape in shapes)


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    """Normwise relative error: max |got - ref| over max |ref|."""
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30)) if ref.size else 0.0


# ------------------------------------------------------------- one config


def check_against_interp(
    cell: Cell, params: Mapping[str, np.ndarray], runners: Mapping[str, Runner], lines: list[str], vocab: Vocab
) -> tuple[dict[str, dict[str, float]], str | None]:
    """Relative error of each implementation's h, c, logits against the interpreter on a few trees.

    Also the first call of the compiled model: if it fails the way an
    unfinished compiled path does, the reason is returned (else None) and the
    compiled model is left out of the errors.
    """
    forest = Forest.from_ptb(lines[:CHECK_TREES])
    ids = vocab.encode(forest)
    ref = reference.run(cell, forest, params, {"word": ids})
    errors: dict[str, dict[str, float]] = {}
    compiled_failure = None
    for name, run in runners.items():
        if name == "interp":
            continue
        try:
            out = run(forest, ids)
        except COMPILED_UNAVAILABLE as err:
            if not name.startswith("compiled"):
                raise
            compiled_failure = f"n/a (first call: {type(err).__name__}: {err})"
            continue
        errors[name] = {key: rel_err(out[key], ref[key]) for key in ("h", "c", "logits") if key in out}
    return errors, compiled_failure


def bench_config(
    args: argparse.Namespace, split: str, lines: list[str], vocab: Vocab, vocab_from: str, hidden: int
) -> dict[str, Any]:
    """Every batch size and implementation for one split and hidden size."""
    defines = {"H": hidden, "V": len(vocab)}
    cell = load_cell(args.cell, defines)
    params = init_params(cell, seed=0)
    dims = TreeDims.of(params)
    per_node = TorchPerNode(params)
    level = TorchLevelBatched(params)
    runners: dict[str, Runner] = {
        "interp": lambda forest, ids: reference.run(cell, forest, params, {"word": ids}),
        "torch_per_node": per_node,
        "torch_level_batched": level,
    }
    model, compiled_status = load_compiled(args.cell, defines)
    unfolded, _ = load_compiled(args.cell, defines, fold=False)
    if model is not None and unfolded is not None:
        runners["compiled_unfolded"] = compiled_runner(unfolded, params)
        runners["compiled"] = compiled_runner(model, params)
    errors, compiled_failure = check_against_interp(cell, params, runners, lines, vocab)
    if compiled_failure is not None:
        compiled_status = compiled_failure
        runners.pop("compiled", None)
        runners.pop("compiled_unfolded", None)
    full = Forest.from_ptb(lines)
    result: dict[str, Any] = {
        "split": split,
        "hidden": hidden,
        "dims": {"V": dims.V, "X": dims.X, "H": dims.H, "C": dims.C},
        "vocab_from": vocab_from,
        "trees": len(lines),
        "nodes": full.num_nodes,
        "levels": full.num_levels,
        "compiled": compiled_status,
        "check_rel_err": errors,
        "fold": None,  # reported after the timing: a lazy fold is built once enough rows went through
        "batches": [],
    }
    for spec in args.batches:
        size = len(lines) if spec == "all" else int(spec)
        groups = batch_groups(lines, size, args.max_trees)
        batches = [make_batch(group, vocab, dims, level, args.repeats) for group in groups]
        roofline = matmul_roofline([s for b in batches for s in b.shapes], repeats=args.repeats)
        trees = sum(len(b.lines) for b in batches)
        parse_s = sum(b.parse_s for b in batches)
        prepare_s = sum(b.prepare_s for b in batches)
        encode_s = sum(b.encode_s for b in batches)
        entry: dict[str, Any] = {
            "batch": spec,
            "batch_size": size,
            "num_batches": len(batches),
            "trees": trees,
            "roofline_gflops": roofline,
            "folded_flops_fraction": sum(leaf_flops(b.forest, dims) for b in batches) / sum(b.flops for b in batches),
            "linearize": {
                "parse_ms_per_batch": 1e3 * parse_s / len(batches),
                "encode_ms_per_batch": 1e3 * encode_s / len(batches),
                "prepare_ms_per_batch": 1e3 * prepare_s / len(batches),
                "trees_per_s": trees / (parse_s + prepare_s),
            },
            "impls": {},
        }
        works: dict[str, tuple[Runner, list[tuple[Any, int, int]]]] = {}
        for name in IMPLS:
            if name.startswith("compiled") and name not in runners:
                entry["impls"][name] = {"status": compiled_status}
                continue
            if name == "interp":
                work = [
                    ((f, ids), count, forward_flops(f, dims))
                    for f, ids, count in capped_batches(batches, args.interp_trees, vocab)
                ]
                run: Runner = runners[name]
            elif name == "torch_per_node":
                work = [
                    ((per_node.prepare(f, ids),), count, forward_flops(f, dims))
                    for f, ids, count in capped_batches(batches, args.per_node_trees, vocab)
                ]
                run = per_node.run
            elif name == "torch_level_batched":
                work = [((level.prepare(b.forest, b.ids),), len(b.lines), b.flops) for b in batches]
                run = level.run
            else:  # the compiled models: the FLOPs of the original cell, folded or not
                work = [((b.forest, b.ids), len(b.lines), b.flops) for b in batches]
                run = runners[name]
            stats = time_runner(run, work, args.repeats)
            stats["status"] = "ok"
            entry["impls"][name] = stats
            works[name] = (run, work)
        if args.loaded:
            with Busy():
                for name in LOADED_IMPLS:
                    if name in works:
                        loaded = time_runner(*works[name], args.repeats)
                        quiet = entry["impls"][name]["trees_per_s"]
                        entry["impls"][name]["loaded"] = {**loaded, "over_quiet": quiet / loaded["trees_per_s"]}
        result["batches"].append(entry)
        print(f"  [{split} H={hidden} batch={spec}] done", file=sys.stderr, flush=True)
    if "compiled" in runners:  # after the compiled runs: whether their inferences came to read folded tables
        result["fold"] = fold_report(model, args.repeats)
    return result


def leaf_flops(forest: Forest, dims: TreeDims) -> int:
    """The FLOPs of the leaves' ``W_iou @ E[word]`` (what folding turns into row copies)."""
    return int(np.count_nonzero(forest.num_children == 0)) * 2 * dims.X * 3 * dims.H


def fold_report(model: Any, repeats: int) -> dict[str, Any]:
    """Whether the compiled model's inferences folded by the end of its timed runs (a fold is built lazily,
    once the inferences have looked up as many rows as the table has), its tables' memory and their build
    time (the median of `repeats` rebuilds from the same weights)."""
    executor = model._executor
    tables = executor.folded_tables(executor.weights) if executor is not None else None
    if not tables:
        return {"used": False, "folds": [f.to_json() for f in model._spec.target("c").folds]}
    rebuilds = []
    for _ in range(repeats):
        start = time.perf_counter()
        executor._build_folds(executor.weights)
        rebuilds.append(time.perf_counter() - start)
    return {
        "used": True,
        "folds": [f.to_json() for f in model._spec.target("c").folds],
        "table_mb": sum(t.nbytes for t in tables if t is not None) / 2**20,
        "build_ms_median": 1e3 * statistics.median(rebuilds),
    }


# ------------------------------------------------------------- report


def add_best_sgemm(results: list[dict[str, Any]], measured: float) -> float:
    """The best sgemm rate of the run (`best_sgemm`, or a level GEMM rate if one was faster); every
    implementation's fraction of it."""
    best = max([measured] + [entry["roofline_gflops"] for r in results for entry in r["batches"]])
    for result in results:
        for entry in result["batches"]:
            for stats in entry["impls"].values():
                if stats.get("status") == "ok":
                    stats["best_sgemm_fraction"] = stats["gflops"] / best
    return best


def print_table(result: dict[str, Any], best: float) -> None:
    """One table per config: trees/s, GFLOP/s and the fraction of the run's best sgemm rate per
    implementation and batch size."""
    dims = result["dims"]
    has_compiled = result["compiled"] == "ok"
    reference = "compiled" if has_compiled else "interp"
    print()
    print(
        f"split={result['split']} H={dims['H']} X={dims['X']} C={dims['C']} V={dims['V']} "
        f"({result['trees']} trees, {result['nodes']} nodes, {result['levels']} levels); "
        f"% best sgemm: of {best:.1f} GFLOP/s, the best torch.matmul float32 rate measured in this run"
    )
    print(f"compiled: {result['compiled']}")
    fold = result.get("fold")
    if fold is not None:
        if fold["used"]:
            shapes = ", ".join(f"{f['table']} @ W^T [{f['rows']}, {f['m']}]" for f in fold["folds"])
            print(
                f"compiled folds: {shapes}: {fold['table_mb']:.1f} MiB, built in {fold['build_ms_median']:.1f} ms "
                "(once per params); compiled_unfolded: fold=False. GFLOP/s: the original cell's FLOPs"
            )
        else:
            print("compiled folds: none used")
    for name, errs in result["check_rel_err"].items():
        worst = max(errs.values()) if errs else float("nan")
        flag = "  MISMATCH" if worst > CHECK_RTOL else ""
        print(f"check vs interp on {CHECK_TREES} trees: {name:20s} max rel err {worst:.1e}{flag}")
    header = (
        f"{'batch':>6} {'impl':<20} {'trees':>6} {'trees/s':>10} {'ms/batch':>9} {'GFLOP/s':>8} "
        f"{'lvl GEMM':>9} {'% best sgemm':>12} {reference + '/impl':>15}"
    )
    print(header)
    print("-" * len(header))
    for entry in result["batches"]:
        ref = entry["impls"][reference]
        for name in IMPLS:
            stats = entry["impls"][name]
            if stats["status"] != "ok":
                print(f"{entry['batch']:>6} {name:<20} {'n/a':>6}")
                continue
            ratio = ref["trees_per_s"] / stats["trees_per_s"]
            print(
                f"{entry['batch']:>6} {name:<20} {stats['trees']:>6} {stats['trees_per_s']:>10.1f} "
                f"{1e3 * entry['batch_size'] / stats['trees_per_s']:>9.3f} {stats['gflops']:>8.2f} "
                f"{entry['roofline_gflops']:>9.1f} "
                f"{100 * stats['best_sgemm_fraction']:>11.2f}% {ratio:>15.3f}"
            )
        for name in LOADED_IMPLS:
            loaded = entry["impls"][name].get("loaded")
            if loaded is not None:
                label, per_s = LOADED_LABELS[name], loaded["trees_per_s"]
                print(
                    f"{entry['batch']:>6} {label:<20} {loaded['trees']:>6} {per_s:>10.1f} "
                    f"{1e3 * entry['batch_size'] / per_s:>9.3f}   next to one busy process: "
                    f"loaded / quiet {loaded['over_quiet']:.2f}x"
                )
        lin = entry["linearize"]
        if fold is not None and fold["used"]:
            share = 100 * entry["folded_flops_fraction"]
            print(f"{entry['batch']:>6} {'(folded FLOPs)':<20} {share:>16.1f}% of the forward's")
        print(
            f"{entry['batch']:>6} {'linearize':<20} {entry['trees']:>6} {lin['trees_per_s']:>10.1f}   "
            f"(per batch: from_ptb {lin['parse_ms_per_batch']:.3f} ms, "
            f"level prepare {lin['prepare_ms_per_batch']:.3f} ms, vocab encode {lin['encode_ms_per_batch']:.3f} ms)"
        )


def save_plot(results: list[dict[str, Any]], path: Path) -> None:
    """Trees/s against batch size (log-log), one panel per split and hidden size, one line per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4.2), squeeze=False)
    for ax, result in zip(axes[0], results):
        sizes = [entry["batch_size"] for entry in result["batches"]]
        for name in IMPLS:
            points = [
                (s, e["impls"][name]["trees_per_s"])
                for s, e in zip(sizes, result["batches"])
                if e["impls"][name]["status"] == "ok"
            ]
            if points:
                ax.plot(*zip(*points), marker="o", label=name)
        lin = [(s, e["linearize"]["trees_per_s"]) for s, e in zip(sizes, result["batches"])]
        ax.plot(*zip(*lin), linestyle="--", color="gray", marker=".", label="linearize (parse+prepare)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("batch size (trees)")
        ax.set_ylabel("trees/s")
        ax.set_title(f"SST {result['split']}, H={result['hidden']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[150, 256], help="hidden sizes H")
    parser.add_argument("--splits", nargs="+", default=["dev"], choices=["train", "dev", "test"])
    parser.add_argument(
        "--batches",
        nargs="+",
        default=["1", "10", "100", "all"],
        help="batch sizes in trees, or 'all' for the whole split",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per batch (median kept)")
    parser.add_argument(
        "--max-trees",
        type=int,
        default=300,
        help="trees timed per batch size (whole batches; 'all' is always the whole split)",
    )
    parser.add_argument("--interp-trees", type=int, default=100, help="at most this many trees for interp")
    parser.add_argument("--per-node-trees", type=int, default=100, help="at most this many trees for torch_per_node")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--data-dir", type=Path, default=SST_DIR)
    parser.add_argument("--cell", type=Path, default=CELL)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--png", type=Path, help="write a plot of trees/s against batch size here")
    parser.add_argument(
        "--loaded",
        action="store_true",
        help="also time compiled and torch_level_batched next to one busy process (started and stopped here)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a reduced run (H=150, dev, batches 1 10 100, 3 repeats, fewer trees) in under a minute",
    )
    args = parser.parse_args(argv)
    for spec in args.batches:
        if spec != "all" and not (spec.isdigit() and int(spec) > 0):
            parser.error(f"--batches takes positive integers or 'all', got {spec!r}")
    if args.quick:
        args.hidden = [150]
        args.splits = ["dev"]
        args.batches = ["1", "10", "100"]
        args.repeats = 3
        args.max_trees = 100
        args.interp_trees = 20
        args.per_node_trees = 30
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)  # the compiled kernels share torch's libgomp, so this sets theirs too
    load_before = os.getloadavg()
    cpus = os.cpu_count() or 1
    if load_before[0] > cpus - args.threads + 1.5:
        # Seen on a shared 2-CPU machine: every fork-join waits for a core, small GEMMs and
        # elementwise ops take milliseconds, and 2-thread timings swing by 10x from run to run.
        advice = "try --threads 1 or a quiet machine" if args.threads > 1 else "use a quiet machine"
        print(
            f"warning: 1-min load average {load_before[0]:.2f} on {cpus} CPUs with {args.threads} thread(s) "
            f"per process: other processes share the cores and timings will be noisy ({advice})",
            file=sys.stderr,
        )
    started = time.perf_counter()
    measured_sgemm = best_sgemm(args.hidden, args.repeats)
    results = []
    for split in args.splits:
        path = args.data_dir / f"{split}.txt"
        if not path.exists():
            print(f"SST split not found: {path} (set CORTEXC_SST_DIR or --data-dir)", file=sys.stderr)
            return 1
        lines = read_trees(path)
        vocab, vocab_from = build_vocab(args.data_dir, lines)
        for hidden in args.hidden:
            results.append(bench_config(args, split, lines, vocab, vocab_from, hidden))
    best = add_best_sgemm(results, max(measured_sgemm, best_sgemm(args.hidden, args.repeats)))
    for result in results:  # at the end: the fractions are of the best rate of the whole run
        print_table(result, best)
    elapsed = time.perf_counter() - started
    load_after = os.getloadavg()
    print(
        f"\ntotal {elapsed:.1f} s; torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
        f"1-min load average {load_before[0]:.2f} before, {load_after[0]:.2f} after"
    )
    if args.json:
        meta = {
            "torch": torch.__version__,
            "numpy": np.__version__,
            "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "repeats": args.repeats,
            "max_trees": args.max_trees,
            "interp_trees": args.interp_trees,
            "per_node_trees": args.per_node_trees,
            "loadavg_before": load_before,
            "loadavg_after": load_after,
            "elapsed_s": elapsed,
            "best_sgemm_gflops": best,
            "warmup": {"calls": WARMUP_CALLS, "seconds": WARMUP_S},
        }
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    if args.png:
        save_plot(results, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
