"""Fixtures, and the `slow` / `nvcc` marks given at collection from the tables below.

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

# Marks kept here, keyed on "file.py" (every test of the module), "file.py::test" (every parameter) or
# "file.py::test[id]" (one), rather than on the tests themselves: one table to tune, and no mark lines in
# test bodies. `-m "not slow"` is the quick run (every nvcc test is slow too); the default runs all.
# Measured with `pytest --durations`: a test is slow when it takes over about 2 s on its own.
NVCC = {
    "test_cuda_emu.py::test_kernels_compile_with_nvcc",
    "test_cuda_emu.py::test_nvcc_refuses_the_emulator_header",
    "test_cuda_target.py::test_every_example_kernel_compiles_with_nvcc_without_spills",
    "test_invented_cells.py::test_every_invented_cell_compiles_with_nvcc_without_spills",
    "test_cuda_gpu.py",  # device="cuda" builds with nvcc (skipped without a GPU)
    "test_ops.py::test_every_op_compiles_with_nvcc_without_spills",
    "test_dropout.py::test_dropout_cells_compile_with_nvcc_without_spills",
}
SLOW = {
    "test_backward_scratch.py::test_sparse_embedding_gradient_on_sst_trees",  # a build at V=18282, 50 SST trees
    "test_fold.py::test_sst_dev_trees_fold_bitwise",  # the whole SST dev set at V=21701, X=300, H=150, twice
    "test_attention.py::test_attentive_treelstm_on_sst_trees_at_its_own_dims",  # X=300, H=150 on 40 SST trees
    "test_attention.py::test_attentive_treelstm_matches_per_node_torch_on_random_forests[cpu]",
    "test_attention.py::test_attentive_treelstm_matches_per_node_torch_on_random_forests[cuda-emu]",
    "test_attention.py::test_dag_cell_normalises_per_parent_over_shared_children[cpu]",
    "test_attention.py::test_dag_cell_normalises_per_parent_over_shared_children[cuda-emu]",
    "test_attention.py::test_arity_cell_leaves_missing_children_out_of_the_softmax[cuda-emu]",
    "test_torch.py::test_the_cuda_host_path_matches_the_cpu_module",  # the emulated CUDA library, 2 cells
    "test_torch.py::test_the_cuda_runner_takes_torchs_arch_needs_no_pycuda_and_runs_on_torchs_stream[split]",  # g++
    "test_torch.py::test_the_cuda_runner_takes_torchs_arch_needs_no_pycuda_and_runs_on_torchs_stream[levels]",
    "test_device_executor.py::test_load_params_while_forwards_run_gives_all_old_or_all_new",  # threads racing
    "test_train.py::test_the_train_sst_example_runs_a_few_steps_into_its_out_directory",  # a build, SST parsed twice
    "test_determinism.py",  # fresh processes per thread count, forests of thousands of nodes
    "test_cpu_deferred.py::test_deferred_gradients_match_the_interpreter",  # dims of 200: the interpreter
    "test_cpu_deferred.py::test_a_skipped_output_leaves_its_term_out",
    "test_cpu_deferred.py::test_the_torch_cpu_op_passes_the_factor_rows",  # dims of 200: the interpreter
    "test_export.py::test_run_matches_python_on_random_trees",  # export + make: a C build per example
    "test_export.py::test_run_matches_python_on_chains",
    "test_export.py::test_run_matches_python_on_dags",
    "test_export.py::test_run_matches_python_on_child_sum_trees_and_mvrnn",
    "test_export.py::test_run_matches_python_on_sst_trees",
    "test_export.py::test_run_matches_python_on_the_attentive_treelstm",
    "test_export_fold.py",  # an export and C builds (some with ASan) per test
    "test_export.py::test_run_on_an_empty_forest",
    "test_export.py::test_bad_forests_and_inputs_give_the_python_message",
    "test_export.py::test_dag_cell_accepts_shared_children_and_refuses_cycles",
    "test_export.py::test_make_test_passes_in_the_exported_directory",
    "test_export.py::test_make_test_fails_on_wrong_expected_outputs",
    "test_export.py::test_threads_on_one_model",
    "test_export.py::test_a_file_of_two_cells_links_into_one_library",
    "test_export.py::test_cpp_serving_example_classifies_trees",
    "test_invented_cells.py",  # one build per invented cell and device
    "test_cli.py::test_run_on_sst_trees",
    "test_compiled.py::test_all_of_sst_train_in_one_call",
    "test_compiled.py::test_binary_treelstm_on_sst_dev",
    "test_compiled.py::test_odd_dim_overrides",
    "test_compiled.py::test_stress_cell_matches_interp",
    "test_cuda_emu.py::test_address_sanitizer_sees_shared_memory_overflow",
    "test_cuda_emu.py::test_the_stream_log_records_the_stream_each_call_names",  # a g++ build
    "test_torch.py::test_the_numpy_api_on_cuda_runs_on_the_default_stream",  # the emulated library's build
    "test_cuda_split.py::test_per_level_mode_splits_small_levels_too",
    "test_cuda_split.py::test_split_mode_at_sizes_that_span_several_chunks_and_passes",
    "test_cuda_split.py::test_split_mode_matches_the_interpreter",
    "test_cuda_split.py::test_the_plan_falls_back_when_shared_memory_is_short",
    "test_cuda_target.py::test_emulated_cuda_at_sizes_that_span_several_gemm_chunks",
    "test_cuda_target.py::test_the_cuda_executor_with_a_stand_in_for_pycuda",
    "test_device_executor.py::test_one_upload_one_memset_one_download_per_call",
    "test_train.py::test_short_sst_training_run_lowers_the_loss",
    "test_runtime_without_compiler.py::test_package_runs_cpu_with_the_compiler_blocked",
    "test_torch_ddp.py",  # two processes importing torch and gloo
    "test_torch.py::test_a_cell_module_pickles_and_deep_copies",  # a subprocess importing torch
    "test_torch.py::test_float_input_gradients_against_per_node_torch",  # builds a second package
    "test_long_cells.py::test_a_chain_deeper_than_the_inline_depth_matches_the_interpreter",
    "test_fuzz_frontend.py::test_many_mutated_cells_compile_or_fail_with_a_located_error",
    "test_export.py::test_an_exported_cell_with_dropout_runs_in_evaluation_mode",
    "test_dropout.py::test_eval_mode_equals_the_cell_without_dropout",  # a second package (and cuda-emu)
    "test_dropout.py::test_hoisted_and_per_child_dropout_on_cpu_and_every_cuda_launch",  # 3 emulated launches
    "test_dropout.py::test_p_zero_is_the_identity_in_train_mode",  # a second package
    "test_dropout.py::test_masks_are_the_contract_s_bitwise_on_every_device[cuda-emu]",
    "test_torch.py::test_opcheck_and_compile_with_dropout_in_training_mode",
    "test_torch.py::test_the_train_sst_torch_example_trains_in_train_mode_evaluates_in_eval_mode",  # SST, a build
    "test_torch.py::test_the_train_sst_torch_example_trains_on_two_ddp_ranks",  # two processes importing torch
    "test_torch.py::test_the_cuda_host_path_reads_and_writes_torch_s_tensors_in_place",  # the emulated CUDA build
    "test_torch.py::test_import_cortexc_and_the_numpy_api_never_import_torch",  # a subprocess
    "test_torch_fold.py::test_sst_dev_trees_fold_bitwise_through_the_module",  # the SST dev set at V=21701, H=150
    "test_torch_fold.py::test_opcheck_and_compile_with_fold",  # opcheck's runs and a compile
    "test_torch_fold.py::test_folded_inference_is_bitwise_the_unfolded_one",  # the package's build (first test)
    # the v2 audit: the emulated CUDA builds of its cells
    "test_language_v2_audit.py::test_the_train_sst_example_trains_the_dropout_cell_in_training_mode",  # SST, a build
    "test_language_v2_audit.py::test_child_softmax_of_large_finite_scores_is_finite_and_sums_to_one[cuda-emu]",
    *(
        f"test_language_v2_audit.py::test_sites_count_per_cell_across_leaf_node_and_outputs[{seed}-cuda-emu]"
        for seed in (0, 4294967295, 4294967296, 4294967301, 18446744073709551615, "random")
    ),
}


def _table_keys(item: pytest.Item) -> tuple[str, ...]:
    function = getattr(item, "originalname", item.name)
    return (item.path.name, f"{item.path.name}::{function}", f"{item.path.name}::{item.name}")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests named in NVCC and SLOW; refuse a table entry whose test no longer exists."""
    seen_modules = {}
    for item in items:
        keys = _table_keys(item)
        if any(key in NVCC for key in keys):
            item.add_marker(pytest.mark.nvcc)
            item.add_marker(pytest.mark.slow)
        elif any(key in SLOW for key in keys):
            item.add_marker(pytest.mark.slow)
        module = getattr(item, "module", None)
        if module is not None:
            seen_modules[item.path.name] = module
    for entry in sorted(NVCC | SLOW):
        file, _, test = entry.partition("::")
        function = test.partition("[")[0]
        if function and file in seen_modules and not hasattr(seen_modules[file], function):
            raise pytest.UsageError(f"tests/conftest.py marks {entry}, but {file} has no {function}")


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
