/* cx_emu test kernel: cooperative persistent kernel. Compiled by g++ with cortexc/runtime/cuda_emu.h
   (tests/test_cuda_emu.py) and by nvcc for sm_80/sm_90; the nvcc prelude is cortexc/runtime/cuda_prelude.cuh. */
#include "cuda_prelude.cuh"  /* nvcc's side of the emulation macros (empty under the emulator) */

/* 4. A persistent kernel under a cooperative launch: an inclusive prefix sum by prefix doubling
   (Hillis-Steele) over the whole grid, one level per cx_grid_sync(); level l reads what other blocks
   wrote in level l-1. The result lands in buf0 or buf1 (*in_buf1 says which). CX_SHARED memory must stay
   per block although all blocks run together: shared_ok[t] checks that this block's tags survived. */
__global__ void grid_scan(const int *__restrict__ in, int *buf0, int *buf1, int n, int use_grid_sync, int *in_buf1,
                          int *shared_ok)
{
    CX_SHARED(int, tag, 1024);
    const int tid = (int)threadIdx.x, nthreads = (int)blockDim.x;
    const int gtid = (int)blockIdx.x * nthreads + tid, stride = (int)gridDim.x * nthreads;
    tag[tid] = (int)blockIdx.x * 4096 + tid;
    for (int i = gtid; i < n; i += stride) buf0[i] = in[i];
    if (use_grid_sync) cx_grid_sync();
    int *src = buf0, *dst = buf1;
    for (int d = 1; d < n; d <<= 1) {
        for (int i = gtid; i < n; i += stride) dst[i] = src[i] + (i >= d ? src[i - d] : 0);
        if (use_grid_sync) cx_grid_sync();
        int *tmp = src;
        src = dst;
        dst = tmp;
    }
    __syncthreads();
    const int next = (tid + 1) % nthreads;
    shared_ok[gtid] = tag[tid] == (int)blockIdx.x * 4096 + tid && tag[next] == (int)blockIdx.x * 4096 + next;
    if (gtid == 0) *in_buf1 = src == buf1;
}

/* Sizes the grid as a persistent kernel does (occupancy x SM count, capped by max_blocks > 0) and launches
   through CX_LAUNCH_COOPERATIVE (api 0) or cudaLaunchCooperativeKernel (api 1). Returns the CUDA error;
   *grid_out = blocks used; out[n] = the scan; shared_ok[grid * block]. */
extern "C" int cx_grid_scan(const int *in, int n, int block, int max_blocks, int api, int use_grid_sync, int *out,
                            int *grid_out, int *shared_ok)
{
    int sms = 0, per_sm = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, grid_scan, block, 0);
    int grid = sms * per_sm;
    if (max_blocks > 0 && grid > max_blocks) grid = max_blocks;
    *grid_out = grid;
    int *din, *b0, *b1, *dflag, *dok;
    cudaMalloc(&din, sizeof(int) * n);
    cudaMalloc(&b0, sizeof(int) * n);
    cudaMalloc(&b1, sizeof(int) * n);
    cudaMalloc(&dflag, sizeof(int));
    cudaMalloc(&dok, sizeof(int) * grid * block);
    cudaMemcpy(din, in, sizeof(int) * n, cudaMemcpyHostToDevice);
    cudaError_t err;
    if (api == 0) {
        err = CX_LAUNCH_COOPERATIVE(grid_scan, grid, block, 0, din, b0, b1, n, use_grid_sync, dflag, dok);
    } else {
        void *args[] = {&din, &b0, &b1, &n, &use_grid_sync, &dflag, &dok};
        err = cudaLaunchCooperativeKernel(grid_scan, dim3((unsigned)grid), dim3((unsigned)block), args, 0, 0);
    }
    if (err == cudaSuccess) err = cudaDeviceSynchronize();
    int flag = 0;
    cudaMemcpy(&flag, dflag, sizeof(int), cudaMemcpyDeviceToHost);
    cudaMemcpy(out, flag ? b1 : b0, sizeof(int) * n, cudaMemcpyDeviceToHost);
    cudaMemcpy(shared_ok, dok, sizeof(int) * grid * block, cudaMemcpyDeviceToHost);
    cudaFree(din);
    cudaFree(b0);
    cudaFree(b1);
    cudaFree(dflag);
    cudaFree(dok);
    return (int)err;
}
