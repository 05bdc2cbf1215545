"""What an op is: the `Op` names, shapes and domains, and `OpDef`, the one entry that holds all of an op's rules.

JAX keeps a primitive's rules side by side (`lax.concatenate_p` is registered exactly like `tanh`); so does
cortexc. An entry holds its op's surface name, type rule (shape and domain, for lowering's checks and the
verifier), interpreter rule (NumPy), derivative, placement in a kernel, and C/CUDA text, as data and small
functions. Stages read the entry and hold no op-by-op ladders. The rules reach the stage that runs them through
small protocols (`TypeContext`, `NodeEnv`, `Derivatives`, `Emitter`), so the IR imports neither passes nor
codegen.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from cortexc.runtime.philox import Dropout

if TYPE_CHECKING:
    from cortexc.ir.cell import Value

Shape = tuple[int, ...]


class Op(enum.Enum):
    # leaves of a body
    PARAM = "param"  # attrs: name
    INPUT = "input"  # attrs: name (float vector or int32 index)
    STATE = "state"  # attrs: name; the node's own state (read-outs only)
    CHILD_STATE = "child_state"  # attrs: name; one row per child (CHILD domain)
    CHILD_STATE_AT = "child_state_at"  # attrs: name, k; child k's state or 0 if missing
    PREV_STATE = "prev_state"  # attrs: name; a graph cell: the node's own state one step earlier
    HOISTED = "hoisted"  # attrs: name; this node's row of a result of the cell's `pre` body
    CONST = "const"  # attrs: value; a float scalar (broadcast by its users) or a filled vector/matrix
    # elementwise binary (scalars broadcast; NODE values broadcast against CHILD values)
    ADD = "add"
    SUB = "sub"
    MUL = "mul"
    DIV = "div"
    # elementwise unary
    NEG = "neg"
    SIGMOID = "sigmoid"
    TANH = "tanh"
    RELU = "relu"
    EXP = "exp"
    LOG = "log"
    ABS = "abs"
    SOFTPLUS = "softplus"
    GELU = "gelu"
    SILU = "silu"
    SQRT = "sqrt"
    MINIMUM = "minimum"  # elementwise, broadcasting like `+`; ties split the gradient equally
    MAXIMUM = "maximum"
    DROPOUT = "dropout"  # attrs: site, p; e in evaluation mode, else kept or zeroed by the element's identity
    # vector-wise
    SOFTMAX = "softmax"
    LOG_SOFTMAX = "log_softmax"
    DOT = "dot"  # [N], [N] -> [1]: the inner product
    LAYERNORM = "layernorm"  # (v - mean(v)) / sqrt(var(v) + 1e-5) over a vector's components
    # structure
    MATMUL = "matmul"  # [M,K] @ [K] -> [M]; [M,K] @ [K,N] -> [M,N]
    SLICE = "slice"  # attrs: lo, hi; of a vector
    CONCAT = "concat"  # vectors end to end, matrices stacked by rows
    EMBED = "embed"  # args: param matrix, index input -> row
    RESHAPE = "reshape"  # attrs: none; the same row of floats seen with another shape (a 3-D param's views)
    SELECT = "select"  # args: [R, M] matrix, index (an index value or edge.position) -> its row [M]
    UNSELECT = "unselect"  # args: [M] row, index -> [R, M] zeros but that row (select's derivative)
    # derivatives (made by `autodiff`, never written by users)
    ADJOINT = "adjoint"  # attrs: name; the incoming gradient of the body's result `name` for this node
    SAVED = "saved"  # attrs: name, column; a value the training forward kept for this node (`passes.saving`)
    NUM_CHILDREN = "num_children"  # the node's number of children, as a float scalar
    TRANSPOSE = "transpose"  # [M, K] -> [K, M]
    OUTER = "outer"  # [M], [K] -> [M, K]
    STEP = "step"  # 1 where x > 0, else 0 (relu')
    SIGN = "sign"  # -1, 0 or 1 (abs')
    EQ = "eq"  # 1 where a == b, else 0 (which children hold a max)
    GELU_GRAD = "gelu_grad"  # gelu'(x) = Phi(x) + x * phi(x)
    RSTD = "rstd"  # 1 / sqrt(x + 1e-5), 0 at inf (layernorm's derivative)
    ROWSUM = "rowsum"  # sum of every element -> scalar, or [1] (the gradient of a broadcast [1] operand)
    PAD = "pad"  # attrs: lo, size; a slice put back in place, zeros elsewhere
    # children
    EXPAND = "expand"  # NODE/PARAM value -> the same value once per child
    SUM = "sum"  # CHILD -> NODE reductions over the children (0 with no child)
    MEAN = "mean"
    MAX = "max"
    CHILD_SOFTMAX = "child_softmax"  # CHILD -> CHILD: softmax across the node's children, per component
    # edges
    EDGE = "edge"  # attrs: name; a value of the edge to each child (CHILD domain): its position, its siblings
    EDGE_AT = "edge_at"  # attrs: name, k; that value of the edge to child k, 0 where there is no child k
    EDGE_INPUT = "edge_input"  # attrs: name; an edge input's row for the edge to each child (CHILD domain)


class Domain(enum.IntEnum):
    """Where a value varies: once per cell, once per node, or once per child of a node.

    Ordered so that the domain of an elementwise result is the max of its operands'.
    """

    PARAM = 0
    NODE = 1
    CHILD = 2


class DType(enum.Enum):
    F32 = "f32"
    I32 = "i32"


class ShapeError(Exception):
    """A type rule is broken; the checker turns it into a located CellTypeError, the verifier into an
    internal error naming the value."""


def fmt_shape(shape: Shape) -> str:
    return "scalar" if not shape else "[" + ", ".join(str(d) for d in shape) + "]"


def expect(condition: bool, message: str) -> None:
    """A type rule's check (a broken one is a `ShapeError`)."""
    if not condition:
        raise ShapeError(message)


