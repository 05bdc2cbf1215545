"""The devices that run the C target."""

from __future__ import annotations

from cortexc.runtime.executor import Backend, Executor, ExecutorRequest


def _cpu(request: ExecutorRequest) -> Executor:
    from cortexc.runtime.build import build_shared

    from .executor import CpuExecutor

    return CpuExecutor(
        request.spec, build_shared(request.source, request.name, request.source_path, purpose="device='cpu'")
    )


BACKENDS = (
    Backend("cpu", "c", _cpu, "the generated C, built with gcc and OpenMP (cached by source and flags)", tensors="cpu"),
)
