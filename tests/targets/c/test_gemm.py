"""The float32 GEMM micro-kernel template (cortexc/targets/c/templates/gemm.h.j2), compiled with gcc and checked
against NumPy float64 matmul through a small ctypes harness."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import jinja2
import numpy as np
import pytest

from cortexc.targets.c.target import C_GEMM_ISAS
from cortexc.targets.c.target import TARGET as C

TEMPLATES = Path(__file__).resolve().parents[3] / "cortexc" / "targets" / "c" / "templates"
RTOL = 1e-5

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not found (needed to compile the kernel)")

HARNESS = r"""
#include <stdlib.h>
#include <omp.h>
#include "gemm.h"

int t_nr(void) { return CX_NR; }
int t_mr(void) { return CX_MR; }
size_t t_packed_size(int M, int K) { return cx_packed_size(M, K); }
void t_pack(const float *W, int M, int K, int ldw, float *packed) { cx_pack(W, M, K, ldw, packed); }

/* acc[M][K] += sum_r A[ia[r]][:M] outer B[ib[r]][:K] (cx_gemm_tn_acc, the weight gradient of a tile). */
void t_gemm_tn(int rows, const float *A, int lda, const int *ia, const float *B, int ldb, const int *ib, int M,
               int K, float *acc)
{
    const float **a = malloc(sizeof(*a) * (rows > 0 ? rows : 1)), **b = malloc(sizeof(*b) * (rows > 0 ? rows : 1));
    for (int r = 0; r < rows; r++) {
        a[r] = A + (size_t)ia[r] * lda;
        b[r] = B + (size_t)ib[r] * ldb;
    }
    cx_gemm_tn_acc(rows, a, M, b, K, acc);
    free(a);
    free(b);
}

/* cx_gemm_grouped with the scratch a kernel gives it: row r reads A + r*lda, its group group[r]. */
void t_gemm_grouped(int rows, const float *A, int lda, const int *group, int ngroups, int K, const float *packed,
                    int M, int lo, int width, float *c, int ldc)
{
    const float **a = malloc(sizeof(*a) * (rows > 0 ? rows : 1)), **sorted = malloc(sizeof(*a) * (rows > 0 ? rows : 1));
    int *order = malloc(sizeof(int) * (rows > 0 ? rows : 1));
    float *tmp = malloc(sizeof(float) * (size_t)(rows > 0 ? rows : 1) * (size_t)(width + 2 * CX_NR));
    for (int r = 0; r < rows; r++)
        a[r] = A + (size_t)r * lda;
    cx_gemm_grouped(rows, a, group, ngroups, K, packed, M, lo, width, c, ldc, sorted, order, tmp);
    free(a);
    free(sorted);
    free(order);
    free(tmp);
}

/* cx_gemm_grouped_k likewise: row r reads A + r*lda (K floats, zero outside its group's k). */
void t_gemm_grouped_k(int rows, const float *A, int lda, const int *group, int ngroups, int K, int width,
                      const float *packed, int M, float *c, int ldc)
{
    const float **a = malloc(sizeof(*a) * (rows > 0 ? rows : 1)), **sorted = malloc(sizeof(*a) * (rows > 0 ? rows : 1));
    int *order = malloc(sizeof(int) * (rows > 0 ? rows : 1));
    float *tmp = malloc(sizeof(float) * (size_t)(rows > 0 ? rows : 1) * (size_t)M);
    for (int r = 0; r < rows; r++)
        a[r] = A + (size_t)r * lda;
    cx_gemm_grouped_k(rows, a, group, ngroups, K, width, packed, M, c, ldc, sorted, order, tmp);
    free(a);
    free(sorted);
    free(order);
    free(tmp);
}

/* Row r of the product reads A + idx[r]*lda, or the shared zero row when idx[r] < 0 (a fused gather).
   p0 < 0: all panels through cx_gemm_rows_all.  threads > 1: split rows (split=0) or panels (split=1)
   with OpenMP, the way generated kernels do. */
