"""Train the bidirectional Tree-LSTM (`examples/bitreelstm.cell`) on SST through `cortexc.torch`.

Two `CellModule`s in one `nn.Module`: the bottom-up cell's `h` is the `down` cell's input `hu`, so autograd
carries the classifier's gradient through the top-down recursion into the bottom-up one. Both cells run on
the same forest (each module makes its own batch from it: the forest, and the reversed forest for the `down`
cell). Loss at every node (all phrases, as Tai et al. 2015), Adagrad (lr 0.05, the embeddings at 0.1, weight
decay 1e-4 on the rest), batches of 25 trees; dev and test root accuracy after every epoch, the best
`state_dict` by dev saved.

    python examples/train_bitreelstm_torch.py --limit 500 --epochs 2 --hidden 32 --embed 32
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

import cortexc
from cortexc import Forest, Vocab
from cortexc.torch import CellModule

HERE = Path(__file__).resolve().parent
SST = Path(os.environ.get("CORTEXC_SST_DIR", HERE.parent.parent / "shared" / "data" / "sst"))


class BiTreeLSTM(torch.nn.Module):
    """The bottom-up cell, then the `down` cell fed its `h`: per-node logits from both directions."""

    def __init__(self, package: object, seed: int):
        super().__init__()
        self.up = CellModule(package.BiTreeLSTMUp, seed=seed)  # type: ignore[attr-defined]
        self.down = CellModule(package.BiTreeLSTMDown, seed=seed + 1)  # type: ignore[attr-defined]

    def forward(self, forest: Forest, word: torch.Tensor) -> torch.Tensor:
        return self.down(forest, word=word, hu=self.up(forest, word=word)["h"])["logits"]


def read_trees(path: Path, limit: int | None, rng: np.random.Generator | None = None) -> list[Forest]:
    """The trees of a split: with `limit`, the first ones, or with `rng` that many drawn at random (SST's
    train.txt is sorted by sentiment)."""
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if limit and rng is not None:
        lines = [lines[i] for i in sorted(rng.choice(len(lines), size=min(limit, len(lines)), replace=False))]
    return [Forest.from_ptb(line) for line in (lines[:limit] if limit else lines)]


def root_accuracy(model: BiTreeLSTM, trees: list[Forest], vocab: Vocab) -> float:
    hits = 0
    with torch.no_grad():
        for start in range(0, len(trees), 256):
            forest = Forest.concat(trees[start : start + 256])
            logits = model(forest, torch.as_tensor(vocab.encode(forest)))
            roots = torch.tensor(forest.roots)
            hits += int((logits[roots].argmax(1) == torch.tensor(forest.labels, dtype=torch.long)[roots]).sum())
    return hits / max(len(trees), 1)


def train(args: argparse.Namespace) -> tuple[float, list[float]]:
    """Train; returns the best dev root accuracy and each epoch's mean training loss."""
    rng = np.random.default_rng(args.seed)
    train_trees = read_trees(SST / "train.txt", args.limit, rng)
    dev, test = (read_trees(SST / f"{s}.txt", args.eval_limit) for s in ("dev", "test"))
    vocab = Vocab.build(train_trees, min_count=1)
    package = cortexc.load(args.cell, V=len(vocab), X=args.embed, H=args.hidden, C=5)
    torch.manual_seed(args.seed)
    model = BiTreeLSTM(package, args.seed)
    embeddings = [model.up.E, model.down.E]
    others = [p for name, p in model.named_parameters() if not name.endswith(".E")]
    optimizer = torch.optim.Adagrad(
        [{"params": embeddings, "lr": 0.1}, {"params": others, "weight_decay": 1e-4}], lr=args.lr
    )
    best, losses = -1.0, []
    for epoch in range(1, args.epochs + 1):
        start_time, total, count = time.perf_counter(), 0.0, 0
        order = rng.permutation(len(train_trees))
        for start in range(0, len(order), args.batch):
            forest = Forest.concat([train_trees[i] for i in order[start : start + args.batch]])
            logits = model(forest, torch.as_tensor(vocab.encode(forest)))
            loss = torch.nn.functional.cross_entropy(logits, torch.tensor(forest.labels, dtype=torch.long))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total, count = total + loss.item(), count + 1
        seconds = time.perf_counter() - start_time
        losses.append(total / max(count, 1))
        dev_acc, test_acc = root_accuracy(model, dev, vocab), root_accuracy(model, test, vocab)
        print(
            f"epoch {epoch}: mean loss {losses[-1]:.4f}, {seconds:.1f} s; "
            f"dev root acc {dev_acc:.4f} test root acc {test_acc:.4f}",
            flush=True,
        )
        if dev_acc > best:
            best = dev_acc
            torch.save(model.state_dict(), args.save)
    print(f"best dev root accuracy {best:.4f}; state_dict saved to {args.save}", flush=True)
    return best, losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cell", type=Path, default=HERE / "bitreelstm.cell")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--limit", type=int, default=None, help="N train trees drawn at random (by --seed)")
    parser.add_argument("--eval-limit", type=int, default=None, help="the first N dev and test trees")
    parser.add_argument("--hidden", type=int, default=150)
    parser.add_argument("--embed", type=int, default=300)
    parser.add_argument("--batch", type=int, default=25)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", type=Path, default=Path("bitreelstm.pt"))
    train(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
