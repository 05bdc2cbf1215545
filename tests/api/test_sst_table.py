"""examples/sst_table.py: the SST table script end to end on a tiny random subset, its results reproduced from the
files it names, and its accuracy rule (binary neutral nodes left out) on hand-made cases."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cortexc
from cortexc import Forest, Vocab
from cortexc.runtime import safetensors
from tests.helpers import EXAMPLES, REPO, SST_DIR, sst_path

pytestmark = pytest.mark.slow  # trains four small models and evaluates them on all of dev and test

SCRIPT = EXAMPLES / "sst_table.py"
FIELDS = {
    "model",
    "task",
    "cell",
    "class",
    "params",
    "vocab",
    "dims",
    "test_root_acc",
    "test_all_acc",
    "dev_root_acc",
    "epochs",
    "seconds_per_epoch",
    "seed",
}
LIMIT, SEED = 40, 3


def _example():
    spec = importlib.util.spec_from_file_location("sst_table_example", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CORTEXC_SST_DIR": str(SST_DIR)}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=600)


def _listing(root: Path) -> set[tuple[str, int, int]]:
    """Every file under `root` (name, size, mtime), caches aside."""
    return {
        (str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def _at(path: str) -> Path:
    """A results.json path: relative to the checkout, or absolute."""
    return Path(path) if Path(path).is_absolute() else REPO / path


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One short run of two models (one with a 3-D param) on both tasks; the checkout listed before and after."""
    sst_path("train")
    out = tmp_path_factory.mktemp("sst") / "table"
    before = _listing(EXAMPLES), sorted(p.name for p in REPO.iterdir())
    done = _run(
        "--out", str(out), "--models", "rnn", "mvrnn", "--epochs", "1", "--train-limit", str(LIMIT), "--seed", str(SEED)
    )
    after = _listing(EXAMPLES), sorted(p.name for p in REPO.iterdir())
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done, before, after


def test_results_have_one_row_per_model_and_task_with_exactly_the_fields(run):
    out, done, _, _ = run
    rows = json.loads((out / "results.json").read_text())
    assert sorted((r["model"], r["task"]) for r in rows) == sorted(
        (m, t) for m in ("rnn", "mvrnn") for t in ("fine", "binary")
    )
    vocab = json.loads((out / "vocab.json").read_text())
    for row in rows:
        assert set(row) == FIELDS
        assert _at(row["cell"]) == EXAMPLES / "sst" / f"{row['model']}.cell"
        assert _at(row["vocab"]) == out / "vocab.json"
        assert _at(row["params"]).is_file() and out in _at(row["params"]).parents
        assert row["dims"]["V"] == len(vocab) and row["dims"]["C"] == {"fine": 5, "binary": 2}[row["task"]]
        assert all(type(v) is int for v in row["dims"].values())
        assert row["epochs"] == 1 and row["seed"] == SEED and row["seconds_per_epoch"] > 0
        assert all(0 <= row[k] <= 100 for k in ("test_root_acc", "test_all_acc", "dev_root_acc"))
    assert "epoch 1/1 [" in done.stderr  # the progress bar
    assert {"results.json", "table.md", "vocab.json", "train_trees.json", "log.jsonl"} <= {
        p.name for p in out.iterdir()
    }


def test_the_script_writes_nothing_in_the_checkout(run):
    _, _, before, after = run
    assert before == after


def _labels(forest: Forest, task: str) -> np.ndarray:
    """Our own reading of the tasks: binary keeps 0-1 as 0 and 3-4 as 1, and drops 2 (-1 here)."""
    labels = np.asarray(forest.labels)
    if task == "fine":
        return labels
    return np.where(labels < 2, 0, np.where(labels > 2, 1, -1))


def _percent(logits: np.ndarray, labels: np.ndarray) -> float:
    kept = labels >= 0
    return 100.0 * float(np.mean(logits[kept].argmax(axis=1) == labels[kept]))


def test_saved_params_reload_into_the_cell_and_give_the_reported_accuracies(run, tmp_path):
    """Anyone's recomputation: the .cell with `dims`, the .safetensors (every param, float32, its shape,
    nothing else), words mapped by vocab.json (unknown -> 1, internal nodes 0), argmax per node."""
    out, _, _, _ = run
    rows = json.loads((out / "results.json").read_text())
    words = json.loads((out / "vocab.json").read_text())
    index = {w: i for i, w in enumerate(words)}
    splits = {s: Forest.from_ptb_file(sst_path(s)) for s in ("dev", "test")}
    ids = {s: np.array([0 if w is None else index.get(w, 1) for w in f.words], np.int32) for s, f in splits.items()}
    for row in rows:
        module = cortexc.load(_at(row["cell"]), out_dir=tmp_path / f"{row['model']}-{row['task']}", **row["dims"])
        model = getattr(module, row["class"])(device="cpu", seed=None)
        saved = safetensors.load(_at(row["params"]))
        assert sorted(saved) == sorted(model.params)
        for name, value in saved.items():
            assert value.dtype == np.float32 and value.shape == model.params[name].shape, name
        model.load_params(_at(row["params"]))
        for split, forest in splits.items():
            logits = model(forest, word=ids[split])["logits"]
            labels = _labels(forest, row["task"])
            roots = np.asarray(forest.roots)
            root = _percent(logits[roots], labels[roots])
            assert abs(root - row[f"{split}_root_acc"]) < 0.05, (row["model"], row["task"], split)
            if split == "test":
                assert abs(_percent(logits, labels) - row["test_all_acc"]) < 0.05, (row["model"], row["task"])


