"""Train the binary Tree-LSTM on SST through `cortexc.torch.CellModule` and `torch.optim`.

Tai et al. (2015)'s settings: H=150, Adagrad lr 0.05 (the embedding at lr 0.1, its own param group,
sparse gradients, under DDP too: the module averages them over the ranks itself), weight decay 1e-4 on
the other params, batches of 25 trees, loss on every node, dropout 0.5 on the hidden state before the
read-out (examples/sst_treelstm.cell: `W_s @ dropout(h, 0.5)`). `module.train()` switches that dropout
on for the training steps (each step's masks seeded from torch's default generator, so `--seed`
reproduces a run); dev and test root accuracy are measured in `module.eval()` after every epoch, and the
best `state_dict` (by dev) is saved.

    python examples/train_sst_torch.py --limit 300 --epochs 2 --hidden 32
    python examples/train_sst_torch.py --ddp 2          # 2 processes on gloo (or run it under torchrun)
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import cortexc
from cortexc import Forest, InputError, Vocab
from cortexc.runtime.model import CellModel
from cortexc.torch import CellModule, ForestBatch

HERE = Path(__file__).resolve().parent
SST = Path(os.environ.get("CORTEXC_SST_DIR", HERE.parent.parent / "shared" / "data" / "sst"))


def read_trees(path: Path, limit: int | None) -> list[Forest]:
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [Forest.from_ptb(line) for line in (lines[:limit] if limit else lines)]


def the_cell(package: object, path: Path) -> type[CellModel]:
    """The one cell class of a compiled `.cell` file (a file of several is refused)."""
    cells = [value for value in vars(package).values() if isinstance(value, type) and issubclass(value, CellModel)]
    cells = [cls for cls in cells if cls is not CellModel]
    if len(cells) != 1:
        raise InputError(f"{path}: expected one cell, found {len(cells)} ({', '.join(c.__name__ for c in cells)})")
    return cells[0]


def root_accuracy(cell: CellModule, trees: list[Forest], vocab: Vocab) -> float:
    hits = 0
    with torch.no_grad():
        for start in range(0, len(trees), 256):
            forest = Forest.concat(trees[start : start + 256])
            logits = cell(forest, word=torch.as_tensor(vocab.encode(forest)))["logits"]
            roots = torch.tensor(forest.roots)
            hits += int((logits[roots].argmax(1) == torch.tensor(forest.labels, dtype=torch.long)[roots]).sum())
    return hits / max(len(trees), 1)


def run(rank: int, world: int, args: argparse.Namespace) -> None:
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    train_rank(rank, world, args)
    if world > 1:
        gc.collect()  # the module's own group dies here, with its last reference, not at interpreter exit
        dist.barrier()  # every rank's collectives are done before any shuts its gloo pairs down
        dist.destroy_process_group()


def train_rank(rank: int, world: int, args: argparse.Namespace) -> None:
    """This rank's training; its model, optimizer and graphs (holding the process groups) die on return."""
    train, dev, test = (
        read_trees(SST / f"{s}.txt", args.limit if s == "train" else args.eval_limit) for s in ("train", "dev", "test")
    )
    vocab = Vocab.build(train, min_count=1)
    package = cortexc.load(args.cell, V=len(vocab), X=args.embed, H=args.hidden, C=5)
    torch.manual_seed(args.seed * world + rank)  # the dropout masks' seeds: reproducible, each rank its own
    cell = CellModule(the_cell(package, args.cell), seed=args.seed, sparse=True)
    model = torch.nn.parallel.DistributedDataParallel(cell) if world > 1 else cell
    embedding = [cell.E]
    others = [p for name, p in cell.named_parameters() if name != "E"]
    optimizer = torch.optim.Adagrad(
        [{"params": embedding, "lr": 0.1}, {"params": others, "weight_decay": 1e-4}], lr=args.lr
    )
    rng = np.random.default_rng(args.seed)
    best = -1.0
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is optional
        tqdm = None
    for epoch in range(1, args.epochs + 1):
        cell.train()  # dropout on
        order = rng.permutation(len(train))
        steps = range(0, len(order), args.batch * world)
        bar = tqdm(steps, desc=f"epoch {epoch}", disable=rank != 0) if tqdm else steps
        for start in bar:
            mine = order[start + rank * args.batch : start + (rank + 1) * args.batch]
            if not len(mine):
                mine = order[start : start + args.batch]  # a short last step: every rank takes a part
            forest = Forest.concat([train[i] for i in mine])
            out = model(ForestBatch.from_forest(forest), word=torch.as_tensor(vocab.encode(forest)))
            loss = torch.nn.functional.cross_entropy(out["logits"], torch.tensor(forest.labels, dtype=torch.long))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if rank == 0:
            cell.eval()  # dropout off
            dev_acc, test_acc = root_accuracy(cell, dev, vocab), root_accuracy(cell, test, vocab)
            print(
                f"epoch {epoch}: loss {loss.item():.4f} dev root acc {dev_acc:.4f} test root acc {test_acc:.4f}",
                flush=True,
            )
            if dev_acc > best:
                best = dev_acc
                torch.save(cell.state_dict(), args.save)
    if rank == 0:
        print(f"best dev root accuracy {best:.4f}; state_dict saved to {args.save}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cell", type=Path, default=HERE / "sst_treelstm.cell")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--limit", type=int, default=None, help="the first N train trees")
    parser.add_argument("--eval-limit", type=int, default=None, help="the first N dev and test trees")
    parser.add_argument("--hidden", type=int, default=150)
    parser.add_argument("--embed", type=int, default=300)
    parser.add_argument("--batch", type=int, default=25)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ddp", type=int, default=1, help="train on N processes (gloo on 127.0.0.1)")
    parser.add_argument("--save", type=Path, default=Path("sst_treelstm.pt"))
    args = parser.parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return 0
    if args.ddp > 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        # each rank compiles the same package; the cache installs it by an atomic rename, so they do not race
        torch.multiprocessing.spawn(run, args=(args.ddp, args), nprocs=args.ddp)
        return 0
    run(0, 1, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
