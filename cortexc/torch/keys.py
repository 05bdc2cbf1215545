"""The key the custom ops name a compiled cell by, the same in every process, and the cell class it names.

A key reads ``<package>.<Cell>-<digest>@<backend>``. The digest is of the package's description (what its
`cell.json` holds: the `.cell` source and its file name, the -D values, the targets, the compiler's version
and every kernel's hash), so a key names what made the kernels, as the build cache's keys do, and never a
process's object: no address, handle or counter. A graph that carries one (traced by `torch.compile`,
exported by `torch.export`, saved and loaded elsewhere) runs in another process, and after the module that
recorded it is gone. The backend is the executor the op runs (``cpu``, ``cuda-emu``, ``cuda``; which GPU
is the tensors').

A key is resolved to its cell class in this order: the classes keyed in this process; the packages this
process imported (`cortexc.load`, `cell_class`, an unpickled module); the packages `cortexc.load` put in
the build cache (``$CORTEXC_CACHE/packages/*/<package>/``, imported on first use). A key found nowhere is an
`OutputError` naming it, which says to load the `.cell` first.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import threading
from pathlib import Path
from typing import NamedTuple

from cortexc.errors import CortexcError, OutputError
from cortexc.runtime.model import CellModel, cell_class
from cortexc.runtime.package import PackageSpec

#: hex digits of the description's sha256 a key carries
DIGEST_CHARS = 16

_KEY = re.compile(rf"(?P<package>\w+)\.(?P<cell>\w+)-(?P<digest>[0-9a-f]{{{DIGEST_CHARS}}})@(?P<backend>[\w-]+)")

#: "<package>.<Cell>-<digest>" -> its class: every class keyed or found in this process
_CLASSES: dict[str, type[CellModel]] = {}
#: a class's "<package>.<Cell>-<digest>" (the digest is computed once per class)
_NAMES: dict[type[CellModel], str] = {}
_LOCK = threading.Lock()


class CellKey(NamedTuple):
    """A key's parts."""

    package: str
    cell: str
    digest: str
    backend: str

    @property
    def cell_name(self) -> str:
        """The key without its backend: the compiled cell."""
        return f"{self.package}.{self.cell}-{self.digest}"


def description_digest(description: PackageSpec) -> str:
    """The digest of a package's description, from its canonical JSON (equal for equal `cell.json`s)."""
    text = json.dumps(description.to_json(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:DIGEST_CHARS]


def cell_key(cls: type[CellModel], backend: str) -> str:
    """The key of cell class `cls` on `backend`; the class is then found by it in this process."""
    name = _NAMES.get(cls)
    if name is None:
        name = f"{cls._description.package}.{cls.signature.name}-{description_digest(cls._description)}"
        with _LOCK:
            _NAMES[cls] = name
            _CLASSES.setdefault(name, cls)
    return f"{name}@{backend}"


def parse_key(key: str) -> CellKey:
    """A key's parts, or a `CortexcError` for a string that is not one."""
    match = _KEY.fullmatch(key) if isinstance(key, str) else None
    if match is None:
        raise CortexcError(f"{key!r} is not a cortexc cell key (<package>.<Cell>-<digest>@<backend>)")
    return CellKey(match["package"], match["cell"], match["digest"], match["backend"])


def class_of(key: str) -> type[CellModel]:
    """The cell class `key` names: keyed in this process, imported by it, or in the build cache."""
    parts = parse_key(key)
    cls = _CLASSES.get(parts.cell_name)
    if cls is None:
        cls = _imported(parts) or _in_the_cache(parts, key)
        with _LOCK:
            cls = _CLASSES.setdefault(parts.cell_name, cls)
    return cls


def _imported(parts: CellKey) -> type[CellModel] | None:
    """The class among the packages this process imported (any directory), or None."""
    for module in list(sys.modules.values()):
        try:
            candidate = vars(module).get(parts.cell)  # the module's own names: no module __getattr__ runs
        except TypeError:  # not a module (a None placeholder in sys.modules)
            continue
        if (
            isinstance(candidate, type)
            and issubclass(candidate, CellModel)
            and getattr(candidate, "_description", None) is not None
            and candidate._description.package == parts.package
            and cell_key(candidate, parts.backend) == _join(parts)
        ):
            return candidate
    return None


def _in_the_cache(parts: CellKey, key: str) -> type[CellModel]:
    """The class from the package `cortexc.load` put in the build cache (imported now), or an `OutputError`."""
    from cortexc.runtime.build import cache_dir

    root = cache_dir() / "packages"
    for description_file in sorted(root.glob(f"*/{parts.package}/cell.json")):
        if _digest_of(description_file) == parts.digest:
            cls = cell_class(description_file.parent, parts.cell)
            cell_key(cls, parts.backend)  # known by its key from now on
            return cls
    raise OutputError(
        f"no compiled cell for the key {key!r} in this process or in the build cache {root}: "
        f"cortexc.load the .cell file of package {parts.package!r} (the same file and dims) in this process "
        "first, or set CORTEXC_CACHE to the cache where it was loaded"
    )


def _digest_of(description_file: Path) -> str | None:
    """The digest of a cached package's description, or None for one this runtime cannot read."""
    try:
        description = PackageSpec.from_json(json.loads(description_file.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        return None  # damaged, or another format (`FormatError` is a ValueError): not the package of any key
    return description_digest(description)


def _join(parts: CellKey) -> str:
    return f"{parts.cell_name}@{parts.backend}"
