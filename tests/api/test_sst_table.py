"""examples/sst_table.py: the SST table script end to end on a tiny random subset, its results reproduced from the
files it names, its accuracy rule (binary neutral nodes left out) on hand-made cases, and the bidirectional
Tree-LSTM's hand-chained gradient (two cells) against autograd of a per-node float64 torch reference."""

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
from cortexc.train import SparseRows
from tests.helpers import EXAMPLES, REPO, SST_DIR, relative_error, sst_path

pytestmark = pytest.mark.slow  # trains six small models and evaluates them on all of dev and test

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
MODELS = ("rnn", "mvrnn", "bitreelstm")  # one with a 3-D param, one of two cells
BI_CELLS = ("SSTBiTreeLSTMUp", "SSTBiTreeLSTMDown")  # bitreelstm.cell: bottom-up, then down


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
    """One short run of three models on both tasks; the checkout listed before and after."""
    sst_path("train")
    out = tmp_path_factory.mktemp("sst") / "table"
    before = _listing(EXAMPLES), sorted(p.name for p in REPO.iterdir())
    done = _run(
        "--out", str(out), "--models", *MODELS, "--epochs", "1", "--train-limit", str(LIMIT), "--seed", str(SEED)
    )
    after = _listing(EXAMPLES), sorted(p.name for p in REPO.iterdir())
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done, before, after


def test_results_have_one_row_per_model_and_task_with_exactly_the_fields(run):
    out, done, _, _ = run
    rows = json.loads((out / "results.json").read_text())
    assert sorted((r["model"], r["task"]) for r in rows) == sorted((m, t) for m in MODELS for t in ("fine", "binary"))
    vocab = json.loads((out / "vocab.json").read_text())
    for row in rows:
        assert set(row) == (FIELDS | {"cells"} if row["model"] == "bitreelstm" else FIELDS)
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


def test_the_bitreelstm_row_names_both_cells_and_prefixes_the_params_of_its_file(run):
    """The two-cell row: `class` is the down cell's (the logits), `params` holds every param of both cells as
    <Cell>.<param> (as `cortexc export` names those of a file of several cells), and `cells` gives each cell
    with a file of its own params under their own names, bottom-up first."""
    out, _, _, _ = run
    rows = [r for r in json.loads((out / "results.json").read_text()) if r["model"] == "bitreelstm"]
    assert len(rows) == 2
    for row in rows:
        assert row["class"] == BI_CELLS[1]
        assert [c["class"] for c in row["cells"]] == list(BI_CELLS)
        assert all(set(c) == {"cell", "class", "params"} and c["cell"] == row["cell"] for c in row["cells"])
        module = cortexc.load(_at(row["cell"]), out_dir=out / "check" / row["task"], **row["dims"])
        combined = safetensors.load(_at(row["params"]))
        expected = {}
        for entry in row["cells"]:
            model = getattr(module, entry["class"])(device="cpu", seed=None)
            own = safetensors.load(_at(entry["params"]))
            assert sorted(own) == sorted(model.params)
            for name, value in own.items():
                assert value.dtype == np.float32 and value.shape == model.params[name].shape, name
                expected[f"{entry['class']}.{name}"] = value
        assert sorted(combined) == sorted(expected)
        assert all(np.array_equal(combined[k], v) for k, v in expected.items())


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
        if row["model"] == "bitreelstm":
            logits_of = _bitreelstm_logits(module, row)
        else:
            model = getattr(module, row["class"])(device="cpu", seed=None)
            saved = safetensors.load(_at(row["params"]))
            assert sorted(saved) == sorted(model.params)
            for name, value in saved.items():
                assert value.dtype == np.float32 and value.shape == model.params[name].shape, name
            model.load_params(_at(row["params"]))

            def logits_of(forest, words, model=model):
                return model(forest, word=words)["logits"]

        for split, forest in splits.items():
            logits = logits_of(forest, ids[split])
            labels = _labels(forest, row["task"])
            roots = np.asarray(forest.roots)
            root = _percent(logits[roots], labels[roots])
            assert abs(root - row[f"{split}_root_acc"]) < 0.05, (row["model"], row["task"], split)
            if split == "test":
                assert abs(_percent(logits, labels) - row["test_all_acc"]) < 0.05, (row["model"], row["task"])


