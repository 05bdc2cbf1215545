"""The exported C path against the Python API: Binary Tree-LSTM on SST dev, batches of 1 and 10 trees.

Both run the same kernels with the same params (`Cell(seed=0)`'s, from the exported `params.safetensors`):

- ``exported``: `BinaryTreeLSTM_check time` — a C driver that loads the model once and times repeated
  `BinaryTreeLSTM_forward` calls inside one process (validation, linearisation, the forward, allocation of
  the result; no file I/O inside the timed loop);
- ``python``: `BinaryTreeLSTM(device="cpu")(forest, word=ids)` timed in this process (validation,
  linearisation in NumPy, the ctypes call, the result dict), the forest built beforehand.

Per batch size, `--batches-per-size` consecutive batches of SST dev are timed: `--rounds` alternating
rounds of `--repeats` calls of each, the best round's mean per call kept (robust to other load on the
machine), both with the same OMP_NUM_THREADS (`--threads`, default 1). Printed per size: the mean
time per call of each, python/exported, and the Python overhead per call (python - exported).

Usage (from the repository root)::

    python benchmarks/bench_export.py [--repeats 200] [--threads 1]
"""

from __future__ import annotations

import argparse
import itertools
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
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per batch (the best is kept)")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")

    import cortexc
    from cortexc import Forest
    from cortexc.codegen.export import export
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
        model = module.BinaryTreeLSTM(device="cpu")
        model.load_params(directory / "params.safetensors")
        vocab = Vocab.build([Forest.from_ptb(lines)])
        limit = model.signature.inputs[0].index_range
        print(f"BinaryTreeLSTM (H=150, X=300) on SST dev, OMP_NUM_THREADS={args.threads}, {args.repeats} calls each")
        print(f"{'batch':>6} {'exported ms':>12} {'python ms':>10} {'python/exported':>16} {'overhead us':>12}")
        for size in args.sizes:
            c_times, py_times = [], []
            for batch in range(args.batches_per_size):
                chunk = list(itertools.islice(lines, batch * size, (batch + 1) * size))
                forest = Forest.from_ptb(chunk)
                ids = np.minimum(vocab.encode(forest), limit - 1).astype(np.int32)
                inputs = root / f"in{size}_{batch}.safetensors"
                safetensors.save(inputs, {"parents": forest.parents.astype(np.int32), "word": ids})
                command = [str(directory / "BinaryTreeLSTM_check"), "time", str(directory / "params.safetensors")]
                command += [str(inputs), str(args.repeats)]
                model(forest, word=ids)  # warm-up (builds or loads the library)
                best_c, best_py = float("inf"), float("inf")
                for _ in range(args.rounds):  # alternating, the best round of each: robust to other load
                    timed = subprocess.run(command, capture_output=True, text=True, check=True)
                    best_c = min(best_c, float(timed.stdout.split()[-1]))
                    started = time.perf_counter()
                    for _ in range(args.repeats):
                        model(forest, word=ids)
                    best_py = min(best_py, (time.perf_counter() - started) / args.repeats)
                c_times.append(best_c)
                py_times.append(best_py)
            c, py = statistics.mean(c_times), statistics.mean(py_times)
            print(f"{size:>6} {c * 1e3:>12.3f} {py * 1e3:>10.3f} {py / c:>16.2f} {(py - c) * 1e6:>12.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
