"""cortexc: an ahead-of-time compiler for recursive neural networks.

The public surface: compile `.cell` files to IR cells, build forests, run a
cell with the reference interpreter, and the typed errors.

Importing cortexc loads only the runtime: the compiler (front end, passes,
code generators, Lark, Jinja2) is imported on first use of `compile_file`,
`compile_source` or `load`, so a generated package runs without it.
"""

from typing import Any

from cortexc.errors import (
    BuildError,
    CellError,
    CellSyntaxError,
    CellTypeError,
    CortexcError,
    DimError,
    ForestError,
    InputError,
    OutputError,
    SourceError,
    SourceLoc,
)
from cortexc.runtime.forest import Forest
from cortexc.runtime.params import init_params
from cortexc.runtime.vocab import Vocab
from cortexc.version import __version__ as __version__

__all__ = [
    "BuildError",
    "CellError",
    "CellSyntaxError",
    "CellTypeError",
    "CortexcError",
    "DimError",
    "Forest",
    "ForestError",
    "InputError",
    "OutputError",
    "SourceError",
    "SourceLoc",
    "Vocab",
    "compile_file",
    "compile_source",
    "init_params",
]


def load(path: Any, out_dir: Any = None, **dims: int) -> Any:
    """Compile a `.cell` file (with dim overrides) and import the generated package.

    The package is written to `out_dir` (default: a directory in the cortexc
    cache keyed by the source and dims) and returned as a module whose
    attributes are the cell classes.
    """
    from cortexc.pipeline import load_file

    spelt: Any = dims.get("defines")
    if isinstance(spelt, dict):  # the CLI's -D spelt as a keyword: say how to write it
        shown = ", ".join(f"{k}={v!r}" for k, v in spelt.items())
        raise DimError(f"dims are keywords of cortexc.load: write cortexc.load(path, {shown}), not defines={{...}}")
    return load_file(path, out_dir, dims)


__all__ += ["load"]


def __getattr__(name: str) -> Any:
    if name in ("compile_file", "compile_source"):
        from cortexc import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'cortexc' has no attribute {name!r}")
