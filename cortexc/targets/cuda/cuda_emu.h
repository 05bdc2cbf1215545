/*
 * cuda_emu.h -- run CUDA kernels on the CPU, for CI machines without a GPU.
 *
 * g++ (C++17, Linux/glibc) compiles an unmodified .cu translation unit against this header and runs
 * its kernels with one cooperatively scheduled fiber (ucontext) per CUDA thread:
 *
 *     g++ -std=c++17 -O1 -x c++ -include cuda_emu.h kernel.cu driver.cpp
 *     (or: #include "cuda_emu.h" then #include "kernel.cu" in a driver)
 *
 * nvcc must not include this header (it stops with #error). The header defines CX_EMULATE; nvcc's side
 * of the few macros generated code uses is one header, which every generated .cu and every test kernel
 * in tests/cuda_emu/ includes (skipped under the emulator; idempotent, so several .cu files may be
 * #included into one translation unit):
 *
 *     #include "cuda_prelude.cuh"   (cortexc/runtime/cuda_prelude.cuh; compile with -I cortexc/runtime)
 *
 * API for generated code
 * ----------------------
 *   CX_LAUNCH(kernel, grid, block, shmem, args...)          kernel<<<grid, block, shmem>>>(args...)
 *   CX_LAUNCH_STREAM(kernel, grid, block, shmem, stream, args...)    the same on `stream` (recorded)
 *   CX_LAUNCH_COOPERATIVE(kernel, grid, block, shmem, args...)  -> cudaError_t; a cooperative launch
 *       (cudaLaunchCooperativeKernel): every block is resident at once, so cx_grid_sync() works.
 *   CX_LAUNCH_COOPERATIVE_STREAM(kernel, grid, block, shmem, stream, args...)  the same on `stream`
 *   cx_grid_sync()                       barrier over every thread of the grid (cooperative launches only)
 *   CX_SHARED(T, name, count)            __shared__ T name[count]        } per-block storage in both launch
 *   CX_SHARED_2D(T, name, rows, cols)    __shared__ T name[rows][cols]   } modes; use inside kernel bodies
 *   CX_DYNAMIC_SHARED(T, name)           extern __shared__ T name[]: the launch's dynamic shared memory
 *   cx_emu::launch(kernel, grid, block, shmem, args...)              the function behind CX_LAUNCH
 *   cx_emu::launch_cooperative(kernel, grid, block, shmem, args...)  the one behind CX_LAUNCH_COOPERATIVE
 *   cx_emu::config()                     stack size, schedule seed, emulated SM count (see Config)
 * Launch macros take the kernel as a plain name (a template-id with commas needs an alias first).
 * Plain `__shared__ T x[...];` works in ordinary launches (it becomes a function-local `static`, which
 * is safe because blocks run one after another); in a cooperative launch of more than one block it
 * would be one array for all blocks, so the emulator stops with a message: use CX_SHARED there.
 * `__shared__` expands to a statement followed by `static`, so it works at the start of a declaration
 * inside a function body only: write `__shared__ volatile T x;` (not `volatile __shared__ T x;`), no
 * namespace-scope or `static __shared__` variables, and `extern __shared__` only through
 * CX_DYNAMIC_SHARED (-DCX_EMU_SIMPLE_SHARED makes `__shared__` a bare `static`, without the check).
 * CX_DYNAMIC_SHARED: all such arrays of a kernel alias one 16-byte aligned buffer (as in CUDA); under
 * nvcc, two of them with the same name and different types in one .cu are an error.
 *
 * Runtime API: cudaMalloc/Free/MallocHost/FreeHost/MallocManaged, cudaMemcpy/Memset(+Async), cudaMemcpyTo/
 * FromSymbol, cudaDeviceSynchronize, cudaStream and cudaEvent calls (synchronous stubs), cudaGetLastError,
 * cudaPeekAtLastError, cudaGetErrorString/Name, cudaGetDevice(Count)/SetDevice, cudaGetDeviceProperties,
 * cudaDeviceGetAttribute, cudaFuncSetAttribute, cudaOccupancyMaxActiveBlocksPerMultiprocessor,
 * cudaLaunchKernel, cudaLaunchCooperativeKernel.  Device side: threadIdx/blockIdx/blockDim/gridDim,
 * warpSize, __syncthreads(_count/_and/_or), __syncwarp, __shfl(_up/_down/_xor)_sync, __ballot/__any/
 * __all_sync, __reduce_*_sync, __match_any_sync, __activemask, atomics (Add/Sub/Exch/Min/Max/Inc/Dec/CAS/
 * And/Or/Xor), __ldg, fast-math intrinsics (__expf, __fdividef, rsqrtf, __saturatef, ...), integer
 * intrinsics (__popc, __clz, __ffs, __brev, ...), min/max, vector types (float2/float4/int4/...).
 *
 * What is faithful
 * ----------------
 * - Every thread is a fiber with its own stack (64 KiB, CX_EMU_STACK_KB); the fibers of a block run
 *   round-robin, each until it blocks in a barrier or returns. __syncthreads() really waits for every
 *   thread of the block, so a missing barrier shows up as wrong results (a thread that completes a
 *   barrier runs ahead into the next phase before the others resume).
 * - Barrier divergence aborts with a message: threads that exit while others wait in __syncthreads()
 *   (or cx_grid_sync()), threads of one block waiting in different __syncthreads() calls
 *   (CX_EMU_STRICT_SITES=0 turns that check off), and any deadlock (no thread can proceed; the message
 *   says who waits where, with file:line of each barrier).
 * - Warp intrinsics wait for every non-exited lane named in the mask (and abort if the calling lane is
 *   not in its mask); a value read from a lane that does not take part (exited, absent in a partial
 *   warp, not in the mask) is undefined in CUDA and reads as all-ones bits here (NaN for floats, -1).
 * - Shared memory from CX_SHARED / CX_DYNAMIC_SHARED and memory from cudaMalloc start as all-ones bits
 *   (NaN/-1), so reading before writing shows (CX_EMU_POISON=0: zeros instead). Dynamic shared memory is
 *   nullptr when the launch asked for 0 bytes.
 * - Launch checks: > 1024 threads per block, bad grid/block dims, too much dynamic shared memory (48 KiB
 *   unless raised with cudaFuncSetAttribute), cooperative grids larger than the emulated device holds
 *   (multiProcessorCount (CX_EMU_SMS, default 4) x occupancy), cudaMemcpy/cudaMemset ranges outside a
 *   cudaMalloc allocation or with the wrong direction, cudaFree of a pointer not from cudaMalloc.
 *   Each of these aborts with a message (rather than returning an error code that may go unchecked).
 * - A segfault in a kernel prints the kernel, block and thread (and whether it hit a fiber stack guard).
 * - Under -fsanitize=address the fibers are announced to ASan, so out-of-bounds accesses to cudaMalloc
 *   memory and CX_SHARED/dynamic shared memory are reported.
 *
 * What is not
 * -----------
 * - No real concurrency: threads only switch at barriers and warp intrinsics, so data races between
 *   threads that do not synchronise are not detected (each thread's segment runs atomically; every
 *   atomic is trivially atomic), and the memory model is sequentially consistent.
 * - Blocks of an ordinary launch run sequentially (in order, or shuffled with CX_EMU_SEED); only
 *   cooperative launches run all blocks together. A spin-wait on another thread hangs unless its loop
 *   calls __nanosleep() (which yields), and waiting for a later block of an ordinary launch always hangs.
 *   No warp-synchronous execution without *_sync intrinsics: code that relies on implicit lock-step
 *   warps (pre-Volta style) is wrong here, as on Volta and later.
 * - Plain `__shared__` arrays are zero-initialised once and keep the previous block's values (no poison).
 * - __activemask() returns all non-exited lanes of the warp, even inside divergent branches.
 * - Fast-math intrinsics are computed at full float precision; __float2int_rn etc. use the host FPU.
 * - Kernels run synchronously at launch; streams and events only keep host code compiling, but the stream
 *   each launch, copy, memset and synchronisation names is recorded while the stream log is on
 *   (extern "C" cx_emu_stream_log_start / cx_emu_stream_log: op codes cx_emu::StreamOp and the handles;
 *   the legacy calls without a stream record 0), so a test can see a stream handle reach them. A handle
 *   is never dereferenced: any value works. Launch
 *   from one host thread at a time (the segfault handler is process-wide). An error aborts the whole
 *   process: a test that expects one runs the kernel in a subprocess.
 * - No textures/surfaces, half/bfloat16, dynamic parallelism, inline PTX, cooperative_groups API (use
 *   cx_grid_sync()), __CUDA_ARCH__ (undefined here, so `#ifdef __CUDA_ARCH__` code takes the host path).
 *
 * Environment: CX_EMU_STACK_KB (fiber stack, default 64), CX_EMU_SEED (nonzero: shuffle the order of
 * fibers every round and of blocks, to shake out order assumptions), CX_EMU_SMS (emulated SM count,
 * default 4), CX_EMU_POISON (default 1), CX_EMU_STRICT_SITES (default 1).
 */
#ifndef CX_CUDA_EMU_H
#define CX_CUDA_EMU_H

#ifdef __CUDACC__
#error "cuda_emu.h is the CPU emulator for g++; nvcc must not include it (see its nvcc prelude)"
#endif
#if !defined(__cplusplus) || __cplusplus < 201703L
#error "cuda_emu.h needs C++17 (g++ -std=c++17)"
#endif

#define CX_EMULATE 1

#include <math.h>
#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <numeric>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define CX_EMU_ASAN 1
#endif

/* ------------------------------------------------------------------------------------------------ */
/* Execution-space qualifiers and attributes                                                        */
/* ------------------------------------------------------------------------------------------------ */
#define __global__
#define __device__
#define __host__
#define __constant__
#define __managed__
#define __grid_constant__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
/* __restrict__ is a g++ keyword already. __noinline__ is not defined: libstdc++ uses that name. */

/* `__shared__ float t[32][33];` -> a check (not in a cooperative multi-block launch) + a static local. */
#ifdef CX_EMU_SIMPLE_SHARED
#define __shared__ static
#else
#define __shared__ ::cx_emu::detail::plain_shared_check(__FILE__, __LINE__); static
#endif

