"""This tree's generated kernels against a baseline checkout's, on the same forests, in one process.

Both packages are compiled from the same cells (the baseline by its own templates, from its own
directory) and run by this tree's runtime, taking turns call by call; the table gives the median of the
per-round ratios baseline / this (> 1: this tree is faster) and whether the results are the same bits.
With one thread the clock is the process's CPU time, so time taken by other jobs on a shared machine
does not count (their cache and memory traffic still does); with more, wall time.

Cases: the chain LSTM of bench_chain.py (X=32, H=64; T x B = 100x100, 1000x10, 1000x1) forward and
forward + backward, and the binary Tree-LSTM on SST dev batches (H=256, X=300, words at leaves).

    python benchmarks/bench_ab.py --baseline /tmp/cortexc-before --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="an earlier cortexc checkout")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--sst-batch", type=int, default=10)
    parser.add_argument("--sst-trees", type=int, default=200, help="trees of SST dev per timed round")
    parser.add_argument("--data-dir", type=Path, default=Path(os.environ.get("CORTEXC_SST_DIR", "")))
    return parser.parse_args()


ARGS = _parse()
os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)  # before any OpenMP library loads

import numpy as np  # noqa: E402

from cortexc import Forest  # noqa: E402
from cortexc.runtime.loader import import_package  # noqa: E402

CLOCK = time.process_time if ARGS.threads == 1 else time.perf_counter


def package(source: Path, cell: str, defines: dict[str, int], out: Path) -> Any:
    """`cell` compiled by the checkout at `source` (run from there: `python -c` puts the working
    directory first on sys.path)."""
    code = (
        "import cortexc; from pathlib import Path; from cortexc.options import CompileOptions; "
        "from cortexc.pipeline import write_package; "
        f"p = Path({str(REPO / 'examples' / cell)!r}); "
        f"print(write_package(p.read_text(), p.name, {str(out)!r}, CompileOptions.make(defines={defines!r}))); "
        "print(cortexc.__file__)"
    )
    env = dict(os.environ, PYTHONPATH=str(source))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=source)
    *_, path, used = done.stdout.strip().splitlines()
    if not Path(used).resolve().is_relative_to(source.resolve()):
        raise SystemExit(f"{cell} was compiled by {used}, not by {source}")
    return import_package(Path(path))


def turns(fns: dict[str, Callable[[], Any]]) -> dict[str, list[float]]:
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(ARGS.repeats):
        for name, fn in fns.items():
            start = CLOCK()
            fn()
            times[name].append(CLOCK() - start)
    return times


def report(label: str, times: dict[str, list[float]], same: bool) -> None:
    for what in ("fwd", "train"):
        this, base = times[f"this_{what}"], times[f"base_{what}"]
        ratio = statistics.median(b / t for b, t in zip(base, this))
        print(
            f"{label:<22} {what:<6} {1e3 * min(this):>9.3f} {1e3 * min(base):>9.3f} {ratio:>9.3f}"
            f"  {'yes' if same else 'no'}"
        )


def chains(work: Path) -> None:
    defines = {"X": 32, "H": 64}
    this = package(REPO, "lstm.cell", defines, work / "this_lstm").LSTM(device="cpu", seed=0)
    base = package(ARGS.baseline, "lstm.cell", defines, work / "base_lstm").LSTM(device="cpu", seed=0)
    rng = np.random.default_rng(0)
    for T, B in ((100, 100), (1000, 10), (1000, 1)):
        forest = Forest.concat([Forest.from_parents(np.append(np.arange(1, T), -1))] * B)
        x = rng.standard_normal((T * B, 32)).astype(np.float32)
        gh = rng.standard_normal((T * B, 64)).astype(np.float32)
        fns: dict[str, Callable[[], Any]] = {}
        for tag, model in (("this", this), ("base", base)):
            fns[f"{tag}_fwd"] = lambda m=model, f=forest, x=x: m(f, x=x)
            fns[f"{tag}_train"] = lambda m=model, f=forest, x=x, g=gh: m.backward(m(f, grad=True, x=x), {"h": g})
        got, want = (
            this.backward(this(forest, grad=True, x=x), {"h": gh}),
            base.backward(base(forest, grad=True, x=x), {"h": gh}),
        )
        same = bool(np.array_equal(this(forest, x=x)["h"], base(forest, x=x)["h"])) and all(
            np.array_equal(got[k], want[k]) for k in want
        )
        report(f"chain T={T} B={B}", turns(fns), same)


def sst(work: Path) -> None:
    if not (ARGS.data_dir / "dev.txt").exists():
        print(f"(no SST dev.txt under {ARGS.data_dir!s}: SST cases skipped)")
        return
    defines = {"V": 21701, "X": 300, "H": 256, "C": 5}
    this = package(REPO, "binary_treelstm.cell", defines, work / "this_sst").BinaryTreeLSTM(device="cpu", seed=0)
    base = package(ARGS.baseline, "binary_treelstm.cell", defines, work / "base_sst").BinaryTreeLSTM(
        device="cpu", seed=0
    )
    lines = (ARGS.data_dir / "dev.txt").read_text().splitlines()
    size = ARGS.sst_batch
    forests = [Forest.from_ptb(lines[k * size : (k + 1) * size]) for k in range(max(1, ARGS.sst_trees // size))]
    rng = np.random.default_rng(0)
    words = [rng.integers(0, defines["V"], f.num_nodes).astype(np.int32) for f in forests]

    def run(model: Any, train: bool) -> None:
        for forest, word in zip(forests, words):
            if train:
                out = model(forest, grad=True, word=word)
                model.backward(out, {"logits": np.ones_like(out["logits"])})
            else:
                model(forest, word=word)

    same = all(np.array_equal(this(f, word=w)["h"], base(f, word=w)["h"]) for f, w in zip(forests, words))
    fns = {
        "this_fwd": lambda: run(this, False),
        "base_fwd": lambda: run(base, False),
        "this_train": lambda: run(this, True),
        "base_train": lambda: run(base, True),
    }
    report(f"SST batch {size} (x{len(forests)})", turns(fns), same)


def main() -> None:
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="bench_ab_"))
    load = os.getloadavg()[0]
    print(f"this tree ({REPO}) vs baseline ({ARGS.baseline}); {ARGS.threads} thread(s), {ARGS.repeats} rounds")
    clock = "process CPU time" if ARGS.threads == 1 else "wall time"
    print(f"ms per call (best round, {clock}); base/this: median of per-round ratios (> 1: this is faster)")
    print(f"{'case':<22} {'what':<6} {'this':>9} {'base':>9} {'base/this':>9}  same bits")
    chains(work)
    sst(work)
    print(f"1-min load average {load:.2f} before, {os.getloadavg()[0]:.2f} after, on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