def _bitreelstm_logits(module, row):
    """The bidirectional Tree-LSTM recomputed from its row alone: both cells' params from the prefixed file,
    the bottom-up h given to the down cell as `hu`; the per-cell files give the same logits."""
    combined = safetensors.load(_at(row["params"]))
    up, down = (getattr(module, name)(device="cpu", seed=None) for name in BI_CELLS)
    up.load_params({k.split(".", 1)[1]: v for k, v in combined.items() if k.startswith(f"{BI_CELLS[0]}.")})
    down.load_params({k.split(".", 1)[1]: v for k, v in combined.items() if k.startswith(f"{BI_CELLS[1]}.")})
    again = [getattr(module, c["class"])(device="cpu", seed=None) for c in row["cells"]]
    for model, entry in zip(again, row["cells"]):
        model.load_params(_at(entry["params"]))

    def logits_of(forest, words):
        logits = down(forest, word=words, hu=up(forest, word=words)["h"])["logits"]
        h = again[0](forest, word=words)["h"]
        assert np.array_equal(again[1](forest, word=words, hu=h)["logits"], logits)
        return logits

    return logits_of


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


def test_word_dropout_turns_only_words_into_unk_at_its_rate():
    """`drop_words`: <pad> (internal nodes) and <unk> stay; a word becomes <unk> with probability p, seeded."""
    example = _example()
    words = np.array([Vocab.PAD_ID, Vocab.UNK_ID, 5, 6, 7, Vocab.PAD_ID] * 2000, np.int32)
    is_word = words > Vocab.UNK_ID
    assert (example.drop_words(words, 0.0, np.random.default_rng(1)) == words).all()
    assert (example.drop_words(words, 1.0, np.random.default_rng(1)) == np.where(is_word, Vocab.UNK_ID, words)).all()
    dropped = example.drop_words(words, 0.25, np.random.default_rng(2))
    assert (dropped[~is_word] == words[~is_word]).all() and set(dropped[is_word]) <= {Vocab.UNK_ID, 5, 6, 7}
    rate = float(np.mean(dropped[is_word] == Vocab.UNK_ID))
    assert 0.23 < rate < 0.27, rate
    assert (dropped == example.drop_words(words, 0.25, np.random.default_rng(2))).all()


def test_epochs_are_each_models_own_unless_given():
    example = _example()
    assert {name: spec.epochs for name, spec in example.MODELS.items()} == {
        "rnn": 40, "mvrnn": 10, "rntn": 40, "treelstm": 10, "bitreelstm": 10,
    }  # fmt: skip
    assert {name: spec.word_dropout for name, spec in example.MODELS.items() if spec.word_dropout} == {
        "rnn": 0.25, "rntn": 0.25,
    }  # fmt: skip
    assert example.parse_args(["--out", "x"]).epochs is None
    assert example.parse_args(["--out", "x", "--epochs", "3"]).epochs == 3


def test_the_binary_loss_leaves_out_neutral_nodes():
    """A minibatch's loss (`Trainer.gradients`, which a training step takes with the cell's dropout on; off here,
    so that the forward below sees the same network) is the cross-entropy of the non-neutral nodes alone."""
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
    trainer = example.Trainer(model, spec)
    loss, counted, _ = trainer.gradients(forest, words, labels, train=False)
    assert counted == int(kept.sum()) == 4 and loss == pytest.approx(expected, rel=1e-5)
    assert trainer.step(forest, words, labels)[1] == 4


def test_every_model_is_a_default_and_an_unknown_one_is_refused(tmp_path):
    example = _example()
    assert example.parse_args(["--out", "x"]).models == ["rnn", "mvrnn", "rntn", "treelstm", "bitreelstm"]
    done = _run("--out", str(tmp_path / "t"), "--models", "rnn", "lstm")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "lstm" in done.stderr and "bitreelstm" in done.stderr  # the choices
    assert not (tmp_path / "t").exists()


