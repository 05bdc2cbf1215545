#!/usr/bin/env bash
# The GPU check of device="cuda": run ONCE on the GPU machine (the `device` tool), from the repository root,
# with .gpu/ carried (fill it first, here, with scripts/prepare_gpu_check.sh). Nothing is fetched there.
#
#   1. checks the carried files (.gpu/SHA256SUMS); prints the GPU, driver, Python, torch and nvcc
#   2. installs the carried wheels into /tmp/site (pip --no-index --no-deps --target)
#   3. preflight: builds one example's .cu exactly as cortexc/targets/cuda/executor.py does (nvcc, no GPU needed)
#   4. builds PyCUDA from its sdist, offline, objects compiled in parallel; installs it into /tmp/site
#   5. installs cortexc itself into /tmp/site (as pip installs it, package data included), and runs tests
#      and benchmark from a copy of tests/ benchmarks/ examples/ so that the checkout's cortexc/ cannot shadow the installed one
#   6. tests/targets/cuda/test_cuda_gpu.py (CORTEXC_REQUIRE_GPU=1: a missing PyCUDA or GPU fails, never skips): the NumPy
#      API against the interpreter, cortexc.torch's CellModule on cuda against the cpu module (forward and
#      gradients; torch with CUDA required; also inside `with torch.cuda.stream(s):`, on a side stream), and
#      DDP on nccl over 2 GPUs (skipped with fewer)
#   7. benchmarks/bench_gpu.py; a summary, then the benchmark table LAST
#
# A failed step is reported and the later ones still run where they can (a failed PyCUDA build still gives the
# PyTorch numbers); the exit status is 1 if any step failed. The log goes to $OUT/gpu_check.log when $OUT is
# set, and the benchmark's JSON to $OUT/bench_gpu.json.
#
# Dry run on a machine without a GPU (any Python >= 3.10):  GPU_CHECK_DRY=1 bash scripts/gpu_check.sh
#   checks the carried files, has pip read every wheel for CPython 3.12 (installs the pure-Python ones with this
#   Python), installs cortexc into a temporary target, runs the nvcc preflight when nvcc is here, runs
#   tests/targets/cuda/test_cuda_gpu.py (it must skip) and the benchmark on the CPU on a few trees. GPU_CHECK_DRY_PYCUDA=1 also
#   compiles PyCUDA here (linked against an empty libcuda stub: it proves the build, not the module).
#
# Time: the whole check aims to end within GPU_CHECK_DEADLINE seconds (default 480; about 4 minutes are expected
# on an H200 with 16 cores): the PyCUDA build, the tests and the benchmark's two child processes each get a
# timeout cut to what is left, so a hung kernel still leaves the summary and the table.
#
# Knobs: PYTHON (default python3), GPU_CHECK_JOBS (parallel compiles, default nproc), GPU_CHECK_BENCH_ARGS
# (extra arguments for bench_gpu.py), GPU_CHECK_DEADLINE.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
DRY=${GPU_CHECK_DRY:-0}
JOBS=${GPU_CHECK_JOBS:-$(nproc)}
DEADLINE=${GPU_CHECK_DEADLINE:-480}
CARRIED=$REPO/.gpu
if [ "$DRY" = 1 ]; then
    SCRATCH=$(mktemp -d /tmp/gpu-check-dry.XXXXXX)
    SITE=$SCRATCH/site
    trap 'rm -rf "$SCRATCH"' EXIT
else
    SCRATCH=/tmp/gpu-check
    SITE=/tmp/site
    rm -rf "$SCRATCH"
fi
RUN=$SCRATCH/run          # the copy of tests/, benchmarks/, examples/ that tests and benchmark run from
TABLE=$SCRATCH/bench_table.txt
export CORTEXC_CACHE=$SCRATCH/cache
export CORTEXC_SST_DIR=$CARRIED/sst
mkdir -p "$SCRATCH" "$SITE" "$CORTEXC_CACHE"

T0=$SECONDS
FAILED=()
LAST_RC=0
left() { echo $((DEADLINE - (SECONDS - T0))); }
# within SECONDS [RESERVE]: the smaller of SECONDS and what the deadline leaves after RESERVE, at least 20
within() {
    local t=$(($(left) - ${2:-0}))
    [ "$t" -lt "$1" ] || t=$1
    [ "$t" -gt 20 ] || t=20
    echo "$t"
}
step() { printf '\n=== [%4ds] %s\n' "$((SECONDS - T0))" "$*"; }
failed() { FAILED+=("$1"); printf '!!! FAILED: %s\n' "$1"; }
# run_step NAME FUNCTION: the function in a subshell with errexit in force (bash ignores -e inside anything
# tested by || or if), its status in LAST_RC, a failure recorded; never stops the script itself
run_step() {
    local name=$1
    shift
    set +e
    (
        set -e
        "$@"
    )
    LAST_RC=$?
    set -e
    [ "$LAST_RC" -eq 0 ] || failed "$name"
}

