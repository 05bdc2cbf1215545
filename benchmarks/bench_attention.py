"""Attentive Tree-LSTM on SST: the compiled cell against PyTorch level by level, in one run.

The cell is ``examples/attn_treelstm.cell`` (X = 300, H = 150 unless ``--hidden``): attention over a
node's children with ``child_softmax``, fused into the level kernel. The peer is
`peers.TorchLevelBatchedAttn` (the DGL way: one batched step per level, the softmax across children as
segmented torch ops). Both get the same params, the same trees and the same random node features ``x``
(SST gives words; the cell takes a feature vector per node, as word embeddings would be). The forward
(inference) is timed: per batch of consecutive trees the median of ``--repeats`` calls after a warm-up;
trees/s over the batches that cover ``--max-trees`` trees (or one batch of all). Linearisation
(``prepare``) is timed apart for the peer and is not in its compute time; the compiled call includes
its own. The two results are checked against each other first.

Usage (from the repository root)::

    python benchmarks/bench_attention.py --quick
    python benchmarks/bench_attention.py --batches 10 all --threads 2 --repeats 5
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import cortexc  # noqa: E402
from benchmarks.bench_treelstm import median_time, rel_err  # noqa: E402
from benchmarks.peers import TorchLevelBatchedAttn  # noqa: E402
from cortexc.runtime.forest import Forest  # noqa: E402

CELL = REPO / "examples" / "attn_treelstm.cell"
SST_DIR = Path(os.environ.get("CORTEXC_SST_DIR", REPO.parent / "shared" / "data" / "sst"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--split", default="dev")
    parser.add_argument("--batches", nargs="+", default=["10", "all"], help="trees per batch, or 'all'")
    parser.add_argument("--max-trees", type=int, default=200, help="trees timed per batch size (at least)")
    parser.add_argument("--hidden", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (the kernels' too)")
    parser.add_argument("--quick", action="store_true", help="3 repeats, 100 trees per batch size")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.max_trees = 3, 100
    path = SST_DIR / f"{args.split}.txt"
    if not path.exists():
        print(f"SST data not found at {path} (set CORTEXC_SST_DIR)")
        return 1
    torch.set_num_threads(args.threads)  # the compiled kernels share torch's libgomp
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    module = cortexc.load(CELL, H=args.hidden)
    model = module.AttnTreeLSTM(device="cpu", seed=0)
    dims = dict(model.cell.dims)
    peer = TorchLevelBatchedAttn(model.params)
    rng = np.random.default_rng(0)

    print(f"attentive Tree-LSTM (X={dims['X']}, H={dims['H']}) on SST {args.split} ({len(lines)} trees)")
    print(f"threads {args.threads}, repeats {args.repeats}, torch {torch.__version__}, {platform.machine()}")
    print(f"load average {os.getloadavg()[0]:.1f}")
    check = Forest.from_ptb(lines[:20])
    xc = rng.standard_normal((check.num_nodes, dims["X"])).astype(np.float32)
    ours, theirs = model(check, x=xc), peer(check, xc)
    errors = {k: rel_err(ours[k], theirs[k]) for k in ("h", "c")}
    print("check on 20 trees, compiled vs torch level-batched: " + ", ".join(f"{k} {e:.1e}" for k, e in errors.items()))
    if max(errors.values()) > 1e-4:
        print("MISMATCH")
        return 1

    print(f"{'batch':>6} {'trees':>6} {'compiled tr/s':>14} {'torch lvl tr/s':>15} {'ratio':>7} {'prepare ms':>11}")
    for spec in args.batches:
        size = len(lines) if spec == "all" else int(spec)
        count = math.ceil(min(len(lines), max(size, args.max_trees)) / size)
        compiled_s = torch_s = prepare_s = 0.0
        trees = 0
        for b in range(count):
            forest = Forest.from_ptb(lines[b * size : (b + 1) * size])
            x = rng.standard_normal((forest.num_nodes, dims["X"])).astype(np.float32)
            plan = peer.prepare(forest)
            model(forest, x=x)  # warm-up
            peer.run(plan, x)
            compiled_s += median_time(lambda f=forest, x=x: model(f, x=x), args.repeats)
            torch_s += median_time(lambda p=plan, x=x: peer.run(p, x), args.repeats)
            prepare_s += median_time(lambda f=forest: peer.prepare(f), args.repeats)
            trees += forest.num_trees
        ours_rate, theirs_rate = trees / compiled_s, trees / torch_s
        print(
            f"{spec:>6} {trees:>6} {ours_rate:>14.0f} {theirs_rate:>15.0f} {ours_rate / theirs_rate:>6.2f}x"
            f" {1e3 * prepare_s:>11.2f}"
        )
    print("ratio = compiled trees/s over torch level-batched trees/s (forward, same run)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