def _bitreelstm_reference(torch, params, forest, words, H):
    """bitreelstm.cell node by node in float64: the bottom-up Tree-LSTM (children first), then the top-down
    one from each root (a root reads no parent), then every node's logits from [h_down; h_up]."""
    up = {k.split(".", 1)[1]: v for k, v in params.items() if k.startswith(f"{BI_CELLS[0]}.")}
    dn = {k.split(".", 1)[1]: v for k, v in params.items() if k.startswith(f"{BI_CELLS[1]}.")}
    sig, tanh = torch.sigmoid, torch.tanh
    n = forest.num_nodes
    h_up, c_up, h_dn, c_dn = [None] * n, [None] * n, [None] * n, [None] * n

    def bottom_up(node):
        kids = [int(k) for k in forest.children(node)]
        for kid in kids:
            bottom_up(kid)
        if not kids:
            g = up["W_x"] @ up["E"][int(words[node])] + up["b_x"]
            c_up[node] = sig(g[:H]) * tanh(g[2 * H :])
        else:
            left, right = kids
            hc = torch.cat([h_up[left], h_up[right]])
            g = up["U"] @ hc + up["b_u"]
            f = sig(up["U_f"] @ hc + up["b_f"])
            c_up[node] = sig(g[:H]) * tanh(g[2 * H :]) + f[:H] * c_up[left] + f[H:] * c_up[right]
        h_up[node] = sig(g[H : 2 * H]) * tanh(c_up[node])

    def top_down(node, parent):
        g = dn["W_x"] @ dn["E"][int(words[node])] + dn["W_u"] @ h_up[node] + dn["b"]
        if parent is None:
            c_dn[node] = sig(g[:H]) * tanh(g[3 * H :])
        else:
            g = g + dn["U"] @ h_dn[parent]
            c_dn[node] = sig(g[:H]) * tanh(g[3 * H :]) + sig(g[H : 2 * H]) * c_dn[parent]
        h_dn[node] = sig(g[2 * H : 3 * H]) * tanh(c_dn[node])
        for kid in forest.children(node):
            top_down(int(kid), node)

    for root in forest.roots:
        bottom_up(int(root))
        top_down(int(root), None)
    return torch.stack([dn["W_s"] @ torch.cat([h_dn[i], h_up[i]]) + dn["b_s"] for i in range(n)])


def test_the_bitreelstm_gradient_chained_by_hand_matches_autograd_of_a_float64_reference(tmp_path):
    """The trainer's gradient of one small batch (binary: neutral nodes out of the loss), the down cell's
    gradient of `hu` carried into the bottom-up cell by `Chain.backward`, against torch autograd of the same
    cost computed node by node in float64; a one-word sentence makes a root that is also a leaf."""
    torch = pytest.importorskip("torch")
    example = _example()
    forest = Forest.from_ptb(["(3 (2 (2 a) (4 b)) (1 c))", "(1 d)", "(4 (0 e) (2 (3 (2 a) (4 f)) (1 g)))"])
    vocab = Vocab.build([forest])
    H = 4
    spec = example.MODELS["bitreelstm"]
    module = cortexc.load(EXAMPLES / "sst" / spec.cell, out_dir=tmp_path / "bi", V=len(vocab), X=3, H=H, C=2)
    model, class_name = example.make_model(module, spec, seed=5)
    assert isinstance(model, example.Chain) and class_name == BI_CELLS[1] and model.names == BI_CELLS
    noise = np.random.default_rng(7)  # biases off zero, larger weights: every gate away from its linear range
    model.load_params({k: v + noise.normal(0, 0.3, v.shape) for k, v in model.params.items()})
    words, labels = vocab.encode(forest), example.task_labels(forest.labels, "binary")
    assert (labels == -1).any()

    loss, counted, grads = example.Trainer(model, spec).gradients(forest, words, labels, train=False)
    grads = {k: g.to_dense() if isinstance(g, SparseRows) else g for k, g in grads.items()}

    params = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in model.params.items()}
    logits = _bitreelstm_reference(torch, params, forest, words, H)
    kept = torch.tensor(np.flatnonzero(labels >= 0))
    expected = torch.nn.functional.cross_entropy(logits[kept], torch.tensor(labels)[kept], reduction="sum")
    (expected / forest.num_trees).backward()
    assert counted == len(kept) and loss == pytest.approx(expected.item(), rel=1e-5)
    assert relative_error(model(forest, word=words)["logits"], logits.detach().numpy()) < 1e-5
    assert sorted(grads) == sorted(params)
    for name, param in params.items():
        assert np.abs(param.grad.numpy()).max() > 0, name  # every param reaches the loss
        assert relative_error(grads[name], param.grad.numpy()) < 1e-4, name


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