check_carried() {
    step "carried files ($CARRIED)"
    if [ ! -f "$CARRIED/SHA256SUMS" ]; then
        echo "no $CARRIED/SHA256SUMS: run scripts/prepare_gpu_check.sh on the CPU machine and carry .gpu"
        return 1
    fi
    (cd "$CARRIED" && sha256sum -c --quiet SHA256SUMS) || return 1
    (cd "$CARRIED" && find . -path ./pyinc -prune -o -type f -print | sort | xargs ls -l |
        awk '{printf "  %9d  %s\n", $5, $9}')
    [ ! -d "$CARRIED/pyinc" ] || echo "  $(find "$CARRIED/pyinc" -type f | wc -l) CPython headers in ./pyinc/"
}

machine() {
    step "machine"
    if [ "$DRY" != 1 ]; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader ||
            nvidia-smi -L || echo "!!! nvidia-smi failed"
    fi
    "$PY" - <<'EOF' || true
import sys
print("python", sys.version.split()[0], sys.executable)
for name in ("numpy", "setuptools", "jinja2", "networkx", "pytest", "torch", "markupsafe", "typing_extensions"):
    try:
        module = __import__(name)
        print(f"  {name} {getattr(module, '__version__', '?')}")
    except ImportError as err:
        print(f"  {name} MISSING ({err})")
try:
    import torch
    print("  torch cuda", torch.version.cuda, "available:", torch.cuda.is_available(),
          "devices:", torch.cuda.device_count() if torch.cuda.is_available() else 0,
          "nccl:", torch.distributed.is_available() and torch.distributed.is_nccl_available())
except ImportError:
    pass
EOF
    if command -v nvcc >/dev/null; then
        echo "nvcc: $(command -v nvcc) -> $(readlink -f "$(command -v nvcc)"): $(nvcc --version | tail -2 | head -1)"
    else
        echo "nvcc: not on PATH"
    fi
    echo "cores: $(nproc), jobs: $JOBS"
}

