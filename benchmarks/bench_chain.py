"""Chain LSTM: cortexc's compiled `examples/lstm.cell` against torch.nn.LSTM with the same weights.

In one run, on B chains of T steps (one forest of B chains; torch gets the [T, B, X] batch), this
times the forward (inference) and the forward + backward of both, quiet and then loaded: the benchmark
starts one competing busy process (a Python spin loop), measures again, and stops it by its pid. It
reports ms per call, cortexc's speed-up over torch (torch ms / cortexc ms) and loaded / quiet for each.

Then the cost of determinism: the same packages' C built a second time with ``-DCX_ANY_ORDER``, the
usual scheme that determinism replaced (each thread adds the tiles it happens to get into an accumulator
of its own, the tiles dealt out as in a forward), run on the same forests by the same runtime, taking
turns; the table gives deterministic / any-order for the chains and for a Tree-LSTM and a DAG-RNN on large
random forests (``--no-determinism`` skips it). The other parts of the design that fix the order of sums
(deferred weight gradients: one GEMM after the recursion; a DAG child's gradient staged per edge) are in
both builds: each replaced a slower scheme, measured when it came in (benchmarks/results/README.md).

Usage (from the repository root)::

    python benchmarks/bench_chain.py --threads 2
    python benchmarks/bench_chain.py --threads 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--x", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--shapes", default="100x100,1000x10,1000x1", help="T x B, comma separated")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-load", action="store_true", help="skip the loaded run")
    parser.add_argument("--no-determinism", action="store_true", help="skip the cost of determinism")
    parser.add_argument("--json", type=Path)
    return parser.parse_args()


ARGS = _parse()
os.environ.setdefault("OMP_NUM_THREADS", str(ARGS.threads))  # before any OpenMP library loads

import numpy as np  # noqa: E402
import torch  # noqa: E402

import cortexc  # noqa: E402
from benchmarks.load import Busy  # noqa: E402
from cortexc import Forest  # noqa: E402

EXAMPLES = REPO / "examples"


def median_ms(fn: Callable[[], Any], repeats: int) -> float:
    return interleaved({"fn": fn}, repeats)["fn"]


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median ms per call of each function, timed in turn within every repeat, so that a machine whose
    load changes during the run (other jobs) weighs on all of them alike. Each timed call follows an untimed
    call of the same function: so every one is measured after itself, in its steady state, not after
    whichever call the order puts before it (measured, Sapphire Rapids: cortexc's 100x100 forward right after
    a torch.nn.LSTM training step took 3.7-3.8 ms, after its own call or torch's forward 3.2-3.3 ms; the
    order gave that to cortexc's forward and never to torch's)."""
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            fn()  # untimed: the timed call below follows its own kind
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(values) for name, values in times.items()}


def chains(length: int, count: int) -> Forest:
    one = Forest.from_parents(np.append(np.arange(1, length), -1))
    return Forest.concat([one] * count)


def chain_cases(module: Any, shapes: list[tuple[int, int]], rng: np.random.Generator) -> list[dict[str, Any]]:
    """Per shape: the cortexc model and the torch layer with the same weights, and their inputs."""
    X, H = ARGS.x, ARGS.hidden
    model = module.LSTM(device="cpu", seed=0)
    lstm = torch.nn.LSTM(X, H)
    with torch.no_grad():
        for name, attr in (("W_ih", "weight_ih_l0"), ("W_hh", "weight_hh_l0"), ("b_ih", "bias_ih_l0")):
            getattr(lstm, attr).copy_(torch.from_numpy(np.array(model.params[name])))
        lstm.bias_hh_l0.copy_(torch.from_numpy(np.array(model.params["b_hh"])))
    cases = []
    for T, B in shapes:
        forest = chains(T, B)  # chain b is nodes b*T .. b*T + T - 1, in time order
        x = rng.standard_normal((B * T, X)).astype(np.float32)
        tx = torch.from_numpy(x.reshape(B, T, X).transpose(1, 0, 2).copy())
        gh = rng.standard_normal((B * T, H)).astype(np.float32)
        tgh = torch.from_numpy(gh.reshape(B, T, H).transpose(1, 0, 2).copy())
        with torch.no_grad():
            expected = lstm(tx)[0].numpy().transpose(1, 0, 2).reshape(B * T, H)
        got = model(forest, x=x)["h"]
        error = float(np.abs(got - expected).max() / np.abs(expected).max())
        cases.append(
            {"T": T, "B": B, "forest": forest, "x": x, "tx": tx, "gh": gh, "tgh": tgh, "error": error, "model": model,
             "threads": shape_threads(model, forest)}
        )  # fmt: skip
    return [dict(case, lstm=lstm) for case in cases]


