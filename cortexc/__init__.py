"""cortexc: an ahead-of-time compiler for recursive neural networks.

The public surface: compile `.cell` files to IR cells, build forests, run a
cell with the reference interpreter, and the typed errors.
"""

from cortexc.errors import (
    BuildError,
    CellError,
    CellSyntaxError,
    CellTypeError,
    CortexcError,
    DimError,
    ForestError,
    InputError,
    SourceLoc,
)
from cortexc.pipeline import compile_file, compile_source
from cortexc.runtime.forest import Forest
from cortexc.runtime.params import init_params
from cortexc.runtime.vocab import Vocab

__version__ = "0.1.0"

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
    "SourceLoc",
    "Vocab",
    "compile_file",
    "compile_source",
    "init_params",
]


def load(path, out_dir=None, **dims):
    """Compile a `.cell` file (with dim overrides) and import the generated package.

    The package is written to `out_dir` (default: a directory in the cortexc
    cache keyed by the source and dims) and returned as a module whose
    attributes are the cell classes.
    """
    from cortexc.runtime.loader import load_cell_file

    return load_cell_file(path, out_dir, dims)


__all__ += ["load"]
