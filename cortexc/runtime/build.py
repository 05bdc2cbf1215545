"""Compile generated C into a shared library, cached by what determines the binary.

The cache key is the hash of the source, the compiler flags, the
compiler's version and the target CPU, so changed code, flags, compiler or
machine always rebuild and stale or foreign code is never loaded. Every
cached library ends in a trailer holding its key and the digest of its bytes,
checked before `dlopen` (a damaged file can crash the loader): a truncated,
overwritten or foreign file, or anything else in its place, is rebuilt.
Builds go to a scratch directory and are renamed into place, so a failed,
killed or concurrent build never leaves a broken library; scratch left by a
killed build is removed by a later one.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cortexc.errors import BuildError, OutputError

#: -ffast-math in full: glibc declares its vector expf/tanhf (libmvec) only under __FAST_MATH__, which any
#: -fno-* refinement undefines; the kernels use -FLT_MAX, not -INFINITY, as the identity of max for that reason.
#: -mprefer-vector-width=512 (x86 only: gcc and clang reject it elsewhere): on an AVX-512 CPU gcc otherwise
#: vectorises loops 8 floats wide (its tuning for Intel's server cores), and libmvec's 8-lane expf; 16 lanes
#: ran the chain LSTM's forward 1.2-1.27x faster (Sapphire Rapids, H=64; the GEMM micro-kernels are 16 wide
#: either way). Without AVX-512 it changes nothing.
X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
VECTOR_WIDTH_FLAGS = ("-mprefer-vector-width=512",) if X86 else ()
C_FLAGS = (
    "-O3",
    "-march=native",
    *VECTOR_WIDTH_FLAGS,
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
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputError(
            f"the cortexc cache {path} cannot be made: {err.strerror or err} (set CORTEXC_CACHE)"
        ) from None
    return path


#: a build (or `--version`) running longer than this is killed; CORTEXC_BUILD_TIMEOUT overrides it (seconds)
BUILD_TIMEOUT = 900.0

#: the end of every cached library: MAGIC, the 24-character key, sha256(everything before + key)
TRAILER_MAGIC = b"\0cortexc-library-v1\0"
TRAILER_SIZE = len(TRAILER_MAGIC) + 24 + 32

SCRATCH_PREFIX = ".build-"

#: the longest name a library's file carries (a cell name, or a package and cell name, may be longer)
MAX_NAME = 80


def build_timeout() -> float:
    text = os.environ.get("CORTEXC_BUILD_TIMEOUT", "")
    try:
        value = float(text) if text else BUILD_TIMEOUT
    except ValueError:
        raise BuildError(f"CORTEXC_BUILD_TIMEOUT={text!r} is not a number of seconds") from None
    if not value > 0:
        raise BuildError(f"CORTEXC_BUILD_TIMEOUT={text!r} must be positive")
    return value


def run_tool(command: list[str]) -> subprocess.CompletedProcess[str]:
    """Run a compiler with the build timeout; on timeout its whole process group (cc1, as, ld) is killed."""
    timeout = build_timeout()
    try:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
    except OSError as err:
        raise BuildError(f"cannot run {command[0]!r}: {err.strerror or err}") from None
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except BaseException as err:  # the timeout, or Ctrl-C: never leave a compiler running
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        if isinstance(err, subprocess.TimeoutExpired):
            raise BuildError(
                f"{command[0]!r} did not finish within {timeout:g} s and was stopped "
                "(set CORTEXC_BUILD_TIMEOUT to allow longer builds)"
            ) from None
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


@functools.cache
def compiler_version(compiler: str) -> str:
    """What `compiler --version` prints (`build_shared` has checked that the compiler is on PATH)."""
    result = run_tool([compiler, "--version"])
    return result.stdout.strip() or compiler  # all of it: nvcc puts its version on the last line


@functools.cache
def native_target(compiler: str) -> str:
    """What `-march=native` means on this machine, as the compiler resolves it (the CPU's features):
    a cache shared between machines never hands one CPU's binary to another."""
    result = run_tool([compiler, "-march=native", "-Q", "--help=target"])
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
    purpose: str = "",
) -> Path:
    """The path of the shared library built from `source` (from the cache when it is there), loaded once
    to prove it loads (`load_library` then returns that handle).

    `source_path` is where the generated source lives for the user (named in errors). A cached file
    that fails its check or does not load is built again. `purpose` (the device it is built for) is named
    when the compiler is missing.
    """
    compiler = compiler or os.environ.get("CC", "gcc")
    if shutil.which(compiler) is None:
        needed = f" (cortexc needs {compiler} for {purpose})" if purpose else ""
        raise BuildError(f"the C compiler {compiler!r} was not found on PATH{needed}")
    key = build_key(source, flags, compiler)
    name = name[:MAX_NAME]  # the key tells libraries apart; the name is for people, and file names are short
    directory = cache_dir()
    library = directory / f"{name}-{key}.so"
    if verify_library(library, key):
        try:
            load_library(library)
            return library
        except OSError:
            pass  # right bytes but it does not load here (a library it needs changed): build it again
    _remove_stale_scratch(directory)
    if _interactive():  # a first build takes seconds to minutes: say what is happening, once per library
        print(f"cortexc: building {name} with {compiler} (once: cached in {directory})", file=sys.stderr, flush=True)
    try:
        _build(source, name, source_path, compiler, flags, key, library)
    except OSError as err:  # a read-only cache, a full disk
        raise OutputError(
            f"cannot write the library of {name} to the cache {directory}: {err.strerror or err} (set CORTEXC_CACHE)"
        ) from None
    try:
        load_library(library)
    except OSError as err:
        raise BuildError(f"the library built from the generated C of {name} does not load: {err}") from None
    return library


