"""What the benchmarks of `bench_topdown.py`, `bench_rntn.py` and `bench_daglstm.py` share: timing by turns,
the comparison of results, the host, and the load other processes put on the machine during a run.

A run records the 1-min load average at its start and end and the CPU seconds other processes used while it ran
(`machine_busy_s` less `own_cpu_s`); `busy` writes a caution into the results where that load could have
changed the ratios: a load average above half the CPUs at the start (before the benchmark's own threads), or
other processes using a quarter of a CPU or more on average.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median s per call of each function, taking turns within every repeat; each timed call follows an
    untimed call of the same function (see `bench_ggnn.interleaved`)."""
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            fn()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def max_rel_diff(got: dict[str, Any], want: dict[str, Any], names: Sequence[str]) -> dict[str, float]:
    """Per name, max |got - want| over the largest |want|."""
    out = {}
    for k in names:
        a, b = np.asarray(got[k], dtype=np.float64), np.asarray(want[k], dtype=np.float64)
        if a.shape != b.shape:
            raise SystemExit(f"{k}: shape {a.shape} against {b.shape}")
        out[k] = float(np.abs(a - b).max() / max(float(np.abs(b).max()), 1e-30)) if b.size else 0.0
    return out


def cross_entropy_grad(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """d mean_v(-log softmax(logits_v)[label_v]) / d logits, in float32."""
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    e /= e.sum(axis=1, keepdims=True)
    e[np.arange(len(labels)), labels] -= 1.0
    return (e / len(labels)).astype(np.float32)


def host() -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "node": platform.node(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
    }


def machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat: all but idle and iowait)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return float("nan")
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def busy(r: dict[str, Any]) -> list[str]:
    """A caution when other processes ran on the machine: a 1-min load average above half its CPUs at the start
    (the end's counts the benchmark's own threads), or other processes using a quarter of a CPU or more on
    average during the run."""
    start = r["load_average_start"]
    others = r.get("other_processes_cpus", 0.0)
    if start <= 0.5 * (r["host"]["cpus"] or 1) and not others >= 0.25:
        return []
    return [
        "",
        f"**Caution: the machine was busy (load average {start:.1f} at the start on {r['host']['cpus']} CPUs; "
        f"other processes used {others:.2f} CPUs on average during the run).** Every implementation ran on its "
        "fixed threads while other processes competed for the cores, which slows each of them by a different "
        "factor: the ratios are not those of a quiet machine.",
        *([f"({r['note']}.)"] if r.get("note") else []),
    ]


def spin(r: dict[str, Any]) -> str:
    """How libgomp's threads waited in the run: the wait policy and spin count it had."""
    parts = [f"OMP_WAIT_POLICY={r['omp_wait_policy']}"] if r.get("omp_wait_policy") else []
    parts += [f"GOMP_SPINCOUNT={r['gomp_spincount']}"] if r.get("gomp_spincount") else []
    return ", ".join(parts) or "libgomp's default spinning"
