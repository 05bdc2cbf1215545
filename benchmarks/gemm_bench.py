#!/usr/bin/env python3
"""Benchmark the cx_gemm micro-kernel (templates/gemm.h.j2) against torch.matmul on level-batch shapes.

Renders the template, compiles it with a small C harness (gcc -O3 -march=native -fopenmp), and prints
GFLOP/s for 1 thread and 2 threads (the harness splits the rows, or the panels, with OpenMP the way a
generated kernel would) beside torch.matmul with torch.set_num_threads(1) and (2).

The cx rows are gathered through row pointers into a state array (random child indices), as generated
code does; torch multiplies an already-contiguous activation matrix, so the gather is free for it.
Packing W is done once, outside the timing (weights are packed at load time).

    python benchmarks/gemm_bench.py [--nr 16] [--mr 8] [--vregs 32] [--repeats 15] [--shapes '256,600,1280;...']
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jinja2
import numpy as np

TEMPLATES = Path(__file__).resolve().parents[1] / "cortexc" / "codegen" / "templates"
SHAPES = [(16, 300, 750), (64, 300, 750), (256, 300, 750), (1024, 300, 750), (256, 600, 1280), (1024, 256, 1280)]

HARNESS = r"""
#include <omp.h>
#include <stdlib.h>
#include "gemm.h"

size_t bench_packed_size(int M, int K) { return cx_packed_size(M, K); }
void bench_pack(const float *W, int M, int K, float *packed) { cx_pack(W, M, K, K, packed); }