void t_gemm(int rows, const float *A, int lda, const int *idx, const float *zero, int K, const float *packed,
            int M, int p0, int p1, float *c, int ldc, int acc, int threads, int split)
{
    const float **a = malloc(sizeof(*a) * (rows > 0 ? rows : 1));
    for (int r = 0; r < rows; r++)
        a[r] = idx[r] < 0 ? zero : A + (size_t)idx[r] * lda;
    if (threads <= 1) {
        if (p0 < 0)
            cx_gemm_rows_all(rows, a, K, packed, M, c, ldc, acc);
        else
            cx_gemm_rows(rows, a, K, packed, M, p0, p1, c, ldc, acc);
    } else {
        int panels = (M + CX_NR - 1) / CX_NR;
        #pragma omp parallel num_threads(threads)
        {
            int t = omp_get_thread_num(), n = omp_get_num_threads();
            if (split == 0) {
                int r0 = rows * t / n, r1 = rows * (t + 1) / n;
                cx_gemm_rows_all(r1 - r0, a + r0, K, packed, M, c + (size_t)r0 * ldc, ldc, acc);
            } else {
                cx_gemm_rows(rows, a, K, packed, M, panels * t / n, panels * (t + 1) / n, c, ldc, acc);
            }
        }
    }
    free(a);
}
"""

NATIVE = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror"]
# No -march and ISO C99: the vector extensions must still compile (as SSE / scalar code) and stay correct.
GENERIC = ["-O2", "-std=c99", "-fopenmp", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror"]

# (name, nr, mr, vregs, gcc flags): every build the C target emits (target.gemm_isas), each compiled here with
# -march=native whatever its ISA (a vector wider than the machine's is split by gcc), and odd shapes
BUILDS = [
    *((f"isa-{i}-nr{isa.nr}-mr{isa.mr}-v{isa.vregs}", isa.nr, isa.mr, isa.vregs, NATIVE)
      for i, isa in enumerate(C_GEMM_ISAS)),
    ("generic-c99-nr8-mr5", 8, 5, 16, GENERIC),
    ("generic-c99-nr4-mr3", 4, 3, 32, GENERIC),
]  # fmt: skip


def render(nr: int, mr: int, vregs: int = 32) -> str:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined)
    return env.get_template("gemm.h.j2").render(nr=nr, mr=mr, vregs=vregs) + env.get_template("gemm_tn.h.j2").render(
        vregs=vregs
    )


class Kernel:
    """ctypes view of one compiled (nr, mr) build."""

    def __init__(self, so: Path):
        lib = ctypes.CDLL(str(so))
        fp, ip, i = ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_int), ctypes.c_int
        lib.t_packed_size.restype = ctypes.c_size_t
        lib.t_packed_size.argtypes = [i, i]
        lib.t_pack.restype = None
        lib.t_pack.argtypes = [fp, i, i, i, fp]
        lib.t_gemm.restype = None
        lib.t_gemm.argtypes = [i, fp, i, ip, fp, i, fp, i, i, i, fp, i, i, i, i]
        lib.t_gemm_grouped.restype = None
        lib.t_gemm_grouped.argtypes = [i, fp, i, ip, i, i, fp, i, i, i, fp, i]
        lib.t_gemm_grouped_k.restype = None
        lib.t_gemm_grouped_k.argtypes = [i, fp, i, ip, i, i, i, fp, i, fp, i]
        lib.t_gemm_tn.restype = None
        lib.t_gemm_tn.argtypes = [i, fp, i, ip, fp, i, ip, i, i, fp]
        self.lib = lib
        self.nr = lib.t_nr()
        self.mr = lib.t_mr()

    def pack(self, W: np.ndarray) -> np.ndarray:
        """Pack W[M][K] (any row stride) into cx panels."""
        M, K = W.shape
        assert W.dtype == np.float32 and W.strides[1] == 4
        packed = np.full(self.lib.t_packed_size(M, K), np.nan, np.float32)
        self.lib.t_pack(_fp(W), M, K, W.strides[0] // 4, _fp(packed))
        return packed

    def gemm_tn(self, A, ia, B, ib, acc) -> None:
        """acc (+)= gather(A, ia)[:, :M].T @ gather(B, ib)[:, :K], M, K = acc.shape (acc contiguous)."""
        assert acc.flags.c_contiguous and A.strides[1] == 4 and B.strides[1] == 4
        ia, ib = (np.ascontiguousarray(x, np.int32) for x in (ia, ib))
        ip = ctypes.POINTER(ctypes.c_int)
        self.lib.t_gemm_tn(
            len(ia), _fp(A), _ld(A), ia.ctypes.data_as(ip), _fp(B), _ld(B), ib.ctypes.data_as(ip),
            acc.shape[0], acc.shape[1], _fp(acc),
        )  # fmt: skip

    def gemm_grouped(self, A, group, groups, packed, M, K, lo, width, c) -> None:
        """c[r, lo + g*width : lo + (g+1)*width] = (A[r] @ W.T) there, g = group[r]; c contiguous."""
        group = np.ascontiguousarray(group, np.int32)
        self.lib.t_gemm_grouped(
            len(group), _fp(A), _ld(A), group.ctypes.data_as(ctypes.POINTER(ctypes.c_int)), groups, K,
            _fp(packed), M, lo, width, _fp(c), _ld(c),
        )  # fmt: skip

    def gemm_grouped_k(self, A, group, groups, width, packed, M, K, c) -> None:
        """c[r] = A[r] @ W.T over row r's group's k alone (A[r] zero elsewhere); c contiguous."""
        group = np.ascontiguousarray(group, np.int32)
        self.lib.t_gemm_grouped_k(
            len(group), _fp(A), _ld(A), group.ctypes.data_as(ctypes.POINTER(ctypes.c_int)), groups, K, width,
            _fp(packed), M, _fp(c), _ld(c),
        )  # fmt: skip

    def gemm(self, A, idx, packed, M, K, c, acc, p0=-1, p1=-1, threads=1, split=0) -> None:
        """c[r, :M] (+)= gather(A, idx)[r] @ W.T; c may be a column slice of a wider (padded) array."""
        assert all(x.size == 0 or x.strides[1] == 4 for x in (A, c))
        zero = np.zeros(K, np.float32)
        idx = np.ascontiguousarray(idx, np.int32)
        self.lib.t_gemm(
            len(idx),
            _fp(A),
            _ld(A),
            idx.ctypes.data_as(ctypes.POINTER(ctypes.c_int)),
            _fp(zero),
            K,
            _fp(packed),
            M,
            p0,
            p1,
            _fp(c),
            _ld(c),
            acc,
            threads,
            split,
        )


def _ld(a: np.ndarray) -> int:
    """Leading dimension (row stride in floats) of a 2-D float32 array."""
    return a.strides[0] // 4 if a.size else max(a.shape[1], 1)


def _fp(a: np.ndarray):
    return a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))


@pytest.fixture(scope="module", params=BUILDS, ids=[b[0] for b in BUILDS])
def kernel(request, tmp_path_factory) -> Kernel:
    name, nr, mr, vregs, flags = request.param
    k = _compile(tmp_path_factory.mktemp(name), render(nr, mr, vregs), flags)
    assert (k.nr, k.mr) == (nr, mr)
    return k


def _compile(d: Path, header: str, flags: list[str]) -> Kernel:
    (d / "gemm.h").write_text(header)
    (d / "harness.c").write_text(HARNESS)
    so = d / "harness.so"
    proc = subprocess.run(["gcc", *flags, "-o", str(so), str(d / "harness.c")], capture_output=True, text=True)
    assert proc.returncode == 0, f"gcc failed for {d.name}:\n{proc.stderr}"
    return Kernel(so)


def gathered(rng, rows: int, K: int, n_state: int = 13):
    """A state array with padded rows (lda > K) and a gather index with repeats and zero rows (-1)."""
    A = rng.standard_normal((n_state, K + 5)).astype(np.float32)[:, :K]
    idx = rng.integers(-1, n_state, rows).astype(np.int32)
    if rows >= 3:
        idx[1] = idx[2] = 4  # a repeat
        idx[0] = -1  # the shared zero row
    return A, idx


def reference(A, idx, W, c0, acc) -> np.ndarray:
    a = np.where((idx >= 0)[:, None], A[np.maximum(idx, 0)], 0).astype(np.float64)
    out = a @ W.astype(np.float64).T
    return out + c0.astype(np.float64) if acc else out


def magnitude(A, idx, W, c0, acc) -> np.ndarray:
    """The sum of the absolute values of the terms of each output: what float32 rounding scales with. A
    dot product can cancel to near zero (one output row of one column), so the error is measured
    against this, not against the result."""
    a = np.where((idx >= 0)[:, None], A[np.maximum(idx, 0)], 0).astype(np.float64)
    out = np.abs(a) @ np.abs(W.astype(np.float64)).T
    return out + np.abs(c0.astype(np.float64)) if acc else out


def check_close(got, want, what: str, scale_of: np.ndarray | None = None) -> None:
    """Normwise relative error (against `scale_of`, the terms' magnitudes, when given) within RTOL."""
    scale = max(float(np.abs(want if scale_of is None else scale_of).max(initial=0.0)), 1e-30)
    err = float(np.abs(got.astype(np.float64) - want).max(initial=0.0)) / scale
    assert np.isfinite(got).all() and err <= RTOL, f"{what}: relative error {err:.3g}"


def test_render_is_strict_and_clean():
    src = render(16, 8)
    assert "{{" not in src and "{%" not in src
    for sym in (
        "cx_packed_size(int M, int K)",
        "cx_pack(const float *W, int M, int K, int ldw, float *packed)",
        "cx_gemm_rows(int rows, const float *const *a_rows, int K, const float *packed, int M,",
        "cx_gemm_rows_all(int rows, const float *const *a_rows, int K, const float *packed, int M,",
    ):
        assert sym in src
    with pytest.raises(jinja2.UndefinedError):
        jinja2.Environment(
            loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined
        ).get_template("gemm.h.j2").render(nr=16)


@pytest.mark.parametrize("K", [1, 3, 300])
def test_pack_layout(kernel, K, rng):
    nr = kernel.nr
    for M in (1, nr - 1, nr, nr + 1, 450):
        if M < 1:
            continue
        W = rng.standard_normal((M, K + 7)).astype(np.float32)[:, :K]  # ldw > K
        packed = kernel.pack(W)
        panels = -(-M // nr)
        assert packed.size == panels * K * nr
        padded = np.zeros((panels * nr, K), np.float32)
        padded[:M] = W
        # packed[p*K*NR + k*NR + j] = W[p*NR + j][k], zero past M
        want = padded.reshape(panels, nr, K).transpose(0, 2, 1).ravel()
        np.testing.assert_array_equal(packed, want, err_msg=f"M={M} K={K}")


@pytest.mark.parametrize("acc", [0, 1])
@pytest.mark.parametrize("M_kind", ["1", "NR-1", "NR+1", "450", "750"])
def test_gemm_matches_numpy(kernel, M_kind, acc, rng):
    nr, mr = kernel.nr, kernel.mr
    M = eval(M_kind, {"NR": nr})
    if M < 1:
        pytest.skip("M < 1")
    for K in (1, 3, 300):
        W = rng.standard_normal((M, K)).astype(np.float32)
        packed = kernel.pack(W)
        for rows in sorted({0, 1, 2, 3, max(mr - 1, 0), mr, mr + 1, 10, 2 * mr, 37}):  # every tile height
            A, idx = gathered(rng, rows, K)
            pad = 3  # ldc > M: the padding columns must stay untouched
            c = rng.standard_normal((rows, M + pad)).astype(np.float32)
            if not acc:
                c[:, :M] = np.nan  # overwrite mode must not read C
            before = c.copy()
            kernel.gemm(A, idx, packed, M, K, c[:, :M], acc)
            want = reference(A, idx, W, before[:, :M], acc)
            terms = magnitude(A, idx, W, before[:, :M], acc)
            check_close(c[:, :M], want, f"rows={rows} K={K} M={M} acc={acc}", terms)
            np.testing.assert_array_equal(c[:, M:], before[:, M:], err_msg="wrote past column M")


@pytest.mark.parametrize("acc", [0, 1])
def test_panel_ranges_write_only_their_columns(kernel, acc, rng):
    nr, mr = kernel.nr, kernel.mr
    K, rows = 37, 2 * mr + 3
    for M in (450, 5 * nr + 3):
        panels = -(-M // nr)
        W = rng.standard_normal((M, K)).astype(np.float32)
        packed = kernel.pack(W)
        A, idx = gathered(rng, rows, K)
        full = reference(A, idx, W, np.zeros((rows, M)), 0)
        ranges = {
            (0, 1),
            (1, 2),
            (3, 4),
            (2, 7),
            (0, 3),
            (5, panels),
            (panels - 1, panels),
            (0, panels),
            (4, 4),
            (panels - 3, panels),
        }
        for p0, p1 in sorted(ranges):
            c0 = rng.standard_normal((rows, M)).astype(np.float32)
            c = c0.copy()
            kernel.gemm(A, idx, packed, M, K, c, acc, p0, p1)
            lo, hi = p0 * nr, min(p1 * nr, M)
            want = full[:, lo:hi] + (c0[:, lo:hi] if acc else 0)
            check_close(c[:, lo:hi], want, f"M={M} panels [{p0},{p1}) acc={acc}")
            untouched = np.ones(M, bool)
            untouched[lo:hi] = False
            np.testing.assert_array_equal(
                c[:, untouched], c0[:, untouched], err_msg=f"M={M} panels [{p0},{p1}) wrote outside its columns"
            )


@pytest.mark.parametrize("split", [0, 1], ids=["rows", "panels"])
def test_openmp_split(kernel, split, rng):
    K, M, rows = 300, 750, 101
    W = rng.standard_normal((M, K)).astype(np.float32)
    packed = kernel.pack(W)
    A, idx = gathered(rng, rows, K, n_state=64)
    c0 = rng.standard_normal((rows, M)).astype(np.float32)
    c = c0.copy()
    kernel.gemm(A, idx, packed, M, K, c, 1, threads=2, split=split)
    check_close(c, reference(A, idx, W, c0, 1), f"2 threads split={split}")


def test_level_batch_shape(kernel, rng):
    """One realistic level-batch shape end to end (256 gathered rows, K=600, M=1280)."""
    rows, K, M = 256, 600, 1280
    W = (rng.standard_normal((M, K)) / np.sqrt(K)).astype(np.float32)
    packed = kernel.pack(W)
    A, idx = gathered(rng, rows, K, n_state=512)
    c = np.full((rows, M), np.nan, np.float32)
    kernel.gemm(A, idx, packed, M, K, c, 0)
    check_close(c, reference(A, idx, W, c, 0), "256x600x1280")


@pytest.mark.parametrize("M", [1, 7, 8, 9, 40, 256])
def test_gemm_tn_matches_numpy(kernel, M, rng):
    """The weight-gradient kernel over every block shape: K of 1..4 panels and a tail, M off the block height."""
    nr = kernel.nr
    for K in sorted({1, nr - 1, nr, 2 * nr + 3, 3 * nr, 4 * nr, 5 * nr + 1, 300}):
        for rows in (1, 3, 10, 37):
            A = rng.standard_normal((17, M + 3)).astype(np.float32)
            B = rng.standard_normal((19, K + 2)).astype(np.float32)
            ia, ib = rng.integers(0, 17, rows), rng.integers(0, 19, rows)
            acc0 = rng.standard_normal((M, K)).astype(np.float32)
            acc = acc0.copy()
            kernel.gemm_tn(A, ia, B, ib, acc)
            a, b = A[ia, :M].astype(np.float64), B[ib, :K].astype(np.float64)
            want = acc0 + a.T @ b
            terms = np.abs(acc0) + np.abs(a).T @ np.abs(b)
            check_close(acc, want, f"tn rows={rows} M={M} K={K}", terms)


def test_the_isa_builds_agree_bitwise(tmp_path_factory, rng):
    """The C target compiles one of its GEMM builds per machine (the first whose ISA the -march has): each
    element is one FMA chain over k (or over rows) in order whatever the panel width or tile, so every build
    gives the same bits, and a package's results do not depend on the machine's vector width."""
    kernels = [
        _compile(tmp_path_factory.mktemp(f"isa{i}"), render(isa.nr, isa.mr, isa.vregs), NATIVE)
        for i, isa in enumerate(C_GEMM_ISAS)
    ]
    M, K = 256, 64  # a chain LSTM's recurrent GEMM, and its weight gradient
    W = rng.standard_normal((M, K)).astype(np.float32)
    for rows in (1, 5, 6, 8, 32, 100):
        A, idx = gathered(rng, rows, K, n_state=128)
        G, X = rng.standard_normal((rows, M)).astype(np.float32), rng.standard_normal((rows, K)).astype(np.float32)
        products, grads = [], []
        for kernel in kernels:
            c = np.zeros((rows, M), np.float32)
            kernel.gemm(A, idx, kernel.pack(W), M, K, c, 0)
            acc = np.zeros((M, K), np.float32)
            kernel.gemm_tn(G, np.arange(rows), X, np.arange(rows), acc)
            products.append(c)
            grads.append(acc)
        for isa, c, g in zip(C_GEMM_ISAS[1:], products[1:], grads[1:]):
            np.testing.assert_array_equal(c, products[0], err_msg=f"{isa} rows={rows}")
            np.testing.assert_array_equal(g, grads[0], err_msg=f"{isa} rows={rows} (tn)")


@pytest.mark.parametrize("K, M", [(7, 36), (9, 36), (64, 256), (300, 150)])
def test_a_row_gets_the_same_bits_in_a_call_of_any_height(kernel, K, M, rng):
    """A level's rows are GEMM calls of 1..hundreds of rows (and windows, tiles, thread shares cut them
    differently): each row's product must be bitwise the same in every one. Caught gcc's Zen tuning splitting
    the FMA of the one-accumulator tiles (1 row) into a multiply and an add."""
    W = rng.standard_normal((M, K)).astype(np.float32)
    packed = kernel.pack(W)
    A = rng.standard_normal((100, K)).astype(np.float32)
    full = np.zeros((100, M), np.float32)
    kernel.gemm(A, np.arange(100), packed, M, K, full, 0)
    for rows in range(1, 20):
        c = np.zeros((rows, M), np.float32)
        kernel.gemm(A, np.arange(rows), packed, M, K, c, 0)
        np.testing.assert_array_equal(c, full[:rows], err_msg=f"rows={rows}")


def test_a_column_share_is_whole_panels_in_every_build():
    """Threads sharing a level by columns own runs of `column_granule` columns: whole panels only if every
    build's panel width divides it."""
    assert C.gemm_isas == C_GEMM_ISAS and all(C.column_granule % isa.nr == 0 for isa in C.gemm_isas)


@pytest.mark.parametrize(
    "K, lo, width, groups, after",
    [(7, 0, 4, 3, 0), (9, 5, 20, 4, 3), (32, 16, 96, 4, 32), (13, 3, 33, 2, 17), (64, 0, 256, 3, 0)],
)
def test_grouped_rows_get_their_own_groups_columns_bitwise(kernel, K, lo, width, groups, after, rng):
    """`cx_gemm_grouped` (passes/grouping.py): each row's own group's columns are bitwise the whole GEMM's,
    every other column untouched; groups of any width and offset against the panels, groups with no rows,
    and a group id out of range (nothing computed)."""
    M = lo + groups * width + after
    W = rng.standard_normal((M, K)).astype(np.float32)
    packed = kernel.pack(W)
    for rows in (1, 2, 9, 40):
        A = rng.standard_normal((rows, K)).astype(np.float32)
        group = rng.integers(0, groups, rows).astype(np.int32)
        group[rng.random(rows) < 0.1] = groups  # out of range
        if groups > 2:
            group[group == 1] = 0  # a group no row has
        full = np.zeros((rows, M), np.float32)
        kernel.gemm(A, np.arange(rows), packed, M, K, full, 0)
        c = np.full((rows, M), np.nan, np.float32)
        kernel.gemm_grouped(A, group, groups, packed, M, K, lo, width, c)
        for r in range(rows):
            g = group[r]
            own = slice(lo + g * width, lo + (g + 1) * width) if g < groups else slice(0, 0)
            np.testing.assert_array_equal(c[r, own], full[r, own], err_msg=f"rows={rows} r={r} g={g}")
            rest = np.ones(M, bool)
            rest[own] = False
            assert np.isnan(c[r, rest]).all(), f"rows={rows} r={r}: columns outside its group written"


@pytest.mark.parametrize("M, width, groups", [(4, 4, 3), (32, 96, 4), (37, 20, 3), (150, 33, 2), (256, 64, 4)])
def test_grouped_k_rows_are_the_whole_products_of_their_groups_k(kernel, M, width, groups, rng):
    """`cx_gemm_grouped_k` (a chosen product's gradient times the transposed family): a row zero outside its
    group's k gets bitwise the whole GEMM's product; a row of a group out of range is left alone."""
    K = width * groups
    W = rng.standard_normal((M, K)).astype(np.float32)
    packed = kernel.pack(W)
    for rows in (1, 3, 17, 40):
        group = rng.integers(0, groups, rows).astype(np.int32)
        group[rng.random(rows) < 0.1] = groups
        A = np.zeros((rows, K), np.float32)
        for r, g in enumerate(group):
            if g < groups:
                A[r, g * width : (g + 1) * width] = rng.standard_normal(width)
        full = np.zeros((rows, M), np.float32)
        kernel.gemm(A, np.arange(rows), packed, M, K, full, 0)
        c = np.full((rows, M), np.nan, np.float32)
        kernel.gemm_grouped_k(A, group, groups, width, packed, M, K, c)
        inside = group < groups
        np.testing.assert_array_equal(c[inside], full[inside], err_msg=f"rows={rows}")
        assert np.isnan(c[~inside]).all()