class OpKind(enum.Enum):
    """What family an op is in: which rules its entry spells out and which the family supplies."""

    LEAF = "leaf"  # no operands: a read of a param, input, state, constant or gradient seed
    UNARY = "unary"  # elementwise, one operand
    BINARY = "binary"  # elementwise, two operands (scalars broadcast)
    VECTOR = "vector"  # a row op over a whole vector (softmax, row sums): a `RowOp`
    STRUCTURAL = "structural"  # moves data or shapes (slice, concat, transpose, products, look-ups)
    CHILDREN = "children"  # across a node's children (expand, reductions, child_softmax)


class Placement(enum.Enum):
    """Where a kernel keeps an op's value (`passes.schedule` reads it; the op's entry sets it)."""

    SOURCE = "source"  # read where it lives: a param, an array of the forest, a constant; never computed
    VIEW = "view"  # a window of its operand, placed where its operand is (a slice of a buffer is a column range)
    EXPRESSION = "expression"  # always rendered inside its users' expressions (expand, transpose, outer)
    ELEMENTWISE = "elementwise"  # inlined into its users; materialised when read twice, by address, or too deep
    STEP = "step"  # computed into a buffer of its own by a step of kind `OpDef.step`


class StepKind(enum.Enum):
    """The kernel step that materialises a `Placement.STEP` value."""

    SMALL_MATMUL = "small_matmul"  # a per-row matrix product (one that is not a GEMM over the tile's rows)
    REDUCE = "reduce"  # over each node's child edges (`ChildReduce`)
    CHILD_SOFTMAX = "child_softmax"  # across each node's child edges, per column
    ROW = "row"  # a row op over each row's elements (`RowOp`)
    CONCAT = "concat"  # its operands copied side by side


# ----------------------------------------------------------------------------- the rules' protocols


class TypeContext(Protocol):
    """What a type rule may ask of the cell and body a value is in (the verifier implements it)."""

    node_body: bool  # a node body (or its gradient): children, hoisted rows and reductions are readable
    output_body: bool  # a read-out (or its gradient): the node's own state is readable
    gradient: bool  # a gradient body: adjoints and saved values are readable
    arity: int | None  # the cell's arity (child[k] reads)
    steps: bool  # a graph cell: `prev` is readable in node bodies

    def param_shape(self, name: str) -> Shape: ...

    def input_decl(self, name: str) -> tuple[Shape, DType, bool]:
        """An input's row shape, its dtype, and whether it is on edges (one row per edge)."""
        ...

    def state_shape(self, name: str) -> Shape: ...

    def hoisted_shape(self, name: str) -> Shape: ...


