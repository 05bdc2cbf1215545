"""Compile generated C into a shared library, cached by what determines the binary.

The cache key is the hash of the source, the compiler flags, the
compiler's version and the target CPU, so changed code, flags, compiler or
machine always rebuild and stale or foreign code is never loaded. Builds go to a temporary name and are renamed
into place, so a failed or concurrent build never leaves a broken library.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from cortexc.errors import BuildError

#: -ffast-math in full: glibc declares its vector expf/tanhf (libmvec) only under __FAST_MATH__, which any
#: -fno-* refinement undefines; the kernels use -FLT_MAX, not -INFINITY, as the identity of max for that reason
C_FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-ffast-math",
    "-fPIC",
    "-shared",
    "-std=gnu11",
    "-Wall",
    "-Wno-unused-function",
    "-Wno-unused-variable",
)
C_LIBS = ("-lm",)  # last on the line: vector math from -ffast-math needs libm after the objects


def cache_dir() -> Path:
    root = os.environ.get("CORTEXC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "cortexc"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.cache
def compiler_version(compiler: str) -> str:
    if shutil.which(compiler) is None:
        raise BuildError(f"the C compiler {compiler!r} was not found on PATH (cortexc needs gcc for device='cpu')")
    result = subprocess.run([compiler, "--version"], capture_output=True, text=True)
    return result.stdout.strip() or compiler  # all of it: nvcc puts its version on the last line


@functools.cache
def native_target(compiler: str) -> str:
    """What `-march=native` means on this machine, as the compiler resolves it (the CPU's features):
    a cache shared between machines never hands one CPU's binary to another."""
    result = subprocess.run([compiler, "-march=native", "-Q", "--help=target"], capture_output=True, text=True)
    return result.stdout if result.returncode == 0 else ""


def build_key(source: str, flags: tuple[str, ...], compiler: str) -> str:
    """The digest of everything that shapes the binary: source, flags, compiler version and, for
    `-march=native` builds, the target CPU."""
    digest = hashlib.sha256()
    version = compiler_version(compiler)  # first: a missing compiler is a BuildError
    cpu = native_target(compiler) if "-march=native" in flags else ""
    for part in (source, "\0".join(flags), version, cpu):
        digest.update(part.encode())
        digest.update(b"\1")
    return digest.hexdigest()[:24]


def build_shared(
    source: str,
    name: str,
    source_path: str | os.PathLike | None = None,
    compiler: str | None = None,
    flags: tuple[str, ...] = C_FLAGS,
) -> Path:
    """The path of the shared library built from `source` (from the cache when it is there).

    `source_path` is where the generated source lives for the user (named in errors).
    """
    compiler = compiler or os.environ.get("CC", "gcc")
    key = build_key(source, flags, compiler)
    directory = cache_dir()
    library = directory / f"{name}-{key}.so"
    if library.exists():
        return library
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        c_file = Path(scratch) / f"{name}.c"
        c_file.write_text(source, encoding="utf-8")
        output = Path(scratch) / "out.so"
        command = [compiler, *flags, "-o", str(output), str(c_file), *C_LIBS]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            shown = source_path or f"C source of {name} (not kept: nothing failed is cached)"
            raise BuildError(f"compiling the generated {shown} failed:\n{result.stderr.strip()}")
        os.replace(output, library)
    return library


@functools.cache
def load_library(path: Path) -> ctypes.CDLL:
    return ctypes.CDLL(str(path))