def shape_threads(model: Any, forest: Forest) -> tuple[int, int]:
    """The threads the library chooses for a forward and a backward of this forest by its shape alone (no
    load cap): what the quiet run uses when nothing else runs."""
    from cortexc.runtime.linearize import linearize

    before = os.environ.get("CORTEXC_ADAPT_THREADS")
    os.environ["CORTEXC_ADAPT_THREADS"] = "0"
    try:
        executor, lin = model._executor_for_device(), linearize(forest)
        return executor.call_threads(lin), executor.call_threads(lin, backward=True)
    finally:
        if before is None:
            os.environ.pop("CORTEXC_ADAPT_THREADS")
        else:
            os.environ["CORTEXC_ADAPT_THREADS"] = before


def chain_timings(case: dict[str, Any]) -> dict[str, float]:
    model, lstm, forest, x, tx, gh, tgh = (case[k] for k in ("model", "lstm", "forest", "x", "tx", "gh", "tgh"))

    def cortexc_fwd() -> None:
        model(forest, x=x)

    def cortexc_train() -> None:
        model.backward(model(forest, grad=True, x=x), {"h": gh})

    def torch_fwd() -> None:
        with torch.no_grad():
            lstm(tx)

    def torch_train() -> None:
        lstm.zero_grad()
        lstm(tx)[0].backward(tgh)

    fns = {"cortexc_fwd": cortexc_fwd, "torch_fwd": torch_fwd, "cortexc_train": cortexc_train}
    return interleaved({**fns, "torch_train": torch_train}, ARGS.repeats)


def any_order(model: Any) -> Any:
    """A second model of `model`'s class and params, run by its C built with ``-DCX_ANY_ORDER``."""
    from cortexc.runtime.build import C_FLAGS, build_shared
    from cortexc.targets.c.executor import CpuExecutor

    cls = type(model)
    flags = (*C_FLAGS, "-DCX_ANY_ORDER")
    library = build_shared(cls._kernel_sources["c"], f"{cls.signature.name}_any_order", flags=flags)
    other = cls(device="cpu", seed=0)
    other.load_params(model.params)
    executor = CpuExecutor(cls._spec, library)
    executor.set_params(other._params)
    other._executor = executor
    return other


def driver_cases(rng: np.random.Generator) -> list[tuple[str, str, dict[str, int], Forest]]:
    """Forests of large levels (many tiles per launch, so the two builds add them in different orders)."""
    return [
        ("binary_treelstm", "binary_treelstm.cell", {"V": 1000, "X": 300, "H": 150, "C": 5},
         Forest.random(500, rng=rng, binary=True, max_nodes=60)),
        ("dagrnn", "dagrnn.cell", {"X": 64, "H": 128}, Forest.random_dag(20000, rng=rng)),
    ]  # fmt: skip


def determinism_timings(model: Any, forest: Forest, rng: np.random.Generator) -> dict[str, float]:
    """Forward and forward + backward of one model, deterministic and any-order, interleaved; and the
    largest difference of their gradients relative to the largest gradient (the orders differ, the sums
    should not by more than rounding)."""
    other = any_order(model)
    inputs = {}
    for decl in model.signature.inputs:
        if decl.is_index:
            inputs[decl.name] = rng.integers(0, decl.index_range, forest.num_nodes).astype(np.int32)
        else:
            inputs[decl.name] = rng.standard_normal((forest.num_nodes, *decl.shape)).astype(np.float32)
    upstream = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in model(forest, **inputs).items()}
    grads = [m.backward(m(forest, grad=True, **inputs), upstream) for m in (model, other)]
    scale = max(float(np.abs(np.asarray(g)).max()) for g in grads[0].values())
    diff = max(float(np.abs(np.asarray(grads[0][k]) - np.asarray(grads[1][k])).max()) for k in grads[0])
    fns: dict[str, Callable[[], Any]] = {}
    for tag, m in (("det", model), ("any", other)):
        fns[f"{tag}_fwd"] = lambda m=m: m(forest, **inputs)
        fns[f"{tag}_train"] = lambda m=m: m.backward(m(forest, grad=True, **inputs), upstream)
    return {**interleaved(fns, ARGS.repeats), "grad_rel_diff": diff / scale}


