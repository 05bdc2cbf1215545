"""`examples/ggnn_distance.py`: a graph cell trained with cortexc learns each node's distance from a marked
node, which needs one message-passing step per hop. A T-step model gets every distance up to T right; the
model of T - 1 steps it trains beside it cannot tell distance T from farther (fresh seeds, small run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from tests.helpers import REPO


def test_a_t_step_ggnn_learns_distances_up_to_t_and_one_step_fewer_does_not(tmp_path):
    seed = int(np.random.default_rng().integers(1 << 30))
    command = [sys.executable, str(REPO / "examples" / "ggnn_distance.py"), "--steps", "3", "--epochs", "30"]
    command += ["--train-graphs", "400", "--test-graphs", "100", "--seed", str(seed), "--out", str(tmp_path)]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["steps"] == 3 and result["seed"] == seed
    per_distance = result["per_distance"]
    for distance in ("0", "1", "2", "3"):  # every hop up to T
        assert per_distance[distance]["accuracy"] >= 0.9, (seed, distance, per_distance)
    assert result["accuracy"] >= result["chance"] + 0.3, (seed, result["accuracy"], result["chance"])
    fewer = result["baseline_fewer_steps"]["per_distance"]
    # T - 1 = 2 steps: distance 3 and "more than 3" look alike, so one of them is often wrong
    assert fewer["3"]["accuracy"] < per_distance["3"]["accuracy"] - 0.1, (seed, fewer["3"], per_distance["3"])
