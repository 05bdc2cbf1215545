/* cx_emu test kernel: vector add with a grid-stride loop. Compiled by g++ with cortexc/runtime/cuda_emu.h
   (tests/test_cuda_emu.py) and by nvcc for sm_80/sm_90; the nvcc prelude is cortexc/runtime/cuda_prelude.cuh. */
#include "cuda_prelude.cuh"  /* nvcc's side of the emulation macros (empty under the emulator) */

/* 1. y = a + alpha * b with a grid-stride loop (grids smaller and larger than the data). */
__global__ void __launch_bounds__(256) vector_add(const float *__restrict__ a, const float *__restrict__ b,
                                                  float alpha, float *__restrict__ c, int n)
{
    const int stride = (int)(gridDim.x * blockDim.x);
    for (int i = (int)(blockIdx.x * blockDim.x + threadIdx.x); i < n; i += stride)
        c[i] = fmaf(alpha, __ldg(b + i), __ldg(a + i));
}

/* Host side, unchanged between nvcc and the emulator: returns the first CUDA error (0 = none). */
extern "C" int cx_vector_add(const float *a, const float *b, float alpha, float *c, int n, int grid, int block)
{
    float *da = nullptr, *db = nullptr, *dc = nullptr;
    const size_t bytes = (size_t)n * sizeof(float);
    cudaError_t err = cudaMalloc(&da, bytes);
    if (err == cudaSuccess) err = cudaMalloc(&db, bytes);
    if (err == cudaSuccess) err = cudaMalloc(&dc, bytes);
    if (err == cudaSuccess) err = cudaMemcpy(da, a, bytes, cudaMemcpyHostToDevice);
    if (err == cudaSuccess) err = cudaMemcpy(db, b, bytes, cudaMemcpyHostToDevice);
    if (err == cudaSuccess) err = cudaMemset(dc, 0, bytes);
    if (err == cudaSuccess) {
        CX_LAUNCH(vector_add, dim3((unsigned)grid), dim3((unsigned)block), 0, da, db, alpha, dc, n);
        err = cudaGetLastError();
    }
    if (err == cudaSuccess) err = cudaDeviceSynchronize();
    if (err == cudaSuccess) err = cudaMemcpy(c, dc, bytes, cudaMemcpyDeviceToHost);
    cudaFree(da);
    cudaFree(db);
    cudaFree(dc);
    return (int)err;
}

/* Built-in indices with 3-D grids and blocks: thread (t, b) writes 8 ints at out[(b * threads + t) * 8]. */
__global__ void index_map(int *out)
{
    const unsigned b = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    const unsigned t = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
    int *o = out + ((size_t)b * blockDim.x * blockDim.y * blockDim.z + t) * 8;
    o[0] = (int)blockIdx.x;
    o[1] = (int)blockIdx.y;
    o[2] = (int)blockIdx.z;
    o[3] = (int)threadIdx.x;
    o[4] = (int)threadIdx.y;
    o[5] = (int)threadIdx.z;
    o[6] = (int)(gridDim.x * 10000 + gridDim.y * 100 + gridDim.z);
    o[7] = (int)(blockDim.x * 10000 + blockDim.y * 100 + blockDim.z);
}

extern "C" int cx_index_map(int *out, int gx, int gy, int gz, int bx, int by, int bz)
{
    const size_t bytes = sizeof(int) * 8 * gx * gy * gz * bx * by * bz;
    int *d;
    cudaMalloc(&d, bytes);
    CX_LAUNCH(index_map, dim3(gx, gy, gz), dim3(bx, by, bz), 0, d);
    cudaError_t err = cudaGetLastError();
    cudaMemcpy(out, d, bytes, cudaMemcpyDeviceToHost);
    cudaFree(d);
    return (int)err;
}
