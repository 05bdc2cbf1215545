"""The Python-side cost of one call into the compiled CPU code: this tree's runtime against a baseline's.

Each checkout runs in its own worker process (its own `cortexc` on ``PYTHONPATH``); the driver asks them in
turn, round after round, to time a few calls of each case, so that a machine whose load changes during the
run weighs on both alike. A worker wraps its executor's library so that the ctypes call into
``cx_forward``/``cx_backward`` is timed on its own: a call's *overhead* is its whole time minus that
(validation, linearization, pointer tables, result arrays, the thread choice), as it runs; each case is
also run with those calls skipped, which times the Python side alone.

Cases: examples/lstm.cell on chains (T x B: 1000x1, 1000x10, 100x100) and examples/binary_treelstm.cell
(V=18282) on 1, 10 and 25 trees of SST dev, each as an inference ``model(forest, x=...)`` ("fwd"), as a
forward + backward ``model.backward(model(forest, grad=True, ...), upstream)`` ("train") and as a whole
training step with `cortexc.train.Adagrad` ("step": forward, the loss's gradient — softmax cross-entropy
on SST, a fixed upstream on chains —, backward, ``model.load_params(opt.step(model.params, grads))``); SST
also as that step with the embedding's gradient sparse ("sparse": ``backward(..., sparse=True)``, the
optimizer updating the looked-up rows). Single-threaded (``OMP_NUM_THREADS=1``).

Usage (from the repository root)::

    python benchmarks/bench_callcost.py --baseline /tmp/base40cc --rounds 15
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
CASES = ("lstm 1000x1", "lstm 1000x10", "lstm 100x100", "sst 1", "sst 10", "sst 25")
MODES = ("fwd", "train", "step", "sparse")
#: fwd and train also run with the compiled calls skipped ("-py"): the Python side of a call alone
RUNS = (*MODES, "fwd-py", "train-py")


def case_runs(name: str) -> tuple[str, ...]:
    """The runs of a case: "sparse" only where there is an embedding table (SST)."""
    return tuple(run for run in RUNS if run != "sparse" or name.startswith("sst"))


# --------------------------------------------------------------------------- worker (one checkout's runtime)


class _TimedLibrary:
    """The executor's library with its `cx_forward`/`cx_backward` calls timed (the rest passed through);
    with `skip[0]` set they return at once (the Python side alone)."""

    def __init__(self, lib: Any, clock: list[float], skip: list[bool]):
        self._lib, self._clock, self._skip = lib, clock, skip

    def __getattr__(self, name: str) -> Any:
        entry = getattr(self._lib, name)
        if name not in ("cx_forward", "cx_backward"):
            return entry
        clock, skip = self._clock, self._skip

        def timed(*args: Any) -> Any:
            if skip[0]:
                return 0
            start = time.perf_counter()
            try:
                return entry(*args)
            finally:
                clock[0] += time.perf_counter() - start

        return timed


def _worker(data_dir: Path, out_dir: Path) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import numpy as np

    import cortexc
    from cortexc import Forest
    from cortexc.train import Adagrad, softmax_cross_entropy

    rng = np.random.default_rng(0)
    lstm = cortexc.load(EXAMPLES / "lstm.cell", out_dir / "lstm")
    sst = cortexc.load(EXAMPLES / "binary_treelstm.cell", out_dir / "sst", V=18282)
    clock, skip = [0.0], [False]
    cases: dict[str, Any] = {}
    lines = (data_dir / "dev.txt").read_text(encoding="utf-8").splitlines()
    for T, B in ((1000, 1), (1000, 10), (100, 100)):
        one = Forest.from_parents(np.append(np.arange(1, T), -1))
        forest = Forest.concat([one] * B)
        x = rng.standard_normal((T * B, 32)).astype(np.float32)
        gh = rng.standard_normal((T * B, 64)).astype(np.float32)
        cases[f"lstm {T}x{B}"] = (lstm.LSTM(seed=0), forest, {"x": x}, {"h": gh})
    for trees in (1, 10, 25):
        forest = Forest.from_ptb(lines[:trees])
        words = rng.integers(0, 18282, forest.num_nodes).astype(np.int64)
        up = rng.standard_normal((forest.num_nodes, 5)).astype(np.float32)
        cases[f"sst {trees}"] = (sst.BinaryTreeLSTM(seed=0), forest, {"word": words}, {"logits": up})
    for model, *_ in cases.values():
        executor = model._executor_for_device()
        executor.lib = _TimedLibrary(executor.lib, clock, skip)

    optimizers = {(name, sparse): Adagrad(lr=0.01) for name in cases for sparse in (False, True)}

    def step(name: str, sparse: bool) -> None:
        model, forest, inputs, upstream = cases[name]
        out = model(forest, grad=True, **inputs)
        if "logits" in upstream:
            _, d_logits = softmax_cross_entropy(out["logits"], forest.labels)
            upstream = {"logits": d_logits}
        grads = model.backward(out, upstream, sparse=sparse)
        del out
        grads = {key: grads[key] for key in model.params}  # the params' (not the inputs')
        model.load_params(optimizers[(name, sparse)].step(model.params, grads))

    def run(name: str, mode: str, calls: int) -> tuple[float, float]:
        model, forest, inputs, upstream = cases[name]
        skip[0] = mode.endswith("-py")
        mode = mode.removesuffix("-py")
        clock[0] = 0.0
        start = time.perf_counter()
        for _ in range(calls):
            if mode == "fwd":
                model(forest, **inputs)
            elif mode == "train":
                model.backward(model(forest, grad=True, **inputs), upstream)
            else:
                step(name, mode == "sparse")
        return (time.perf_counter() - start) / calls, clock[0] / calls

    for name in cases:  # warm-up: libraries loaded, scratch mapped
        for mode in case_runs(name):
            run(name, mode, 3)
    print(json.dumps({"ready": cortexc.__file__}), flush=True)
    for line in sys.stdin:
        name, mode, calls = json.loads(line)
        print(json.dumps(run(name, mode, calls)), flush=True)


# --------------------------------------------------------------------------- driver


def _start(checkout: Path, args: argparse.Namespace, tag: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(checkout), OMP_NUM_THREADS="1")
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--data-dir", str(args.data_dir)]
    command += ["--out-dir", str(args.out_dir / tag)]
    # run from the checkout: its own cortexc comes first on sys.path
    return subprocess.Popen(command, env=env, cwd=checkout, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _ask(worker: subprocess.Popen[str], request: Any) -> Any:
    assert worker.stdin is not None and worker.stdout is not None
    worker.stdin.write(json.dumps(request) + "\n")
    worker.stdin.flush()
    return json.loads(worker.stdout.readline())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="an earlier cortexc checkout (required)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--data-dir", type=Path, default=Path(os.environ.get("CORTEXC_SST_DIR", "data/sst")))
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp/bench_callcost"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.data_dir, args.out_dir)
        return
    if args.baseline is None:
        parser.error("--baseline is required")
    workers = {"before": _start(args.baseline, args, "before"), "after": _start(REPO, args, "after")}
    for tag, worker in workers.items():
        assert worker.stdout is not None
        used = json.loads(worker.stdout.readline())["ready"]
        print(f"{tag}: {used}")
    calls = {"lstm 1000x1": 20, "lstm 1000x10": 5, "lstm 100x100": 5, "sst 1": 100, "sst 10": 30, "sst 25": 10}
    samples: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
    for round_ in range(args.rounds):
        order = list(workers) if round_ % 2 == 0 else list(workers)[::-1]
        for name in CASES:
            for mode in case_runs(name):
                for tag in order:
                    result = _ask(workers[tag], [name, mode, calls[name]])
                    samples.setdefault((name, mode, tag), []).append(tuple(result))
    for worker in workers.values():
        assert worker.stdin is not None
        worker.stdin.close()
        worker.wait()
    rows = []
    header = (
        f"{'case':<14}{'mode':<7}{'before ms':>17}{'after ms':>17}{'b/a':>7}"
        f"{'before py us':>15}{'after py us':>15}{'before over':>14}{'after over':>13}"
    )
    print(
        f"\nOMP_NUM_THREADS=1, {args.rounds} alternating rounds; min/median of each. ms: a whole call; py: the "
        "same with the compiled calls skipped (the Python side alone); over: a whole call minus its compiled "
        "calls (the Python side as it runs, with the allocator's page faults)"
    )
    print(header)

    def stat(values: list[float], scale: float) -> str:
        if any(value != value for value in values):  # no "-py" run of this mode
            return "-"
        return f"{min(values) * scale:.0f}/{statistics.median(values) * scale:.0f}"

    for name in CASES:
        for mode in (m for m in MODES if m in case_runs(name)):
            row: dict[str, Any] = {"case": name, "mode": mode}
            for tag in workers:
                whole = samples[(name, mode, tag)]
                python = samples.get((name, f"{mode}-py", tag), [(float("nan"), 0.0)])
                row[tag] = {
                    "total_s": [t for t, _ in whole],
                    "over_s": [t - c for t, c in whole],
                    "python_s": [t for t, _ in python],
                }
            rows.append(row)
            b, a = row["before"], row["after"]
            ratio = statistics.median(b["total_s"]) / statistics.median(a["total_s"])
            print(
                f"{name:<14}{mode:<7}"
                f"{min(b['total_s']) * 1e3:>8.3f}/{statistics.median(b['total_s']) * 1e3:<8.3f}"
                f"{min(a['total_s']) * 1e3:>8.3f}/{statistics.median(a['total_s']) * 1e3:<8.3f}{ratio:>6.2f}x"
                f"{stat(b['python_s'], 1e6):>15}{stat(a['python_s'], 1e6):>15}"
                f"{stat(b['over_s'], 1e6):>14}{stat(a['over_s'], 1e6):>13}"
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
