/* cx_emu test kernel: synchronisation bugs. Compiled by g++ with cortexc/runtime/cuda_emu.h
   (tests/test_cuda_emu.py) and by nvcc for sm_80/sm_90; the nvcc prelude is cortexc/runtime/cuda_prelude.cuh. */
#include "cuda_prelude.cuh"  /* nvcc's side of the emulation macros (empty under the emulator) */

/* Real CUDA bugs the emulator must stop on (each case runs in its own process). */
__global__ void early_return(float *out)
{
    __shared__ float s[64];
    if (threadIdx.x == 5) return; /* BUG: thread 5 never reaches the barrier */
    s[threadIdx.x] = 1.0f;
    __syncthreads();
    out[threadIdx.x] = s[63 - threadIdx.x];
}

__global__ void divergent_barriers(float *out)
{
    if (threadIdx.x % 2) {
        out[threadIdx.x] = 1.0f;
        __syncthreads(); /* BUG: odd and even threads wait in different barriers */
    } else {
        out[threadIdx.x] = 2.0f;
        __syncthreads();
    }
}

__global__ void plain_shared_in_cooperative(float *out)
{
    __shared__ float s[32]; /* one static array for all blocks when they run together */
    s[threadIdx.x] = (float)blockIdx.x;
    cx_grid_sync();
    out[blockIdx.x * blockDim.x + threadIdx.x] = s[threadIdx.x];
}

__global__ void warp_deadlock(float *out)
{
    if (threadIdx.x < 16) {
        __syncwarp(); /* BUG: lanes 16..31 are not coming: they wait in __syncthreads() */
    } else {
        __syncthreads();
    }
    out[threadIdx.x] = 1.0f;
}

__global__ void big_frame(float *out)
{
    volatile char big[100 * 1024]; /* larger than the emulator's 64 KiB fiber stack */
    big[0] = 1;
    out[threadIdx.x] = big[0];
}

__global__ void shared_overflow(float *out)
{
    CX_SHARED(float, tile, 32);
    tile[threadIdx.x + 1] = 1.0f; /* BUG: thread 31 writes tile[32] */
    __syncthreads();
    out[threadIdx.x] = tile[threadIdx.x];
}

__global__ void fine(float *out)
{
    CX_SHARED(float, tile, 64);
    CX_DYNAMIC_SHARED(float, big); /* 64 KiB: needs cudaFuncSetAttribute */
    tile[threadIdx.x] = (float)threadIdx.x;
    big[threadIdx.x * 256] = (float)threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = tile[63 - threadIdx.x] + big[(63 - threadIdx.x) * 256];
}

/* Runs case `which`; returns 0 when it finished (only case 0 should). */
extern "C" int cx_error_case(int which)
{
    float *d;
    cudaMalloc(&d, 256 * sizeof(float));
    const size_t big = 64 * 1024;
    if (which != 11) cudaFuncSetAttribute(fine, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)big);
    switch (which) {
    case 0: {
        CX_LAUNCH(fine, 1, 64, big, d);
        float h[64];
        cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost);
        for (int i = 0; i < 64; i++)
            if (h[i] != 2.0f * (float)(63 - i)) return 1;
        break;
    }
    case 1: CX_LAUNCH(early_return, 1, 64, 0, d); break;
    case 2: CX_LAUNCH(divergent_barriers, 1, 64, 0, d); break;
    case 3: CX_LAUNCH(fine, 1, 2048, big, d); break;
    case 4: CX_LAUNCH_COOPERATIVE(plain_shared_in_cooperative, 2, 32, 0, d); break;
    case 5: CX_LAUNCH(plain_shared_in_cooperative, 2, 32, 0, d); break;
    case 6: CX_LAUNCH(warp_deadlock, 1, 32, 0, d); break;
    case 7: {
        float h[512] = {0};
        volatile size_t count = 300; /* BUG: 300 floats into 256 */
        cudaMemcpy(d, h, count * sizeof(float), cudaMemcpyHostToDevice);
        break;
    }
    case 8: {
        float h[4] = {0};
        cudaMemcpy(d, h, sizeof h, cudaMemcpyDeviceToHost); /* BUG: swapped arguments */
        break;
    }
    case 9: CX_LAUNCH(big_frame, 1, 32, 0, d); break;
    case 10: CX_LAUNCH(shared_overflow, 1, 32, 0, d); break;
    case 11: CX_LAUNCH(fine, 1, 64, big, d); break; /* BUG: 64 KiB without cudaFuncSetAttribute */
    default: return 2;
    }
    cudaError_t err = cudaDeviceSynchronize();
    cudaFree(d);
    return (int)err;
}
