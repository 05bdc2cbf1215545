/*
 * cuda_prelude.cuh -- nvcc's side of the few macros the emulated CUDA uses (CX_LAUNCH(_STREAM), CX_SHARED,
 * cx_grid_sync, ...). The emulator (cuda_emu.h, for g++) defines CX_EMULATE and its own side of them, so
 * this header is empty there; under nvcc it maps them onto CUDA. Every generated .cu and every test
 * kernel in tests/cuda_emu/ includes this one file (-I cortexc/runtime); a generated .cu carries it inline.
 * Idempotent: several .cu files may be #included into one translation unit.
 */
#if !defined(CX_EMULATE) && !defined(CX_NVCC_PRELUDE)
#define CX_NVCC_PRELUDE
#include <cooperative_groups.h>
#define CX_LAUNCH(kernel, grid, block, shmem, ...) kernel<<<(grid), (block), (shmem)>>>(__VA_ARGS__)
#define CX_LAUNCH_STREAM(kernel, grid, block, shmem, stream, ...) \
    kernel<<<(grid), (block), (shmem), (stream)>>>(__VA_ARGS__)
#define CX_LAUNCH_COOPERATIVE(kernel, grid, block, shmem, ...) \
    cx_launch_cooperative_((kernel), (grid), (block), (shmem), (cudaStream_t)0, __VA_ARGS__)
#define CX_LAUNCH_COOPERATIVE_STREAM(kernel, grid, block, shmem, stream, ...) \
    cx_launch_cooperative_((kernel), (grid), (block), (shmem), (stream), __VA_ARGS__)
#define CX_SHARED(T, name, count) __shared__ T name[count]
#define CX_SHARED_2D(T, name, rows, cols) __shared__ T name[rows][cols]
#define CX_DYNAMIC_SHARED(T, name) extern __shared__ __align__(16) T name[]
__device__ __forceinline__ void cx_grid_sync() { cooperative_groups::this_grid().sync(); }
template <class T> struct cx_type_identity_ { using type = T; };
template <class... P>
inline cudaError_t cx_launch_cooperative_(void (*kernel)(P...), dim3 grid, dim3 block, size_t shmem,
                                          cudaStream_t stream, typename cx_type_identity_<P>::type... args) {
    void *argv[] = {nullptr, (void *)&args...};
    return cudaLaunchCooperativeKernel((const void *)kernel, grid, block, argv + 1, shmem, stream);
}
#endif
