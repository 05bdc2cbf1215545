"""examples/sst_seeds.py: the mean and standard deviation of the SST table over seeds, on hand-made results and
end to end (two seeds of a tiny run, whose per-seed results it must have read back)."""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys

import pytest

from tests.helpers import EXAMPLES, sst_path


def _script():
    spec = importlib.util.spec_from_file_location("sst_seeds_example", EXAMPLES / "sst_seeds.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _result(model, task, test_root, test_all=80.0, dev_root=40.0):
    return {
        "model": model,
        "task": task,
        "test_root_acc": test_root,
        "test_all_acc": test_all,
        "dev_root_acc": dev_root,
    }


def test_summary_is_the_mean_and_sample_deviation_per_model_and_task():
    seeds = _script()
    runs = {
        0: [_result("rntn", "fine", 42.0), _result("rntn", "binary", 82.0, dev_root=80.0)],
        1: [_result("rntn", "binary", 84.0, dev_root=81.0), _result("rntn", "fine", 44.0)],
        2: [_result("rntn", "fine", 46.0), _result("rntn", "binary", 86.0, dev_root=85.0)],
    }
    rows = seeds.summarise(runs)
    assert [(r["model"], r["task"]) for r in rows] == [("rntn", "fine"), ("rntn", "binary")]
    fine, binary = rows
    assert fine["seeds"] == [0, 1, 2] and fine["test_root_acc"] == [42.0, 44.0, 46.0]
    assert fine["test_root_acc_mean"] == pytest.approx(44.0) and fine["test_root_acc_std"] == pytest.approx(2.0)
    assert binary["dev_root_acc"] == [80.0, 81.0, 85.0]
    assert binary["dev_root_acc_std"] == pytest.approx(statistics.stdev([80.0, 81.0, 85.0]))
    assert seeds.summarise({5: runs[0]})[0]["test_root_acc_std"] == 0.0
    with pytest.raises(ValueError, match=r"rntn binary: no single result for seed\(s\) \[1\]"):
        seeds.summarise({0: runs[0], 1: runs[1][1:]})


@pytest.mark.slow
def test_two_seeds_end_to_end(tmp_path, capsys, monkeypatch):
    sst_path("train")
    seeds = _script()
    out = tmp_path / "seeds"
    argv = ["--out", str(out), "--seeds", "1", "2", "--models", "rnn", "--tasks", "binary"]
    assert seeds.main([*argv, "--epochs", "1", "--train-limit", "30"]) == 0
    rows = json.loads((out / "seeds.json").read_text(encoding="utf-8"))
    per_seed = [json.loads((out / f"seed-{s}" / "results.json").read_text(encoding="utf-8"))[0] for s in (1, 2)]
    assert len(rows) == 1 and rows[0]["seeds"] == [1, 2]
    assert rows[0]["test_root_acc"] == [r["test_root_acc"] for r in per_seed]
    assert [r["seed"] for r in per_seed] == [1, 2]
    assert rows[0]["test_root_acc_mean"] == pytest.approx(statistics.fmean(rows[0]["test_root_acc"]))
    table = (out / "seeds.md").read_text(encoding="utf-8")
    assert "| rnn | binary |" in table and "82.4" in table  # beside the paper's
