"""The exported C path against the Python API: Binary Tree-LSTM on SST dev, batches of 1 and 10 trees.

Both run the same kernels with the same params (`Cell(seed=0)`'s, from the exported `params.safetensors`):

- ``exported``: `BinaryTreeLSTM_check time` — a C driver that loads the model once and times repeated
  `BinaryTreeLSTM_forward` calls inside one process (validation, linearisation, the forward, allocation of
  the result; no file I/O inside the timed loop);
- ``python``: `BinaryTreeLSTM(device="cpu")(forest, word=ids)` timed in this process (validation,
  linearisation in NumPy, the ctypes call, the result dict), the forest built beforehand.

Each runs folded (the leaves' ``W_iou @ E[word]`` read from the table `passes.fold` builds: the exported
library builds it at load, the Python API at its first inference with ``CORTEXC_FOLD=eager``) and unfolded
(``CORTEXC_FOLD=0`` for the exported library, ``fold=False`` for Python): four variants.

Per batch size, `--batches-per-size` consecutive batches of SST dev are timed: `--rounds` alternating
rounds of `--repeats` calls of every variant, each round's mean per call kept; per batch the min and the
median over rounds (the min is robust to other load on the machine), then averaged over the batches; all
with the same OMP_NUM_THREADS (`--threads`, default 1). Printed per size: min and median per call of each
variant, exported unfolded/folded, python/exported (folded) and the Python overhead per call (folded).

Usage (from the repository root)::

    python benchmarks/bench_export.py [--repeats 200] [--threads 1] [--json results.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

CELL = REPO / "examples" / "binary_treelstm.cell"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sst", default=os.environ.get("CORTEXC_SST_DIR", str(REPO.parent / "shared/data/sst")))
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--batches-per-size", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 10])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per batch (min and median kept)")
    parser.add_argument("--json", help="also write the numbers here")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")

    import cortexc
    from cortexc import Forest
    from cortexc.export import export
    from cortexc.runtime import safetensors
    from cortexc.runtime.vocab import Vocab

    dev = Path(args.sst) / "dev.txt"
    if not dev.exists():
        print(f"SST dev not found at {dev} (set CORTEXC_SST_DIR)")
        return 1
    lines = [line for line in dev.read_text(encoding="utf-8").splitlines() if line.strip()]
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        directory = export(CELL, root / "dist")
        subprocess.run(["make", "-s", "-C", str(directory), "BinaryTreeLSTM_check"], check=True)
        module = cortexc.load(CELL, root / "py")
        models = {fold: module.BinaryTreeLSTM(device="cpu", fold=fold) for fold in (True, False)}
        for model in models.values():
            model.load_params(directory / "params.safetensors")
        vocab = Vocab.build([Forest.from_ptb(lines)])
        limit = models[True].signature.inputs[0].index_range
        print(
            f"BinaryTreeLSTM (H=150, X=300) on SST dev, OMP_NUM_THREADS={args.threads}, "
            f"{args.repeats} calls per round, "
            f"{args.rounds} rounds; ms per call as min/median over rounds, mean over {args.batches_per_size} batches"
        )
        variants = ("exported folded", "exported unfolded", "python folded", "python unfolded")
        print(
            f"{'batch':>6} "
            + " ".join(f"{v:>19}" for v in variants)
            + f" {'exp unf/fold':>13} {'py/exp':>7} {'overhead us':>12}"
        )
        report = {"threads": args.threads, "repeats": args.repeats, "rounds": args.rounds, "sizes": {}}
        for size in args.sizes:
            per_batch: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
            for batch in range(args.batches_per_size):
                chunk = list(itertools.islice(lines, batch * size, (batch + 1) * size))
                forest = Forest.from_ptb(chunk)
                ids = np.minimum(vocab.encode(forest), limit - 1).astype(np.int32)
                inputs = root / f"in{size}_{batch}.safetensors"
                safetensors.save(inputs, {"parents": forest.parents.astype(np.int32), "word": ids})
                command = [str(directory / "BinaryTreeLSTM_check"), "time", str(directory / "params.safetensors")]
                command += [str(inputs), str(args.repeats)]
                os.environ["CORTEXC_FOLD"] = "eager"  # the Python API's table built at its first inference
                for model in models.values():
                    model(forest, word=ids)  # warm-up (builds or loads the library, the table)
                rounds: dict[str, list[float]] = {v: [] for v in variants}
                for _ in range(args.rounds):  # alternating: the same load on every variant
                    for variant, fold in (("exported folded", "1"), ("exported unfolded", "0")):
                        env = {**os.environ, "CORTEXC_FOLD": fold}
                        timed = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
                        rounds[variant].append(float(timed.stdout.split()[-1]))
                    for variant, fold in (("python folded", True), ("python unfolded", False)):
                        model = models[fold]
                        started = time.perf_counter()
                        for _ in range(args.repeats):
                            model(forest, word=ids)
                        rounds[variant].append((time.perf_counter() - started) / args.repeats)
                for variant, times in rounds.items():
                    per_batch[variant].append((min(times), statistics.median(times)))
            stats = {v: tuple(statistics.mean(t[i] for t in per_batch[v]) for i in (0, 1)) for v in variants}
            ef, eu, pf = stats["exported folded"], stats["exported unfolded"], stats["python folded"]
            cells = " ".join(f"{a * 1e3:>9.3f}/{b * 1e3:<9.3f}" for a, b in stats.values())
            print(f"{size:>6} {cells} {eu[0] / ef[0]:>13.2f} {pf[0] / ef[0]:>7.2f} {(pf[0] - ef[0]) * 1e6:>12.1f}")
            report["sizes"][str(size)] = {v: {"min_s": a, "median_s": b} for v, (a, b) in stats.items()}
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
