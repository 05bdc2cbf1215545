/* cx_emu test kernel: block reduction and warp intrinsics. Compiled by g++ with cortexc/runtime/cuda_emu.h
   (tests/test_cuda_emu.py) and by nvcc for sm_80/sm_90; the nvcc prelude is cortexc/runtime/cuda_prelude.cuh. */
#include "cuda_prelude.cuh"  /* nvcc's side of the emulation macros (empty under the emulator) */

/* 3. Sum of x[0..n): grid-stride partial sums, a __shfl_down_sync warp reduction, warp totals through
   CX_SHARED memory, and one atomicAdd per block into *out (partials[b] keeps each block's total). */
#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float warp_sum(float v)
{
    for (int offset = warpSize / 2; offset > 0; offset >>= 1) v += __shfl_down_sync(FULL_MASK, v, offset);
    return v;
}

__global__ void block_sum(const float *__restrict__ x, int n, float *__restrict__ out, float *__restrict__ partials)
{
    CX_SHARED(float, warp_sums, 32);
    float v = 0.0f;
    for (int i = (int)(blockIdx.x * blockDim.x + threadIdx.x); i < n; i += (int)(gridDim.x * blockDim.x)) v += x[i];
    v = warp_sum(v);
    const int lane = (int)threadIdx.x % warpSize, warp = (int)threadIdx.x / warpSize;
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const int nwarps = ((int)blockDim.x + warpSize - 1) / warpSize;
        v = warp_sum(lane < nwarps ? warp_sums[lane] : 0.0f);
        if (lane == 0) {
            partials[blockIdx.x] = v;
            atomicAdd(out, v);
        }
    }
}

/* Every warp intrinsic once per thread: out[t * WARP_OPS_COLS + k] for thread t, column k. */
#define WARP_OPS_COLS 11
__global__ void warp_ops(const int *__restrict__ in, int *__restrict__ out, unsigned long long *sum, int *maxv,
                         unsigned *count, float *fmax_out)
{
    const int t = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    const int lane = (int)threadIdx.x % warpSize;
    const int v = in[t];
    int *o = out + (size_t)t * WARP_OPS_COLS;
    o[0] = __shfl_xor_sync(FULL_MASK, v, 1);
    o[1] = __shfl_sync(FULL_MASK, v, 3);
    o[2] = __shfl_up_sync(FULL_MASK, v, 2);
    o[3] = __shfl_down_sync(FULL_MASK, v, 5, 16);
    o[4] = (int)__ballot_sync(FULL_MASK, v & 1);
    o[5] = __any_sync(FULL_MASK, v > 90) + 2 * __all_sync(FULL_MASK, v >= 0);
    o[6] = __syncthreads_count(v % 3 == 0);
    o[7] = (int)__reduce_add_sync(FULL_MASK, (unsigned)v);
    o[8] = (int)__match_any_sync(FULL_MASK, v % 4);
    const unsigned half = lane < 16 ? 0x0000ffffu : 0xffff0000u; /* two independent half-warp groups */
    o[9] = __shfl_xor_sync(half, v, 8);
    __syncwarp();
    o[10] = (int)atomicInc(count, 1000000u);
    atomicAdd(sum, (unsigned long long)v);
    atomicMax(maxv, v);
    /* float max through the classic atomicCAS loop */
    int *addr = (int *)fmax_out;
    int old = *addr, assumed;
    do {
        assumed = old;
        old = atomicCAS(addr, assumed, __float_as_int(fmaxf(__int_as_float(assumed), (float)v * 0.5f)));
    } while (assumed != old);
}

extern "C" int cx_block_sum(const float *x, int n, int grid, int block, float *total, float *partials)
{
    float *dx, *dout, *dpart;
    cudaMalloc(&dx, sizeof(float) * n);
    cudaMalloc(&dout, sizeof(float));
    cudaMalloc(&dpart, sizeof(float) * grid);
    cudaMemcpy(dx, x, sizeof(float) * n, cudaMemcpyHostToDevice);
    cudaMemset(dout, 0, sizeof(float));
    CX_LAUNCH(block_sum, grid, block, 0, dx, n, dout, dpart);
    cudaError_t err = cudaGetLastError();
    cudaMemcpy(total, dout, sizeof(float), cudaMemcpyDeviceToHost);
    cudaMemcpy(partials, dpart, sizeof(float) * grid, cudaMemcpyDeviceToHost);
    cudaFree(dx);
    cudaFree(dout);
    cudaFree(dpart);
    return (int)err;
}

/* n = grid * block threads; scalars = {sum, max, count, float max as bits}. */
extern "C" int cx_warp_ops(const int *in, int grid, int block, int *out, long long *scalars)
{
    const int n = grid * block;
    int *din, *dout, *dmax;
    unsigned long long *dsum;
    unsigned *dcount;
    float *dfmax;
    cudaMalloc(&din, sizeof(int) * n);
    cudaMalloc(&dout, sizeof(int) * n * WARP_OPS_COLS);
    cudaMalloc(&dsum, sizeof(unsigned long long));
    cudaMalloc(&dmax, sizeof(int));
    cudaMalloc(&dcount, sizeof(unsigned));
    cudaMalloc(&dfmax, sizeof(float));
    cudaMemcpy(din, in, sizeof(int) * n, cudaMemcpyHostToDevice);
    cudaMemset(dsum, 0, sizeof(unsigned long long));
    cudaMemset(dmax, 0, sizeof(int));
    cudaMemset(dcount, 0, sizeof(unsigned));
    cudaMemset(dfmax, 0, sizeof(float));
    CX_LAUNCH(warp_ops, grid, block, 0, din, dout, dsum, dmax, dcount, dfmax);
    cudaError_t err = cudaGetLastError();
    unsigned long long sum;
    int maxv;
    unsigned count;
    float fmax;
    cudaMemcpy(out, dout, sizeof(int) * n * WARP_OPS_COLS, cudaMemcpyDeviceToHost);
    cudaMemcpy(&sum, dsum, sizeof sum, cudaMemcpyDeviceToHost);
    cudaMemcpy(&maxv, dmax, sizeof maxv, cudaMemcpyDeviceToHost);
    cudaMemcpy(&count, dcount, sizeof count, cudaMemcpyDeviceToHost);
    cudaMemcpy(&fmax, dfmax, sizeof fmax, cudaMemcpyDeviceToHost);
    scalars[0] = (long long)sum;
    scalars[1] = maxv;
    scalars[2] = count;
    scalars[3] = (long long)(fmax * 2.0f);
    cudaFree(din);
    cudaFree(dout);
    cudaFree(dsum);
    cudaFree(dmax);
    cudaFree(dcount);
    cudaFree(dfmax);
    return (int)err;
}
