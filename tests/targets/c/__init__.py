"""The C target: its kernels, driver, GEMM, determinism, caches and executor."""
