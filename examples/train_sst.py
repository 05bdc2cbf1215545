"""Train the binary Tree-LSTM (examples/binary_treelstm.cell) on the Stanford Sentiment Treebank.

Fine-grained (5 classes) sentiment with a cross-entropy loss on every node of every tree, as in
Tai, Socher & Manning (2015): Adagrad (lr 0.05), batches of 25 trees, random embeddings, a
vocabulary of every train word (others map to <unk>). The compiled forward and backward kernels
(``--device cpu``) or the reference interpreter (``--device interp``); the embedding table gets a
sparse gradient, so the Adagrad step touches only the rows a batch looked up. After each epoch, the
loss and root accuracy on dev. With ``--out DIR``, the params of the best epoch (by dev root
accuracy) go to DIR/params.npz, the vocabulary to DIR/vocab.json and one JSON line per epoch to
DIR/log.jsonl; without it nothing is written. ``--cell`` trains another SST cell with the same dims and
`logits` (its first cell), e.g. examples/treelstm_dropout.cell: the training steps run in training mode
(`model(..., train=True)`: its dropout masks on, a seed per step from the model's generator), the
evaluation in evaluation mode.

    python examples/train_sst.py --limit 300 --epochs 2 --hidden 32
    python examples/train_sst.py --out runs/sst         # the full settings, outputs in runs/sst/

Each split is parsed once (`Forest.from_ptb_file`, vectorised) and batches are cut from it
(`cortexc.train.Treebank`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

import cortexc
from cortexc import Forest, Vocab
from cortexc.train import Adagrad, Treebank, accuracy, softmax_cross_entropy

HERE = Path(__file__).resolve().parent
SST = Path(os.environ.get("CORTEXC_SST_DIR", HERE.parent.parent / "shared" / "data" / "sst"))


def read_trees(path: Path, limit: int | None) -> Treebank:
    """The trees of a PTB file (one per line), parsed once; the first `limit` of them."""
    bank = Treebank(Forest.from_ptb_file(path))
    if limit is not None and limit < len(bank):
        bank = Treebank(bank.select(np.arange(limit)))
    return bank


class Progress:
    """A plain-text progress bar on stderr (rewritten in place on a terminal, a line every 5 s in a log)."""

    def __init__(self, total: int, label: str, width: int = 30):
        self.total, self.label, self.width = total, label, width
        self.start = time.perf_counter()
        self.is_tty = sys.stderr.isatty()
        self.last_print = 0.0

    def update(self, done: int, info: str = "") -> None:
        now = time.perf_counter()
        if not self.is_tty and done < self.total and now - self.last_print < 5.0:
            return
        self.last_print = now
        filled = int(self.width * done / max(self.total, 1))
        rate = done / max(now - self.start, 1e-9)
        bar = "#" * filled + "." * (self.width - filled)
        text = f"{self.label} [{bar}] {done}/{self.total} trees {rate:.1f} trees/s {info}"
        end = "\r" if self.is_tty and done < self.total else "\n"
        sys.stderr.write(text + end)
        sys.stderr.flush()


def evaluate(model, bank: Treebank, vocab: Vocab, batch_size: int = 256) -> tuple[float, float, float]:
    """(mean per-node loss, root accuracy, all-node accuracy) over the trees of `bank`."""
    losses, root_hits, node_hits, nodes = 0.0, 0, 0, 0
    for forest in bank.batches(batch_size):
        logits = model(forest, word=vocab.encode(forest))["logits"]
        loss, _ = softmax_cross_entropy(logits, forest.labels, reduction="sum")
        losses += loss
        roots = np.asarray(forest.roots)
        root_hits += round(accuracy(logits[roots], forest.labels[roots]) * len(roots))
        node_hits += round(accuracy(logits, forest.labels) * forest.num_nodes)
        nodes += forest.num_nodes
    return losses / max(nodes, 1), root_hits / max(len(bank), 1), node_hits / max(nodes, 1)


def _positive(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown, except None ones (their help says what none means)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None and action.help and action.dest in ("steps", "limit", "dev_limit"):
            return action.help + " (default: all)"
        return action.help if action.default is None else super()._get_help_string(action)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=_Help)
    parser.add_argument("--train", type=Path, default=SST / "train.txt", help="SST train trees (PTB format)")
    parser.add_argument("--dev", type=Path, default=SST / "dev.txt", help="SST dev trees (PTB format)")
    parser.add_argument("--cell", type=Path, default=HERE / "binary_treelstm.cell", help="the .cell file")
    parser.add_argument("--epochs", type=_positive, default=10, help="passes over the train trees")
    parser.add_argument("--steps", type=_positive, default=None, help="stop each epoch after N batches")
    parser.add_argument("--limit", type=_positive, default=None, help="use the first N train trees")
    parser.add_argument(
        "--dev-limit", type=_positive, default=None, help="evaluate on the first N dev trees (default: all)"
    )
    parser.add_argument("--hidden", type=_positive, default=150, help="H, the Tree-LSTM memory size")
    parser.add_argument("--embed", type=_positive, default=300, help="X, the word vector size")
    parser.add_argument("--batch", type=_positive, default=25, help="trees per batch")
    parser.add_argument("--lr", type=float, default=0.05, help="the Adagrad learning rate")
    parser.add_argument("--device", default="cpu", choices=["cpu", "interp"], help="compiled kernels or interpreter")
    parser.add_argument("--seed", type=int, default=0, help="params and batch order")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="write params.npz (best epoch), vocab.json and log.jsonl here (default: write nothing)",
    )
    args = parser.parse_args(argv)
    for path in (args.train, args.dev):
        if not path.is_file():
            parser.error(f"{path} not found (see --train/--dev, or set CORTEXC_SST_DIR)")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out}: that is a file, not a directory")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    train = read_trees(args.train, args.limit)
    dev = read_trees(args.dev, args.dev_limit)
    vocab = Vocab.build([train.forest], min_count=1)
    print(
        f"train {len(train)} trees ({train.forest.num_nodes} nodes), dev {len(dev)} trees, "
        f"vocabulary {len(vocab)} words; read in {time.perf_counter() - t0:.2f} s",
        flush=True,
    )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "vocab.json").write_text(json.dumps(vocab.to_dict()), encoding="utf-8")
        (args.out / "log.jsonl").write_text("", encoding="utf-8")
        print(f"writing params.npz, vocab.json and log.jsonl to {args.out}/", flush=True)

    module = cortexc.load(args.cell, V=len(vocab), X=args.embed, H=args.hidden, C=5)
    name = module.__all__[0]  # the file's first cell (BinaryTreeLSTM, DropoutTreeLSTM, ...)
    model = getattr(module, name)(device=args.device, seed=args.seed)
    count = sum(value.size for value in model.params.values())
    print(f"{name} V={len(vocab)} X={args.embed} H={args.hidden} on {args.device}: {count:,} params", flush=True)
    opt = Adagrad(args.lr)
    rng = np.random.default_rng(args.seed)

    best = -1.0
    for epoch in range(1, args.epochs + 1):
        start = time.perf_counter()
        steps = len(range(0, len(train), args.batch)) if args.steps is None else args.steps
        progress = Progress(min(len(train), steps * args.batch), f"epoch {epoch}/{args.epochs}")
        done, total_loss, total_nodes = 0, 0.0, 0
        for step, forest in enumerate(train.batches(args.batch, rng)):
            if step == steps:
                break
            out = model(forest, grad=True, train=True, word=vocab.encode(forest))  # dropout on (if any)
            loss, d_logits = softmax_cross_entropy(out["logits"], forest.labels)
            grads = model.backward(out, {"logits": d_logits}, sparse=True)
            model.load_params(opt.step(model.params, grads))
            done += forest.num_trees
            total_loss += loss * forest.num_nodes
            total_nodes += forest.num_nodes
            progress.update(done, f"loss {total_loss / total_nodes:.4f}")
        train_time = time.perf_counter() - start
        dev_loss, dev_root, dev_nodes = evaluate(model, dev, vocab)
        train_loss = total_loss / max(total_nodes, 1)
        print(
            f"epoch {epoch}: train loss {train_loss:.4f} ({train_time:.1f} s) | "
            f"dev loss {dev_loss:.4f}, root acc {dev_root:.4f}, all-node acc {dev_nodes:.4f} "
            f"({time.perf_counter() - start - train_time:.1f} s)",
            flush=True,
        )
        if args.out is not None:
            record = {"epoch": epoch, "train_loss": train_loss, "dev_loss": dev_loss, "dev_root_acc": dev_root}
            with open(args.out / "log.jsonl", "a", encoding="utf-8") as log:
                log.write(json.dumps(record) + "\n")
            if dev_root > best:
                model.save_params(args.out / "params.npz")
        best = max(best, dev_root)
    saved = f"; the best epoch's params in {args.out / 'params.npz'}" if args.out is not None else ""
    print(f"best dev root accuracy {best:.4f}{saved}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