class NodeEnv(Protocol):
    """What an interpreter rule sees of one node (`cortexc.ir.interp.NodeView`)."""

    @property
    def index(self) -> int: ...

    @property
    def children(self) -> Any:
        """The children's ids (an int array)."""
        ...

    @property
    def edges(self) -> Any:
        """The rows of the edges to the children in the edge inputs' arrays (an int array)."""
        ...

    @property
    def prev(self) -> int:
        """A graph cell's node at a step after 0: its row one step earlier (-1 elsewhere)."""
        ...

    @property
    def input_row(self) -> int:
        """The node's row of the node inputs: its index, or a graph cell's node at any step, the node's own."""
        ...

    @property
    def states(self) -> Mapping[str, np.ndarray]: ...

    @property
    def inputs(self) -> Mapping[str, np.ndarray]: ...

    @property
    def params(self) -> Mapping[str, np.ndarray]: ...

    @property
    def dtype(self) -> Any: ...

    @property
    def hoisted(self) -> Mapping[str, np.ndarray]: ...

    @property
    def adjoints(self) -> Mapping[str, np.ndarray]: ...

    @property
    def saved(self) -> Mapping[str, np.ndarray]: ...

    @property
    def dropout(self) -> Dropout: ...


class Derivatives(Protocol):
    """What a derivative rule may build (autodiff implements it over the GRAD body being built).

    Values are indices into that body; `op` takes any op (shape and domain follow its operands unless given),
    `rowsum` sums a vector to a scalar, `gradient` adds `g` to a result of the body (a leaf's gradient).
    """

    def op(self, op: Op, *args: int, shape: Shape | None = None, domain: Domain | None = None, attrs=()) -> int: ...

    def const(self, number: float) -> int: ...

    def rowsum(self, x: int) -> int: ...

    def value(self, x: int) -> Value:
        """A value of the body being built (its shape and domain)."""
        ...

    def mask(self, y: int) -> int:
        """The mask a dropout value `y` was made with (per element: its scale where kept, else 0)."""
        ...

    def gradient(self, kind: str, g: int, name: str, k: int | None = None, index: str | None = None) -> None:
        """Add `g` to the body's result: the gradient of a leaf (`cortexc.ir.cell.GradKind`, by its value)."""
        ...


class Emitter(Protocol):
    """What an op's C rule sees of the kernel it is rendered into: element `col` of one row of a loop
    (`cortexc.codegen.exprs`). Everything it returns is C text, the same for C and CUDA."""

    col: str  # the column (element) index expression
    row: str  # the row index expression of the loop (a node row, or a child edge row)
    train: bool  # False: the evaluation-mode text (dropout(e, p) is e)
    inline_gates: bool  # the kernel computes its gates without libm calls (`OpDef.c_inline`)

    def arg(self, position: int, col: str | None = None) -> str:
        """Element `col` (default: this element) of operand `position`, wherever it lives."""
        ...

    def arg_value(self, position: int) -> Value: ...

    def read(self, array: str, name: str, row: str, width: int) -> str:
        """Element `col` of a forest array's row: `array` is `input`, `state` or `pre` (a hoisted row),
        `row` is `node` (this node), `child` (this child edge's child), `edge` (this child edge: an edge
        input's row), `kid<k>` (child k of this node) or `prev` (this node one step earlier: a graph cell)."""
        ...

    def param(self, name: str, offset: str) -> str: ...

    def index(self, name: str) -> str:
        """This node's value of index input `name`, as an int64_t."""
        ...

    def edge_index(self, name: str) -> str:
        """This child edge's value of edge index input `name`, as an int64_t."""
        ...

    def adjoint(self, name: str, width: int) -> str: ...

    def saved(self, name: str, column: int) -> str: ...

    def num_children(self) -> str: ...

    def has_child(self, k: int) -> str:
        """Whether this node row's node has a child k (a C condition)."""
        ...

    def col_split(self, k: int) -> tuple[str, str]:
        """This element's row and column in a matrix of `k` columns, `(col / k, col % k)`: the loop's own
        indices where it walks the matrix by row and column (`Loop` steps of an outer product), so that the
        text has no division and vectorises."""
        ...

    def edge_position(self) -> str:
        """This child edge's 0-based place among its parent's children (a child edge row), as a float."""
        ...

    def edge_siblings(self) -> str:
        """How many children this child edge's parent has (a child edge row), as a float."""
        ...

    def node(self) -> str:
        """The node id of this row (its parent's for a child edge)."""
        ...

    def slot(self) -> str:
        """The child slot of this row: 0 for a node row, 1 + the child's place for a child edge."""
        ...


