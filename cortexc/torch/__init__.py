"""A compiled cell as a `torch.nn.Module` (the contract: ../shared/spec/torch.md).

`CellModule(cls)` wraps a cell class of a generated package: its params are
`nn.Parameter`s named as in the `.cell` file, and calling it runs the generated
C (or CUDA) through two `torch.library` custom ops, ``cortexc::cell_forward`` and
``cortexc::cell_backward``, tied by `register_autograd`. One idea per module:

- `module`: `CellModule` and `ForestBatch` (the linearised forest as tensors);
- `ops`: the custom ops, their fake implementations and their autograd formula;
- `runner`: each module's executors (one per backend), driven through the `Executor`
  protocol's calls on caller-allocated arrays, and the table the ops find them in;
- `ddp`: data-parallel training (`ignore_sparse_tables_for_ddp`, the sparse tables'
  synchronisation over the ranks).

Importing this package imports torch; `import cortexc` never does.
"""

from __future__ import annotations

from cortexc.torch.ddp import ignore_sparse_tables_for_ddp
from cortexc.torch.module import CellModule, ForestBatch
from cortexc.torch.ops import _split as _split
from cortexc.torch.ops import cell_backward as cell_backward
from cortexc.torch.ops import cell_forward as cell_forward
from cortexc.torch.runner import _HANDLES as _HANDLES
from cortexc.torch.runner import _RUNNERS as _RUNNERS
from cortexc.torch.runner import _Runner as _Runner

__all__ = ["CellModule", "ForestBatch", "ignore_sparse_tables_for_ddp"]
