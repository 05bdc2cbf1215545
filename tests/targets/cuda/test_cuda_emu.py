"""The CPU emulator for CUDA kernels (cortexc/targets/cuda/cuda_emu.h).

The kernels in tests/cuda_emu/*.cu (unmodified CUDA that includes the one nvcc prelude,
cortexc/targets/cuda/cuda_prelude.cuh) are compiled by g++ against the emulator, run through ctypes and compared with
NumPy: a grid-stride vector add, a tiled matmul (whose variants without a barrier must come out wrong), a
shuffle + atomicAdd block reduction and every warp intrinsic, and a cooperative persistent kernel synchronised
by cx_grid_sync(). Real CUDA bugs (barrier divergence, deadlocks, bad launches, bad copies, stack overflow)
must abort with the emulator's message, in a subprocess. Where nvcc exists, the same .cu files must compile
for sm_80 and sm_90 with every warning an error.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[3]
RUNTIME = REPO / "cortexc" / "targets" / "cuda"  # the CUDA target: its emulator and nvcc prelude
HEADER = RUNTIME / "cuda_emu.h"
KERNELS = REPO / "tests" / "cuda_emu"
KERNEL_FILES = sorted(KERNELS.glob("*.cu"))
GXX = shutil.which("g++")
NVCC = shutil.which("nvcc")
CXXFLAGS = ("-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{RUNTIME}")
PRELUDE = RUNTIME / "cuda_prelude.cuh"

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not found (needed to compile the emulated kernels)")

#: appended to every ctypes driver: lets a test set the schedule seed (CX_EMU_SEED) of that library
SEED_HOOK = 'extern "C" void cx_test_set_seed(unsigned seed) { cx_emu::config().seed = seed; }\n'

ERROR_MAIN = r"""#include "cuda_emu.h"
#include "{kernel}"
#include <cstdlib>
int main(int argc, char **argv)
{{
    const int which = argc > 1 ? std::atoi(argv[1]) : 0;
    if (which == 100) {{ /* the launch API behind CX_LAUNCH, called directly */
        float *d, h[64];
        cudaMalloc(&d, 64 * sizeof(float));
        cudaFuncSetAttribute(fine, cudaFuncAttributeMaxDynamicSharedMemorySize, 65536);
        cx_emu::launch(fine, dim3(1), dim3(64), 65536, d);
        cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost);
        cudaFree(d);
        return h[0] == 126.0f && h[63] == 0.0f ? 0 : 1;
    }}
    return cx_error_case(which);
}}
"""


def _run(cmd: list, what: str) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.fail(f"{what} failed ({result.returncode}):\n{' '.join(map(str, cmd))}\n{result.stderr}")
    return result


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """Every emulated test binary, compiled in parallel: vector_add through `-include cuda_emu.h`, the others
    through a driver that #includes the header and then the .cu file, sync_errors as an executable."""
    out = tmp_path_factory.mktemp("cuda_emu")
    jobs = {}
    vec = out / "vector_add.so"
    seed_hook = out / "seed_hook.cpp"
    seed_hook.write_text(f'#include "cuda_emu.h"\n{SEED_HOOK}')
    jobs[vec] = [
        GXX,
        *CXXFLAGS,
        "-fPIC",
        "-shared",
        "-include",
        "cuda_emu.h",
        "-x",
        "c++",
        KERNELS / "vector_add.cu",
        seed_hook,
        "-o",
        vec,
    ]
    for name in ("matmul_tiled", "block_reduce", "grid_scan"):
        driver = out / f"{name}_driver.cpp"
        driver.write_text(f'#include "cuda_emu.h"\n#include "{KERNELS / name}.cu"\n{SEED_HOOK}')
        jobs[out / f"{name}.so"] = [GXX, *CXXFLAGS, "-fPIC", "-shared", driver, "-o", out / f"{name}.so"]
    driver = out / "sync_errors_main.cpp"
    driver.write_text(ERROR_MAIN.format(kernel=KERNELS / "sync_errors.cu"))
    jobs[out / "sync_errors"] = [GXX, *CXXFLAGS, driver, "-o", out / "sync_errors"]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        list(pool.map(lambda item: _run(item[1], f"compiling {item[0].name}"), jobs.items()))
    return {path.stem: path for path in jobs}


def _lib(built, name: str, seed: int = 0) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(built[name]))
    lib.cx_test_set_seed.argtypes = [ctypes.c_uint]
    lib.cx_test_set_seed(seed)
    return lib