@dataclass(frozen=True)
class Identity:
    """Which elements of one node's value an identity-dependent rule (dropout) sees: the call's dropout
    mode, the node's id, and for a per-child value how many children it has rows for (slots 1..children)."""

    dropout: Dropout
    node: int
    children: int | None  # None: a per-node value (slot 0)


#: ``rule(ctx, value, args)``: the shape and domain of `value` from its operands (raises `ShapeError`)
TypeRule = Callable[[TypeContext, "Value", Sequence["Value"]], tuple[Shape, Domain]]
#: ``rule(env, value, xs, arg_values)``: the interpreter's result for one node from its operands' arrays
#: (per-child values have a leading axis of children)
InterpRule = Callable[[NodeEnv, "Value", list[np.ndarray], Sequence["Value"]], np.ndarray]
#: ``rule(d, g, y, args, value)``: given the adjoint ``g`` of ``y = op(*args)`` (`value` the forward value),
#: yield one contribution per argument, in argument order (None: nothing flows to it). A generator, so that
#: each contribution is built just before autodiff adds it to its argument's adjoint.
DerivativeRule = Callable[[Derivatives, int, int, Sequence[int], "Value"], Iterator[int | None]]
#: ``rule(e, value)``: the C text of element `e.col` of the value in row `e.row`
CRule = Callable[[Emitter, "Value"], str]
#: ``rule(x, attrs, identity)``: the interpreter rule of an op whose result depends on its elements' identity
IdentityRule = Callable[[np.ndarray, Mapping[str, Any], Identity], np.ndarray]


@dataclass(frozen=True)
class RowPass:
    """One pass of a row op over a row's elements ``j``: ``before`` (a C statement, once), then per element
    ``out_row[j] = store`` (when given) and ``update`` (a C statement folding the element into an
    accumulator). ``{0}``, ``{1}``: element ``j`` of the operands; ``{n}``: the row's length as a float; the
    accumulators of earlier passes are in scope."""

    store: str
    update: str
    before: str = ""


@dataclass(frozen=True)
class RowOp:
    """A row op: accumulators (C name, initial value), passes over the row, a setup run once after them,
    and the result: per element (``element``, over ``out_row[j]`` and the accumulators) or one scalar
    (``scalar``). Softmax is three passes (max, exponentials and their sum, quotient); a row sum one."""

    accumulators: tuple[tuple[str, str], ...]
    passes: tuple[RowPass, ...]
    element: str = ""
    scalar: str = ""
    setup: str = ""


@dataclass(frozen=True)
class ChildReduce:
    """A reduction over a node's children: the C initial value, how elements combine (``add`` or ``max``:
    the dialects' reduce macros), whether the total is divided by the number of children, and the NumPy rule
    over the leading (children) axis."""

    init: str
    combine: str
    mean: bool


