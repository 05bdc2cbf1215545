"""Fixtures, and the rule that every `nvcc` test is `slow` (the marks are set in the test files).

The plain helpers live in tests/helpers.py; the names below are re-exported for modules that still
import them from here.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import (
    EXAMPLES,
    REPO,
    SST_DIR,
    children_of,
    compare_backward,
    nvcc_compile,
    random_inputs,
    relative_error,
    small_forest,
    sst_path,
    twin_models,
)

__all__ = [
    "EXAMPLES",
    "REPO",
    "SST_DIR",
    "children_of",
    "compare_backward",
    "nvcc_compile",
    "random_inputs",
    "relative_error",
    "small_forest",
    "sst_path",
    "twin_models",
]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every `nvcc` test is `slow` too. The marks themselves are set in the test files (`pytestmark`,
    decorators, `pytest.param(..., marks=...)`), so a renamed test keeps its mark."""
    for item in items:
        if item.get_closest_marker("nvcc") is not None:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A fresh seed per test (printed on failure via the test id's hash), reproducible by CORTEXC_SEED."""
    seed = int(os.environ.get("CORTEXC_SEED", np.random.SeedSequence().entropy % (2**32)))
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="session", autouse=True)
def _private_cortexc_cache(tmp_path_factory):
    """One build cache for the whole session, never the user's (`scripts/run_tests.py` gives its pytest
    processes one between them, `CORTEXC_TEST_CACHE`)."""
    shared = os.environ.get("CORTEXC_TEST_CACHE")
    path = Path(shared) if shared else tmp_path_factory.getbasetemp() / "cortexc-cache"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CORTEXC_CACHE", str(path))
        # libgomp's default spin-waiting at the per-level barriers makes a forward 100-1000x slower when
        # the cores are shared (other jobs, pytest-xdist): only speed, never results, depends on this
        patch.setenv("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", "passive"))
        yield path
