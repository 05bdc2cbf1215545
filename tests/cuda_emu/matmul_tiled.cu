/* cx_emu test kernel: tiled matrix multiply. Compiled by g++ with cortexc/runtime/cuda_emu.h
   (tests/test_cuda_emu.py) and by nvcc for sm_80/sm_90; the nvcc prelude is cortexc/runtime/cuda_prelude.cuh. */
#include "cuda_prelude.cuh"  /* nvcc's side of the emulation macros (empty under the emulator) */

/* 2. C[M,N] = A[M,K] @ B[K,N] with TILE x TILE shared-memory tiles; M, N, K need not be multiples of TILE.
   VARIANT 0 is correct; 1 drops the second __syncthreads() (a fast thread overwrites the tile others still
   read), 2 drops the first (threads read the tile before the others have stored it). As is a plain
   __shared__ array, Bs a CX_SHARED_2D one: both forms work in ordinary (sequential-block) launches. */
#define TILE 16

template <int VARIANT>
__global__ void __launch_bounds__(TILE * TILE) matmul_tiled(const float *__restrict__ A, const float *__restrict__ B,
                                                            float *__restrict__ C, int M, int N, int K)
{
    __shared__ float As[TILE][TILE + 1];
    CX_SHARED_2D(float, Bs, TILE, TILE + 1);
    const int tx = (int)threadIdx.x, ty = (int)threadIdx.y;
    const int row = (int)blockIdx.y * TILE + ty, col = (int)blockIdx.x * TILE + tx;
    float acc = 0.0f;
    for (int k0 = 0; k0 < K; k0 += TILE) {
        As[ty][tx] = (row < M && k0 + tx < K) ? A[(size_t)row * K + k0 + tx] : 0.0f;
        Bs[ty][tx] = (k0 + ty < K && col < N) ? B[(size_t)(k0 + ty) * N + col] : 0.0f;
        if (VARIANT != 2) __syncthreads();
        for (int k = 0; k < TILE; k++) acc = fmaf(As[ty][k], Bs[k][tx], acc);
        if (VARIANT != 1) __syncthreads();
    }
    if (row < M && col < N) C[(size_t)row * N + col] = acc;
}

/* The same with a tile of blockDim.x x blockDim.x in dynamic shared memory. */
__global__ void matmul_dynamic(const float *__restrict__ A, const float *__restrict__ B, float *__restrict__ C, int M,
                               int N, int K)
{
    CX_DYNAMIC_SHARED(float, smem);
    const int T = (int)blockDim.x;
    float *As = smem, *Bs = smem + T * T;
    const int tx = (int)threadIdx.x, ty = (int)threadIdx.y;
    const int row = (int)blockIdx.y * T + ty, col = (int)blockIdx.x * T + tx;
    float acc = 0.0f;
    for (int k0 = 0; k0 < K; k0 += T) {
        As[ty * T + tx] = (row < M && k0 + tx < K) ? A[(size_t)row * K + k0 + tx] : 0.0f;
        Bs[ty * T + tx] = (k0 + ty < K && col < N) ? B[(size_t)(k0 + ty) * N + col] : 0.0f;
        __syncthreads();
        for (int k = 0; k < T; k++) acc = fmaf(As[ty * T + k], Bs[k * T + tx], acc);
        __syncthreads();
    }
    if (row < M && col < N) C[(size_t)row * N + col] = acc;
}

/* variant 0-2: matmul_tiled<variant>; 3: matmul_dynamic with 8 x 8 tiles. Returns the CUDA error. */
extern "C" int cx_matmul(const float *A, const float *B, float *C, int M, int N, int K, int variant)
{
    float *dA, *dB, *dC;
    cudaMalloc(&dA, sizeof(float) * M * K);
    cudaMalloc(&dB, sizeof(float) * K * N);
    cudaMalloc(&dC, sizeof(float) * M * N);
    cudaMemcpy(dA, A, sizeof(float) * M * K, cudaMemcpyHostToDevice);
    cudaMemcpy(dB, B, sizeof(float) * K * N, cudaMemcpyHostToDevice);
    const int T = variant == 3 ? 8 : TILE;
    const dim3 grid((unsigned)((N + T - 1) / T), (unsigned)((M + T - 1) / T)), block((unsigned)T, (unsigned)T);
    if (variant == 0) CX_LAUNCH(matmul_tiled<0>, grid, block, 0, dA, dB, dC, M, N, K);
    if (variant == 1) CX_LAUNCH(matmul_tiled<1>, grid, block, 0, dA, dB, dC, M, N, K);
    if (variant == 2) CX_LAUNCH(matmul_tiled<2>, grid, block, 0, dA, dB, dC, M, N, K);
    if (variant == 3) CX_LAUNCH(matmul_dynamic, grid, block, 2 * T * T * sizeof(float), dA, dB, dC, M, N, K);
    cudaError_t err = cudaGetLastError();
    cudaMemcpy(C, dC, sizeof(float) * M * N, cudaMemcpyDeviceToHost);
    cudaFree(dA);
    cudaFree(dB);
    cudaFree(dC);
    return (int)err;
}