def _ptr(array: np.ndarray) -> ctypes.c_void_p:
    assert array.flags.c_contiguous
    return array.ctypes.data_as(ctypes.c_void_p)


P = ctypes.c_void_p
I = ctypes.c_int


def test_every_kernel_includes_the_one_prelude():
    """nvcc's side of the macros is one header (cortexc/targets/cuda/cuda_prelude.cuh): every test kernel includes
    it and defines none of its macros itself, so the nvcc compile below proves that header."""
    prelude = PRELUDE.read_text()
    defined = re.findall(r"^#define (CX_\w+)", prelude, re.MULTILINE)
    assert {"CX_LAUNCH", "CX_LAUNCH_COOPERATIVE", "CX_SHARED", "CX_DYNAMIC_SHARED"} <= set(defined)
    assert "cx_grid_sync" in prelude and prelude.count("#if !defined(CX_EMULATE)") == 1
    assert len(KERNEL_FILES) >= 5
    for path in KERNEL_FILES:
        src = path.read_text()
        assert '#include "cuda_prelude.cuh"' in src, path.name
        assert not re.search(rf"^#define ({'|'.join(defined)})\b", src, re.MULTILINE), path.name


# ---------------------------------------------------------------------------------------------------------------
# 1. vector add, grid-stride loop
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, grid, block", [(10007, 7, 256), (10007, 100, 128), (1000, 1, 32), (1, 4, 64)])
def test_vector_add(built, rng, n, grid, block):
    lib = _lib(built, "vector_add")
    lib.cx_vector_add.argtypes = [P, P, ctypes.c_float, P, I, I, I]
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    c = np.full(n, np.nan, np.float32)
    assert lib.cx_vector_add(_ptr(a), _ptr(b), 0.75, _ptr(c), n, grid, block) == 0
    np.testing.assert_allclose(c, a.astype(np.float64) + 0.75 * b.astype(np.float64), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 5])
def test_builtin_indices_3d(built, seed):
    lib = _lib(built, "vector_add", seed)
    g, b = (3, 2, 2), (4, 3, 5)
    out = np.full((np.prod(g), np.prod(b), 8), -1, np.int32)
    lib.cx_index_map.argtypes = [P, I, I, I, I, I, I]
    assert lib.cx_index_map(_ptr(out), *g, *b) == 0
    bz, by, bx = np.unravel_index(np.arange(np.prod(g)), g[::-1])
    tz, ty, tx = np.unravel_index(np.arange(np.prod(b)), b[::-1])
    assert (out[:, :, 0] == bx[:, None]).all() and (out[:, :, 1] == by[:, None]).all()
    assert (out[:, :, 2] == bz[:, None]).all()
    assert (out[:, :, 3] == tx[None]).all() and (out[:, :, 4] == ty[None]).all() and (out[:, :, 5] == tz[None]).all()
    assert (out[:, :, 6] == 30202).all() and (out[:, :, 7] == 40305).all()


# ---------------------------------------------------------------------------------------------------------------
# 2. tiled matmul: barriers really order the tile loads
# ---------------------------------------------------------------------------------------------------------------
def _matmul(lib, A, B, variant):
    M, K = A.shape
    N = B.shape[1]
    C = np.full((M, N), np.nan, np.float32)
    lib.cx_matmul.argtypes = [P, P, P, I, I, I, I]
    assert lib.cx_matmul(_ptr(A), _ptr(B), _ptr(C), M, N, K, variant) == 0
    return C


