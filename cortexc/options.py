"""`CompileOptions`: everything a compile depends on, in one frozen value.

Every stage of the pipeline receives the same options, and the cache keys of
packages and binaries are made from `CompileOptions.key`, so two compiles
that could produce different files never share a cache entry. This module
imports nothing of the compiler: the runtime builds options to look a
package up without loading the compiler.
"""

from __future__ import annotations

import hashlib
import json
import numbers
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cortexc.errors import CortexcError, DimError
from cortexc.runtime.abi import LaunchOptions
from cortexc.targets import NAMES

#: the largest dim a cell may declare or a define may set
MAX_DIM = 1 << 24


def define_problem(name: str, value: object) -> str | None:
    """What is wrong with a dim override's value (None if nothing): it must be an int in [1, MAX_DIM]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        return f"dim override {name}={_shown(value)}: a dim must be a positive integer"
    if int(value) > MAX_DIM:
        return f"dim override {name}={_shown(value)}: a dim must be at most {MAX_DIM}"
    return None


def _shown(value: object) -> str:
    """A user's value as a message shows it: an int too long to print (Python refuses to write ints of
    over 4300 digits) by its size instead."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and abs(int(value)) > 10**30:
        return f"<an integer of about {round(abs(int(value)).bit_length() * 0.30103)} digits>"
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}..."


#: the kernel targets the code generators know (the backends that run them are in `cortexc.runtime.backends`)
KNOWN_TARGETS = NAMES  # the registered targets (`cortexc.targets`)


@dataclass(frozen=True)
class CompileOptions:
    """What to compile and how.

    ``defines`` override dims (``-D H=256``) in every cell that declares them;
    ``targets`` are the kernel sources to generate (`KNOWN_TARGETS` names; the first registered one by
    default);
    ``launch`` is the CUDA launch the package asks for by default (written into
    `cell.json`; the environment's ``CORTEXC_CUDA_*`` and an executor's own
    options still override it, since the generated code takes it as an
    argument, not as a constant); ``dump_dir``, when set, receives the text
    form of every stage (it does not change any output, so it is not part of
    the key).
    """

    defines: tuple[tuple[str, int], ...] = ()
    targets: tuple[str, ...] = KNOWN_TARGETS[:1]
    launch: LaunchOptions = LaunchOptions()
    dump_dir: Path | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in self.targets:
            if name not in KNOWN_TARGETS:
                raise CortexcError(f"target {name!r} is not available (available: {', '.join(KNOWN_TARGETS)})")
        if not self.targets:
            raise CortexcError("at least one target is needed")
        for name, value in self.defines:
            problem = define_problem(name, value)
            if problem is not None:  # before anything prints or hashes the value
                raise DimError(problem)

    @classmethod
    def make(
        cls,
        defines: Mapping[str, int] | None = None,
        targets: Iterable[str] = KNOWN_TARGETS[:1],
        dump_dir: str | os.PathLike[str] | None = None,
        launch: LaunchOptions | None = None,
    ) -> CompileOptions:
        """Options from loose values (a dict of defines, any iterable of targets, a path or None)."""
        return cls(
            defines=tuple(sorted((defines or {}).items())),
            targets=tuple(dict.fromkeys(targets)),
            launch=launch or LaunchOptions(),
            dump_dir=Path(dump_dir) if dump_dir is not None else None,
        )

    @property
    def define_map(self) -> dict[str, int]:
        return dict(self.defines)

    def key(self, source: str, source_file: str) -> str:
        """A digest of everything that shapes the generated files: the source, its file name (it is
        written into the package), the options and the compiler's version."""
        from cortexc.version import __version__

        payload = {
            "source": source,
            "file": str(source_file),
            "defines": list(self.defines),
            "targets": list(self.targets),
            "launch": self.launch.to_json(),
            "cortexc": __version__,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
