"""A compiled cell as a `torch.nn.Module` (the contract: ../shared/spec/torch.md).

`CellModule(cls)` wraps a cell class of a generated package: its params are
`nn.Parameter`s named as in the `.cell` file, and calling it runs the generated
C (or CUDA) through two `torch.library` custom ops, ``cortexc::cell_forward`` and
``cortexc::cell_backward``, tied by `register_autograd`. One idea per module:

- `module`: `CellModule`;
- `batch`: `ForestBatch` (the linearised forest as tensors), a pytree node for `torch.export`;
- `ops`: the custom ops, their fake implementations and their autograd formula;
- `keys`: the key an op names its cell by (the package's digest and the backend, the same in every
  process), and the cell class a key names (in this process, or loaded from the build cache);
- `runner`: the executors (a module's own, one per backend and device; or a key's shared one), driven
  through the `Executor` protocol's calls on caller-allocated arrays, and how an op finds its runner;
- `ddp`: data-parallel training (`ignore_sparse_tables_for_ddp`, the sparse tables'
  synchronisation over the ranks).

A model holding `CellModule`s exports with `torch.export.export(model, (batch, ...), dynamic_shapes=...)`
(`ForestBatch.dynamic_shapes`); a saved program loads in another process after ``import cortexc.torch``,
which registers the ops and the pytree node. Importing this package imports torch; `import cortexc` never
does.
"""

from __future__ import annotations

from cortexc.torch.batch import ForestBatch
from cortexc.torch.ddp import ignore_sparse_tables_for_ddp
from cortexc.torch.keys import cell_key as cell_key
from cortexc.torch.module import CellModule
from cortexc.torch.ops import _split as _split
from cortexc.torch.ops import cell_backward as cell_backward
from cortexc.torch.ops import cell_forward as cell_forward
from cortexc.torch.runner import _Runner as _Runner

__all__ = ["CellModule", "ForestBatch", "ignore_sparse_tables_for_ddp"]