@dataclass(frozen=True)
class OpDef:
    """Everything about one op. Families (`OpKind`) share rules: `elementwise.py` builds the entries of
    unary and binary ops from their NumPy rule, shape rule and C text.

    ``c`` is an elementwise op's C/CUDA text over its operands' expressions ``{0}``, ``{1}`` (``c_helper``
    defines a function that it calls, emitted once in every kernel file whose program uses the op, with the
    target's qualifiers in front). ``at_zero`` is the value with every operand zero (None: not a constant;
    specialisation then computes the op on an explicit zero); ``zero_absorbs`` the operands whose zero alone
    makes the result zero, ``zero_identity`` those whose zero leaves the other operand (``x + 0``), and
    ``childless_zero`` whether the value at a node without children is zero (reads of children and reductions).
    An op whose result depends on which element of which node it is (dropout) has an ``identity`` rule (the
    interpreter's, given the node's `Identity`), ``c_identity`` (its attrs as the named fields of ``c``,
    besides ``{elem}``, ``{node}`` and ``{slot}``), ``c_helper_needs`` (helpers its helper calls) and
    ``min_domain`` (its result varies at least per node, whatever its operands).
    ``c_inline`` and ``c_inline_helper`` (a gate's C text and helper without a libm call) are what an inference
    kernel that computes the gates of all its rows at once (``Kernel.inline_gates``) uses instead.
    ``index_args``: the operand positions that take an index value (a look-up's row).
    """

    op: Op
    kind: OpKind
    surface: str | None  # the function name or operator symbol a .cell file writes; None: not written so
    arity: int | None  # None: any number of operands (concat)
    type_rule: TypeRule
    interp: InterpRule
    derivative: DerivativeRule
    placement: Placement
    c_rule: CRule
    step: StepKind | None = None
    shape: Callable[..., Shape] | None = None  # an elementwise or row op's shape rule over its operands' shapes
    numpy: Callable[..., np.ndarray] | None = None
    c: str = ""
    at_zero: float | None = None
    zero_absorbs: tuple[int, ...] = ()
    zero_identity: tuple[int, ...] = ()
    childless_zero: bool = False
    addressable: bool = True  # a SOURCE value that has a place in memory (a constant has none)
    c_helper: str = ""
    row: RowOp | None = None
    reduce: ChildReduce | None = None
    identity: IdentityRule | None = None
    c_identity: Callable[[Mapping[str, Any]], Mapping[str, str]] | None = None
    c_helper_needs: tuple[str, ...] = ()
    min_domain: Domain = Domain.PARAM
    c_inline: str = ""
    c_inline_helper: str = ""
    c_inline_needs: tuple[str, ...] = ()
    index_args: tuple[int, ...] = ()
    view_column: Callable[[Value, Value], int] | None = None  # a VIEW's first element in its operand's row
    hint_on_one: str = ""  # the front end's advice after "a row op of a [1] value is constant" ({arg}, {across})
    reads_children: bool = False  # a leaf that reads the node's children (a body that has one is not hoisted)


def computed_by_a_step(e: Emitter, value: Value) -> str:  # pragma: no cover - placed as a step of its own
    """The C rule of an op placed as a kernel step (`Placement.STEP`): never rendered as an expression."""
    raise NotImplementedError(f"{value.op.value} is computed by a kernel step, not an expression")


def no_gradient(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    """Piecewise constant (step, sign, eq) or a constant: the derivative is 0 wherever it exists."""
    for _ in args:
        yield None


def width(value: Value) -> int:
    """Floats in one row of a value (its elements flattened; 1 for a scalar)."""
    return math.prod(value.shape) if value.shape else 1


def param_views(shape: Shape) -> tuple[Shape, ...]:
    """The shapes a body reads a declared param as. A 3-D family ``[R, M, K]`` is read as its ``R*M`` rows of
    ``K`` by products (``W @ v``, the rows of all ``R`` matrices: `param_matrix`) and as ``R`` rows of
    ``M*K`` by look-ups (``W[i]``); one row-major array either way."""
    if len(shape) == 3:
        r, m, k = shape
        return ((r * m, k), (r, m * k))
    return (shape,)


def param_matrix(shape: Shape) -> Shape:
    """The shape a param multiplies as, and its gradient's in a body: a 3-D family's ``[R*M, K]`` rows."""
    return param_views(shape)[0]


def slice_offset(base: Value, lo: int) -> int:
    """Where part ``lo`` of `base` starts in its flattened row: element ``lo`` of a vector, row ``lo`` of a
    matrix (slices of matrices are made by autodiff for concatenations)."""
    return lo * (width(base) // base.shape[0])


def float_literal(value: float) -> str:
    """A float as C/CUDA text."""
    if math.isnan(value):
        return "NAN"
    if math.isinf(value):
        return "INFINITY" if value > 0 else "(-INFINITY)"
    return f"{float(value)!r}f"