install_wheels() {
    step "wheels -> $SITE"
    if [ "$DRY" = 1 ] && ! "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
        # pip reads every wheel as the GPU machine's pip would (CPython 3.12, manylinux x86_64) ...
        "$PY" -m pip install -q --disable-pip-version-check --dry-run --no-index --no-deps --ignore-installed \
            --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            --target "$SCRATCH/dry-target" "$CARRIED"/wheels/*.whl
        echo "pip (CPython 3.12 manylinux x86_64) accepts: $(cd "$CARRIED/wheels" && echo *.whl)"
        # ... and installs the pure-Python ones with this Python
        "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --upgrade \
            --target "$SITE" "$CARRIED"/wheels/*-py3-none-any.whl
    else
        "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target "$SITE" "$CARRIED"/wheels/*.whl
    fi
    ls "$SITE"
}

install_cortexc() {
    step "cortexc -> $SITE (from a copy of the checkout's package files)"
    local src=$SCRATCH/cortexc-src
    rm -rf "$src" && mkdir -p "$src"
    cp -r pyproject.toml README.md cortexc "$src"/
    find "$src" -name __pycache__ -prune -exec rm -rf {} +
    "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-build-isolation --no-compile \
        --upgrade --target "$SITE" "$src"
    rm -rf "$RUN" && mkdir -p "$RUN"
    cp -r tests benchmarks examples "$RUN"/
    find "$RUN" -name __pycache__ -prune -exec rm -rf {} +
    (cd "$RUN" && "$PY" -c "
import cortexc, cortexc.frontend.parser as p
from importlib import resources
assert cortexc.__file__.startswith('$SITE'), cortexc.__file__
assert resources.files('cortexc.grammars').joinpath('cell.lark').is_file()
import lark
print('cortexc from', cortexc.__file__, '| lark', lark.__version__, 'from', lark.__file__)
")
}

preflight_nvcc() {
    step "preflight: the CUDA executor's nvcc build of examples/treernn.cell (cortexc/targets/cuda/executor.py, no GPU)"
    if ! command -v nvcc >/dev/null; then
        echo "nvcc not on PATH: skipped"
        return 0
    fi
    # CudaExecutor.__init__ with a stand-in for PyCUDA that reports compute capability 9.0: the library is
    # built with the executor's own flags (and cached: on an H200 the test then reuses it)
    (cd "$RUN" && "$PY" - <<'EOF')
import types

import cortexc
import cortexc.targets.cuda.executor as cuda

device = types.SimpleNamespace(compute_capability=lambda: (9, 0))
driver = types.SimpleNamespace(Context=types.SimpleNamespace(get_device=lambda: device))
cuda._pycuda = lambda: (driver, None)
module = cortexc.load("examples/treernn.cell", X=9, H=7)
cls = getattr(module, module.__all__[0])
try:
    executor = cuda.CudaExecutor(cls._spec, cls._kernel_sources["cuda"], "preflight_treernn")
except Exception as err:
    lines = str(err).splitlines()
    print(f"{type(err).__name__}:", *lines[:12], f"... ({len(lines)} lines)" if len(lines) > 12 else "", sep="\n")
    raise SystemExit(1) from None
print("built and loaded:", executor.lib._name)
EOF
}

# LIBCUDA: the driver's libcuda (what PyCUDA links against and loads); its folder joins LD_LIBRARY_PATH
find_libcuda() {
    local f
    LIBCUDA=""
    for f in $(ldconfig -p 2>/dev/null | awk '/libcuda\.so/ {print $NF}') \
             /usr/local/nvidia/lib64/libcuda.so* /usr/lib/x86_64-linux-gnu/libcuda.so* /usr/lib64/libcuda.so*; do
        if [ -f "$f" ] && [[ "$f" != */stubs/* ]]; then LIBCUDA=$(readlink -f "$f"); break; fi
    done
    if [ -z "$LIBCUDA" ]; then
        LIBCUDA=$(timeout 30 find / -xdev -name 'libcuda.so*' -not -path '*/stubs/*' 2>/dev/null | head -1 || true)
    fi
    if [ -n "$LIBCUDA" ]; then
        export LD_LIBRARY_PATH=$(dirname "$LIBCUDA")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
        echo "driver library: $LIBCUDA"
    else
        echo "driver library libcuda.so not found"
    fi
}

pycuda_smoke() {
    (cd "$RUN" && "$PY" -c "
import pycuda, pycuda.autoinit, pycuda.driver as drv, pycuda.gpuarray as ga, numpy as np
dev = pycuda.autoinit.device
print('pycuda', pycuda.VERSION_TEXT, 'from', pycuda.__file__)
print('device', dev.name(), 'cc', dev.compute_capability(), 'driver', drv.get_driver_version(), 'built for', drv.get_version())
a = ga.to_gpu(np.arange(8, dtype=np.float32)); assert (2 * a).get().tolist() == [2.0 * i for i in range(8)]
print('gpuarray round trip ok (a kernel compiled by PyCUDA at run time)')
")
}

build_pycuda() {
    if [ "$DRY" != 1 ] && [ -d "$SITE/pycuda" ] && (cd "$RUN" && "$PY" -c 'import pycuda.driver' 2>/dev/null); then
        echo "PyCUDA is already in $SITE (a warm machine): not built again"
        pycuda_smoke
        return
    fi
    local build=$SCRATCH/pycuda-build
    rm -rf "$build" && mkdir -p "$build/lib"
    tar -xzf "$CARRIED"/sdist/pycuda-*.tar.gz -C "$build"
    local src
    src=$(echo "$build"/pycuda-*/)
    local nvcc_root cuda_root="" inc="" libcuda="" root d
    nvcc_root=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
    # the toolkit: where cuda.h is (nvcc on PATH may be a wrapper script outside the toolkit)
    for root in ${CUDA_HOME:-} ${CUDA_PATH:-} "$nvcc_root" /usr/local/cuda; do
        for d in "$root/include" "$root/targets/x86_64-linux/include"; do
            if [ -z "$inc" ] && [ -f "$d/cuda.h" ]; then inc=$d; cuda_root=$root; fi
        done
    done
    [ -n "$inc" ] || { echo "cuda.h not found (nvcc in $nvcc_root; set CUDA_HOME)"; return 1; }
    local pyinc
    pyinc=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
    if [ ! -f "$pyinc/Python.h" ] || [ "${GPU_CHECK_CARRIED_PYINC:-0}" = 1 ]; then
        if ! "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' ||
           [ ! -f "$CARRIED/pyinc/python3.12/Python.h" ]; then
            echo "no Python.h in $pyinc, and no carried CPython 3.12 headers for this Python"
            return 1
        fi
        echo "Python.h: the carried CPython 3.12 headers (none in $pyinc)"
        export CPATH=$CARRIED/pyinc/python3.12${CPATH:+:$CPATH}
    fi
    if [ "$DRY" = 1 ]; then
        # no driver here: an empty stub with the driver's soname lets the link (not the import) be tried
        echo 'void cortexc_libcuda_stub(void) {}' | gcc -shared -fPIC -x c - -Wl,-soname,libcuda.so.1 \
            -o "$build/lib/libcuda.so"
        libcuda="(empty stub)"
    else
        libcuda=${LIBCUDA:-}
        if [ -z "$libcuda" ]; then
            # no driver library found: the toolkit's stub (it defines the cu* symbols; soname libcuda.so.1)
            for f in "$cuda_root"/lib64/stubs/libcuda.so "$cuda_root"/targets/x86_64-linux/lib/stubs/libcuda.so \
                     /usr/local/cuda*/lib64/stubs/libcuda.so; do
                if [ -f "$f" ]; then libcuda=$(readlink -f "$f"); break; fi
            done
        fi
        [ -n "$libcuda" ] || { echo "libcuda.so not found"; return 1; }
        ln -s "$libcuda" "$build/lib/libcuda.so"
    fi
    echo "source $src; CUDA_ROOT $cuda_root; cuda.h in $inc; libcuda $libcuda"
    # siteconf.py answers configure.py's questions (and skips its 10-second countdown); no CURAND, no GL
    cat >"$src/siteconf.py" <<EOF
