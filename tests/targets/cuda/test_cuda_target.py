"""The CUDA target, proven without a GPU: every emitted `.cu` compiles with nvcc (sm_80, sm_90, warnings
as errors, no register spills) and runs on the CPU through the emulation harness, where its forward and
backward must match the reference interpreter."""

from __future__ import annotations

import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import cortexc
from cortexc import Forest
from cortexc.errors import CortexcError
from cortexc.runtime.topdown import linearize_for
from tests.helpers import (
    EXAMPLES,
    EXAMPLES_BY_NAME,
    compare_backward,
    load_example,
    nvcc_compile,
    random_inputs,
    relative_error,
    small_forest,
    twin_models,
)

DIMS = {"X": 9, "H": 7, "V": 20, "C": 3}


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """Every example compiled once for both targets (small dims, so emulation stays quick)."""
    out = tmp_path_factory.mktemp("packages")
    built = {}
    for name, path in EXAMPLES_BY_NAME.items():
        built[name] = load_example(path, DIMS, out / name.replace("/", "_"))
    return built


@pytest.mark.parametrize("mode", ["persistent", "levels"])
@pytest.mark.parametrize("name", list(EXAMPLES_BY_NAME))
def test_emulated_cuda_matches_the_interpreter(packages, name, mode, rng, monkeypatch):
    """Both launch modes: the persistent kernel (all levels in one cooperative launch, grid barriers
    between levels) and one grid per level; every cell of the file (a two-cell file's down cell too)."""
    monkeypatch.setenv("CORTEXC_CUDA_MODE", mode)
    module = packages[name]
    for cell in module.__all__:
        emulated, reference = twin_models(module, "cuda-emu", 2, rng, cell=cell)
        forest = small_forest(reference.cell, rng, 12, 20)
        inputs = random_inputs(reference.cell, forest, rng)
        out_e, out_r = emulated(forest, grad=True, **inputs), reference(forest, grad=True, **inputs)
        launches = emulated._executor_for_device().lib.cx_last_launch_count()
        if mode == "persistent":
            assert launches == 1, cell  # the whole forward
        else:
            assert launches >= linearize_for(reference.signature, forest).num_levels, cell  # a graph's: its steps
        for key, expected in out_r.items():
            assert relative_error(out_e[key], expected) < 1e-5, (cell, key)
        compare_backward(emulated, reference, out_e, out_r, rng)


def test_cuda_device_without_pycuda_is_a_clear_error(packages):
    pytest.importorskip("numpy")
    try:
        import pycuda  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("PyCUDA is installed here: the error path is not reachable")
    model = packages["treernn"].TreeRNN(device="cuda")
    forest = Forest.random(2, rng=0, binary=True)
    with pytest.raises(cortexc.CortexcError, match=r"install cortexc\[cuda\] on a machine with an NVIDIA driver"):
        model(forest, x=np.zeros((forest.num_nodes, 9), np.float32))


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_every_example_kernel_compiles_with_nvcc_without_spills(packages):
    sources = []
    for module in packages.values():
        directory = next(iter(module.__path__))
        sources += sorted(p for p in __import__("pathlib").Path(directory).glob("*.cu"))
    assert len(sources) == sum(len(module.__all__) for module in packages.values())  # a .cu per cell
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda path: nvcc_compile(path, generated=True), sources))
    for path, result in zip(sources, results):
        assert result.returncode == 0, f"{path.name}:\n{result.stderr[-3000:]}"
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", result.stderr)
        assert spills, result.stderr[-2000:]
        assert all(stores == "0" and loads == "0" for stores, loads in spills), f"{path.name} spills registers"


