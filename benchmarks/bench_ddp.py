"""Data-parallel training through `cortexc.torch` on this machine: 2 DDP ranks x 1 thread against 1 process
x 2 threads (and 1 x 1 as the base), the same trees per optimizer step.

Tai et al.'s SST setting (binary Tree-LSTM, H=150, X=300, V = every train word, Adagrad lr 0.05, loss on
every node, `CellModule`; its embedding gradient sparse or dense: see CONFIGS). A step takes
``2 * --batch`` trees: each of 2 ranks its half (DDP averages the gradients over
127.0.0.1), or one process all of them in one forest (the gradient of the mean loss over the same nodes up
to the weighting of the two halves). Batches are assembled before timing; every configuration runs
``--warmup`` untimed steps, then ``--steps`` timed ones, rank 0 timing between two barriers; the
configurations take turns over ``--rounds`` rounds and the median round is kept. The cortexc CPU code's
load cap is turned off (``CORTEXC_ADAPT_THREADS=0``) so that "2 threads" means 2 threads whatever else runs.

    python benchmarks/bench_ddp.py --steps 20 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SST_DIR = Path(os.environ.get("CORTEXC_SST_DIR", REPO.parent / "shared" / "data" / "sst"))
#: name, ranks, threads per rank, sparse embedding gradient (on 2 ranks a sparse one is DDP-ignored and
#: averaged by the module over its own process group: the looked-up rows gathered, not the whole table)
CONFIGS = (
    ("1 x 1 thread, sparse", 1, 1, True),
    ("1 x 1 thread, dense", 1, 1, False),
    ("1 x 2 threads, sparse", 1, 2, True),
    ("1 x 2 threads, dense", 1, 2, False),
    ("2 ranks x 1, dense", 2, 1, False),
    ("2 ranks x 1, sparse", 2, 1, True),
)

WORKER = """
import gc, json, os, pickle, sys, time
import torch, torch.distributed as dist
from cortexc.runtime.model import cell_class
from cortexc.torch import CellModule
rank, world, package, data, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
if world > 1:
    dist.init_process_group("gloo", rank=rank, world_size=world)
with open(data, "rb") as file:
    steps = pickle.load(file)[world]  # per step: one (forest, word, labels) per rank
cell = CellModule(cell_class(package, "BinaryTreeLSTM"), seed=0, sparse=os.environ["BENCH_SPARSE"] == "1")
model = torch.nn.parallel.DistributedDataParallel(cell) if world > 1 else cell
optimizer = torch.optim.Adagrad(cell.parameters(), lr=0.05)
warmup = int(os.environ["BENCH_WARMUP"])

def step(shard):
    forest, word, labels, _ = shard[rank]
    optimizer.zero_grad(set_to_none=True)
    logits = model(forest, word=torch.from_numpy(word))["logits"]
    torch.nn.functional.cross_entropy(logits, torch.from_numpy(labels)).backward()
    optimizer.step()

for shard in steps[:warmup]:
    step(shard)
if world > 1:
    dist.barrier()
start = time.perf_counter()
for shard in steps[warmup:]:
    step(shard)
if world > 1:
    dist.barrier()
seconds = time.perf_counter() - start
if rank == 0:
    trees = sum(s[3] for shard in steps[warmup:] for s in shard)
    with open(out, "w") as file:
        json.dump({"seconds": seconds, "trees": trees, "steps": len(steps) - warmup}, file)
if world > 1:
    del model, optimizer, cell  # the module holds its own group: freed in destroy, not at interpreter exit
    gc.collect()
    dist.barrier()  # every rank's collectives are done before any shuts its gloo pairs down
    dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prepare(args: argparse.Namespace, directory: Path) -> tuple[str, Path]:
    """The package (built once, here) and the batches of every configuration, pickled."""
    import numpy as np

    import cortexc
    from cortexc import Forest, Vocab

    lines = [line for line in (args.data_dir / "train.txt").read_text(encoding="utf-8").splitlines() if line.strip()]
    trees = [Forest.from_ptb(line) for line in lines]
    vocab = Vocab.build(trees)  # every train word: V as in bench_train.py
    package = cortexc.load(REPO / "examples" / "binary_treelstm.cell", V=len(vocab), X=args.embed, H=args.hidden, C=5)
    order = np.random.default_rng(args.seed).permutation(len(trees))
    per_step = 2 * args.batch

    def shard(indices) -> tuple:
        forest = Forest.concat([trees[int(i)] for i in indices])
        return forest, vocab.encode(forest).astype(np.int64), np.asarray(forest.labels, np.int64), len(indices)

    steps = [order[k * per_step : (k + 1) * per_step] for k in range(args.warmup + args.steps)]
    data = {
        1: [[shard(chosen)] for chosen in steps],  # one process: all of the step's trees in one forest
        2: [[shard(chosen[: args.batch]), shard(chosen[args.batch :])] for chosen in steps],  # a half per rank
    }
    path = directory / "steps.pickle"
    with open(path, "wb") as file:
        pickle.dump(data, file)
    return str(package.BinaryTreeLSTM._package), path