CUDA_ROOT = "$cuda_root"
CUDA_INC_DIR = ["$inc"]
CUDADRV_LIB_DIR = ["$build/lib"]
CUDADRV_LIBNAME = ["cuda"]
CUDA_ENABLE_CURAND = False
CUDA_ENABLE_GL = False
USE_SHIPPED_BOOST = True
CXXFLAGS = []
LDFLAGS = []
EOF
    # setuptools compiles the sources of one extension one after another, and nearly all of PyCUDA is one
    # extension (_driver): this runs setup.py with the compiler's object loop spread over threads
    cat >"$src/build_parallel.py" <<'EOF'
import os
import runpy
import sys
from concurrent.futures import ThreadPoolExecutor

import setuptools  # noqa: F401  (puts setuptools' distutils in place)
from distutils import ccompiler

JOBS = int(os.environ.get("PYCUDA_JOBS", os.cpu_count() or 1))


def compile_parallel(self, sources, output_dir=None, macros=None, include_dirs=None, debug=False,
                     extra_preargs=None, extra_postargs=None, depends=None):
    macros, objects, extra_postargs, pp_opts, build = self._setup_compile(
        output_dir, macros, include_dirs, sources, depends, extra_postargs)
    cc_args = self._get_cc_args(pp_opts, debug, extra_preargs)

    def one(obj):
        if obj in build:
            src, ext = build[obj]
            self._compile(obj, src, ext, cc_args, extra_postargs, pp_opts)

    with ThreadPoolExecutor(JOBS) as pool:
        list(pool.map(one, objects))
    return objects


ccompiler.CCompiler.compile = compile_parallel
sys.path.insert(0, os.getcwd())
sys.argv = ["setup.py", *sys.argv[1:]]
runpy.run_path("setup.py", run_name="__main__")
EOF
    local t=$SECONDS
    (cd "$src" && PYCUDA_JOBS=$JOBS timeout "$(within 300 150)" "$PY" build_parallel.py build_ext \
        >"$build/build.log" 2>&1) || {
        tail -40 "$build/build.log"; [ -z "${OUT:-}" ] || cp "$build/build.log" "$OUT/pycuda_build.log"; return 1; }
    echo "compiled in $((SECONDS - t)) s with $JOBS jobs ($(grep -c -- ' -c ' "$build/build.log") compiler runs)"
    echo "($(grep -c 'warning:' "$build/build.log" || true) compiler warnings; the log: $build/build.log)"
    t=$SECONDS
    # pip builds the wheel in the same tree: the objects are up to date, only the wheel is made
    (cd "$src" && "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-build-isolation \
        --no-compile --upgrade --target "$SITE" . >"$build/install.log" 2>&1) || {
        tail -40 "$build/install.log"; [ -z "${OUT:-}" ] || cp "$build/install.log" "$OUT/pycuda_install.log"; return 1; }
    echo "installed in $((SECONDS - t)) s: $(ls -d "$SITE"/pycuda*)"
    [ "$DRY" = 1 ] && return 0   # built for this machine's Python against a stub libcuda: not importable
    pycuda_smoke
}