def test_scratch_kept_between_calls_grows_with_the_forest(packages, rng):
    """The CUDA driver keeps its scratch from call to call: a larger forest (more tiles, more children)
    after a small one, then a small one again, must all still be right."""
    module = packages["treelstm"]
    emulated = module.ChildSumTreeLSTM(device="cuda-emu", seed=4)
    reference = module.ChildSumTreeLSTM(device="interp", seed=4)
    forests = [
        Forest.random(2, rng=rng, max_children=2, max_nodes=5),
        Forest.random(30, rng=rng, max_children=9, max_nodes=25),
        Forest.from_parents([-1]),
    ]
    for forest in forests:
        inputs = random_inputs(reference.cell, forest, rng)
        got, expected = emulated(forest, **inputs), reference(forest, **inputs)
        assert relative_error(got["h"], expected["h"]) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, dims", [("treelstm", {"X": 40, "H": 70}), ("binary_treelstm", {"X": 40, "H": 70, "V": 30, "C": 5})]
)
def test_emulated_cuda_at_sizes_that_span_several_gemm_chunks(name, dims, rng, tmp_path, monkeypatch):
    """K > 32 (several shared-memory chunks) and M > 128 (several column passes of the block)."""
    monkeypatch.setenv("CORTEXC_CACHE", str(tmp_path / "cache"))
    module = cortexc.load(EXAMPLES / f"{name}.cell", out_dir=tmp_path, **dims)
    emulated, reference = twin_models(module, "cuda-emu", 5, rng, jitter=0.0)
    forest = small_forest(reference.cell, rng, 12, 20)
    inputs = random_inputs(reference.cell, forest, rng)
    out_e, out_r = emulated(forest, grad=True, **inputs), reference(forest, grad=True, **inputs)
    for key, expected in out_r.items():
        assert relative_error(out_e[key], expected) < 1e-5, key
    compare_backward(emulated, reference, out_e, out_r, rng)


@pytest.mark.parametrize("device", ["cpu", "cuda-emu", "interp"])
def test_host_false_elsewhere_is_numpy_as_usual(packages, device, rng):
    """Only device="cuda" keeps results on the GPU; every other device returns the same NumPy arrays."""
    model = packages["treernn"].TreeRNN(device=device, seed=0)
    forest = Forest.random(4, rng=rng, binary=True, max_nodes=9)
    inputs = random_inputs(model.cell, forest, rng)
    on_host, kept = model(forest, **inputs), model(forest, host=False, **inputs)
    for key, expected in on_host.items():
        assert isinstance(kept[key], np.ndarray) and np.array_equal(kept[key], expected), key


class _StandInGPUArray:
    """What cuda.py uses of a PyCUDA GPUArray, over host memory (the emulator's "device" memory)."""

    def __init__(self, shape, dtype):
        self._host = np.zeros(shape, dtype)
        self.gpudata = self._host.ctypes.data
        self.nbytes = self._host.nbytes
        self.shape = self._host.shape

    def get(self):
        return self._host.copy()


