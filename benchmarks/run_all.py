"""The headline benchmarks in one run, and `benchmarks/results/README.md`'s table and plot from what they wrote.

    pip install -e ".[bench]"
    python benchmarks/run_all.py --quick   # a few minutes: SST inference and training, the chain LSTM
    python benchmarks/run_all.py --full    # the same at full size, plus the attentive Tree-LSTM and export

Each benchmark writes one current file per kind into `benchmarks/results/` (`<name>.txt`, what it printed;
`<name>.json`, its numbers; the inference run also `inference.png`, trees/s by batch size), replacing the
last run's: the history is git's (`git log -p benchmarks/results`). The README's table is then made again
from the JSON files: each ratio is cortexc's speed over a peer measured in the same run, on the host the
README names. The benchmarks need the test extras (torch, matplotlib) and the SST data
(`../shared/data/sst`, or `$CORTEXC_SST_DIR`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
#: the README's line for the SST table, a separate run (`examples/sst_table.py`), not made by this script
SST_TABLE_LINE = (
    "- `sst_table.{json,md,png}`, `sst_table/`: `examples/sst_table.py` — the SST paper's Table 1 models (and the "
    "Tree-LSTMs) trained with cortexc, test accuracy beside the papers', with the small params and the vocab to "
    "recompute those rows (a separate run, not made by `run_all.py`: see `sst_table.md` for its command and host)."
)


def _runs(quick: bool, threads: int) -> list[tuple[str, str, list[str]]]:
    """(name, script, arguments) of each benchmark of a quick or full run."""
    common = ["--threads", str(threads)]
    if quick:
        return [
            ("inference", "bench_treelstm.py", ["--quick", *common, "--png", str(RESULTS / "inference.png")]),
            ("training", "bench_train.py", ["--quick", *common]),
            ("chain", "bench_chain.py", [*common, "--repeats", "5", "--no-load", "--no-determinism"]),
        ]
    return [
        (
            "inference",
            "bench_treelstm.py",
            [*common, "--hidden", "150", "256", "--batches", "1", "10", "100", "all", "--loaded"]
            + ["--png", str(RESULTS / "inference.png")],
        ),
        ("training", "bench_train.py", [*common, "--accuracy-impls", "cortexc", "torch_level_batched"]),
        ("chain", "bench_chain.py", [*common, "--repeats", "9"]),
        ("attention", "bench_attention.py", ["--quick"]),
        ("export", "bench_export.py", ["--repeats", "30"]),
    ]


def run(name: str, script: str, arguments: list[str]) -> None:
    """One benchmark: its output into `<name>.txt` (and on the terminal), its numbers into `<name>.json`
    where it writes any."""
    command = [sys.executable, str(HERE / script), *arguments]
    if script != "bench_attention.py":  # the one that writes no JSON
        command += ["--json", str(RESULTS / f"{name}.json")]
    print(f"== {name}: {' '.join(command[1:])}", flush=True)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    sys.stdout.write(done.stdout)
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        raise SystemExit(f"{script} failed (exit status {done.returncode})")
    (RESULTS / f"{name}.txt").write_text(done.stdout, encoding="utf-8")


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def _host() -> str:
    """The CPU model and count, as the results were measured on."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs"


def _against_torch(ours: float, impls: dict[str, Any]) -> str:
    """cortexc's trees/s over each PyTorch peer's of the same run (those that ran)."""
    peers = (("torch_level_batched", "PyTorch level-batched"), ("torch_per_node", "per node"))
    return ", ".join(
        f"{ours / impls[p]['trees_per_s']:.2f}x {label}" for p, label in peers if impls.get(p, {}).get("trees_per_s")
    )


def headline_rows() -> list[tuple[str, str, str, str]]:
    """(what, setting, cortexc, ratios against the peers) for every result file present."""
    rows = []
    inference = _load("inference")
    if inference is not None:
        for result in inference["results"]:
            for batch in result["batches"]:
                impls = batch["impls"]
                ours = impls.get("compiled", {}).get("trees_per_s")
                if not ours:
                    continue
                rows.append(
                    (
                        f"SST inference, binary Tree-LSTM H={result['hidden']}",
                        f"{result['split']}, batch {batch['batch']}",
                        f"{ours:,.0f} trees/s",
                        _against_torch(ours, impls),
                    )
                )
    training = _load("training")
    if training is not None:
        throughput, setup = training["throughput"], training["setup"]
        ours = throughput["cortexc"]["trees_per_s"]
        rows.append(
            (
                f"SST training, binary Tree-LSTM H={setup['H']}",
                f"train, batch {setup['batch']}, forward + backward + Adagrad",
                f"{ours:,.0f} trees/s",
                _against_torch(ours, throughput),
            )
        )
    chain = _load("chain")
    if chain is not None:
        for row in chain["chain"]:
            for what, label in (("fwd", "inference"), ("train", "training")):
                ours, torch = row["quiet"][f"cortexc_{what}"], row["quiet"][f"torch_{what}"]
                rows.append(
                    (
                        f"Chain LSTM X={chain['X']} H={chain['H']}, {label}",
                        f"{row['B']} chain{'s' if row['B'] != 1 else ''} of {row['T']}",
                        f"{ours:.2f} ms",
                        f"{torch / ours:.2f}x torch.nn.LSTM",
                    )
                )
    return rows