run_tests() {
    step "tests/targets/cuda/test_cuda_gpu.py"
    local require=1
    [ "$DRY" = 1 ] && require=0
    local rc=0 limit per_test=()
    limit=$(within 240 100)  # leaves the benchmark 100 s
    # pytest-timeout (on the GPU image), thread method: a test stuck in a kernel ends the run, not just the test
    if "$PY" -c 'import pytest_timeout' 2>/dev/null; then per_test=(--timeout=120 --timeout-method=thread); fi
    echo "(timeout ${limit} s${per_test:+, ${per_test[0]} per test})"
    (cd "$RUN" && CORTEXC_REQUIRE_GPU=$require timeout "$limit" "$PY" -m pytest -p no:cacheprovider -ra -v -s \
        --durations=5 "${per_test[@]}" tests/targets/cuda/test_cuda_gpu.py) || rc=$?
    if [ "$DRY" = 1 ] && [ "$rc" -eq 5 ]; then
        echo "(dry run: the module skipped, as it must without a GPU)"
        rc=0
    fi
    if [ "$DRY" = 1 ] && [ "$rc" -eq 0 ]; then
        # the CellModule checks through the CUDA host path on the emulator (what .to("cuda") runs)
        (cd "$RUN" && CORTEXC_GPU_TEST_DEVICE=cuda-emu timeout "$(within 240 100)" "$PY" -m pytest \
            -p no:cacheprovider -q tests/targets/cuda/test_cuda_gpu.py -k "cell_module or ddp") || rc=$?
    fi
    return "$rc"
}

run_bench() {
    step "benchmarks/bench_gpu.py"
    local limit worker
    limit=$(within 400 5)
    worker=$(((limit - 25) / 2))  # two child processes, one after the other, and the parent's own setup
    [ "$worker" -gt 20 ] || worker=20
    echo "(timeout ${limit} s, ${worker} s per child process)"
    local args=(--table "$TABLE" --worker-timeout "$worker")
    [ -n "${OUT:-}" ] && args+=(--json "$OUT/bench_gpu.json")
    if [ "$DRY" = 1 ]; then
        # a smoke test of the script on the CPU; one OpenMP/torch thread, as a loaded small machine wants
        export OMP_NUM_THREADS=1
        args+=(--device cpu --hidden 64 --batches 1 10 --max-trees 10 --per-node-trees 5 --repeats 2)
    fi
    # shellcheck disable=SC2086
    (cd "$RUN" && timeout "$limit" "$PY" benchmarks/bench_gpu.py "${args[@]}" ${GPU_CHECK_BENCH_ARGS:-})
}

summary() {
    step "summary"
    if [ "${#FAILED[@]}" -eq 0 ]; then
        echo "all steps passed"
    else
        printf 'FAILED: %s\n' "${FAILED[@]}"
    fi
    if [ -f "$TABLE" ]; then
        step "benchmark table"
        cat "$TABLE"
    fi
    [ "${#FAILED[@]}" -eq 0 ]
}

main() {
    echo "gpu_check $(date -u +%FT%TZ) dry=$DRY repo=$REPO commit=$(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    run_step "carried files" check_carried
    [ "$LAST_RC" -eq 0 ] || { summary; return 1; }
    run_step "machine" machine
    run_step "wheels" install_wheels
    [ "$LAST_RC" -eq 0 ] || { summary; return 1; }
    export PYTHONPATH=$SITE
    run_step "cortexc install" install_cortexc
    [ "$LAST_RC" -eq 0 ] || { summary; return 1; }
    run_step "nvcc preflight (the CUDA executor's build of a .cu, cortexc/targets/cuda/executor.py)" preflight_nvcc
    if [ "$DRY" != 1 ] || [ "${GPU_CHECK_DRY_PYCUDA:-0}" = 1 ]; then
        step "PyCUDA from its sdist"
        [ "$DRY" = 1 ] || find_libcuda
        run_step "PyCUDA build" build_pycuda
    fi
    run_step "tests/targets/cuda/test_cuda_gpu.py" run_tests
    run_step "benchmarks/bench_gpu.py" run_bench
    summary
}

if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    main 2>&1 | tee "$OUT/gpu_check.log"
    exit "${PIPESTATUS[0]}"
fi
main
