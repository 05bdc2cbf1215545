"""The SST table over several seeds: `examples/sst_table.py` once per seed, then the mean and standard deviation
of each (model, task)'s accuracies.

    python examples/sst_seeds.py --out DIR --seeds 0 1 2 [--models rntn treelstm] [--tasks fine binary]
                                 [--epochs N] [--train-limit K]

Each seed's run is `sst_table.py --seed S` into `DIR/seed-S/` (its own results.json, params, vocabulary and
table, as that script writes them; `--train-limit` draws its sentences by that seed). Then `DIR/seeds.json`
holds one row per (model, task): the seeds, each seed's test root, test all and dev root accuracy, and their
means and sample standard deviations (n - 1; 0 for one seed); `DIR/seeds.md` is the same as a table beside the
papers' test root accuracy. The seeds vary the params' initialisation and the batch order (and the drawn
subset); the data and the model selection (the best dev epoch) are as in one run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MEASURES = ("test_root_acc", "test_all_acc", "dev_root_acc")


def _table_script() -> Any:
    """examples/sst_table.py as a module (it is a script, not a package)."""
    spec = importlib.util.spec_from_file_location("sst_table", HERE / "sst_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def summarise(runs: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (model, task), in the order of the first seed's results: each measure per seed, its mean and
    its sample standard deviation. Every seed must have the same (model, task) rows."""
    seeds = sorted(runs)
    keys = [(r["model"], r["task"]) for r in runs[seeds[0]]]
    rows = []
    for model, task in keys:
        found = {s: [r for r in runs[s] if (r["model"], r["task"]) == (model, task)] for s in seeds}
        missing = [s for s, matches in found.items() if len(matches) != 1]
        if missing:
            raise ValueError(f"{model} {task}: no single result for seed(s) {missing}")
        row: dict[str, Any] = {"model": model, "task": task, "seeds": seeds}
        for measure in MEASURES:
            values = [float(found[s][0][measure]) for s in seeds]
            row[measure] = values
            row[f"{measure}_mean"] = statistics.fmean(values)
            row[f"{measure}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
        rows.append(row)
    return rows


def write_markdown(
    path: Path, rows: list[dict[str, Any]], papers: dict[str, tuple[Any, Any]], tasks: list[str], epochs: int | None
) -> None:
    """`rows` (`summarise`) as a table beside the papers; `epochs` None: each model's own (`ModelSpec.epochs`)."""
    trained = f"{epochs} epoch(s) each" if epochs else "each model's own epochs (sst_table.py's ModelSpec.epochs)"
    lines = [
        "# SST over seeds: accuracy (%), mean ± standard deviation",
        "",
        f"Seeds {', '.join(str(s) for s in rows[0]['seeds'])}; {trained}; params of each run's best dev epoch.",
        "",
        "| model | task | test root | paper | test all | dev root | test root per seed |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        paper = papers[row["model"]][tasks.index(row["task"])]
        cells = [f"{row[f'{m}_mean']:.1f} ± {row[f'{m}_std']:.1f}" for m in MEASURES]
        per_seed = ", ".join(f"{v:.1f}" for v in row["test_root_acc"])
        lines.append(
            f"| {row['model']} | {row['task']} | {cells[0]} | {'-' if paper is None else paper} | {cells[1]} "
            f"| {cells[2]} | {per_seed} |"
        )
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    table = _table_script()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, metavar="DIR")
    parser.add_argument("--seeds", nargs="+", type=table._seed, required=True, metavar="S")
    parser.add_argument("--models", nargs="+", default=["rntn", "treelstm"], choices=list(table.MODELS))
    parser.add_argument("--tasks", nargs="+", default=list(table.TASKS), choices=list(table.TASKS))
    parser.add_argument("--epochs", type=table._positive, default=None, help="default: each model's own")
    parser.add_argument("--train-limit", type=table._positive, default=None, metavar="K")
    args = parser.parse_args(argv)
    seeds = list(dict.fromkeys(args.seeds))
    runs = {}
    for seed in seeds:
        given = ["--out", str(args.out / f"seed-{seed}"), "--seed", str(seed)]
        given += ["--epochs", str(args.epochs)] if args.epochs else []
        given += ["--models", *args.models, "--tasks", *args.tasks]
        if args.train_limit is not None:
            given += ["--train-limit", str(args.train_limit)]
        status = table.main(given)
        if status:
            return status
        runs[seed] = json.loads((args.out / f"seed-{seed}" / "results.json").read_text(encoding="utf-8"))
    rows = summarise(runs)
    (args.out / "seeds.json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    write_markdown(args.out / "seeds.md", rows, table.PAPER, list(table.TASKS), args.epochs)
    print(f"wrote {args.out}/seeds.json, seeds.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