def _stand_in_pycuda(monkeypatch, devices: int = 1) -> list[str]:
    """PyCUDA replaced by a stand-in over host memory: its driver records what is done to contexts (a
    context it would *create* is an error, and `pycuda.autoinit`, which creates one, cannot be imported);
    the device reports compute capability 9.0, a device-to-device copy is a memmove. Returns the record."""
    import ctypes
    import sys
    import types

    from cortexc.targets.cuda import executor as cuda_runtime

    events: list[str] = []
    device = types.SimpleNamespace(compute_capability=lambda: (9, 0))

    class Primary:
        def __init__(self, ordinal: int):
            self.ordinal = ordinal

        def push(self):
            events.append(f"push {self.ordinal}")

        def pop(self):
            events.append(f"pop {self.ordinal}")

    class Device:
        def __init__(self, ordinal: int):
            self.ordinal = ordinal

        @staticmethod
        def count() -> int:
            return devices

        def retain_primary_context(self):
            events.append(f"retain {self.ordinal}")
            return Primary(self.ordinal)

        def make_context(self):  # pragma: no cover - what must not happen
            raise AssertionError("PyCUDA was asked to create a context")

        def compute_capability(self):
            return (9, 0)

    driver = types.ModuleType("pycuda.driver")
    driver.init = lambda flags=0: events.append("init")
    driver.Device = Device
    driver.Context = types.SimpleNamespace(get_device=lambda: device)
    driver.memcpy_dtod = lambda dst, src, nbytes: ctypes.memmove(int(dst), int(src), nbytes)
    gpuarray = types.ModuleType("pycuda.gpuarray")
    gpuarray.empty = _StandInGPUArray
    package = types.ModuleType("pycuda")
    package.driver, package.gpuarray = driver, gpuarray
    for name, module in {
        "pycuda": package,
        "pycuda.autoinit": None,  # importing it raises ImportError
        "pycuda.driver": driver,
        "pycuda.gpuarray": gpuarray,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(cuda_runtime, "_PRIMARY", {})
    monkeypatch.setattr(cuda_runtime.atexit, "register", lambda *args: None)
    return events


def test_pycuda_attaches_to_the_primary_context_of_torchs_device(monkeypatch):
    """The device: torch's current one once torch has set up CUDA, else CORTEXC_CUDA_DEVICE (default 0);
    its primary context retained and pushed once per process, never created; a missing GPU is a typed error."""
    import torch

    from cortexc.targets.cuda import executor as cuda_runtime

    events = _stand_in_pycuda(monkeypatch, devices=2)
    monkeypatch.delenv("CORTEXC_CUDA_DEVICE", raising=False)
    assert cuda_runtime.cuda_device_ordinal() == 0
    monkeypatch.setenv("CORTEXC_CUDA_DEVICE", "1")
    cuda_runtime._pycuda()
    cuda_runtime._pycuda()
    assert events == ["init", "retain 1", "push 1", "init"]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert cuda_runtime.cuda_device_ordinal() == 0  # torch's device wins over the variable
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    with pytest.raises(CortexcError, match="there is no GPU 5 \\(2 found\\)"):
        cuda_runtime._pycuda()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setenv("CORTEXC_CUDA_DEVICE", "x")
    with pytest.raises(CortexcError, match="CORTEXC_CUDA_DEVICE='x'"):
        cuda_runtime.cuda_device_ordinal()


@pytest.mark.slow
def test_the_cuda_executor_with_a_stand_in_for_pycuda(packages, rng, monkeypatch):
    """device="cuda" end to end on the CPU: PyCUDA replaced by a stand-in (its context reports sm_90, its
    device-to-device copy is a memmove) and nvcc by the emulator build. What is left for a GPU run is PyCUDA
    itself and the driver; cuda.py's own logic (the primary context, arch flags, results kept on the device)
    runs here."""
    from cortexc.targets.cuda import executor as cuda_runtime
    from cortexc.targets.cuda.emulated import build_emulated

    events = _stand_in_pycuda(monkeypatch)
    builds = []

    def build(source, name, source_path=None, compiler=None, flags=(), purpose=""):
        builds.append((name, compiler, flags))
        return build_emulated(source, name)

    monkeypatch.setattr(cuda_runtime, "build_shared", build)

    module = packages["binary_treelstm"]
    gpu, reference = module.BinaryTreeLSTM(device="cuda", seed=3), module.BinaryTreeLSTM(device="interp", seed=3)
    gpu._executor_for_device()
    module.BinaryTreeLSTM(device="cuda", seed=3)._executor_for_device()  # a second executor: no second push
    assert events == ["init", "retain 0", "push 0", "init"]  # the primary context, retained once, no autoinit
    forest = Forest.random(6, rng=rng, binary=True, max_nodes=15)
    inputs = random_inputs(reference.cell, forest, rng)
    out, expected = gpu(forest, grad=True, **inputs), reference(forest, grad=True, **inputs)
    assert builds and builds[0][1] == "nvcc" and "-arch=sm_90" in builds[0][2] and builds[0][0].endswith("_sm90")
    for key in expected:
        assert relative_error(out[key], expected[key]) < 1e-5, key
    kept = gpu(forest, host=False, **inputs)
    for key in expected:
        assert isinstance(kept[key], _StandInGPUArray) and np.array_equal(kept[key].get(), out[key]), key
    upstream = {"logits": rng.standard_normal(expected["logits"].shape).astype(np.float32)}
    grads, expected_grads = gpu.backward(out, upstream), reference.backward(expected, upstream)
    for key in expected_grads:
        assert relative_error(grads[key], expected_grads[key]) < 1e-5, key
