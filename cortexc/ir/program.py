"""The scheduled program: what the code generators render and the runtime launches.

`schedule` turns a specialised, hoisted `Cell` into a `Program`: a few
`Kernel`s, each a body evaluated over a *row set* of nodes (all internal
nodes for ``pre``, one level at a time for ``leaf`` and ``node``, every node
or the roots for an output), and, inside each kernel, an ordered list of
`Step`s over a *tile* of rows: GEMMs whose left rows are gathered through
row pointers, elementwise loops that inline whole expression trees, child
reductions, softmaxes, small per-row matrix products, concatenations and
stores (and child softmaxes, segmented over a node's child edges). Where
each value lives is its `Place`. The launch order of the kernels is data too:
the program's `forward` and `backward` phases, which every driver renders.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from cortexc.ir.cell import Body, Cell, Value
from cortexc.ir.ops import Domain, width
from cortexc.ir.ops import slice_offset as slice_offset  # the program's users read it here too

# the program's packed weights and folds are the package format's values (one definition each)
from cortexc.runtime.package import Fold, PackedWeight


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


def hoisted_widths(cell: Cell) -> list[int]:
    """Floats in one row of each hoisted array (the pre body's named results, in order; none without one)."""
    return [width(cell.pre.values[i]) for _, i in cell.pre.named_results] if cell.pre else []


def row_kind(value: Value) -> RowKind:
    """A per-child value has a row per child edge of the tile; anything else a row per node."""
    return RowKind.CHILD if value.domain == Domain.CHILD else RowKind.NODE


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
    """Tile scratch: one row of `width` floats per node (or per child edge) of the tile; or, `saved`, the
    tile's rows of a saved array (rows by level-order position), where a training forward computes the
    values it keeps, so they are written once."""

    name: str
    rows: RowKind
    width: int
    saved: str = ""  # a saving kernel's: not scratch but the tile's rows of this saved array (`SavedValues`)


@dataclass(frozen=True)
class Grouped:
    """Columns of a GEMM that a row needs for one matrix of a family only (`passes.grouping`): of the
    columns ``[lo + g * width, lo + (g + 1) * width)`` for g < `groups`, row r reads only those of g = the
    value `index` at r (a relation or a position: its `select`), so only those are computed."""

    lo: int
    width: int
    groups: int
    index: int  # the body's value that chooses the group


@dataclass(frozen=True)
class Gemm:
    """`out[row, :] = operand[row, :] @ concat(weights).T` for every row: matmuls sharing an operand. The columns
    of a `grouped` range are computed for each row's group alone (in `scratch`, a buffer of the kernel); with
    `grouped_k`, the operand's k of each row's group alone (the rest are zero)."""

    out: str
    operand: int
    packed: str  # name of the packed, stacked weight
    weights: tuple[str, ...]
    rows: RowKind
    k: int
    m: int
    fold: str = ""  # `Fold.name` when the operand is a table row: an inference may read the folded table instead
    grouped: tuple[Grouped, ...] = ()
    grouped_k: Grouped | None = None  # the operand's k are zero but those of the row's group: only those are read
    scratch: str = ""  # the buffer grouped columns (rows) are computed into before they are copied to their rows


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
class ChildSoftmax:
    """`out[e, j] = exp(arg(e, j) - top) / total` over each node's child edges e (a segmented pass over
    `eb[i]..eb[i+1]`: the max, then the sum of exponentials, then the quotient; per column j)."""

    value: int
    out: str
    width: int


@dataclass(frozen=True)
class Row:
    """A row op (`ir.ops.RowOp`: softmax, a row sum) over each row's `width` elements of its operand."""

    value: int
    out: str
    rows: RowKind
    width: int  # of the operand's row


@dataclass(frozen=True)
class SmallMatmul:
    """A per-row matrix product (a matrix operand that varies per row): `[M, K] @ [K, N]` each row."""

    value: int
    out: str
    rows: RowKind
    m: int
    k: int
    n: int  # 1 for a matrix-vector product


class StoreTarget(enum.Enum):
    """The forest-wide array a `Store` writes (the value is its spelling in generated comments)."""

    STATE = "state"  # a state, by node
    PRE = "pre"  # a hoisted row
    OUTPUT = "output"
    D_STATE = "d_state"  # gradient kernels: this node's state gradient
    D_CHILD = "d_child"  # one row per child edge
    D_CHILD_AT = "d_child_at"  # child k's row
    D_PREV = "d_prev"  # a graph cell: the node's row one step earlier
    D_HOISTED = "d_hoisted"
    D_INPUT = "d_input"  # this node's input row
    D_EDGE_INPUT = "d_edge_input"  # an edge input's row, one per child edge
    D_EMBED = "d_embed"  # the looked-up row of a table
    SAVED = "saved"  # a training forward: the node's row of a saved array (`SavedValues`), at `column`


class StoreMode(enum.Enum):
    SET = "set"
    ADD = "add"  # rows no other row of the launch writes
    ATOMIC_ADD = "atomic_add"  # rows several rows of one launch may add to (shared table rows, DAG children)


@dataclass(frozen=True)
class Store:
    """Write (or add) a value to a forest-wide array.

    Targets of forward kernels: ``state`` (by node), ``pre`` (a hoisted row),
    ``output``. Of gradient kernels: ``d_state`` (this node), ``d_child``
    (one row per child edge), ``d_child_at`` (child ``k``), ``d_hoisted``,
    ``d_input`` (this node) and ``d_embed`` (the looked-up row of a table;
    several nodes may share a row, so it is added atomically). In a DAG a
    child has several parents, possibly in the same level: its gradient rows
    are added atomically too.
    """

    value: int
    target: StoreTarget
    name: str
    width: int
    rows: RowKind = RowKind.NODE
    mode: StoreMode = StoreMode.SET
    k: int = 0  # for d_child_at
    index_input: str = ""  # for d_embed: which index input chose the row
    column: int = 0  # for saved: where the value starts in the node's row (`name` is the `SavedValues`')


@dataclass(frozen=True)
class AccumOuter:
    """`acc[param] += sum over rows of outer(a(row), b(row))`: a weight gradient, as a transposed GEMM. With
    `grouped`, a row's `a` is zero but in its group's columns, and only those are added (`passes.grouping`)."""

    param: str
    a: int
    b: int
    rows: RowKind
    m: int
    k: int
    grouped: Grouped | None = None


@dataclass(frozen=True)
class AccumSum:
    """`acc[param] += sum over rows of value(row)`: a bias-like gradient (any per-row expression)."""

    param: str
    value: int
    rows: RowKind
    width: int


Step = Gemm | Loop | Reduce | ChildSoftmax | Row | SmallMatmul | Store | AccumOuter | AccumSum


@dataclass(frozen=True)
class ColumnSplit:
    """How a kernel's steps divide among thread blocks that each own residues of `period` (a column c
    belongs to the owner of c mod period); see `cortexc.passes.columns`."""

    period: int
    split_steps: tuple[bool, ...]  # per step: runs over the owned columns only (else whole)


class Adjoints(enum.Enum):
    """Where a gradient kernel reads the incoming gradients (`adjoint` values) of its body's results."""

    NONE = "none"  # a forward kernel
    STATE = "state"  # the states' gradients, by node (leaf and node gradients)
    PRE = "pre"  # the hoisted rows' gradients (the hoisted projections' gradient)
    OUTPUT = "output"  # an output's upstream gradient (an output's gradient)


class KernelRole(enum.Enum):
    """What a kernel computes: one per body of the cell, forward and gradient."""

    PRE = "pre"
    LEAF = "leaf"
    NODE = "node"
    LEAF_SAVING = "leaf_saving"  # a training forward's leaf kernel: also keeps values for the gradient
    NODE_SAVING = "node_saving"
    NODE_DIRECT = "node_direct"  # an inference's node kernel that reads no hoisted row (`passes.direct`)
    OUTPUT = "out"
    GRAD_OUTPUT = "grad_out"
    GRAD_NODE = "grad_node"
    GRAD_LEAF = "grad_leaf"
    GRAD_PRE = "grad_pre"

    @property
    def is_gradient(self) -> bool:
        return self in _ADJOINTS

    @property
    def adjoints(self) -> Adjoints:
        return _ADJOINTS.get(self, Adjoints.NONE)

    @property
    def reads_output(self) -> bool:
        """An output's kernel (forward or gradient): `Kernel.output` names it."""
        return self in (KernelRole.OUTPUT, KernelRole.GRAD_OUTPUT)


_ADJOINTS = {
    KernelRole.GRAD_OUTPUT: Adjoints.OUTPUT,
    KernelRole.GRAD_NODE: Adjoints.STATE,
    KernelRole.GRAD_LEAF: Adjoints.STATE,
    KernelRole.GRAD_PRE: Adjoints.PRE,
}


@dataclass(frozen=True)
class Kernel:
    role: KernelRole
    rows: Rows
    body: Body
    places: tuple[Place, ...]  # one per value of the body
    buffers: tuple[Buffer, ...]
    steps: tuple[Step, ...]
    child_ks: tuple[int, ...]  # which child[k] the body reads (their node ids are gathered per tile)
    output: str = ""  # the output of an OUTPUT or GRAD_OUTPUT kernel
    split: ColumnSplit | None = None  # the node kernel: how blocks may share a level by columns

    @property
    def name(self) -> str:
        """The kernel's name in generated code (`cx_kernel_<name>`) and in the module's JSON."""
        return f"{self.role.value}_{self.output}" if self.role.reads_output else self.role.value

    @property
    def adjoints(self) -> Adjoints:
        return self.role.adjoints

    @property
    def inline_gates(self) -> bool:
        """Whether its gates are the registry's libm-free forms (`OpDef.c_inline`): only the direct node
        kernel's, an inference's alone (no gradient reads what it computes), where the gate loops cost most."""
        return self.role == KernelRole.NODE_DIRECT

    def scratch_floats(self, tile_rows: int, max_children: int) -> int:
        per_node = sum(b.width for b in self.buffers if b.rows == RowKind.NODE and not b.saved)
        per_child = sum(b.width for b in self.buffers if b.rows == RowKind.CHILD)
        return tile_rows * per_node + tile_rows * max_children * per_child


class Sweep(enum.Enum):
    """Which rows of its kernel's row set a phase runs, and in what order."""

    ALL = "all"  # the whole row set at once (hoisted projections, outputs)
    LEAVES = "leaves"  # level 0
    UP = "up"  # each level above 0, bottom up (a node after its children)
    DOWN = "down"  # each level above 0, top down (a node's gradient after its parents')


@dataclass(frozen=True)
class Phase:
    """One step of the launch order: a kernel over some rows. Consecutive phases (and the levels of an
    UP or DOWN sweep) are ordered: each starts after the last has finished for every row.
    `upstream` (backward only): the phase runs only when that output (its index) has an upstream gradient."""

    kernel: str  # Kernel.name
    sweep: Sweep
    upstream: int | None = None


@dataclass(frozen=True)
class DeferredOuter:
    """A weight-gradient term a target computes after the recursion instead of per tile: the `AccumOuter`
    at ``steps[step]`` of kernel ``kernel`` only keeps its factors' rows (one per node position, or per
    child edge, of the forest) and one GEMM over all of them adds ``outer(a, b)`` to ``param``. A `narrow`
    term (a small weight) is deferred only by launches of few rows, chosen by each launch's row count; the
    others add it per tile as an undeferred `AccumOuter` does."""

    kernel: str
    step: int
    param: str
    m: int
    k: int
    rows: RowKind
    narrow: bool = False


@dataclass(frozen=True)
class SavedValues:
    """Values a training forward's kernel keeps for its gradient kernel (`passes.saving`): one row of
    `width` floats per node the kernel runs on (by level-order position), value ``values[i]`` of the forward body at
    ``columns[i]``; the gradient kernel reads them as `saved` values named `name` instead of computing them
    again. The saving kernel computes an elementwise one straight into its row (its `Buffer` is the saved
    array's), and stores any other."""

    name: str  # the forward kernel whose values these are ("leaf", "node")
    saving: str  # the kernel a training forward runs in its place (it stores them)
    grad: str  # the gradient kernel that reads them
    values: tuple[int, ...]
    columns: tuple[int, ...]
    width: int
    internal: bool  # rows: one per internal node (position - level_ptr[1]), else one per leaf (position)


@dataclass(frozen=True)
class Program:
    cell: Cell
    kernels: tuple[Kernel, ...]  # in launch order: pre?, leaf, node, outputs...; then the gradient kernels
    packed: tuple[PackedWeight, ...]
    accumulators: tuple[tuple[str, int, int], ...] = ()  # (param, offset, floats) of per-thread gradients
    forward: tuple[Phase, ...] = ()  # the launch order of a forward: pre?, leaves, levels up, outputs
    backward: tuple[Phase, ...] = ()  # of a backward: output gradients, levels down, leaves, pre?
    deferred: tuple[DeferredOuter, ...] | None = None  # set by `passes.deferred` (targets that defer them)
    folds: tuple[Fold, ...] = ()  # set by `passes.fold` (targets that fold look-ups: C)
    saved: tuple[SavedValues, ...] = ()  # set by `passes.saving` (targets that keep activations: C)
    direct: tuple[Phase, ...] = ()  # set by `passes.direct`: an inference's phases with the direct node kernel

    def saving_forward(self) -> tuple[Phase, ...]:
        """The launch order of a training forward: the forward's, each kernel whose values are `saved` replaced
        by its saving variant (the forward itself when nothing is saved)."""
        renamed = {values.name: values.saving for values in self.saved}
        return tuple(replace(p, kernel=renamed.get(p.kernel, p.kernel)) for p in self.forward)

    def kernel(self, name: str) -> Kernel:
        return next(k for k in self.kernels if k.name == name)

    def role(self, role: KernelRole) -> Kernel:
        """The kernel of a role that has one kernel (not an output's)."""
        return next(k for k in self.kernels if k.role == role)
