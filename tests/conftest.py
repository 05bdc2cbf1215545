"""Shared fixtures: where the examples and the SST data are, and random inputs for a cell."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
SST_DIR = Path(os.environ.get("CORTEXC_SST_DIR", REPO.parent / "shared" / "data" / "sst"))


def sst_path(split: str) -> Path:
    """Path of an SST split; skips the test (with the reason) when the data is absent."""
    path = SST_DIR / f"{split}.txt"
    if not path.exists():
        pytest.skip(f"SST data not found at {path} (set CORTEXC_SST_DIR)")
    return path


def random_inputs(cell, forest, rng: np.random.Generator, scale: float = 1.0) -> dict[str, np.ndarray]:
    """One random row per node for every input of the cell (indices in range)."""
    inputs = {}
    for decl in cell.inputs:
        if decl.is_index:
            inputs[decl.name] = rng.integers(0, decl.index_range, forest.num_nodes).astype(np.int32)
        else:
            inputs[decl.name] = (scale * rng.standard_normal((forest.num_nodes, *decl.shape))).astype(np.float32)
    return inputs


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A fresh seed per test (printed on failure via the test id's hash), reproducible by CORTEXC_SEED."""
    seed = int(os.environ.get("CORTEXC_SEED", np.random.SeedSequence().entropy % (2**32)))
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="session", autouse=True)
def _private_cortexc_cache(tmp_path_factory):
    """One build cache for the whole session, never the user's."""
    path = tmp_path_factory.getbasetemp() / "cortexc-cache"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CORTEXC_CACHE", str(path))
        # libgomp's default spin-waiting at the per-level barriers makes a forward 100-1000x slower when
        # the cores are shared (other jobs, pytest-xdist): only speed, never results, depends on this
        patch.setenv("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", "passive"))
        yield path
