"""benchmarks/results/sst_table.json: the committed SST table reproduced from the files it names.

Every row whose params are committed (``params`` not null: those under 5 MB) is recomputed as anyone would:
its `.cell` loaded with its `dims`, its `.safetensors` loaded, the words of dev and test mapped by its vocab
(unknown -> 1, internal nodes 0), and its root accuracies (and test all-node accuracy) taken by
examples/sst_table.py's own rule (`task_labels`, `accuracy_counts`), to 0.05 points of the committed numbers."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

import cortexc
from cortexc import Forest
from tests.helpers import EXAMPLES, REPO, sst_path

RESULTS = REPO / "benchmarks" / "results" / "sst_table.json"
LIMIT_BYTES = 5 * 1024 * 1024  # the "small": what is committed


def _example():
    spec = importlib.util.spec_from_file_location("sst_table_example", EXAMPLES / "sst_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _rows() -> list[dict]:
    return json.loads(RESULTS.read_text(encoding="utf-8"))


def _committed() -> list[dict]:
    """The rows whose params are committed (none if the table is not there: the first test says so)."""
    return [row for row in _rows() if row["params"] is not None] if RESULTS.is_file() else []


def _files(row: dict) -> list[str]:
    """Every params path a row names (its own, and each cell's for a two-cell row), nulls included."""
    return [row["params"], *(cell["params"] for cell in row.get("cells", []))]


def test_the_committed_table_names_files_of_the_checkout_and_every_model_and_task():
    rows = _rows()
    assert sorted((r["model"], r["task"]) for r in rows) == sorted(
        (m, t) for m in ("rnn", "mvrnn", "rntn", "treelstm", "bitreelstm") for t in ("fine", "binary")
    )
    for row in rows:
        for path in [row["cell"], row["vocab"], *(p for p in _files(row) if p is not None)]:
            assert not Path(path).is_absolute(), path
            assert (REPO / path).is_file(), path
        for path in _files(row):
            assert path is None or (REPO / path).stat().st_size < LIMIT_BYTES, path
    assert any(row["params"] is not None for row in rows)


@pytest.mark.slow  # reads all of SST dev and test, a forward over each per row (about 3 s a row)
@pytest.mark.parametrize("row", _committed(), ids=lambda row: f"{row['model']}-{row['task']}")
def test_a_committed_row_is_recomputed_from_its_files(row, tmp_path):
    example = _example()
    splits = {split: Forest.from_ptb_file(sst_path(split)) for split in ("dev", "test")}
    words = json.loads((REPO / row["vocab"]).read_text(encoding="utf-8"))
    index = {word: i for i, word in enumerate(words)}
    module = cortexc.load(REPO / row["cell"], out_dir=tmp_path / "package", **row["dims"])
    if "cells" in row:  # two cells: the bottom-up h is the down cell's input hu
        up, down = (getattr(module, cell["class"])(device="cpu", seed=None) for cell in row["cells"])
        up.load_params(REPO / row["cells"][0]["params"])
        down.load_params(REPO / row["cells"][1]["params"])

        def logits_of(forest, ids):
            return down(forest, word=ids, hu=up(forest, word=ids)["h"])["logits"]

    else:
        model = getattr(module, row["class"])(device="cpu", seed=None)
        model.load_params(REPO / row["params"])

        def logits_of(forest, ids):
            return model(forest, word=ids)["logits"]

    for split, forest in splits.items():
        ids = np.array([0 if w is None else index.get(w, 1) for w in forest.words], np.int32)
        logits = np.asarray(logits_of(forest, ids))
        labels = example.task_labels(forest.labels, row["task"])
        roots = np.asarray(forest.roots)
        root = example.percent(*example.accuracy_counts(logits[roots], labels[roots]))
        assert abs(root - row[f"{split}_root_acc"]) < 0.05, (split, root, row[f"{split}_root_acc"])
        if split == "test":
            every = example.percent(*example.accuracy_counts(logits, labels))
            assert abs(every - row["test_all_acc"]) < 0.05, (every, row["test_all_acc"])