def _interactive() -> bool:
    """Whether a person is watching stderr (a terminal): only then does a build announce itself."""
    return sys.stderr is not None and sys.stderr.isatty()


def verify_library(path: Path, key: str) -> bool:
    """Whether `path` is a regular file ending in the trailer of `key` whose digest matches its bytes."""
    try:
        with open(path, "rb") as handle:  # follows a symlink, as dlopen would; a directory raises
            data = handle.read()
    except OSError:
        return False
    if len(data) <= TRAILER_SIZE:
        return False
    body, trailer = data[:-TRAILER_SIZE], data[-TRAILER_SIZE:]
    return trailer == _trailer(body, key)


def _trailer(body: bytes, key: str) -> bytes:
    encoded = key.encode("ascii")
    return TRAILER_MAGIC + encoded + hashlib.sha256(body + encoded).digest()


def _build(
    source: str,
    name: str,
    source_path: str | os.PathLike | None,
    compiler: str,
    flags: tuple[str, ...],
    key: str,
    library: Path,
) -> None:
    """Compile in a scratch directory of the cache, append the trailer, rename the library into place."""
    scratch = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{name}-", dir=library.parent))
    try:
        c_file = scratch / f"{name}.c"
        c_file.write_text(source, encoding="utf-8")
        output = scratch / "out.so"
        result = run_tool([compiler, *flags, "-o", str(output), str(c_file), *C_LIBS])
        if result.returncode != 0:
            shown = source_path or f"C source of {name} (not kept: nothing failed is cached)"
            detail = result.stderr.strip() or result.stdout.strip() or "(it printed nothing)"
            raise BuildError(
                f"compiling the generated {shown} failed: {compiler} exited with status {result.returncode}:\n{detail}"
            )
        try:
            body = output.read_bytes()
        except OSError:
            raise BuildError(f"{compiler} reported success but wrote no library for {name}") from None
        with open(output, "ab") as handle:
            handle.write(_trailer(body, key))
        if library.is_dir() and not library.is_symlink():
            shutil.rmtree(library, ignore_errors=True)  # a directory in the library's place cannot be replaced
        os.replace(output, library)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _remove_stale_scratch(directory: Path) -> None:
    """Remove scratch directories older than any live build could be (left by a killed process)."""
    limit = time.time() - build_timeout() - 60
    try:
        entries = list(directory.iterdir())
    except OSError:
        return
    for entry in entries:
        legacy = entry.name.startswith("tmp") and len(entry.name) == 11  # tempfile's names, before .build-
        if not (entry.name.startswith(SCRATCH_PREFIX) or legacy):
            continue
        try:
            stale = entry.is_dir() and not entry.is_symlink() and entry.stat().st_mtime < limit
        except OSError:
            continue
        if stale:
            shutil.rmtree(entry, ignore_errors=True)


@functools.cache
def load_library(path: Path) -> ctypes.CDLL:
    return ctypes.CDLL(str(path))
