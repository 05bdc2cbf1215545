"""The devices that run the CUDA target: a GPU, and the emulator on the CPU."""

from __future__ import annotations

from cortexc.runtime.executor import Backend, Executor, ExecutorRequest


def _cuda(request: ExecutorRequest) -> Executor:
    from .executor import CudaExecutor

    return CudaExecutor(request.spec, request.source, request.name, arch=request.arch)


def _cuda_emulated(request: ExecutorRequest) -> Executor:
    from .emulated import EmulatedCudaExecutor

    return EmulatedCudaExecutor(request.spec, request.source, request.name)


BACKENDS = (
    Backend(
        "cuda", "cuda", _cuda, "the generated CUDA, built with nvcc for the GPU's arch (needs pycuda)", tensors="cuda"
    ),
    Backend(
        "cuda-emu", "cuda", _cuda_emulated, "the generated CUDA run on the CPU by cuda_emu.h (tests)", tensors="cpu"
    ),
)