@pytest.mark.parametrize("seed", [0, 7])
@pytest.mark.parametrize("variant", [0, 3], ids=["static-tiles", "dynamic-shared"])
@pytest.mark.parametrize("shape", [(37, 45, 53), (16, 32, 16), (1, 70, 33)])
def test_tiled_matmul(built, rng, shape, variant, seed):
    M, N, K = shape
    lib = _lib(built, "matmul_tiled", seed)
    A = rng.standard_normal((M, K)).astype(np.float32)
    B = rng.standard_normal((K, N)).astype(np.float32)
    np.testing.assert_allclose(_matmul(lib, A, B, variant), A.astype(np.float64) @ B, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("seed", [0, 7])
@pytest.mark.parametrize("variant", [1, 2], ids=["no-second-syncthreads", "no-first-syncthreads"])
def test_tiled_matmul_without_a_barrier_is_wrong(built, rng, variant, seed):
    """With a barrier missing, a thread that runs ahead overwrites (or reads) a tile the others still read (or
    have not written): the emulator must produce a wrong product, as a GPU would."""
    lib = _lib(built, "matmul_tiled", seed)
    A = rng.standard_normal((37, 53)).astype(np.float32)
    B = rng.standard_normal((53, 45)).astype(np.float32)
    C = _matmul(lib, A, B, variant)
    assert not np.allclose(C, A.astype(np.float64) @ B, rtol=1e-3, atol=1e-3, equal_nan=False)


# ---------------------------------------------------------------------------------------------------------------
# 3. block reduction (shuffles + shared memory + atomicAdd) and every warp intrinsic
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, grid, block", [(100003, 7, 256), (5000, 1, 1024), (777, 40, 64)])
def test_block_sum(built, rng, n, grid, block):
    lib = _lib(built, "block_reduce")
    lib.cx_block_sum.argtypes = [P, I, I, I, P, P]
    x = rng.standard_normal(n).astype(np.float32)
    total = np.full(1, np.nan, np.float32)
    partials = np.full(grid, np.nan, np.float32)
    assert lib.cx_block_sum(_ptr(x), n, grid, block, _ptr(total), _ptr(partials)) == 0
    owner = (np.arange(n) // block) % grid  # the block whose grid-stride loop reads x[i]
    expected = np.bincount(owner, weights=x.astype(np.float64), minlength=grid)
    np.testing.assert_allclose(partials, expected, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(total[0], x.astype(np.float64).sum(), rtol=1e-4, atol=1e-2)


@pytest.mark.parametrize("seed", [0, 3])
def test_warp_intrinsics_and_atomics(built, rng, seed):
    lib = _lib(built, "block_reduce", seed)
    lib.cx_warp_ops.argtypes = [P, I, I, P, P]
    grid, block = 3, 64
    n = grid * block
    v = rng.integers(0, 100, n).astype(np.int32)
    out = np.zeros((n, 11), np.int32)
    scalars = np.zeros(4, np.int64)
    assert lib.cx_warp_ops(_ptr(v), grid, block, _ptr(out), _ptr(scalars)) == 0

    lane = np.arange(32)
    w = v.reshape(-1, 32).astype(np.int64)
    per_warp = lambda a: np.broadcast_to(a, w.shape).reshape(-1)  # noqa: E731
    assert (out[:, 0] == w[:, lane ^ 1].reshape(-1)).all()  # __shfl_xor_sync
    assert (out[:, 1] == w[:, [3] * 32].reshape(-1)).all()  # __shfl_sync broadcast
    assert (out[:, 2] == w[:, np.where(lane >= 2, lane - 2, lane)].reshape(-1)).all()  # __shfl_up_sync
    down16 = np.where(lane % 16 + 5 < 16, lane + 5, lane)  # __shfl_down_sync, width 16
    assert (out[:, 3] == w[:, down16].reshape(-1)).all()
    ballot = ((w & 1) << lane).sum(axis=1).astype(np.uint32).view(np.int32)
    assert (out[:, 4] == per_warp(ballot[:, None])).all()
    vote = (w > 90).any(axis=1) + 2 * (w >= 0).all(axis=1)
    assert (out[:, 5] == per_warp(vote[:, None])).all()
    count = (v.reshape(grid, block) % 3 == 0).sum(axis=1)  # __syncthreads_count, per block
    assert (out[:, 6] == np.repeat(count, block)).all()
    assert (out[:, 7] == per_warp(w.sum(axis=1)[:, None])).all()  # __reduce_add_sync
    same = w[:, :, None] % 4 == w[:, None, :] % 4  # __match_any_sync
    match = (same * (1 << lane)[None, None, :]).sum(axis=2).astype(np.uint32).view(np.int32)
    assert (out[:, 8] == match.reshape(-1)).all()
    assert (out[:, 9] == w[:, lane ^ 8].reshape(-1)).all()  # two half-warp groups with their own masks
    assert sorted(out[:, 10]) == list(range(n))  # atomicInc hands out every ticket once
    assert scalars.tolist() == [v.sum(), v.max(), n, v.max()]  # atomicAdd(ull), atomicMax, atomicInc, CAS loop


# ---------------------------------------------------------------------------------------------------------------
# 4. cooperative persistent kernel: levels separated by cx_grid_sync()
# ---------------------------------------------------------------------------------------------------------------
def _grid_scan(lib, v, block, max_blocks, api, use_grid_sync):
    lib.cx_grid_scan.argtypes = [P, I, I, I, I, I, P, P, P]
    out = np.zeros(len(v), np.int32)
    grid = np.zeros(1, np.int32)
    shared_ok = np.zeros(1 << 17, np.int32)
    assert (
        lib.cx_grid_scan(_ptr(v), len(v), block, max_blocks, api, use_grid_sync, _ptr(out), _ptr(grid), _ptr(shared_ok))
        == 0
    )
    return out, int(grid[0]), shared_ok[: grid[0] * block]


@pytest.mark.parametrize("seed", [0, 11])
@pytest.mark.parametrize(
    "n, block, max_blocks, api",
    [(5000, 96, 5, 0), (3001, 64, 3, 1), (20000, 128, 0, 0)],
    ids=["5-blocks-macro", "3-blocks-cudaLaunchCooperativeKernel", "full-occupancy"],
)
def test_cooperative_prefix_scan(built, rng, n, block, max_blocks, api, seed):
    lib = _lib(built, "grid_scan", seed)
    v = rng.integers(0, 10, n).astype(np.int32)
    out, grid, shared_ok = _grid_scan(lib, v, block, max_blocks, api, use_grid_sync=1)
    assert grid == (max_blocks or 4 * (64 // (block // 32)))  # 4 emulated SMs x blocks per SM
    assert grid * block < n  # every thread owns several elements, so levels cross blocks
    assert (out == np.cumsum(v)).all()
    assert shared_ok.all(), "CX_SHARED memory leaked between blocks of a cooperative launch"


def test_cooperative_prefix_scan_without_grid_sync_is_wrong(built, rng):
    lib = _lib(built, "grid_scan")
    v = rng.integers(1, 10, 5000).astype(np.int32)
    out, _, _ = _grid_scan(lib, v, 96, 5, 0, use_grid_sync=0)
    assert not (out == np.cumsum(v)).all()


# ---------------------------------------------------------------------------------------------------------------
# Real CUDA bugs abort with a message (sync_errors.cu, one process per case)
# ---------------------------------------------------------------------------------------------------------------
ERROR_CASES = {
    1: "barrier divergence in block (0,0,0): 63 thread(s) wait in __syncthreads()",
    2: "wait in different barriers",
    3: "more than 1024 threads per block",
    4: "a plain __shared__ variable",
    5: "in a launch that is not cooperative",
    6: "deadlock: no thread can proceed",
    7: "run past the end of its 1024-byte allocation",
    8: "is not device memory from cudaMalloc",
    9: "fiber stack overflow",
    11: "dynamic shared memory exceeds the kernel's limit",
}


def _error_case(exe: Path, case: int, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(exe), str(case)], capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})}
    )


@pytest.mark.parametrize("case", [0, 100], ids=["CX_LAUNCH", "cx_emu::launch"])
def test_error_driver_runs_a_correct_kernel(built, case):
    result = _error_case(built["sync_errors"], case)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_bug_aborts_with_message(built, case):
    result = _error_case(built["sync_errors"], case)
    assert result.returncode != 0
    assert "cx_emu: " in result.stderr and ERROR_CASES[case] in result.stderr, result.stderr


def test_divergence_message_names_the_culprit(built):
    stderr = _error_case(built["sync_errors"], 1).stderr
    assert "first: thread (5,0,0)" in stderr and "in kernel `early_return`" in stderr
    assert re.search(r"sync_errors\.cu:\d+", stderr), stderr


@pytest.mark.slow
def test_address_sanitizer_sees_shared_memory_overflow(tmp_path):
    """Under -fsanitize=address the fibers are announced to ASan: a clean kernel runs clean, and writing one past
    a CX_SHARED array is reported."""
    driver = tmp_path / "asan_main.cpp"
    driver.write_text(ERROR_MAIN.format(kernel=KERNELS / "sync_errors.cu"))
    exe = tmp_path / "sync_errors_asan"
    cmd = [GXX, *CXXFLAGS, "-g", "-fsanitize=address", "-fno-omit-frame-pointer", driver, "-o", exe]
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if result.returncode != 0:
        if "asan" in result.stderr.lower() or "sanitize" in result.stderr.lower():
            pytest.skip(f"AddressSanitizer unavailable: {result.stderr[-300:]}")
        pytest.fail(result.stderr)
    env = {"ASAN_OPTIONS": "detect_leaks=0"}
    clean = _error_case(exe, 0, env)
    assert clean.returncode == 0, clean.stderr
    assert "ERROR: AddressSanitizer" not in clean.stderr
    overflow = _error_case(exe, 10, env)
    assert overflow.returncode != 0
    assert "heap-buffer-overflow" in overflow.stderr and "shared_overflow" in overflow.stderr, overflow.stderr


# ---------------------------------------------------------------------------------------------------------------
# 5. the same kernels compile with nvcc
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.nvcc
@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_kernels_compile_with_nvcc(tmp_path):
    """nvcc side of the prelude: sm_80 and sm_90 code, every warning an error. All kernels go into one translation
    unit (the prelude is idempotent), which costs one nvcc front end instead of one per file."""
    unit = tmp_path / "all_kernels.cu"
    unit.write_text("".join(f'#include "{path}"\n' for path in KERNEL_FILES))
    cmd = [
        NVCC,
        "-std=c++17",
        "-gencode",
        "arch=compute_80,code=sm_80",
        "-gencode",
        "arch=compute_90,code=sm_90",
        "-Werror",
        "all-warnings",
        f"-I{RUNTIME}",
        "-c",
        unit,
        "-o",
        tmp_path / "all_kernels.o",
    ]
    result = _run(cmd, "nvcc")
    assert "warning" not in (result.stdout + result.stderr).lower()


@pytest.mark.nvcc
@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_nvcc_refuses_the_emulator_header(tmp_path):
    unit = tmp_path / "wrong.cu"
    unit.write_text('#include "cuda_emu.h"\n')
    result = subprocess.run([NVCC, "-E", f"-I{RUNTIME}", str(unit)], capture_output=True, text=True)
    assert result.returncode != 0 and "nvcc must not include it" in result.stderr


STREAMS = r"""
#include "cuda_emu.h"
__global__ void add_one(float *x) { x[threadIdx.x] += 1.0f; }
__global__ void add_two(float *x) { x[threadIdx.x] += 2.0f; }
extern "C" int run(float *host, void *stream_handle) {
    cudaStream_t stream = (cudaStream_t)stream_handle;  /* any value: the emulator never dereferences it */
    float *d = nullptr;
    cudaMalloc(&d, 32 * sizeof(float));
    cudaMemsetAsync(d, 0, 32 * sizeof(float), stream);
    cudaMemcpyAsync(d, host, 32 * sizeof(float), cudaMemcpyHostToDevice, stream);
    CX_LAUNCH_STREAM(add_one, dim3(1), dim3(32), 0, stream, d);
    CX_LAUNCH_COOPERATIVE_STREAM(add_two, dim3(1), dim3(32), 0, stream, d);
    CX_LAUNCH(add_one, dim3(1), dim3(32), 0, d);  /* the default stream */
    cudaMemcpyAsync(host, d, 32 * sizeof(float), cudaMemcpyDeviceToHost, stream);
    cudaStreamSynchronize(stream);
    cudaDeviceSynchronize();
    return (int)cudaFree(d);
}
"""


@pytest.mark.slow
@pytest.mark.skipif(GXX is None, reason="g++ not found")
def test_the_stream_log_records_the_stream_each_call_names(tmp_path):
    """While its log is on, the emulator records which stream every launch, copy, memset and synchronisation
    names (the calls without a stream: 0), in order; it is off until started and cleared by a new start."""
    source = tmp_path / "streams.cpp"
    source.write_text(STREAMS)
    library = tmp_path / "streams.so"
    _run([GXX, *CXXFLAGS, "-fPIC", "-shared", source, "-o", library], "compiling the stream test")
    lib = ctypes.CDLL(str(library))
    lib.run.argtypes = [P, P]
    lib.cx_emu_stream_log.restype = ctypes.c_int64
    lib.cx_emu_stream_log.argtypes = [P, P, ctypes.c_int64]

    def log():
        count = lib.cx_emu_stream_log(None, None, 0)
        ops, streams = np.zeros(count, np.int64), np.zeros(count, np.uint64)
        lib.cx_emu_stream_log(_ptr(ops), _ptr(streams), count)
        return list(zip(ops.tolist(), streams.tolist()))

    host = np.arange(32, dtype=np.float32)
    assert lib.run(_ptr(host), 0xABC0) == 0 and log() == []  # off until started
    np.testing.assert_array_equal(host, np.arange(32) + 4)
    lib.cx_emu_stream_log_start()
    assert lib.run(_ptr(host), 0xABC0) == 0
    launch, cooperative, copy, memset, sync = range(5)
    s = 0xABC0
    assert log() == [
        (memset, s),
        (copy, s),
        (launch, s),
        (cooperative, s),
        (launch, 0),
        (copy, s),
        (sync, s),
        (sync, 0),
    ]
    lib.cx_emu_stream_log_start()
    assert log() == []
