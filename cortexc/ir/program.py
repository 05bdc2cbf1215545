"""The scheduled program: what the code generators render and the runtime launches.

`schedule` turns a specialised, hoisted `Cell` into a `Program`: a few
`Kernel`s, each a body evaluated over a *row set* of nodes (all internal
nodes for ``pre``, one level at a time for ``leaf`` and ``node``, every node
or the roots for an output), and, inside each kernel, an ordered list of
`Step`s over a *tile* of rows: GEMMs whose left rows are gathered through
row pointers, elementwise loops that inline whole expression trees, child
reductions, softmaxes, small per-row matrix products, concatenations and
stores. Where each value lives is its `Place`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from cortexc.ir.cell import Body, Cell


class Rows(enum.Enum):
    """What a kernel's rows are."""

    INTERNAL = "internal"  # every node with children, in level order (the pre kernel)
    LEVEL = "level"  # the nodes of one level (leaf: level 0; node: each level above)
    NODES = "nodes"  # every node in node order (an output)
    ROOTS = "roots"  # the roots in forest order (an output `at root`)


class RowKind(enum.Enum):
    """Inside a tile, a value has one row per node of the tile, or one per child edge."""

    NODE = "node"
    CHILD = "child"


class PlaceKind(enum.Enum):
    SOURCE = "source"  # read where it already is: a param, an input, a state, a hoisted row, E[w]
    INLINE = "inline"  # recomputed inside the expression that uses it
    BUFFER = "buffer"  # materialised in tile scratch (or a column range of one)


@dataclass(frozen=True)
class Place:
    kind: PlaceKind
    buffer: str = ""
    column: int = 0  # where the value starts in the buffer's row


@dataclass(frozen=True)
class Buffer:
    """Tile scratch: one row of `width` floats per node (or per child edge) of the tile."""

    name: str
    rows: RowKind
    width: int


@dataclass(frozen=True)
class Gemm:
    """`out[row, :] = operand[row, :] @ concat(weights).T` for every row: matmuls sharing an operand."""

    out: str
    operand: int
    packed: str  # name of the packed, stacked weight
    weights: tuple[str, ...]
    rows: RowKind
    k: int
    m: int


@dataclass(frozen=True)
class Loop:
    """`out[row, column + j] = value(row, j)` for j < width.

    With ``compute`` the value's own expression is rendered (this loop is
    where it is materialised); without, the value is read from where it
    lives (a part copied into a concatenation).
    """

    value: int
    out: str
    column: int
    rows: RowKind
    width: int
    compute: bool = True


@dataclass(frozen=True)
class Reduce:
    """`out[node, j] = op over the node's child edges e of arg(e, j)` (0 for no children)."""

    value: int
    out: str
    width: int


@dataclass(frozen=True)
class Softmax:
    value: int
    out: str
    rows: RowKind
    width: int
    log: bool


@dataclass(frozen=True)
class SmallMatmul:
    """A per-row matrix product (a matrix operand that varies per row): `[M, K] @ [K, N]` each row."""

    value: int
    out: str
    rows: RowKind
    m: int
    k: int
    n: int  # 1 for a matrix-vector product


@dataclass(frozen=True)
class Store:
    """Write a value to a forest-wide array: a state (by node), a hoisted row, an output row."""

    value: int
    target: str  # "state", "pre" or "output"
    name: str
    width: int


Step = Gemm | Loop | Reduce | Softmax | SmallMatmul | Store


@dataclass(frozen=True)
class Kernel:
    name: str
    rows: Rows
    body: Body
    places: tuple[Place, ...]  # one per value of the body
    buffers: tuple[Buffer, ...]
    steps: tuple[Step, ...]
    child_ks: tuple[int, ...]  # which child[k] the body reads (their node ids are gathered per tile)

    def scratch_floats(self, tile_rows: int, max_children: int) -> int:
        per_node = sum(b.width for b in self.buffers if b.rows == RowKind.NODE)
        per_child = sum(b.width for b in self.buffers if b.rows == RowKind.CHILD)
        return tile_rows * per_node + tile_rows * max_children * per_child


@dataclass(frozen=True)
class PackedWeight:
    """Params stacked by rows and packed once at load time for the GEMM micro-kernel."""

    name: str
    params: tuple[str, ...]
    m: int
    k: int


@dataclass(frozen=True)
class Program:
    cell: Cell
    kernels: tuple[Kernel, ...]  # in launch order: pre?, leaf, node, outputs...
    packed: tuple[PackedWeight, ...]

    def kernel(self, name: str) -> Kernel:
        return next(k for k in self.kernels if k.name == name)
