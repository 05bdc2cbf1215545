"""Train the binary Tree-LSTM (examples/binary_treelstm.cell) on the Stanford Sentiment Treebank.

Fine-grained (5 classes) sentiment with a cross-entropy loss on every node of every tree, as in
Tai, Socher & Manning (2015): Adagrad (lr 0.05), batches of 25 trees, random embeddings, a
vocabulary of every train word (others map to <unk>). After each epoch, the root accuracy on dev.

    python examples/train_sst.py --limit 300 --epochs 2 --hidden 32
    python examples/train_sst.py --device cpu          # the compiled kernels (once the backward lands)

Only the device string differs between devices: the model runs the forest forward (keeping what
backward needs) and `model.backward` returns the gradients, whatever the device.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import cortexc
from cortexc import Forest, Vocab
from cortexc.train import Adagrad, accuracy, batches, softmax_cross_entropy

HERE = Path(__file__).resolve().parent
SST = HERE.parent.parent / "shared" / "data" / "sst"


def read_trees(path: Path, limit: int | None) -> list[Forest]:
    """One Forest per non-blank line (the first `limit` lines)."""
    trees: list[Forest] = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                trees.append(Forest.from_ptb(line))
                if limit is not None and len(trees) >= limit:
                    break
    return trees


class Progress:
    """A plain-text progress bar on stderr (rewritten in place with a carriage return)."""

    def __init__(self, total: int, label: str, width: int = 30):
        self.total, self.label, self.width = total, label, width
        self.start = time.perf_counter()
        self.is_tty = sys.stderr.isatty()
        self.last_print = 0.0

    def update(self, done: int, info: str = "") -> None:
        now = time.perf_counter()
        if not self.is_tty and done < self.total and now - self.last_print < 5.0:
            return  # a log file gets a line every few seconds, not a flood
        self.last_print = now
        filled = int(self.width * done / max(self.total, 1))
        rate = done / max(now - self.start, 1e-9)
        bar = "#" * filled + "." * (self.width - filled)
        text = f"{self.label} [{bar}] {done}/{self.total} trees {rate:.1f} trees/s {info}"
        end = "\r" if self.is_tty and done < self.total else "\n"
        sys.stderr.write(text + end)
        sys.stderr.flush()


def evaluate(model, trees: list[Forest], vocab: Vocab, batch_size: int = 256) -> tuple[float, float, float]:
    """(mean per-node loss, root accuracy, all-node accuracy) over `trees`."""
    losses, root_hits, node_hits, nodes = 0.0, 0, 0, 0
    for start in range(0, len(trees), batch_size):
        forest = Forest.concat(trees[start : start + batch_size])
        logits = model(forest, word=vocab.encode(forest))["logits"]
        loss, _ = softmax_cross_entropy(logits, forest.labels, reduction="sum")
        losses += loss
        roots = np.asarray(forest.roots)
        root_hits += round(accuracy(logits[roots], forest.labels[roots]) * len(roots))
        node_hits += round(accuracy(logits, forest.labels) * forest.num_nodes)
        nodes += forest.num_nodes
    return losses / max(nodes, 1), root_hits / max(len(trees), 1), node_hits / max(nodes, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=Path, default=SST / "train.txt", help="SST train trees (PTB format)")
    parser.add_argument("--dev", type=Path, default=SST / "dev.txt", help="SST dev trees (PTB format)")
    parser.add_argument("--cell", type=Path, default=HERE / "binary_treelstm.cell")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--limit", type=int, default=None, help="use the first N train trees")
    parser.add_argument("--dev-limit", type=int, default=None, help="evaluate on the first N dev trees")
    parser.add_argument("--hidden", type=int, default=150, help="H, the Tree-LSTM memory size")
    parser.add_argument("--embed", type=int, default=300, help="X, the word vector size")
    parser.add_argument("--batch", type=int, default=25)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument(
        "--device", default="cpu", help='"cpu" (compiled forward and backward) or "interp" (reference interpreter)'
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--save",
        type=Path,
        default=Path("sst_treelstm.npz"),
        help="params (.npz); the vocabulary is written next to it as .vocab.json",
    )
    args = parser.parse_args(argv)

    for path in (args.train, args.dev):
        if not path.exists():
            parser.error(f"{path} not found (see --train/--dev)")
    t0 = time.perf_counter()
    train = read_trees(args.train, args.limit)
    dev = read_trees(args.dev, args.dev_limit)
    vocab = Vocab.build(train, min_count=1)
    print(
        f"train {len(train)} trees ({sum(t.num_nodes for t in train)} nodes), dev {len(dev)} trees, "
        f"vocabulary {len(vocab)} words; read in {time.perf_counter() - t0:.1f}s",
        flush=True,
    )

    module = cortexc.load(args.cell, V=len(vocab), X=args.embed, H=args.hidden, C=5)
    model = module.BinaryTreeLSTM(device=args.device, seed=args.seed)
    sizes = {name: value.size for name, value in model.params.items()}
    print(
        f"BinaryTreeLSTM V={len(vocab)} X={args.embed} H={args.hidden} on {args.device}: {sum(sizes.values())} params",
        flush=True,
    )
    opt = Adagrad(args.lr)
    rng = np.random.default_rng(args.seed)

    best = -1.0
    for epoch in range(1, args.epochs + 1):
        start = time.perf_counter()
        progress = Progress(len(train), f"epoch {epoch}/{args.epochs}")
        done, total_loss, total_nodes = 0, 0.0, 0
        for batch in batches(train, args.batch, rng):
            forest = Forest.concat(batch)
            out = model(forest, grad=True, word=vocab.encode(forest))
            loss, d_logits = softmax_cross_entropy(out["logits"], forest.labels)
            grads = model.backward(out, {"logits": d_logits})
            model.load_params(opt.step(model.params, grads))
            done += len(batch)
            total_loss += loss * forest.num_nodes
            total_nodes += forest.num_nodes
            progress.update(done, f"loss {total_loss / total_nodes:.4f}")
        train_time = time.perf_counter() - start
        dev_loss, dev_root, dev_nodes = evaluate(model, dev, vocab)
        best = max(best, dev_root)
        print(
            f"epoch {epoch}: train loss {total_loss / max(total_nodes, 1):.4f} ({train_time:.1f}s) | "
            f"dev loss {dev_loss:.4f}, root acc {dev_root:.4f}, all-node acc {dev_nodes:.4f} "
            f"({time.perf_counter() - start - train_time:.1f}s)",
            flush=True,
        )
        model.save_params(args.save)
        args.save.with_suffix(".vocab.json").write_text(json.dumps(vocab.to_dict()), encoding="utf-8")
    print(f"best dev root accuracy {best:.4f}; params saved to {args.save}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