def main() -> None:
    torch.set_num_threads(ARGS.threads)
    rng = np.random.default_rng(0)
    shapes = [tuple(int(v) for v in s.split("x")) for s in ARGS.shapes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench_chain_"))
    module = cortexc.load(EXAMPLES / "lstm.cell", out_dir=work / "ours", X=ARGS.x, H=ARGS.hidden)
    cases = chain_cases(module, shapes, rng)  # type: ignore[arg-type]
    results: dict[str, Any] = {"threads": ARGS.threads, "X": ARGS.x, "H": ARGS.hidden, "chain": []}
    quiet = [chain_timings(case) for case in cases]
    loaded: list[dict[str, float] | None] = [None] * len(cases)
    if not ARGS.no_load:
        with Busy():
            loaded = [chain_timings(case) for case in cases]
    load = os.getloadavg()[0]
    print(f"chain LSTM X={ARGS.x} H={ARGS.hidden}, {ARGS.threads} threads (cortexc and torch); ms per call")
    print(
        f"(median of {ARGS.repeats}, implementations interleaved, each call timed after an untimed one of its own; "
        f"1-min load average {load:.2f} on {os.cpu_count()} CPUs)"
    )
    header = f"{'T':>5} {'B':>4} {'what':<6} {'cortexc':>9} {'torch':>9} {'speed-up':>8}"
    header += f" | {'loaded cx':>9} {'loaded th':>9} {'speed-up':>8} {'cx l/q':>7} {'th l/q':>7}"
    print(header)
    print("-" * len(header))
    for case, q, ld in zip(cases, quiet, loaded):
        row: dict[str, Any] = {"T": case["T"], "B": case["B"], "max_rel_err": case["error"], "quiet": q, "loaded": ld}
        row["threads_fwd_bwd"] = list(case["threads"])
        results["chain"].append(row)
        for what in ("fwd", "train"):
            cx, th = q[f"cortexc_{what}"], q[f"torch_{what}"]
            line = f"{case['T']:>5} {case['B']:>4} {what:<6} {cx:>9.3f} {th:>9.3f} {th / cx:>7.2f}x"
            if ld is not None:
                lcx, lth = ld[f"cortexc_{what}"], ld[f"torch_{what}"]
                line += f" | {lcx:>9.3f} {lth:>9.3f} {lth / lcx:>7.2f}x {lcx / cx:>6.2f}x {lth / th:>6.2f}x"
            print(line)
    print("max relative error of h vs torch: " + ", ".join(f"{c['error']:.1e}" for c in cases))
    print(
        "cortexc threads by shape (fwd/bwd; one while another process is runnable): "
        + ", ".join(f"{c['T']}x{c['B']} {c['threads'][0]}/{c['threads'][1]}" for c in cases)
    )

    if not ARGS.no_determinism:
        print("\nthe cost of determinism: this build / the same C built with -DCX_ANY_ORDER (see the docstring),")
        print(f"same runtime and forests, taking turns; ms per call, median of {ARGS.repeats}")
        print(f"{'cell':<16} {'nodes':>7} {'what':<6} {'determ.':>9} {'any order':>9} {'det/any':>8} {'grad diff':>9}")
        results["determinism"] = []
        runs = [(f"lstm {T}x{B}", cases[i]["model"], cases[i]["forest"]) for i, (T, B) in enumerate(shapes)]
        for name, cell, defines, forest in driver_cases(rng):
            module = cortexc.load(EXAMPLES / cell, out_dir=work / name, **defines)
            runs.append((name, getattr(module, module.__all__[0])(device="cpu", seed=0), forest))
        for name, model, forest in runs:
            t = determinism_timings(model, forest, rng)
            results["determinism"].append({"cell": name, "nodes": forest.num_nodes, **t})
            for what in ("fwd", "train"):
                det, anyo = t[f"det_{what}"], t[f"any_{what}"]
                diff = f"{t['grad_rel_diff']:>9.1e}" if what == "train" else ""
                print(f"{name:<16} {forest.num_nodes:>7} {what:<6} {det:>9.3f} {anyo:>9.3f} {det / anyo:>7.3f}x {diff}")
    if ARGS.json:
        ARGS.json.write_text(json.dumps(results, indent=1, default=float))


if __name__ == "__main__":
    main()