/* Time `reps` calls of C = gather(S, idx) @ W^T.  split: 0 = rows, 1 = panels (ignored for 1 thread). */
double bench_run(int rows, const float *S, const int *idx, int K, const float *packed, int M, float *C,
                 int reps, int threads, int split)
{
    const float **a = malloc(sizeof(*a) * (rows > 0 ? rows : 1));
    for (int r = 0; r < rows; r++)
        a[r] = S + (size_t)idx[r] * K;
    int panels = (M + CX_NR - 1) / CX_NR;
    double t0 = omp_get_wtime();
    for (int rep = 0; rep < reps; rep++) {
        if (threads <= 1) {
            cx_gemm_rows_all(rows, a, K, packed, M, C, M, 0);
            continue;
        }
        #pragma omp parallel num_threads(threads)
        {
            int t = omp_get_thread_num(), n = omp_get_num_threads();
            if (split == 0) {
                /* Row split on MR-row tile boundaries. */
                int tiles = (rows + CX_MR - 1) / CX_MR;
                int r0 = tiles * t / n * CX_MR, r1 = tiles * (t + 1) / n * CX_MR;
                if (r1 > rows) r1 = rows;
                if (r1 > r0)
                    cx_gemm_rows_all(r1 - r0, a + r0, K, packed, M, C + (size_t)r0 * M, M, 0);
            } else {
                /* Panel split on pairs of panels (the kernel's register tile is two panels wide). */
                int pairs = (panels + 1) / 2;
                int p0 = pairs * t / n * 2, p1 = pairs * (t + 1) / n * 2;
                cx_gemm_rows(rows, a, K, packed, M, p0, p1 < panels ? p1 : panels, C, M, 0);
            }
        }
    }
    double dt = omp_get_wtime() - t0;
    free(a);
    return dt;
}
"""


def build(nr: int, mr: int, vregs: int, workdir: Path, extra_flags: list[str]) -> ctypes.CDLL:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined)
    (workdir / "gemm.h").write_text(env.get_template("gemm.h.j2").render(nr=nr, mr=mr, vregs=vregs))
    (workdir / "bench.c").write_text(HARNESS)
    so = workdir / "bench.so"
    cmd = [
        "gcc",
        "-O3",
        "-march=native",
        "-fopenmp",
        "-shared",
        "-fPIC",
        *extra_flags,
        "-o",
        str(so),
        str(workdir / "bench.c"),
    ]
    subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(str(so))
    fp, ip = ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_int)
    lib.bench_packed_size.restype = ctypes.c_size_t
    lib.bench_packed_size.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.bench_pack.restype = None
    lib.bench_pack.argtypes = [fp, ctypes.c_int, ctypes.c_int, fp]
    lib.bench_run.restype = ctypes.c_double
    lib.bench_run.argtypes = [
        ctypes.c_int,
        fp,
        ip,
        ctypes.c_int,
        fp,
        ctypes.c_int,
        fp,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
    ]
    return lib


def ptr(a: np.ndarray, ctype=ctypes.c_float):
    return a.ctypes.data_as(ctypes.POINTER(ctype))


def reps_for(flops: float) -> int:
    """Calls per timed sample: about 5 ms of work at ~150 GFLOP/s (short samples, so that on a shared
    machine some of them run undisturbed: see the 'best' figures)."""
    return max(1, int(7.5e8 / flops))


def rates(flops: float, times: list[float]) -> tuple[float, float]:
    """(median, best) GFLOP/s over the timed samples."""
    return flops / np.median(times) / 1e9, flops / np.min(times) / 1e9


def bench_cx(lib, rows, K, M, threads, split, repeats, rng) -> tuple[float, float]:
    S = rng.standard_normal((2 * rows, K)).astype(np.float32)  # state array the rows are gathered from
    idx = rng.integers(0, 2 * rows, rows).astype(np.int32)
    W = (rng.standard_normal((M, K)) / np.sqrt(K)).astype(np.float32)
    packed = np.empty(lib.bench_packed_size(M, K), np.float32)
    lib.bench_pack(ptr(W), M, K, ptr(packed))
    C = np.empty((rows, M), np.float32)
    flops = 2.0 * rows * K * M
    reps = reps_for(flops)
    args = (rows, ptr(S), ptr(idx, ctypes.c_int), K, ptr(packed), M, ptr(C))
    lib.bench_run(*args, reps, threads, split)  # warm-up (threads, caches, page faults)
    ref = S[idx].astype(np.float64) @ W.astype(np.float64).T
    err = np.abs(C - ref).max() / max(np.abs(ref).max(), 1e-30)
    if err > 1e-4:
        sys.exit(f"cx_gemm result wrong for {(rows, K, M)}: rel err {err:.2e}")
    times = [lib.bench_run(*args, reps, threads, split) / reps for _ in range(repeats)]
    return rates(flops, times)


def bench_torch(rows, K, M, threads, repeats, rng) -> tuple[float, float] | None:
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(threads)
    a = torch.from_numpy(rng.standard_normal((rows, K)).astype(np.float32))
    w = torch.from_numpy(rng.standard_normal((M, K)).astype(np.float32))
    out = torch.empty(rows, M)
    wt = w.t()
    flops = 2.0 * rows * K * M
    reps = reps_for(flops)
    for _ in range(reps):
        torch.matmul(a, wt, out=out)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, wt, out=out)
        times.append((time.perf_counter() - t0) / reps)
    return rates(flops, times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nr", type=int, default=16, help="panel width in floats (16 AVX-512, 8 AVX2, 4 portable)")
    ap.add_argument("--mr", type=int, default=8, help="rows per register tile")
    ap.add_argument("--vregs", type=int, default=32, help="vector registers of the ISA (32 AVX-512/NEON, 16 AVX2)")
    ap.add_argument("--repeats", type=int, default=31, help="timed samples per cell (median and best are reported)")
    ap.add_argument("--cflags", default="", help="extra gcc flags, e.g. -DCX_GEMM_L2_BYTES=262144")
    ap.add_argument("--shapes", default="", help="subset, e.g. '16,300,750;256,600,1280' (default: all)")
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args()
    if shutil.which("gcc") is None:
        sys.exit("gcc not found")

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="cx_gemm_bench_") as tmp:
        lib = build(args.nr, args.mr, args.vregs, Path(tmp), args.cflags.split())
        print(
            f"cx_gemm nr={args.nr} mr={args.mr} {args.cflags}  cores={os.cpu_count()}  "
            f"load average before: {os.getloadavg()[0]:.2f}"
        )
        print(f"GFLOP/s as 'median (best)' of {args.repeats} timed samples")
        cols = ["cx 1T", "torch 1T", "cx 2T rows", "cx 2T panels", "torch 2T"]
        hdr = f"{'rows':>5} {'K':>4} {'M':>5} |" + "".join(f" {c:>13}" for c in cols)
        print(hdr)
        print("-" * len(hdr))
        shapes = [tuple(int(x) for x in sh.split(",")) for sh in args.shapes.split(";") if sh] or SHAPES
        for rows, K, M in shapes:
            cells = [
                bench_cx(lib, rows, K, M, 1, 0, args.repeats, rng),
                None if args.no_torch else bench_torch(rows, K, M, 1, args.repeats, rng),
                bench_cx(lib, rows, K, M, 2, 0, args.repeats, rng),
                bench_cx(lib, rows, K, M, 2, 1, args.repeats, rng),
                None if args.no_torch else bench_torch(rows, K, M, 2, args.repeats, rng),
            ]
            text = ["n/a" if x is None else f"{x[0]:.1f} ({x[1]:.0f})" for x in cells]
            print(f"{rows:>5} {K:>4} {M:>5} |" + "".join(f" {t:>13}" for t in text), flush=True)
        print(f"load average after: {os.getloadavg()[0]:.2f} (other processes on these cores skew the 2T numbers)")


if __name__ == "__main__":
    main()