def test_the_vocabulary_is_the_drawn_train_words_in_id_order(run):
    out, _, _, _ = run
    words = json.loads((out / "vocab.json").read_text())
    assert words[:2] == ["<pad>", "<unk>"] and len(set(words)) == len(words)
    lines = sst_path("train").read_text(encoding="utf-8").splitlines()
    drawn = json.loads((out / "train_trees.json").read_text())
    # leaves as the lines spell them: "(label word)", split on ASCII space only
    tokens = [m for i in drawn for m in re.findall(r"\(\d+ ([^ ()]+)\)", lines[i])]
    assert set(words[2:]) == set(tokens)
    counts = {w: tokens.count(w) for w in set(tokens)}
    first = {w: tokens.index(w) for w in set(tokens)}
    assert words[2:] == sorted(counts, key=lambda w: (-counts[w], first[w]))  # by count, ties by first sight


def test_train_limit_draws_random_sentences_seeded(run):
    """SST's train.txt is sorted by sentiment: the draw must not be its first K lines."""
    out, _, _, _ = run
    drawn = json.loads((out / "train_trees.json").read_text())
    assert len(drawn) == LIMIT == len(set(drawn)) and drawn == sorted(drawn)
    assert drawn != list(range(LIMIT)) and max(drawn) >= 1000
    lines = sst_path("train").read_text(encoding="utf-8").splitlines()
    assert all(0 <= i < len(lines) for i in drawn)
    roots = {int(lines[i][1]) for i in drawn}
    assert roots & {0, 1} and roots & {3, 4}  # both sides of the sorted file
    example = _example()
    bank = range(len(lines))  # what draw_train reads of the treebank: its length
    assert example.draw_train(bank, LIMIT, SEED).tolist() == drawn
    assert example.draw_train(bank, LIMIT, SEED + 1).tolist() != drawn
    assert example.draw_train(bank, None, SEED).tolist() == list(range(len(lines)))


def test_accuracy_leaves_out_binary_neutral_nodes_on_hand_made_cases():
    example = _example()
    fine = np.array([0, 1, 2, 3, 4])
    assert example.task_labels(fine, "fine").tolist() == [0, 1, 2, 3, 4]
    assert example.task_labels(fine, "binary").tolist() == [0, 0, -1, 1, 1]
    logits = np.array([[2.0, 1.0], [0.0, 1.0], [5.0, 0.0], [0.0, 3.0], [1.0, 1.0]])
    # rows 0 and 3 right, 1 wrong, 4 a tie (argmax is the first: class 0, wrong); row 2 neutral, not counted
    assert example.accuracy_counts(logits, example.task_labels(fine, "binary")) == (2, 4)
    assert example.accuracy_counts(logits, np.array([-1, -1, -1, -1, -1])) == (0, 0)
    assert example.percent(0, 0) == 0.0 and example.percent(2, 4) == 50.0
    five = np.eye(5)[[0, 1, 2, 3, 3]]
    assert example.accuracy_counts(five, fine) == (4, 5)
    with pytest.raises(cortexc.InputError):
        example.accuracy_counts(logits, fine[:3])
    with pytest.raises(cortexc.InputError):
        example.task_labels(fine, "ternary")


def test_the_binary_loss_leaves_out_neutral_nodes():
    """A training step's loss is the cross-entropy of the non-neutral nodes alone."""
    example = _example()
    forest = Forest.from_ptb(["(3 (2 (2 a) (4 b)) (1 c))", "(2 (0 d) (2 e))"])
    vocab = Vocab.build([forest])
    spec = example.MODELS["rnn"]
    model = cortexc.load(EXAMPLES / "sst" / spec.cell, V=len(vocab), H=4, C=2).SSTRNN(device="cpu", seed=0)
    words, labels = vocab.encode(forest), example.task_labels(forest.labels, "binary")
    logits = np.asarray(model(forest, word=words)["logits"], np.float64)
    kept = labels >= 0
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    expected = -log_probs[kept, labels[kept]].sum()
    loss, counted = example.Trainer(model, spec).step(forest, words, labels)
    assert counted == int(kept.sum()) == 4 and loss == pytest.approx(expected, rel=1e-5)


def test_bitreelstm_is_refused_until_down_cells_exist(tmp_path):
    done = _run("--out", str(tmp_path / "t"), "--models", "rnn", "bitreelstm")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "down" in done.stderr and "bitreelstm" in done.stderr
    assert not (tmp_path / "t").exists()


def test_missing_data_is_a_clear_error(tmp_path):
    env = {**os.environ, "CORTEXC_SST_DIR": str(tmp_path / "nowhere")}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "t"), "--models", "rnn"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr and "CORTEXC_SST_DIR" in done.stderr