def run_config(world: int, threads: int, sparse: bool, package: str, data: Path, directory: Path, warmup: int) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": str(threads),
        "CORTEXC_ADAPT_THREADS": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "BENCH_WARMUP": str(warmup),
        "BENCH_SPARSE": "1" if sparse else "0",
    }
    out = directory / "result.json"
    out.unlink(missing_ok=True)
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(r), str(world), package, str(data), str(out)],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    for process in ranks:
        _, err = process.communicate(timeout=1800)
        if process.returncode != 0:
            raise RuntimeError(f"a rank failed:\n{err}")
    result = json.loads(out.read_text())
    result["trees_per_s"] = result["trees"] / result["seconds"]
    result["loadavg"] = os.getloadavg()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=150)
    parser.add_argument("--embed", type=int, default=300)
    parser.add_argument("--batch", type=int, default=25, help="trees per rank and step (a step: 2x this)")
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", type=Path, default=SST_DIR)
    parser.add_argument("--json", type=Path, default=Path("bench_ddp.json"))
    args = parser.parse_args(argv)
    if not (args.data_dir / "train.txt").exists():
        print(f"SST not found at {args.data_dir} (set CORTEXC_SST_DIR or --data-dir)", file=sys.stderr)
        return 1
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        package, data = prepare(args, directory)
        runs: dict[str, list[dict]] = {name: [] for name, *_ in CONFIGS}
        for r in range(args.rounds):  # taking turns, so that a change of load hits every configuration
            for name, world, threads, sparse in CONFIGS:
                runs[name].append(run_config(world, threads, sparse, package, data, directory, args.warmup))
                print(
                    f"  round {r + 1}/{args.rounds} [{name}] {runs[name][-1]['trees_per_s']:.1f} trees/s "
                    f"(load {os.getloadavg()[0]:.2f})",
                    file=sys.stderr,
                    flush=True,
                )
    median = {name: sorted(rs, key=lambda x: x["trees_per_s"])[(len(rs) - 1) // 2] for name, rs in runs.items()}
    base = median[CONFIGS[0][0]]["trees_per_s"]
    print(
        f"\nSST train, binary Tree-LSTM H={args.hidden} X={args.embed}, {2 * args.batch} trees per optimizer step, "
        f"{args.steps} timed steps, median of {args.rounds} round(s); CellModule + torch.optim.Adagrad"
    )
    print(f"{'configuration':<22} {'trees/s':>8} {'[min, max]':>14} {'vs first':>8}")
    for name, *_ in CONFIGS:
        rates = [r["trees_per_s"] for r in runs[name]]
        print(
            f"{name:<22} {median[name]['trees_per_s']:>8.1f} {f'[{min(rates):.0f}, {max(rates):.0f}]':>14} "
            f"{median[name]['trees_per_s'] / base:>8.2f}"
        )
    rate = {name: median[name]["trees_per_s"] for name in median}
    ddp, threads, best = rate["2 ranks x 1, dense"], rate["1 x 2 threads, dense"], rate["1 x 2 threads, sparse"]
    ddp_sparse = rate["2 ranks x 1, sparse"]
    print(
        f"2 ranks x 1 thread / 1 rank x 2 threads, both dense: {ddp / threads:.2f}; "
        f"both sparse: {ddp_sparse / best:.2f}"
    )
    print(f"2 ranks x 1 thread, sparse / dense: {ddp_sparse / ddp:.2f}")
    load_after = os.getloadavg()
    print(
        f"load average (1/5/15 min) {'/'.join(f'{x:.2f}' for x in load_before)} before, "
        f"{'/'.join(f'{x:.2f}' for x in load_after)} after; {os.cpu_count()} CPUs"
    )
    report = {
        "setup": vars(args) | {"data_dir": str(args.data_dir), "json": str(args.json)},
        "runs": runs,
        "ddp_over_threads_dense": ddp / threads,
        "ddp_over_threads_sparse": ddp_sparse / best,
        "ddp_sparse_over_dense": ddp_sparse / ddp,
        "loadavg_before": load_before,
        "loadavg_after": load_after,
    }
    args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