#define CX_EMU_CAT2_(a, b) a##b
#define CX_EMU_CAT_(a, b) CX_EMU_CAT2_(a, b)

/* Emulator side of the nvcc prelude (see the header comment). */
#define CX_LAUNCH(kernel, grid, block, shmem, ...)                                                  \
    (::cx_emu::record_stream(::cx_emu::STREAM_LAUNCH, nullptr),                                      \
     ::cx_emu::launch_named(#kernel, kernel, (grid), (block), (shmem), ##__VA_ARGS__))
#define CX_LAUNCH_STREAM(kernel, grid, block, shmem, stream, ...)                                    \
    (::cx_emu::record_stream(::cx_emu::STREAM_LAUNCH, (const void *)(stream)),                       \
     ::cx_emu::launch_named(#kernel, kernel, (grid), (block), (shmem), ##__VA_ARGS__))
#define CX_LAUNCH_COOPERATIVE(kernel, grid, block, shmem, ...)                                      \
    (::cx_emu::record_stream(::cx_emu::STREAM_COOPERATIVE, nullptr),                                 \
     ::cx_emu::launch_cooperative_named(#kernel, kernel, (grid), (block), (shmem), ##__VA_ARGS__))
#define CX_LAUNCH_COOPERATIVE_STREAM(kernel, grid, block, shmem, stream, ...)                        \
    (::cx_emu::record_stream(::cx_emu::STREAM_COOPERATIVE, (const void *)(stream)),                  \
     ::cx_emu::launch_cooperative_named(#kernel, kernel, (grid), (block), (shmem), ##__VA_ARGS__))
#define CX_SHARED(T, name, count)                                                                    \
    static char CX_EMU_CAT_(cx_shared_key_, name);                                                   \
    T(&name)[count] = *reinterpret_cast<T(*)[count]>(                                                \
        ::cx_emu::detail::shared_slot(&CX_EMU_CAT_(cx_shared_key_, name), sizeof(T[count]), #name))
#define CX_SHARED_2D(T, name, rows, cols)                                                            \
    static char CX_EMU_CAT_(cx_shared_key_, name);                                                   \
    T(&name)[rows][cols] = *reinterpret_cast<T(*)[rows][cols]>(::cx_emu::detail::shared_slot(        \
        &CX_EMU_CAT_(cx_shared_key_, name), sizeof(T[rows][cols]), #name))
#define CX_DYNAMIC_SHARED(T, name) \
    T *const name [[maybe_unused]] = reinterpret_cast<T *>(::cx_emu::detail::dynamic_shared())

/* ------------------------------------------------------------------------------------------------ */
/* Vector types and built-in variables                                                              */
/* ------------------------------------------------------------------------------------------------ */
struct uint3 { unsigned x, y, z; };
struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    constexpr operator uint3() const { return uint3{x, y, z}; }
};
struct int3 { int x, y, z; };
struct float3 { float x, y, z; };
struct alignas(8) int2 { int x, y; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) double2 { double x, y; };
inline int2 make_int2(int x, int y) { return {x, y}; }
inline int3 make_int3(int x, int y, int z) { return {x, y, z}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint3 make_uint3(unsigned x, unsigned y, unsigned z) { return {x, y, z}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float3 make_float3(float x, float y, float z) { return {x, y, z}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline double2 make_double2(double x, double y) { return {x, y}; }

/* The running fiber's indices: the scheduler stores them before it switches to a fiber. */
inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;
constexpr int warpSize = 32;

/* ------------------------------------------------------------------------------------------------ */
/* Runtime API types                                                                                */
/* ------------------------------------------------------------------------------------------------ */
enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInvalidDevicePointer = 17,
    cudaErrorInvalidMemcpyDirection = 21,
    cudaErrorInvalidDeviceFunction = 98,
    cudaErrorInvalidDevice = 101,
    cudaErrorLaunchFailure = 719,
    cudaErrorCooperativeLaunchTooLarge = 720,
    cudaErrorNotSupported = 801,
};
typedef enum cudaError cudaError_t;
enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4,
};
enum cudaDeviceAttr {
    cudaDevAttrMaxThreadsPerBlock = 1,
    cudaDevAttrMaxSharedMemoryPerBlock = 8,
    cudaDevAttrWarpSize = 10,
    cudaDevAttrMultiProcessorCount = 16,
    cudaDevAttrMaxThreadsPerMultiProcessor = 39,
    cudaDevAttrComputeCapabilityMajor = 75,
    cudaDevAttrComputeCapabilityMinor = 76,
    cudaDevAttrMaxSharedMemoryPerMultiprocessor = 81,
    cudaDevAttrCooperativeLaunch = 95,
    cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
    cudaDevAttrMaxBlocksPerMultiprocessor = 106,
};
enum cudaFuncAttribute {
    cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
    cudaFuncAttributePreferredSharedMemoryCarveout = 9,
};
struct CUstream_st;
struct CUevent_st { std::chrono::steady_clock::time_point t; };
typedef CUstream_st *cudaStream_t;
typedef CUevent_st *cudaEvent_t;
#define cudaStreamDefault 0x00
#define cudaStreamNonBlocking 0x01
#define cudaMemAttachGlobal 0x01
#define cudaHostAllocDefault 0x00
struct cudaDeviceProp {
    char name[256];
    size_t totalGlobalMem, sharedMemPerBlock;
    int regsPerBlock, warpSize, maxThreadsPerBlock, maxThreadsDim[3], maxGridSize[3];
    size_t totalConstMem;
    int major, minor, multiProcessorCount, l2CacheSize, maxThreadsPerMultiProcessor;
    size_t sharedMemPerMultiprocessor;
    int regsPerMultiprocessor, cooperativeLaunch;
    size_t sharedMemPerBlockOptin;
    int maxBlocksPerMultiProcessor;
};

namespace cx_emu {

/* ------------------------------------------------------------------------------------------------ */
/* Configuration                                                                                    */
/* ------------------------------------------------------------------------------------------------ */
struct Config {
    size_t stack_bytes = 64 * 1024;      // per fiber (CX_EMU_STACK_KB)
    unsigned seed = 0;                   // 0: round-robin in thread order; else shuffled (CX_EMU_SEED)
    int num_sms = 4;                     // emulated multiProcessorCount (CX_EMU_SMS)
    bool poison = true;                  // fill new device/shared memory with 0xff bytes (CX_EMU_POISON)
    bool strict_sites = true;            // __syncthreads() of one barrier must be one call site
    size_t max_shared_per_block = 48 * 1024;        // without cudaFuncSetAttribute
    size_t max_shared_per_block_optin = 227 * 1024; // sm_90
};
namespace detail {
inline long env_long(const char *name, long dflt) {
    const char *s = std::getenv(name);
    return (s && *s) ? std::strtol(s, nullptr, 0) : dflt;
}
}  // namespace detail
inline Config &config() {
    static Config c = [] {
        Config k;
        k.stack_bytes = (size_t)std::max(16L, detail::env_long("CX_EMU_STACK_KB", 64)) * 1024;
        k.seed = (unsigned)detail::env_long("CX_EMU_SEED", 0);
        k.num_sms = (int)std::max(1L, detail::env_long("CX_EMU_SMS", 4));
        k.poison = detail::env_long("CX_EMU_POISON", 1) != 0;
        k.strict_sites = detail::env_long("CX_EMU_STRICT_SITES", 1) != 0;
        return k;
    }();
    return c;
}

namespace detail {

/* ------------------------------------------------------------------------------------------------ */
/* Fibers, blocks, warps, launches                                                                  */
/* ------------------------------------------------------------------------------------------------ */
enum class St : unsigned char { Run, WaitBlock, WaitWarp, WaitGrid, Done };
enum WarpOp { OP_SYNC, OP_SHFL, OP_BALLOT, OP_ANY, OP_ALL, OP_RADD, OP_RMIN_U, OP_RMAX_U, OP_RMIN_I, OP_RMAX_I,
              OP_RAND, OP_ROR, OP_RXOR, OP_MATCH_ANY };
constexpr uint64_t POISON64 = ~uint64_t(0);
constexpr uint64_t CANARY = 0xC0DEC0DEFEEDF00DULL;

struct Block;
struct Fiber {
    ucontext_t ctx;
    char *stack_lo = nullptr;  // lowest usable byte (the canary lives here)
    size_t stack_size = 0;
    uint3 tid{};
    unsigned linear = 0, warp = 0, lane = 0;
    Block *block = nullptr;
    St st = St::Run;
    const char *wname = nullptr, *wfile = nullptr;  // what it waits in, for diagnostics
    int wline = 0;
    unsigned wmask = 0;
    int xsrc = -1;      // warp exchange: source lane wanted
    uint64_t xval = 0;  // warp exchange: result
    void *asan_fake = nullptr;
};
struct WarpGroup {
    unsigned mask, arrived;
    int op;
    const char *name;
};
struct Warp {
    uint64_t slot[32];
    Fiber *fib[32];
    unsigned live = 0;  // lanes that exist and have not exited
    std::vector<WarpGroup> pending;
};
struct Block {
    uint3 idx{};
    unsigned nthreads = 0, arrived = 0, exited = 0;
    const char *bname = nullptr, *bfile = nullptr;
    int bline = 0;
    long long acc = 0, result = 0;
    std::vector<Fiber *> waiters;
    std::vector<Warp> warps;
    unsigned char *dyn = nullptr;
    std::vector<std::pair<const void *, void *>> slots;
    size_t slot_bytes = 0;
    Fiber *first_exit = nullptr;
};
struct Launch {
    const char *name = "kernel";
    dim3 grid, block;
    size_t shmem = 0, shmem_limit = 0;
    bool coop = false;
    void (*invoke)(void *) = nullptr;
    void *ctx = nullptr;
    ucontext_t sched;
    const void *sched_stack_lo = nullptr;
    size_t sched_stack_size = 0;
    unsigned long long grid_total = 0, grid_arrived = 0, grid_exited = 0;
    const char *gfile = nullptr;
    int gline = 0;
    std::vector<Fiber *> grid_waiters;
    Fiber *grid_first_exit = nullptr;
};

inline thread_local Launch *g_launch = nullptr;
inline thread_local Fiber *g_cur = nullptr;

/* ------------------------------------------------------------------------------------------------ */
/* Errors                                                                                           */
/* ------------------------------------------------------------------------------------------------ */
[[noreturn]] inline void vfail(const char *fmt, va_list ap) {
    std::fflush(stdout);
    std::fprintf(stderr, "cx_emu: error: ");
    std::vfprintf(stderr, fmt, ap);
    if (Launch *L = g_launch) {
        std::fprintf(stderr, "\n  in kernel `%s` <<<(%u,%u,%u), (%u,%u,%u), %zu>>>%s", L->name, L->grid.x, L->grid.y,
                     L->grid.z, L->block.x, L->block.y, L->block.z, L->shmem, L->coop ? " (cooperative launch)" : "");
        if (Fiber *f = g_cur)
            std::fprintf(stderr, "\n  current thread: block (%u,%u,%u) thread (%u,%u,%u)", f->block->idx.x,
                         f->block->idx.y, f->block->idx.z, f->tid.x, f->tid.y, f->tid.z);
    }
    std::fprintf(stderr, "\n");
    std::fflush(stderr);
    std::abort();
}
[[noreturn]] __attribute__((format(printf, 1, 2))) inline void fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vfail(fmt, ap);
}

inline Fiber *current(const char *what) {
    if (!g_cur) fail("%s called outside a kernel", what);
    return g_cur;
}

/* ------------------------------------------------------------------------------------------------ */
/* Fiber stacks: one mapping, a PROT_NONE guard page below each stack (when not too many)            */
/* ------------------------------------------------------------------------------------------------ */
struct StackPool {
    char *base = nullptr;
    size_t mapped = 0, stride = 0, guard = 0, each = 0, count = 0;
    ~StackPool() {
        if (base) munmap(base, mapped);
    }
    char *lo(size_t i) const { return base + i * stride + guard; }
    void ensure(size_t n, size_t bytes) {
        size_t pg = (size_t)sysconf(_SC_PAGESIZE);
        bytes = (bytes + pg - 1) / pg * pg;
        if (n <= count && bytes == each) return;
        if (base) munmap(base, mapped);
        /* 64 KiB of PROT_NONE below each stack (address space only), so that a large frame lands in it
           rather than in the neighbouring stack; each guard splits the mapping, so only up to 8192 stacks */
        guard = n <= 8192 ? std::max<size_t>(pg, 64 * 1024) : 0;
        stride = bytes + guard;
        mapped = stride * n;
        void *p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) {
            base = nullptr;
            count = 0;
            fail("cannot map %zu fiber stacks of %zu KiB", n, bytes / 1024);
        }
        base = (char *)p;
        if (guard)
            for (size_t i = 0; i < n; i++) mprotect(base + i * stride, guard, PROT_NONE);
        count = n;
        each = bytes;
    }
};
inline thread_local StackPool t_stacks;

/* ------------------------------------------------------------------------------------------------ */
/* Segfault diagnostics (installed for the duration of a launch)                                   */
/* ------------------------------------------------------------------------------------------------ */
inline thread_local struct sigaction t_old_segv, t_old_bus;
inline void segv_handler(int sig, siginfo_t *si, void *) {
    char buf[640];
    int n = 0;
    Fiber *f = g_cur;
    Launch *L = g_launch;
    if (f && L) {
        const char *addr = (const char *)si->si_addr;
        bool guard = addr >= f->stack_lo - t_stacks.guard && addr < f->stack_lo + 256;
        n = std::snprintf(buf, sizeof buf,
                          "cx_emu: %s at address %p in kernel `%s`, block (%u,%u,%u) thread (%u,%u,%u)%s\n",
                          sig == SIGSEGV ? "segmentation fault" : "bus error", si->si_addr, L->name,
                          f->block->idx.x, f->block->idx.y, f->block->idx.z, f->tid.x, f->tid.y, f->tid.z,
                          guard ? ": fiber stack overflow (raise CX_EMU_STACK_KB or cx_emu::config().stack_bytes)"
                                : "");
    } else if (L) {
        n = std::snprintf(buf, sizeof buf, "cx_emu: %s while running kernel `%s` (in the scheduler)\n",
                          sig == SIGSEGV ? "segmentation fault" : "bus error", L->name);
    }
    if (n > 0) {
        ssize_t w = write(2, buf, (size_t)std::min(n, (int)sizeof buf - 1));
        (void)w;
    }
    /* restore the previous handler and return: the fault repeats and that handler (or the default) runs */
    sigaction(sig, sig == SIGSEGV ? &t_old_segv : &t_old_bus, nullptr);
}
struct SignalGuard {
    stack_t old_ss{};
    bool have_ss = false;
    static char *altstack() {
        static thread_local char *mem = nullptr;
        if (!mem) mem = (char *)std::malloc(1 << 16);
        return mem;
    }
    SignalGuard() {
        stack_t ss{};
        ss.ss_sp = altstack();
        ss.ss_size = 1 << 16;
        ss.ss_flags = 0;
        have_ss = ss.ss_sp && sigaltstack(&ss, &old_ss) == 0;
        struct sigaction sa {};
        sa.sa_sigaction = segv_handler;
        sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGSEGV, &sa, &t_old_segv);
        sigaction(SIGBUS, &sa, &t_old_bus);
    }
    ~SignalGuard() {
        sigaction(SIGSEGV, &t_old_segv, nullptr);
        sigaction(SIGBUS, &t_old_bus, nullptr);
        if (have_ss) sigaltstack(&old_ss, nullptr);
    }
};

/* ------------------------------------------------------------------------------------------------ */
/* Switching                                                                                        */
/* ------------------------------------------------------------------------------------------------ */
/* From a fiber back to the scheduler; returns when the scheduler resumes this fiber. */
inline void switch_out(Fiber *f) {
    Launch *L = g_launch;
#ifdef CX_EMU_ASAN
    __sanitizer_start_switch_fiber(&f->asan_fake, L->sched_stack_lo, L->sched_stack_size);
#endif
    swapcontext(&f->ctx, &L->sched);
#ifdef CX_EMU_ASAN
    __sanitizer_finish_switch_fiber(f->asan_fake, &L->sched_stack_lo, &L->sched_stack_size);
#endif
}

/* From the scheduler into a fiber, until it blocks or finishes. */
inline void resume(Launch &L, Fiber *f) {
    g_cur = f;
    threadIdx = f->tid;
    blockIdx = f->block->idx;
#ifdef CX_EMU_ASAN
    void *fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, f->stack_lo, f->stack_size);
#endif
    swapcontext(&L.sched, &f->ctx);
#ifdef CX_EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
    g_cur = nullptr;
}

inline void wait_here(Fiber *f, St st, const char *name, const char *file, int line, unsigned mask = 0) {
    f->st = st;
    f->wname = name;
    f->wfile = file;
    f->wline = line;
    f->wmask = mask;
    switch_out(f);
}

/* ------------------------------------------------------------------------------------------------ */
/* Block barrier                                                                                    */
/* ------------------------------------------------------------------------------------------------ */
[[noreturn]] inline void block_divergence(Block &b, const char *what) {
    Fiber *e = b.first_exit;
    fail("barrier divergence in block (%u,%u,%u): %u thread(s) wait in %s at %s:%d but %u thread(s) of the "
         "block have exited (first: thread (%u,%u,%u)); every thread of a block must reach each "
         "__syncthreads() (%s)",
         b.idx.x, b.idx.y, b.idx.z, b.arrived, b.bname, b.bfile, b.bline, b.exited, e->tid.x, e->tid.y, e->tid.z,
         what);
}

inline long long block_barrier(const char *name, long long pred, const char *file, int line) {
    Fiber *f = current(name);
    Block &b = *f->block;
    if (b.arrived == 0) {
        b.bname = name;
        b.bfile = file;
        b.bline = line;
    } else if (config().strict_sites && (b.bline != line || std::strcmp(b.bfile, file) != 0)) {
        fail("threads of block (%u,%u,%u) wait in different barriers: %u thread(s) in %s at %s:%d, thread "
             "(%u,%u,%u) in %s at %s:%d (divergent __syncthreads(); CX_EMU_STRICT_SITES=0 allows it)",
             b.idx.x, b.idx.y, b.idx.z, b.arrived, b.bname, b.bfile, b.bline, f->tid.x, f->tid.y, f->tid.z, name,
             file, line);
    }
    b.arrived++;
    b.acc += pred;
    if (b.arrived + b.exited == b.nthreads) {
        if (b.exited) block_divergence(b, "a thread returned early");
        b.result = b.acc;
        b.acc = 0;
        b.arrived = 0;
        for (Fiber *w : b.waiters) w->st = St::Run;
        b.waiters.clear();
        return b.result;  // the last thread to arrive runs on ahead
    }
    b.waiters.push_back(f);
    wait_here(f, St::WaitBlock, name, file, line);
    return b.result;
}

/* ------------------------------------------------------------------------------------------------ */
/* Warp collectives: each lane writes its slot, waits for every live lane named in the mask; the    */
/* lane completing the group computes every participant's result.                                  */
/* ------------------------------------------------------------------------------------------------ */
inline bool warp_try_complete(Warp &w, size_t gi, Fiber *self) {
    WarpGroup g = w.pending[gi];
    unsigned need = g.mask & w.live;
    if ((g.arrived & need) != need) return false;
    unsigned A = g.arrived;
    uint64_t all = 0;
    bool have = false;
    switch (g.op) {
    case OP_BALLOT:
    case OP_ANY:
    case OP_ALL:
        for (unsigned l = 0; l < 32; l++)
            if ((A >> l & 1) && w.slot[l]) all |= 1ull << l;
        if (g.op == OP_ANY) all = all != 0;
        if (g.op == OP_ALL) all = all == A;
        have = true;
        break;
    case OP_RADD:
    case OP_RMIN_U:
    case OP_RMAX_U:
    case OP_RMIN_I:
    case OP_RMAX_I:
    case OP_RAND:
    case OP_ROR:
    case OP_RXOR: {
        bool first = true;
        uint32_t r = 0;
        for (unsigned l = 0; l < 32; l++) {
            if (!(A >> l & 1)) continue;
            uint32_t v = (uint32_t)w.slot[l];
            if (first) {
                r = v;
                first = false;
                continue;
            }
            switch (g.op) {
            case OP_RADD: r += v; break;
            case OP_RMIN_U: r = std::min(r, v); break;
            case OP_RMAX_U: r = std::max(r, v); break;
            case OP_RMIN_I: r = (uint32_t)std::min((int32_t)r, (int32_t)v); break;
            case OP_RMAX_I: r = (uint32_t)std::max((int32_t)r, (int32_t)v); break;
            case OP_RAND: r &= v; break;
            case OP_ROR: r |= v; break;
            default: r ^= v; break;
            }
        }
        all = r;
        have = true;
        break;
    }
    default: break;
    }
    for (unsigned l = 0; l < 32; l++) {
        if (!(A >> l & 1)) continue;
        Fiber *p = w.fib[l];
        if (have) {
            p->xval = all;
        } else if (g.op == OP_SHFL) {
            int s = p->xsrc;
            p->xval = ((unsigned)s == l || (A >> s & 1)) ? w.slot[s] : POISON64;
        } else if (g.op == OP_MATCH_ANY) {
            unsigned m = 0;
            for (unsigned k = 0; k < 32; k++)
                if ((A >> k & 1) && w.slot[k] == w.slot[l]) m |= 1u << k;
            p->xval = m;
        }
        if (p != self) p->st = St::Run;
    }
    w.pending.erase(w.pending.begin() + (long)gi);
    return true;
}

inline uint64_t warp_collective(const char *name, unsigned mask, int op, uint64_t value, int src, const char *file,
                                int line) {
    Fiber *f = current(name);
    Warp &w = f->block->warps[f->warp];
    unsigned bit = 1u << f->lane;
    if (!(mask & bit))
        fail("%s at %s:%d: the calling lane %u is not in the mask 0x%08x", name, file, line, f->lane, mask);
    w.slot[f->lane] = value;
    f->xsrc = src;
    size_t gi = 0;
    while (gi < w.pending.size() && w.pending[gi].mask != mask) gi++;
    if (gi == w.pending.size()) {
        w.pending.push_back(WarpGroup{mask, 0, op, name});
    } else if (w.pending[gi].op != op) {
        fail("lanes of warp %u in block (%u,%u,%u) execute different warp intrinsics with mask 0x%08x: %s and %s "
             "(at %s:%d)",
             f->warp, f->block->idx.x, f->block->idx.y, f->block->idx.z, mask, w.pending[gi].name, name, file, line);
    }
    w.pending[gi].arrived |= bit;
    if (!warp_try_complete(w, gi, f)) wait_here(f, St::WaitWarp, name, file, line, mask);
    return f->xval;
}

template <class T>
inline uint64_t to_bits(T v) {
    static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 8, "warp shuffle of a type over 8 bytes");
    uint64_t u = 0;
    std::memcpy(&u, &v, sizeof(T));
    return u;
}
template <class T>
inline T from_bits(uint64_t u) {
    T v;
    std::memcpy(&v, &u, sizeof(T));
    return v;
}
inline void check_width(const char *name, int width) {
    if (width <= 0 || width > 32 || (width & (width - 1)))
        fail("%s: width %d is not a power of two in [1, 32]", name, width);
}

/* ------------------------------------------------------------------------------------------------ */
/* Grid barrier (cooperative launches)                                                              */
/* ------------------------------------------------------------------------------------------------ */
inline void grid_barrier(const char *file, int line) {
    Fiber *f = current("cx_grid_sync()");
    Launch &L = *g_launch;
    if (!L.coop)
        fail("cx_grid_sync() at %s:%d in a launch that is not cooperative: launch the kernel with "
             "CX_LAUNCH_COOPERATIVE (cudaLaunchCooperativeKernel)",
             file, line);
    if (L.grid_arrived == 0) {
        L.gfile = file;
        L.gline = line;
    } else if (config().strict_sites && (L.gline != line || std::strcmp(L.gfile, file) != 0)) {
        fail("threads wait in different cx_grid_sync() calls: at %s:%d and at %s:%d", L.gfile, L.gline, file, line);
    }
    L.grid_arrived++;
    if (L.grid_arrived + L.grid_exited == L.grid_total) {
        if (L.grid_exited) {
            Fiber *e = L.grid_first_exit;
            fail("grid barrier divergence: %llu thread(s) wait in cx_grid_sync() at %s:%d but %llu thread(s) "
                 "have exited (first: block (%u,%u,%u) thread (%u,%u,%u))",
                 L.grid_arrived, L.gfile, L.gline, L.grid_exited, e->block->idx.x, e->block->idx.y, e->block->idx.z,
                 e->tid.x, e->tid.y, e->tid.z);
        }
        L.grid_arrived = 0;
        for (Fiber *w : L.grid_waiters) w->st = St::Run;
        L.grid_waiters.clear();
        return;
    }
    L.grid_waiters.push_back(f);
    wait_here(f, St::WaitGrid, "cx_grid_sync()", file, line);
}

/* ------------------------------------------------------------------------------------------------ */
/* Shared memory                                                                                    */
/* ------------------------------------------------------------------------------------------------ */
inline void *alloc_poisoned(size_t bytes, size_t align) {
    size_t n = (std::max<size_t>(bytes, 1) + align - 1) / align * align;
    void *p = std::aligned_alloc(align, n);
    if (!p) fail("out of memory allocating %zu bytes", bytes);
    std::memset(p, config().poison ? 0xff : 0, n);
#ifdef CX_EMU_ASAN
    ASAN_POISON_MEMORY_REGION((char *)p + bytes, n - bytes);  // the alignment padding is out of bounds too
#endif
    return p;
}

inline void plain_shared_check(const char *file, int line) {
    Launch *L = g_launch;
    if (L && L->coop && (unsigned long long)L->grid.x * L->grid.y * L->grid.z > 1)
        fail("a plain __shared__ variable (%s:%d) in a cooperative launch: the emulator makes it one static "
             "array for all blocks, which run together here; declare it with CX_SHARED(T, name, count)",
             file, line);
}

inline void *shared_slot(const void *key, size_t bytes, const char *name) {
    Fiber *f = current("CX_SHARED");
    Block &b = *f->block;
    for (auto &s : b.slots)
        if (s.first == key) return s.second;
    Launch &L = *g_launch;
    b.slot_bytes += bytes;
    if (b.slot_bytes + L.shmem > L.shmem_limit)
        fail("CX_SHARED(%s): %zu bytes of CX_SHARED arrays plus %zu bytes of dynamic shared memory exceed the "
             "%zu bytes a block may use",
             name, b.slot_bytes, L.shmem, L.shmem_limit);
    void *p = alloc_poisoned(bytes, 64);
    b.slots.emplace_back(key, p);
    return p;
}

inline void *dynamic_shared() { return current("CX_DYNAMIC_SHARED")->block->dyn; }

/* ------------------------------------------------------------------------------------------------ */
/* Launch                                                                                           */
/* ------------------------------------------------------------------------------------------------ */
inline void on_exit(Fiber *f) {
    uint64_t canary;
    std::memcpy(&canary, f->stack_lo, sizeof canary);
    if (canary != CANARY)
        fail("fiber stack overflow (the %zu KiB stack was overrun; raise CX_EMU_STACK_KB)", f->stack_size / 1024);
    f->st = St::Done;
    Block &b = *f->block;
    if (!b.first_exit) b.first_exit = f;
    b.exited++;
    if (b.arrived && b.arrived + b.exited == b.nthreads) block_divergence(b, "a thread returned early");
    Warp &w = b.warps[f->warp];
    w.live &= ~(1u << f->lane);
    for (size_t gi = 0; gi < w.pending.size();)
        if (!warp_try_complete(w, gi, f)) gi++;
    Launch &L = *g_launch;
    if (L.coop) {
        if (!L.grid_first_exit) L.grid_first_exit = f;
        L.grid_exited++;
        if (L.grid_arrived && L.grid_arrived + L.grid_exited == L.grid_total)
            fail("grid barrier divergence: %llu thread(s) wait in cx_grid_sync() at %s:%d but %llu thread(s) "
                 "have exited (last: this thread)",
                 L.grid_arrived, L.gfile, L.gline, L.grid_exited);
    }
}

inline void trampoline() {
    Fiber *f = g_cur;
    Launch *L = g_launch;
#ifdef CX_EMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &L->sched_stack_lo, &L->sched_stack_size);
#endif
    L->invoke(L->ctx);
    on_exit(f);
#ifdef CX_EMU_ASAN
    __sanitizer_start_switch_fiber(nullptr, L->sched_stack_lo, L->sched_stack_size);
#endif
    swapcontext(&f->ctx, &L->sched);  // never resumed
    std::abort();
}

[[noreturn]] inline void deadlock(Launch &L, Fiber *fibers, size_t n) {
    std::map<std::string, unsigned> waits;
    for (size_t i = 0; i < n; i++) {
        Fiber &f = fibers[i];
        if (f.st == St::Done || f.st == St::Run) continue;
        char key[512];
        if (f.st == St::WaitWarp)
            std::snprintf(key, sizeof key, "block (%u,%u,%u) warp %u: %s(mask=0x%08x) at %s:%d", f.block->idx.x,
                          f.block->idx.y, f.block->idx.z, f.warp, f.wname, f.wmask, f.wfile, f.wline);
        else
            std::snprintf(key, sizeof key, "block (%u,%u,%u): %s at %s:%d", f.block->idx.x, f.block->idx.y,
                          f.block->idx.z, f.wname, f.wfile, f.wline);
        waits[key]++;
    }
    std::string msg;
    unsigned shown = 0;
    for (auto &kv : waits) {
        if (shown++ == 24) {
            msg += "\n    ...";
            break;
        }
        msg += "\n    " + std::to_string(kv.second) + " thread(s) wait in " + kv.first;
    }
    (void)L;
    g_cur = nullptr;
    fail("deadlock: no thread can proceed (divergent barriers or warp intrinsics?):%s", msg.c_str());
}

inline uint32_t xorshift(uint32_t &s) {
    s ^= s << 13;
    s ^= s >> 17;
    s ^= s << 5;
    return s;
}

/* Run fibers[0..n) (one block, or every block of a cooperative launch) to completion. */
/* (its own function: getcontext "returns twice", which would clobber the caller's locals) */
__attribute__((noinline)) inline void init_fiber(Fiber &f) {
#ifdef CX_EMU_ASAN
    ASAN_UNPOISON_MEMORY_REGION(f.stack_lo, f.stack_size);
#endif
    std::memcpy(f.stack_lo, &CANARY, sizeof CANARY);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack_lo;
    f.ctx.uc_stack.ss_size = f.stack_size;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, trampoline, 0);
    f.st = St::Run;
    f.asan_fake = nullptr;
}

inline void run_group(Launch &L, Fiber *fibers, size_t n, uint32_t &rng) {
    for (size_t i = 0; i < n; i++) init_fiber(fibers[i]);
    std::vector<uint32_t> order;
    if (rng) {
        order.resize(n);
        for (size_t i = 0; i < n; i++) order[i] = (uint32_t)i;
    }
    size_t done = 0;
    while (done < n) {
        bool progressed = false;
        if (rng)
            for (size_t i = n; i > 1; i--) std::swap(order[i - 1], order[xorshift(rng) % i]);
        for (size_t k = 0; k < n; k++) {
            Fiber *f = &fibers[rng ? order[k] : k];
            if (f->st != St::Run) continue;
            resume(L, f);
            progressed = true;
            if (f->st == St::Done) done++;
        }
        if (done < n && !progressed) deadlock(L, fibers, n);
    }
}

inline void setup_block(Launch &L, Block &b, unsigned long long linear_block, Fiber *fibers, size_t stack0) {
    dim3 g = L.grid, t = L.block;
    b.idx = uint3{(unsigned)(linear_block % g.x), (unsigned)(linear_block / g.x % g.y),
                  (unsigned)(linear_block / ((unsigned long long)g.x * g.y))};
    b.nthreads = t.x * t.y * t.z;
    b.arrived = b.exited = 0;
    b.acc = b.result = 0;
    b.waiters.clear();
    b.first_exit = nullptr;
    b.warps.assign((b.nthreads + 31) / 32, Warp{});
    b.dyn = L.shmem ? (unsigned char *)alloc_poisoned(L.shmem, 256) : nullptr;
    b.slots.clear();
    b.slot_bytes = 0;
    for (unsigned i = 0; i < b.nthreads; i++) {
        Fiber &f = fibers[i];
        f.tid = uint3{i % t.x, i / t.x % t.y, i / (t.x * t.y)};
        f.linear = i;
        f.warp = i / 32;
        f.lane = i % 32;
        f.block = &b;
        f.stack_lo = t_stacks.lo(stack0 + i);
        f.stack_size = t_stacks.each;
        Warp &w = b.warps[f.warp];
        w.live |= 1u << f.lane;
        w.fib[f.lane] = &f;
    }
}
inline void teardown_block(Block &b) {
    std::free(b.dyn);
    b.dyn = nullptr;
    for (auto &s : b.slots) std::free(s.second);
    b.slots.clear();
}

inline std::map<const void *, size_t> &func_max_dynamic_shared() {
    static std::map<const void *, size_t> m;
    return m;
}

/* Blocks of `threads` threads using `dyn` bytes that one emulated SM holds at once. */
inline int blocks_per_sm(int threads, size_t dyn) {
    if (threads <= 0) return 0;
    int warps = (threads + 31) / 32;
    int by_threads = 64 / warps;  // 2048 threads per SM
    int by_smem = dyn ? (int)(228 * 1024 / (dyn + 1024)) : 32;
    return std::max(0, std::min({32, by_threads, by_smem}));
}

inline void run_launch(const char *name, const void *fn, dim3 grid, dim3 block, size_t shmem, bool coop,
                       void (*invoke)(void *), void *ctx) {
    if (g_launch) fail("kernel `%s` launched from inside kernel `%s` (dynamic parallelism is not emulated)", name,
                       g_launch->name);
    Launch L;
    L.name = name;
    L.grid = grid;
    L.block = block;
    L.shmem = shmem;
    L.coop = coop;
    L.invoke = invoke;
    L.ctx = ctx;
    unsigned long long threads = (unsigned long long)block.x * block.y * block.z;
    unsigned long long blocks = (unsigned long long)grid.x * grid.y * grid.z;
    auto bad = [&](const char *why) {
        std::fprintf(stderr,
                     "cx_emu: error: invalid launch of kernel `%s` <<<(%u,%u,%u), (%u,%u,%u), %zu>>>: %s\n", name,
                     grid.x, grid.y, grid.z, block.x, block.y, block.z, shmem, why);
        std::fflush(stderr);
        std::abort();
    };
    if (threads == 0 || blocks == 0) bad("a grid or block dimension is 0");
    if (threads > 1024) bad("more than 1024 threads per block");
    if (block.x > 1024 || block.y > 1024 || block.z > 64) bad("block dimensions exceed (1024, 1024, 64)");
    if (grid.x > 2147483647u || grid.y > 65535 || grid.z > 65535) bad("grid dimensions exceed (2^31-1, 65535, 65535)");
    auto it = func_max_dynamic_shared().find(fn);
    size_t dyn_limit = it != func_max_dynamic_shared().end() ? it->second : config().max_shared_per_block;
    if (shmem > dyn_limit)
        bad("dynamic shared memory exceeds the kernel's limit (48 KiB unless raised with cudaFuncSetAttribute("
            "kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes))");
    L.shmem_limit = std::max(config().max_shared_per_block_optin, shmem);
    if (coop) {
        unsigned long long fit = (unsigned long long)config().num_sms * blocks_per_sm((int)threads, shmem);
        if (blocks > fit) {
            char why[256];
            std::snprintf(why, sizeof why,
                          "a cooperative grid of %llu blocks does not fit the emulated device (%d SMs x %d blocks "
                          "per SM = %llu); size it with cudaOccupancyMaxActiveBlocksPerMultiprocessor x "
                          "multiProcessorCount",
                          blocks, config().num_sms, blocks_per_sm((int)threads, shmem), fit);
            bad(why);
        }
    }
    dim3 saved_grid = gridDim, saved_block = blockDim;
    gridDim = grid;
    blockDim = block;
    uint32_t rng = config().seed ? config().seed * 2654435761u + 1u : 0u;
    g_launch = &L;
    {
        SignalGuard sig;
        if (coop) {
            size_t nf = (size_t)(blocks * threads);
            t_stacks.ensure(nf, config().stack_bytes);
            std::vector<Fiber> fibers(nf);
            std::vector<Block> bl(blocks);
            for (unsigned long long b = 0; b < blocks; b++)
                setup_block(L, bl[b], b, &fibers[b * threads], (size_t)(b * threads));
            L.grid_total = nf;
            run_group(L, fibers.data(), nf, rng);
            for (auto &b : bl) teardown_block(b);
        } else {
            t_stacks.ensure(threads, config().stack_bytes);
            std::vector<Fiber> fibers(threads);
            Block b;
            /* CX_EMU_SEED: visit the blocks in a random order, k -> (k * mul + add) mod blocks */
            unsigned long long mul = 1, add = 0;
            if (rng && blocks > 1) {
                do mul = xorshift(rng) % blocks; while (std::gcd(mul, blocks) != 1);
                add = xorshift(rng) % blocks;
            }
            for (unsigned long long k = 0; k < blocks; k++) {
                unsigned long long which = (k * mul + add) % blocks;
                setup_block(L, b, which, fibers.data(), 0);
                run_group(L, fibers.data(), threads, rng);
                teardown_block(b);
            }
        }
    }
    g_launch = nullptr;
    g_cur = nullptr;
    gridDim = saved_grid;
    blockDim = saved_block;
}

template <class... P>
struct KernelCall {
    void (*kernel)(P...);
    std::tuple<std::decay_t<P>...> args;
    static void invoke(void *self) {
        auto *c = static_cast<KernelCall *>(self);
        std::apply(c->kernel, c->args);  // each thread gets its own copy of the parameters
    }
};

template <class... P, std::size_t... I>
inline KernelCall<P...> call_from_argv(void (*kernel)(P...), void **argv, std::index_sequence<I...>) {
    return KernelCall<P...>{kernel, std::tuple<std::decay_t<P>...>(*static_cast<std::decay_t<P> *>(argv[I])...)};
}

}  // namespace detail

/* ------------------------------------------------------------------------------------------------ */
/* Stream log: which stream each launch, copy, memset and synchronisation named (off until started)  */
/* ------------------------------------------------------------------------------------------------ */
enum StreamOp { STREAM_LAUNCH = 0, STREAM_COOPERATIVE = 1, STREAM_COPY = 2, STREAM_MEMSET = 3, STREAM_SYNC = 4 };
struct StreamLog {
    std::mutex mu;
    bool on = false;
    std::vector<std::pair<int64_t, uint64_t>> entries;  // (StreamOp, handle)
};
inline StreamLog &stream_log() {
    static StreamLog log;
    return log;
}
inline void record_stream(StreamOp op, const void *stream) {
    StreamLog &log = stream_log();
    std::lock_guard<std::mutex> lock(log.mu);
    if (log.on) log.entries.emplace_back((int64_t)op, (uint64_t)(uintptr_t)stream);
}

/* ------------------------------------------------------------------------------------------------ */
/* Public launch API                                                                                */
/* ------------------------------------------------------------------------------------------------ */
template <class... P, class... A>
inline void launch_named(const char *name, void (*kernel)(P...), dim3 grid, dim3 block, size_t shmem, A &&...args) {
    static_assert(sizeof...(P) == sizeof...(A), "wrong number of kernel arguments");
    detail::KernelCall<P...> call{kernel, std::tuple<std::decay_t<P>...>(std::forward<A>(args)...)};
    detail::run_launch(name, (const void *)kernel, grid, block, shmem, false, &detail::KernelCall<P...>::invoke, &call);
}
template <class... P, class... A>
inline void launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t shmem, A &&...args) {
    launch_named("kernel", kernel, grid, block, shmem, std::forward<A>(args)...);
}
template <class... P, class... A>
inline cudaError_t launch_cooperative_named(const char *name, void (*kernel)(P...), dim3 grid, dim3 block,
                                            size_t shmem, A &&...args) {
    static_assert(sizeof...(P) == sizeof...(A), "wrong number of kernel arguments");
    detail::KernelCall<P...> call{kernel, std::tuple<std::decay_t<P>...>(std::forward<A>(args)...)};
    detail::run_launch(name, (const void *)kernel, grid, block, shmem, true, &detail::KernelCall<P...>::invoke, &call);
    return cudaSuccess;
}
template <class... P, class... A>
inline cudaError_t launch_cooperative(void (*kernel)(P...), dim3 grid, dim3 block, size_t shmem, A &&...args) {
    return launch_cooperative_named("kernel", kernel, grid, block, shmem, std::forward<A>(args)...);
}

}  // namespace cx_emu

/* ------------------------------------------------------------------------------------------------ */
/* Device-side synchronisation                                                                      */
/* ------------------------------------------------------------------------------------------------ */
inline void __syncthreads(const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    cx_emu::detail::block_barrier("__syncthreads()", 0, file, line);
}
inline int __syncthreads_count(int pred, const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    return (int)cx_emu::detail::block_barrier("__syncthreads_count()", pred != 0, file, line);
}
inline int __syncthreads_and(int pred, const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    return cx_emu::detail::block_barrier("__syncthreads_and()", pred != 0, file, line) ==
           blockDim.x * blockDim.y * blockDim.z;
}
inline int __syncthreads_or(int pred, const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    return cx_emu::detail::block_barrier("__syncthreads_or()", pred != 0, file, line) != 0;
}
inline void cx_grid_sync(const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    cx_emu::detail::grid_barrier(file, line);
}
inline void __syncwarp(unsigned mask = 0xffffffffu, const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    cx_emu::detail::warp_collective("__syncwarp", mask, cx_emu::detail::OP_SYNC, 0, -1, file, line);
}
inline unsigned __activemask() {  // every non-exited lane of the warp, even in divergent code
    cx_emu::detail::Fiber *f = cx_emu::detail::current("__activemask()");
    return f->block->warps[f->warp].live;
}
inline void __threadfence() {}
inline void __threadfence_block() {}
inline void __threadfence_system() {}
inline void __nanosleep(unsigned) {
    using namespace cx_emu::detail;
    Fiber *f = current("__nanosleep()");
    f->st = St::Run;  // stays runnable; lets the other fibers run (spin-waits in cooperative launches)
    switch_out(f);
}
[[noreturn]] inline void __trap() { cx_emu::detail::fail("__trap() called"); }
inline long long clock64() {
    return (long long)std::chrono::steady_clock::now().time_since_epoch().count();
}

/* Warp shuffles */
template <class T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize, const char *file = __builtin_FILE(),
                     int line = __builtin_LINE()) {
    using namespace cx_emu::detail;
    check_width("__shfl_sync", width);
    unsigned lane = current("__shfl_sync")->lane;
    int src = (int)((lane & ~(unsigned)(width - 1)) + ((unsigned)src_lane & (unsigned)(width - 1)));
    return from_bits<T>(warp_collective("__shfl_sync", mask, OP_SHFL, to_bits(var), src, file, line));
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                        const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    using namespace cx_emu::detail;
    check_width("__shfl_up_sync", width);
    unsigned lane = current("__shfl_up_sync")->lane;
    int src = (lane % (unsigned)width) >= delta ? (int)(lane - delta) : (int)lane;
    return from_bits<T>(warp_collective("__shfl_up_sync", mask, OP_SHFL, to_bits(var), src, file, line));
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                          const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    using namespace cx_emu::detail;
    check_width("__shfl_down_sync", width);
    unsigned lane = current("__shfl_down_sync")->lane;
    int src = (lane % (unsigned)width) + delta < (unsigned)width ? (int)(lane + delta) : (int)lane;
    return from_bits<T>(warp_collective("__shfl_down_sync", mask, OP_SHFL, to_bits(var), src, file, line));
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize,
                         const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    using namespace cx_emu::detail;
    check_width("__shfl_xor_sync", width);
    unsigned lane = current("__shfl_xor_sync")->lane;
    unsigned src = lane ^ (unsigned)lane_mask;
    if (src >= 32 || src / (unsigned)width > lane / (unsigned)width) src = lane;  // later segments: own value
    return from_bits<T>(warp_collective("__shfl_xor_sync", mask, OP_SHFL, to_bits(var), (int)src, file, line));
}
/* Votes and reductions */
inline unsigned __ballot_sync(unsigned mask, int pred, const char *file = __builtin_FILE(),
                              int line = __builtin_LINE()) {
    return (unsigned)cx_emu::detail::warp_collective("__ballot_sync", mask, cx_emu::detail::OP_BALLOT, pred != 0, -1,
                                                     file, line);
}
inline int __any_sync(unsigned mask, int pred, const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    return (int)cx_emu::detail::warp_collective("__any_sync", mask, cx_emu::detail::OP_ANY, pred != 0, -1, file, line);
}
inline int __all_sync(unsigned mask, int pred, const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    return (int)cx_emu::detail::warp_collective("__all_sync", mask, cx_emu::detail::OP_ALL, pred != 0, -1, file, line);
}
template <class T>
inline unsigned __match_any_sync(unsigned mask, T value, const char *file = __builtin_FILE(),
                                 int line = __builtin_LINE()) {
    using namespace cx_emu::detail;
    return (unsigned)warp_collective("__match_any_sync", mask, OP_MATCH_ANY, to_bits(value), -1, file, line);
}
#define CX_EMU_WARP_REDUCE_(fn, T, op)                                                                        \
    inline T fn(unsigned mask, T value, const char *file = __builtin_FILE(), int line = __builtin_LINE()) {  \
        return (T)(uint32_t)cx_emu::detail::warp_collective(#fn, mask, cx_emu::detail::op, (uint32_t)value, -1, \
                                                            file, line);                                    \
    }
CX_EMU_WARP_REDUCE_(__reduce_add_sync, unsigned, OP_RADD)
CX_EMU_WARP_REDUCE_(__reduce_add_sync, int, OP_RADD)
CX_EMU_WARP_REDUCE_(__reduce_min_sync, unsigned, OP_RMIN_U)
CX_EMU_WARP_REDUCE_(__reduce_min_sync, int, OP_RMIN_I)
CX_EMU_WARP_REDUCE_(__reduce_max_sync, unsigned, OP_RMAX_U)
CX_EMU_WARP_REDUCE_(__reduce_max_sync, int, OP_RMAX_I)
CX_EMU_WARP_REDUCE_(__reduce_and_sync, unsigned, OP_RAND)
CX_EMU_WARP_REDUCE_(__reduce_or_sync, unsigned, OP_ROR)
CX_EMU_WARP_REDUCE_(__reduce_xor_sync, unsigned, OP_RXOR)
#undef CX_EMU_WARP_REDUCE_

/* ------------------------------------------------------------------------------------------------ */
/* Atomics: fibers never interleave inside a function, so plain read-modify-write is atomic          */
/* ------------------------------------------------------------------------------------------------ */
#define CX_EMU_RMW_(fn, T, expr)            \
    inline T fn(T *address, T val) {        \
        T old = *address;                   \
        *address = (expr);                  \
        return old;                         \
    }
CX_EMU_RMW_(atomicAdd, int, (int)((unsigned)old + (unsigned)val))
CX_EMU_RMW_(atomicAdd, unsigned, old + val)
CX_EMU_RMW_(atomicAdd, unsigned long long, old + val)
CX_EMU_RMW_(atomicAdd, float, old + val)
CX_EMU_RMW_(atomicAdd, double, old + val)
CX_EMU_RMW_(atomicSub, int, (int)((unsigned)old - (unsigned)val))
CX_EMU_RMW_(atomicSub, unsigned, old - val)
CX_EMU_RMW_(atomicExch, int, val)
CX_EMU_RMW_(atomicExch, unsigned, val)
CX_EMU_RMW_(atomicExch, unsigned long long, val)
CX_EMU_RMW_(atomicExch, float, val)
CX_EMU_RMW_(atomicMin, int, val < old ? val : old)
CX_EMU_RMW_(atomicMin, unsigned, val < old ? val : old)
CX_EMU_RMW_(atomicMin, long long, val < old ? val : old)
CX_EMU_RMW_(atomicMin, unsigned long long, val < old ? val : old)
CX_EMU_RMW_(atomicMax, int, val > old ? val : old)
CX_EMU_RMW_(atomicMax, unsigned, val > old ? val : old)
CX_EMU_RMW_(atomicMax, long long, val > old ? val : old)
CX_EMU_RMW_(atomicMax, unsigned long long, val > old ? val : old)
CX_EMU_RMW_(atomicInc, unsigned, old >= val ? 0u : old + 1u)
CX_EMU_RMW_(atomicDec, unsigned, (old == 0u || old > val) ? val : old - 1u)
CX_EMU_RMW_(atomicAnd, int, old &val)
CX_EMU_RMW_(atomicAnd, unsigned, old &val)
CX_EMU_RMW_(atomicAnd, unsigned long long, old &val)
CX_EMU_RMW_(atomicOr, int, old | val)
CX_EMU_RMW_(atomicOr, unsigned, old | val)
CX_EMU_RMW_(atomicOr, unsigned long long, old | val)
CX_EMU_RMW_(atomicXor, int, old ^ val)
CX_EMU_RMW_(atomicXor, unsigned, old ^ val)
CX_EMU_RMW_(atomicXor, unsigned long long, old ^ val)
#undef CX_EMU_RMW_
#define CX_EMU_CAS_(T)                                   \
    inline T atomicCAS(T *address, T compare, T val) {   \
        T old = *address;                                \
        if (old == compare) *address = val;              \
        return old;                                      \
    }
CX_EMU_CAS_(int)
CX_EMU_CAS_(unsigned)
CX_EMU_CAS_(unsigned long long)
CX_EMU_CAS_(unsigned short)
#undef CX_EMU_CAS_

/* ------------------------------------------------------------------------------------------------ */
/* Math and bit intrinsics                                                                          */
/* ------------------------------------------------------------------------------------------------ */
template <class T>
inline T __ldg(const T *p) { return *p; }
template <class T>
inline T __ldcg(const T *p) { return *p; }
template <class T>
inline T __ldcs(const T *p) { return *p; }
template <class T>
inline void __stcg(T *p, T v) { *p = v; }
template <class T>
inline void __stcs(T *p, T v) { *p = v; }

inline float __expf(float x) { return ::expf(x); }
inline float __exp10f(float x) { return ::exp10f(x); }
inline float __logf(float x) { return ::logf(x); }
inline float __log2f(float x) { return ::log2f(x); }
inline float __log10f(float x) { return ::log10f(x); }
inline float __sinf(float x) { return ::sinf(x); }
inline float __cosf(float x) { return ::cosf(x); }
inline float __tanf(float x) { return ::tanf(x); }
inline void __sincosf(float x, float *s, float *c) { ::sincosf(x, s, c); }
inline float __powf(float x, float y) { return ::powf(x, y); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __fdiv_rn(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return ::sqrtf(x); }
inline float __fadd_rn(float x, float y) { return x + y; }
inline float __fsub_rn(float x, float y) { return x - y; }
inline float __fmul_rn(float x, float y) { return x * y; }
inline float __fmaf_rn(float x, float y, float z) { return ::fmaf(x, y, z); }
inline float __saturatef(float x) { return x > 0.0f ? (x < 1.0f ? x : 1.0f) : 0.0f; }  // NaN -> 0
inline float rsqrtf(float x) { return 1.0f / ::sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / ::sqrt(x); }

namespace cx_emu {
namespace detail {
template <class I, class F>
inline I f2i_sat(F v) {
    if (v != v) return 0;
    if (v <= (F)std::numeric_limits<I>::min()) return std::numeric_limits<I>::min();
    if (v >= (F)std::numeric_limits<I>::max()) return std::numeric_limits<I>::max();
    return (I)v;
}
}  // namespace detail
}  // namespace cx_emu
inline int __float2int_rn(float x) { return cx_emu::detail::f2i_sat<int>(::nearbyintf(x)); }
inline int __float2int_rz(float x) { return cx_emu::detail::f2i_sat<int>(::truncf(x)); }
inline int __float2int_rd(float x) { return cx_emu::detail::f2i_sat<int>(::floorf(x)); }
inline int __float2int_ru(float x) { return cx_emu::detail::f2i_sat<int>(::ceilf(x)); }
inline unsigned __float2uint_rn(float x) { return cx_emu::detail::f2i_sat<unsigned>(::nearbyintf(x)); }
inline unsigned __float2uint_rz(float x) { return cx_emu::detail::f2i_sat<unsigned>(::truncf(x)); }
inline long long __float2ll_rn(float x) { return cx_emu::detail::f2i_sat<long long>(::nearbyintf(x)); }
inline int __double2int_rn(double x) { return cx_emu::detail::f2i_sat<int>(::nearbyint(x)); }
inline float __int2float_rn(int x) { return (float)x; }
inline float __uint2float_rn(unsigned x) { return (float)x; }
inline int __float_as_int(float x) { return cx_emu::detail::from_bits<int>(cx_emu::detail::to_bits(x)); }
inline unsigned __float_as_uint(float x) { return cx_emu::detail::from_bits<unsigned>(cx_emu::detail::to_bits(x)); }
inline float __int_as_float(int x) { return cx_emu::detail::from_bits<float>(cx_emu::detail::to_bits(x)); }
inline float __uint_as_float(unsigned x) { return cx_emu::detail::from_bits<float>(cx_emu::detail::to_bits(x)); }
inline long long __double_as_longlong(double x) {
    return cx_emu::detail::from_bits<long long>(cx_emu::detail::to_bits(x));
}
inline double __longlong_as_double(long long x) {
    return cx_emu::detail::from_bits<double>(cx_emu::detail::to_bits(x));
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
    x = ((x >> 8) & 0x00ff00ffu) | ((x & 0x00ff00ffu) << 8);
    return (x >> 16) | (x << 16);
}
inline int __mul24(int x, int y) { return (int)((long long)(x << 8 >> 8) * (y << 8 >> 8)); }
inline unsigned __umul24(unsigned x, unsigned y) { return (x & 0xffffffu) * (y & 0xffffffu); }
inline int __mulhi(int x, int y) { return (int)(((long long)x * y) >> 32); }
inline unsigned __umulhi(unsigned x, unsigned y) { return (unsigned)(((unsigned long long)x * y) >> 32); }

/* min/max as CUDA's math headers overload them (also callable from host code) */
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline unsigned min(int a, unsigned b) { return min((unsigned)a, b); }
inline unsigned max(int a, unsigned b) { return max((unsigned)a, b); }
inline unsigned min(unsigned a, int b) { return min(a, (unsigned)b); }
inline unsigned max(unsigned a, int b) { return max(a, (unsigned)b); }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline unsigned long min(unsigned long a, unsigned long b) { return a < b ? a : b; }
inline unsigned long max(unsigned long a, unsigned long b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return ::fminf(a, b); }
inline float max(float a, float b) { return ::fmaxf(a, b); }
inline double min(double a, double b) { return ::fmin(a, b); }
inline double max(double a, double b) { return ::fmax(a, b); }
inline double min(float a, double b) { return ::fmin(a, b); }
inline double max(float a, double b) { return ::fmax(a, b); }
inline double min(double a, float b) { return ::fmin(a, b); }
inline double max(double a, float b) { return ::fmax(a, b); }

/* ------------------------------------------------------------------------------------------------ */
/* Runtime API (host side): device memory is host memory, tracked to check copies and frees         */
/* ------------------------------------------------------------------------------------------------ */
namespace cx_emu {
namespace detail {
enum MemKind { MEM_NONE = 0, MEM_DEVICE = 1, MEM_HOST = 2, MEM_MANAGED = 3 };
struct Alloc {
    size_t size;
    MemKind kind;
};
struct AllocTable {
    std::mutex mu;
    std::map<uintptr_t, Alloc> map;
};
inline AllocTable &allocs() {
    static AllocTable t;
    return t;
}
inline thread_local cudaError_t t_last_error = cudaSuccess;
inline cudaError_t set_error(cudaError_t e) {
    if (e != cudaSuccess) t_last_error = e;
    return e;
}
/* The allocation holding p (kind MEM_NONE if none), with its base and size. */
inline MemKind find_alloc(const void *p, uintptr_t *base = nullptr, size_t *size = nullptr) {
    AllocTable &t = allocs();
    std::lock_guard<std::mutex> lock(t.mu);
    auto it = t.map.upper_bound((uintptr_t)p);
    if (it == t.map.begin()) return MEM_NONE;
    --it;
    if ((uintptr_t)p >= it->first + std::max<size_t>(it->second.size, 1)) return MEM_NONE;
    if (base) *base = it->first;
    if (size) *size = it->second.size;
    return it->second.kind;
}
inline cudaError_t do_alloc(void **p, size_t size, MemKind kind) {
    if (!p) return set_error(cudaErrorInvalidValue);
    void *m = alloc_poisoned(size, 256);
    if (kind != MEM_DEVICE) std::memset(m, 0, size);
    AllocTable &t = allocs();
    std::lock_guard<std::mutex> lock(t.mu);
    t.map[(uintptr_t)m] = Alloc{size, kind};
    *p = m;
    return cudaSuccess;
}
inline cudaError_t do_free(void *p, const char *what, bool host) {
    if (!p) return cudaSuccess;
    AllocTable &t = allocs();
    {
        std::lock_guard<std::mutex> lock(t.mu);
        auto it = t.map.find((uintptr_t)p);
        if (it == t.map.end() || (it->second.kind == MEM_HOST) != host) {
            std::fprintf(stderr, "cx_emu: error: %s(%p): not a pointer returned by %s (double free?)\n", what, p,
                         host ? "cudaMallocHost" : "cudaMalloc/cudaMallocManaged");
            std::fflush(stderr);
            std::abort();
        }
        t.map.erase(it);
    }
    std::free(p);
    return cudaSuccess;
}
/* Checks that [p, p+n) is device memory (or, need_device=false, anything: then only in-bounds if tracked). */
inline void check_range(const char *what, const char *role, const void *p, size_t n, bool need_device) {
    if (!p) fail("%s: the %s pointer is null", what, role);
    uintptr_t base = 0;
    size_t size = 0;
    MemKind k = find_alloc(p, &base, &size);
    if (k == MEM_NONE || k == MEM_HOST) {
        if (need_device)
            fail("%s: the %s %p is not device memory from cudaMalloc (wrong cudaMemcpyKind or swapped arguments?)",
                 what, role, p);
        return;
    }
    if ((uintptr_t)p + n > base + size)
        fail("%s: %zu bytes at %s %p run past the end of its %zu-byte allocation (by %zu bytes)", what, n, role, p,
             size, (size_t)((uintptr_t)p + n - base - size));
}
}  // namespace detail
}  // namespace cx_emu

inline cudaError_t cudaMalloc(void **p, size_t size) {
    return cx_emu::detail::do_alloc(p, size, cx_emu::detail::MEM_DEVICE);
}
template <class T>
inline cudaError_t cudaMalloc(T **p, size_t size) {
    return cudaMalloc(reinterpret_cast<void **>(p), size);
}
inline cudaError_t cudaMallocManaged(void **p, size_t size, unsigned = cudaMemAttachGlobal) {
    return cx_emu::detail::do_alloc(p, size, cx_emu::detail::MEM_MANAGED);
}
template <class T>
inline cudaError_t cudaMallocManaged(T **p, size_t size, unsigned flags = cudaMemAttachGlobal) {
    return cudaMallocManaged(reinterpret_cast<void **>(p), size, flags);
}
inline cudaError_t cudaMallocHost(void **p, size_t size) {
    return cx_emu::detail::do_alloc(p, size, cx_emu::detail::MEM_HOST);
}
template <class T>
inline cudaError_t cudaMallocHost(T **p, size_t size) {
    return cudaMallocHost(reinterpret_cast<void **>(p), size);
}
inline cudaError_t cudaHostAlloc(void **p, size_t size, unsigned) { return cudaMallocHost(p, size); }
inline cudaError_t cudaFree(void *p) { return cx_emu::detail::do_free(p, "cudaFree", false); }
inline cudaError_t cudaFreeHost(void *p) { return cx_emu::detail::do_free(p, "cudaFreeHost", true); }

namespace cx_emu {
namespace detail {
inline cudaError_t copy(void *dst, const void *src, size_t count, cudaMemcpyKind kind) {
    if (count == 0) return cudaSuccess;
    static const char *names[] = {"cudaMemcpy(HostToHost)", "cudaMemcpy(HostToDevice)", "cudaMemcpy(DeviceToHost)",
                                  "cudaMemcpy(DeviceToDevice)", "cudaMemcpy(Default)"};
    if ((unsigned)kind > 4u) return set_error(cudaErrorInvalidMemcpyDirection);
    const char *what = names[kind];
    check_range(what, "destination", dst, count, kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice);
    check_range(what, "source", src, count, kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice);
    std::memmove(dst, src, count);
    return cudaSuccess;
}
inline cudaError_t fill(void *p, int value, size_t count) {
    if (count == 0) return cudaSuccess;
    check_range("cudaMemset", "destination", p, count, true);
    std::memset(p, value, count);
    return cudaSuccess;
}
}  // namespace detail
}  // namespace cx_emu
inline cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, cudaMemcpyKind kind) {
    cx_emu::record_stream(cx_emu::STREAM_COPY, nullptr);
    return cx_emu::detail::copy(dst, src, count, kind);
}
inline cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, cudaMemcpyKind kind,
                                   cudaStream_t stream = nullptr) {
    cx_emu::record_stream(cx_emu::STREAM_COPY, stream);
    return cx_emu::detail::copy(dst, src, count, kind);
}
inline cudaError_t cudaMemset(void *p, int value, size_t count) {
    cx_emu::record_stream(cx_emu::STREAM_MEMSET, nullptr);
    return cx_emu::detail::fill(p, value, count);
}
inline cudaError_t cudaMemsetAsync(void *p, int value, size_t count, cudaStream_t stream = nullptr) {
    cx_emu::record_stream(cx_emu::STREAM_MEMSET, stream);
    return cx_emu::detail::fill(p, value, count);
}
template <class T>
inline cudaError_t cudaMemcpyToSymbol(T &symbol, const void *src, size_t count, size_t offset = 0,
                                      cudaMemcpyKind = cudaMemcpyHostToDevice) {
    if (offset + count > sizeof(T)) cx_emu::detail::fail("cudaMemcpyToSymbol: %zu bytes at offset %zu exceed the "
                                                         "%zu-byte symbol", count, offset, sizeof(T));
    std::memcpy(reinterpret_cast<char *>(&symbol) + offset, src, count);
    return cudaSuccess;
}
template <class T>
inline cudaError_t cudaMemcpyFromSymbol(void *dst, const T &symbol, size_t count, size_t offset = 0,
                                        cudaMemcpyKind = cudaMemcpyDeviceToHost) {
    if (offset + count > sizeof(T)) cx_emu::detail::fail("cudaMemcpyFromSymbol: %zu bytes at offset %zu exceed the "
                                                         "%zu-byte symbol", count, offset, sizeof(T));
    std::memcpy(dst, reinterpret_cast<const char *>(&symbol) + offset, count);
    return cudaSuccess;
}
template <class T>
inline cudaError_t cudaGetSymbolAddress(void **p, const T &symbol) {
    *p = (void *)&symbol;
    return cudaSuccess;
}

inline cudaError_t cudaDeviceSynchronize() {
    cx_emu::record_stream(cx_emu::STREAM_SYNC, nullptr);
    return cudaSuccess;
}
inline cudaError_t cudaDeviceReset() { return cudaSuccess; }
inline cudaError_t cudaStreamCreate(cudaStream_t *s) {
    static char dummy;
    *s = reinterpret_cast<cudaStream_t>(&dummy);
    return cudaSuccess;
}
inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned) { return cudaStreamCreate(s); }
inline cudaError_t cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
    cx_emu::record_stream(cx_emu::STREAM_SYNC, stream);
    return cudaSuccess;
}
inline cudaError_t cudaEventCreate(cudaEvent_t *e) {
    *e = new CUevent_st{std::chrono::steady_clock::now()};
    return cudaSuccess;
}
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned) { return cudaEventCreate(e); }
inline cudaError_t cudaEventDestroy(cudaEvent_t e) {
    delete e;
    return cudaSuccess;
}
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t = nullptr) {
    e->t = std::chrono::steady_clock::now();
    return cudaSuccess;
}
inline cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
inline cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) {
    *ms = std::chrono::duration<float, std::milli>(b->t - a->t).count();
    return cudaSuccess;
}
inline cudaError_t cudaGetLastError() {
    cudaError_t e = cx_emu::detail::t_last_error;
    cx_emu::detail::t_last_error = cudaSuccess;
    return e;
}
inline cudaError_t cudaPeekAtLastError() { return cx_emu::detail::t_last_error; }
inline const char *cudaGetErrorName(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorInvalidDeviceFunction: return "cudaErrorInvalidDeviceFunction";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorCooperativeLaunchTooLarge: return "cudaErrorCooperativeLaunchTooLarge";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    }
    return "cudaErrorUnknown";
}
inline const char *cudaGetErrorString(cudaError_t e) { return cudaGetErrorName(e); }
inline cudaError_t cudaGetDeviceCount(int *n) {
    *n = 1;
    return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int *d) {
    *d = 0;
    return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int d) {
    return d == 0 ? cudaSuccess : cx_emu::detail::set_error(cudaErrorInvalidDevice);
}
inline cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int device) {
    if (device != 0) return cx_emu::detail::set_error(cudaErrorInvalidDevice);
    std::memset(p, 0, sizeof *p);
    std::snprintf(p->name, sizeof p->name, "cx_emu CPU emulator (%d SMs)", cx_emu::config().num_sms);
    p->totalGlobalMem = (size_t)16 << 30;
    p->sharedMemPerBlock = cx_emu::config().max_shared_per_block;
    p->regsPerBlock = 65536;
    p->warpSize = 32;
    p->maxThreadsPerBlock = 1024;
    p->maxThreadsDim[0] = p->maxThreadsDim[1] = 1024;
    p->maxThreadsDim[2] = 64;
    p->maxGridSize[0] = 2147483647;
    p->maxGridSize[1] = p->maxGridSize[2] = 65535;
    p->totalConstMem = 65536;
    p->major = 9;
    p->minor = 0;
    p->multiProcessorCount = cx_emu::config().num_sms;
    p->l2CacheSize = 50 << 20;
    p->maxThreadsPerMultiProcessor = 2048;
    p->sharedMemPerMultiprocessor = 228 * 1024;
    p->regsPerMultiprocessor = 65536;
    p->cooperativeLaunch = 1;
    p->sharedMemPerBlockOptin = cx_emu::config().max_shared_per_block_optin;
    p->maxBlocksPerMultiProcessor = 32;
    return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int device) {
    cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, device) != cudaSuccess) return cudaErrorInvalidDevice;
    switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = p.maxThreadsPerBlock; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = (int)p.sharedMemPerBlock; break;
    case cudaDevAttrWarpSize: *value = 32; break;
    case cudaDevAttrMultiProcessorCount: *value = p.multiProcessorCount; break;
    case cudaDevAttrMaxThreadsPerMultiProcessor: *value = p.maxThreadsPerMultiProcessor; break;
    case cudaDevAttrComputeCapabilityMajor: *value = p.major; break;
    case cudaDevAttrComputeCapabilityMinor: *value = p.minor; break;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *value = (int)p.sharedMemPerMultiprocessor; break;
    case cudaDevAttrCooperativeLaunch: *value = 1; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = (int)p.sharedMemPerBlockOptin; break;
    case cudaDevAttrMaxBlocksPerMultiprocessor: *value = p.maxBlocksPerMultiProcessor; break;
    default: return cx_emu::detail::set_error(cudaErrorInvalidValue);
    }
    return cudaSuccess;
}
template <class... P>
inline cudaError_t cudaFuncSetAttribute(void (*kernel)(P...), cudaFuncAttribute attr, int value) {
    if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
        if (value < 0 || (size_t)value > cx_emu::config().max_shared_per_block_optin)
            return cx_emu::detail::set_error(cudaErrorInvalidValue);
        cx_emu::detail::func_max_dynamic_shared()[(const void *)kernel] = (size_t)value;
    }
    return cudaSuccess;
}
template <class... P>
inline cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int *num_blocks, void (*)(P...), int block_size,
                                                                 size_t dynamic_smem) {
    *num_blocks = cx_emu::detail::blocks_per_sm(block_size, dynamic_smem);
    return cudaSuccess;
}
template <class... P>
inline cudaError_t cudaLaunchKernel(void (*kernel)(P...), dim3 grid, dim3 block, void **args, size_t shmem = 0,
                                    cudaStream_t stream = nullptr) {
    cx_emu::record_stream(cx_emu::STREAM_LAUNCH, stream);
    auto call = cx_emu::detail::call_from_argv(kernel, args, std::index_sequence_for<P...>{});
    cx_emu::detail::run_launch("kernel", (const void *)kernel, grid, block, shmem, false, &decltype(call)::invoke,
                               &call);
    return cudaSuccess;
}
template <class... P>
inline cudaError_t cudaLaunchCooperativeKernel(void (*kernel)(P...), dim3 grid, dim3 block, void **args,
                                               size_t shmem = 0, cudaStream_t stream = nullptr) {
    cx_emu::record_stream(cx_emu::STREAM_COOPERATIVE, stream);
    auto call = cx_emu::detail::call_from_argv(kernel, args, std::index_sequence_for<P...>{});
    cx_emu::detail::run_launch("kernel", (const void *)kernel, grid, block, shmem, true, &decltype(call)::invoke,
                               &call);
    return cudaSuccess;
}

/* The stream log for a host program or a test through ctypes (weak: one definition however many translation
   units include this header). `start` clears it and turns it on; `read` copies up to `max` entries (op codes,
   handles) and returns how many there are. */
extern "C" __attribute__((weak)) void cx_emu_stream_log_start(void) {
    cx_emu::StreamLog &log = cx_emu::stream_log();
    std::lock_guard<std::mutex> lock(log.mu);
    log.entries.clear();
    log.on = true;
}
extern "C" __attribute__((weak)) int64_t cx_emu_stream_log(int64_t *ops, uint64_t *streams, int64_t max) {
    cx_emu::StreamLog &log = cx_emu::stream_log();
    std::lock_guard<std::mutex> lock(log.mu);
    const int64_t count = (int64_t)log.entries.size();
    for (int64_t i = 0; i < count && i < max; ++i) {
        ops[i] = log.entries[(size_t)i].first;
        streams[i] = log.entries[(size_t)i].second;
    }
    return count;
}

#endif /* CX_CUDA_EMU_H */
