"""Folded look-up projections (`cortexc.passes.fold`) on SST: the compiled binary Tree-LSTM with and without
folding, through the NumPy API and through `cortexc.torch.CellModule` (eval, `torch.no_grad`, a `ForestBatch`
made once per batch), and PyTorch level-batched, *interleaved* call by call on the same batches.

Why interleaved: on a shared machine the load changes within seconds, and `bench_treelstm.py` times one
implementation after the other, so a 10% difference drowns in it. Here every round calls the three
implementations on the same batch back to back (in a rotating order), and for each batch keeps the fastest
call of each (min) and the median; trees/s is the trees over the sum of those per-batch times. GFLOP/s counts
the FLOPs of the original cell (`peers.forward_flops`: the folded leaf GEMMs included); the share that folding
replaces by row copies is printed, with the table's memory and its one-time build cost.

    python benchmarks/bench_fold.py --hidden 256 --batches 1 10 --threads 2 --max-trees 200 --repeats 15
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.bench_treelstm import CELL, SST_DIR, batch_groups, build_vocab, fold_report, leaf_flops, read_trees  # noqa: E402
from benchmarks.peers import TorchLevelBatched, TreeDims, forward_flops  # noqa: E402
from cortexc.runtime.forest import Forest  # noqa: E402
from cortexc.runtime.params import init_params  # noqa: E402

IMPLS = ("torch_level_batched", "compiled_unfolded", "compiled", "module_unfolded", "module")
#: folded vs unfolded pairs the report prints the ratio of
PAIRS = (("compiled", "compiled_unfolded"), ("module", "module_unfolded"))


def bench(args: argparse.Namespace, hidden: int, lines: list[str], vocab: Any) -> dict[str, Any]:
    import cortexc
    from cortexc.torch import CellModule, ForestBatch

    module = cortexc.load(str(args.cell), H=hidden, V=len(vocab))
    cls = module.BinaryTreeLSTM
    folded, unfolded = cls(device="cpu", seed=0), cls(device="cpu", seed=0, fold=False)
    params = init_params(cls.signature, seed=0)
    folded.load_params(params)
    unfolded.load_params(params)
    cell_folded, cell_unfolded = CellModule(cls, seed=0).eval(), CellModule(cls, seed=0, fold=False).eval()
    dims = TreeDims.of(params)
    level = TorchLevelBatched(params)
    result: dict[str, Any] = {"hidden": hidden, "V": len(vocab), "batches": []}
    for spec in args.batches:
        size = int(spec)
        groups = batch_groups(lines, size, args.max_trees)
        work = []
        for group in groups:
            forest = Forest.from_ptb(group)
            ids = vocab.encode(forest)
            plan = level.prepare(forest, ids)
            batch, word = ForestBatch.from_forest(forest), torch.as_tensor(ids)
            calls: dict[str, Callable[[], Any]] = {
                "torch_level_batched": lambda plan=plan: level.run(plan),
                "compiled_unfolded": lambda f=forest, i=ids: unfolded(f, word=i),
                "compiled": lambda f=forest, i=ids: folded(f, word=i),
                "module_unfolded": lambda b=batch, w=word: _infer(cell_unfolded, b, w),
                "module": lambda b=batch, w=word: _infer(cell_folded, b, w),
            }
            out_f, out_u = calls["compiled"](), calls["compiled_unfolded"]()
            mod_f, mod_u = calls["module"](), calls["module_unfolded"]()
            same = all(out_f[k].tobytes() == out_u[k].tobytes() == mod_f[k].numpy().tobytes() for k in out_u)
            same = same and all(mod_f[k].numpy().tobytes() == mod_u[k].numpy().tobytes() for k in mod_u)
            work.append((group, forest, calls, same))
        if not all(same for *_, same in work):
            raise SystemExit(f"batch {spec}: folded and unfolded results differ (they must be bitwise equal)")
        for warm in range(30):  # warm-up rounds, until the default policy has built both tables
            for _, _, calls, _ in work:
                for call in calls.values():
                    call()
            built = folded._executor._folded, cell_folded.runner.executor._folded
            if warm >= 2 and all(b is not None and b[1] is not None for b in built):
                break
        times: dict[str, list[list[float]]] = {name: [[] for _ in work] for name in IMPLS}
        for r in range(args.repeats):
            order = IMPLS[r % len(IMPLS) :] + IMPLS[: r % len(IMPLS)]
            for k, (_, _, calls, _) in enumerate(work):
                for name in order:
                    start = time.perf_counter()
                    calls[name]()
                    times[name][k].append(time.perf_counter() - start)
        trees = sum(len(g) for g, *_ in work)
        flops = sum(forward_flops(f, dims) for _, f, *_ in work)
        folded_flops = sum(leaf_flops(f, dims) for _, f, *_ in work)
        entry: dict[str, Any] = {
            "batch": size,
            "trees": trees,
            "folded_flops_fraction": folded_flops / flops,
            "bitwise_equal": True,
            "impls": {},
        }
        for name in IMPLS:
            best = sum(min(t) for t in times[name][: len(work)])
            median = sum(statistics.median(t) for t in times[name])
            entry["impls"][name] = {
                "trees_per_s_min": trees / best,
                "trees_per_s_median": trees / median,
                "gflops_min": flops / best / 1e9,
                "ms_per_batch_min": 1e3 * best / len(work),
            }
        result["batches"].append(entry)
    result["fold"] = fold_report(folded, 5)
    result["module_fold_builds"] = cell_folded.runner.executor.fold_builds
    return result


def _infer(module: Any, batch: Any, word: Any) -> Any:
    with torch.no_grad():
        return module(batch, word=word)


def report(results: list[dict[str, Any]]) -> str:
    out = []
    for result in results:
        fold = result["fold"]
        out.append(
            f"H={result['hidden']} V={result['V']}: folded table {fold.get('table_mb', 0):.1f} MiB, "
            f"built in {fold.get('build_ms_median', float('nan')):.1f} ms (median of 5), used: {fold['used']}"
        )
        out.append(
            f"{'batch':>6} {'impl':<20} {'trees/s min':>12} {'median':>9} {'GFLOP/s':>8} "
            f"{'x torch (min)':>14} {'x torch (median)':>17}"
        )
        for entry in result["batches"]:
            torch_stats = entry["impls"]["torch_level_batched"]
            for name in IMPLS:
                stats = entry["impls"][name]
                out.append(
                    f"{entry['batch']:>6} {name:<20} {stats['trees_per_s_min']:>12.1f} "
                    f"{stats['trees_per_s_median']:>9.1f} {stats['gflops_min']:>8.2f} "
                    f"{stats['trees_per_s_min'] / torch_stats['trees_per_s_min']:>14.3f} "
                    f"{stats['trees_per_s_median'] / torch_stats['trees_per_s_median']:>17.3f}"
                )
            share = 100 * entry["folded_flops_fraction"]
            for folded_name, unfolded_name in PAIRS:
                unfolded, folded = entry["impls"][unfolded_name], entry["impls"][folded_name]
                by_min = folded["trees_per_s_min"] / unfolded["trees_per_s_min"]
                by_median = folded["trees_per_s_median"] / unfolded["trees_per_s_median"]
                out.append(
                    f"{entry['batch']:>6} {folded_name}/{unfolded_name}: {by_min:.3f} (min), {by_median:.3f} "
                    f"(median); folded {share:.1f}% of the forward's FLOPs; bitwise equal: {entry['bitwise_equal']}"
                )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[256])
    parser.add_argument("--split", default="dev", choices=["train", "dev", "test"])
    parser.add_argument("--batches", nargs="+", default=["1", "10"])
    parser.add_argument("--max-trees", type=int, default=200, help="trees timed per batch size (whole batches)")
    parser.add_argument("--repeats", type=int, default=15, help="interleaved rounds (min and median kept)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (the kernels' too)")
    parser.add_argument("--data-dir", type=Path, default=SST_DIR)
    parser.add_argument("--cell", type=Path, default=CELL)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = args.data_dir / f"{args.split}.txt"
    if not path.exists():
        print(f"SST split not found: {path} (set CORTEXC_SST_DIR or --data-dir)", file=sys.stderr)
        return 1
    lines = read_trees(path)
    vocab, _ = build_vocab(args.data_dir, lines)
    load = os.getloadavg()
    results = [bench(args, hidden, lines, vocab) for hidden in args.hidden]
    text = report(results)
    after = os.getloadavg()
    text += (
        f"\n{args.split}, {args.repeats} interleaved rounds, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs; "
        f"1-min load average {load[0]:.2f} before, {after[0]:.2f} after; torch {torch.__version__}"
    )
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"results": results, "loadavg": [load, after]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