def write_readme(mode: str, seconds: float, header: str = "") -> None:
    """The README: the headline table and plot, then where each number comes from; `header`: the line that
    names the host and run, kept from the README there (the table made again from the same files)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    load = os.getloadavg()
    lines = [
        "# Benchmark results",
        "",
        header
        or f"Measured {datetime.date.today().isoformat()} on {_host()} (commit {commit.stdout.strip() or '?'}, "
        f"`python benchmarks/run_all.py --{mode}`, {seconds / 60:.1f} min, 1-min load average {load[0]:.1f} at "
        "the end). Each ratio is cortexc's speed over a peer's measured in the same run, on this host, with the "
        "same weights and inputs (the benchmarks check the results agree before timing). Higher is better.",
        "",
        "| benchmark | setting | cortexc | against the peers |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {what} | {setting} | {ours} | {ratios} |" for what, setting, ours, ratios in headline_rows()]
    if (RESULTS / "inference.png").exists():
        lines += ["", "![trees/s by batch size](inference.png)"]
    lines += [
        "",
        "## Where the numbers come from",
        "",
        "- `inference.{txt,json,png}`: `benchmarks/bench_treelstm.py` — the binary Tree-LSTM on SST trees, "
        'cortexc compiled (`device="cpu"`) against the interpreter, PyTorch one call per node and PyTorch '
        "level by level (the TF Fold / DGL scheme, `benchmarks/peers.py`), trees/s by batch size.",
        "- `training.{txt,json}`: `benchmarks/bench_train.py` — forward + backward + Adagrad step on SST train "
        "batches of 25 trees against PyTorch autograd level by level and per node; dev accuracy after training.",
        "- `chain.{txt,json}`: `benchmarks/bench_chain.py` — `examples/lstm.cell` against `torch.nn.LSTM` with "
        "the same weights, milliseconds per call (median, the two taking turns).",
    ]
    for name, what in (
        ("attention", "`benchmarks/bench_attention.py --quick` — the attentive Tree-LSTM against PyTorch"),
        ("export", "`benchmarks/bench_export.py` — the exported C library against the Python API"),
    ):
        if (RESULTS / f"{name}.txt").exists():
            lines.append(f"- `{name}.txt`: {what} (made by `--full` only: see the file for its date and host).")
    if (RESULTS / "sst_table.md").exists():
        lines.append(SST_TABLE_LINE)
    lines += [
        "",
        "Run again with `python benchmarks/run_all.py --quick` (a few minutes) or `--full`; numbers on a shared "
        "or another machine differ. Earlier runs, with each session's host and notes, are in git's history of "
        "this folder (`git log -p benchmarks/results`).",
        "",
    ]
    (RESULTS / "README.md").write_text("\n".join(lines), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--quick", action="store_true", help="the headline table in a few minutes")
    mode.add_argument("--full", action="store_true", help="every benchmark at full size")
    parser.add_argument("--threads", type=int, default=2, help="threads for cortexc and torch (default 2)")
    parser.add_argument("--readme-only", action="store_true", help="only make the README from the files there")
    args = parser.parse_args(argv)
    RESULTS.mkdir(exist_ok=True)
    start = time.perf_counter()
    if not args.readme_only:
        for name, script, arguments in _runs(args.quick, args.threads):
            run(name, script, arguments)
    if args.readme_only:  # the table from the files there, under the header of the run that made them
        header = (
            (RESULTS / "README.md").read_text(encoding="utf-8").split("\n")[2]
            if (RESULTS / "README.md").exists()
            else ""
        )
        write_readme("quick" if args.quick else "full", 0.0, header)
    else:
        write_readme("quick" if args.quick else "full", time.perf_counter() - start)
    print((RESULTS / "README.md").read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
